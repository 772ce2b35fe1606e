// Command gocheck reads what dra-agent wrote for prepared claims with the official libraries, not
// with the agent's own code: the CDI specs with the CDI project's cache (the code container
// runtimes use to resolve and inject CDI devices), and the device metadata files with the reader of
// k8s.io/dynamic-resource-allocation (the code workloads and KubeVirt use). It judges nothing
// itself: it prints, as JSON on stdout, every error those libraries report and everything they
// decoded or injected, and tests/test_official_readers.py compares that with what the agent
// promises.
//
// Usage: gocheck REQUEST.json, where the request is
//
//	{"cdiDirs": [dir, ...], "claims": {"<uid>": ["vendor/class=name", ...]}, "metadataFiles": [path, ...]}
//
// cdiDirs in the runtime's order, lowest priority first (the static directory, then the dynamic
// one); claims maps each claim to the CDI device IDs the kubelet got for it.
//
// gocheck kubevirt MANIFEST.yaml prints, as JSON, each object of the manifest, every
// VirtualMachine decoded strictly into KubeVirt's API types (kubevirt.go).
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	kjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	"k8s.io/dynamic-resource-allocation/api/metadata"
	"k8s.io/dynamic-resource-allocation/api/metadata/install"
	"k8s.io/dynamic-resource-allocation/api/metadata/v1alpha1"
	"k8s.io/dynamic-resource-allocation/api/metadata/v1beta1"
	"k8s.io/dynamic-resource-allocation/devicemetadata"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"tags.cncf.io/container-device-interface/pkg/cdi"
	cdispec "tags.cncf.io/container-device-interface/specs-go"
)

type request struct {
	CDIDirs       []string            `json:"cdiDirs"`
	Claims        map[string][]string `json:"claims"`
	MetadataFiles []string            `json:"metadataFiles"`
}

type report struct {
	CDI      cdiReport                   `json:"cdi"`
	Metadata map[string]metadataFileInfo `json:"metadata"`
}

type cdiReport struct {
	SpecErrors map[string][]string  `json:"specErrors"`
	DirErrors  map[string]string    `json:"dirErrors"`
	Devices    []string             `json:"devices"`
	Specs      map[string]specInfo  `json:"specs"`
	Claims     map[string]injection `json:"claims"`
	// Every claim's IDs injected into one container, as a pod's container using all its claims gets them.
	All injection `json:"all"`
}

type specInfo struct {
	Kind string `json:"kind"`
	// Version is the file's cdiVersion; MinimumVersion the lowest one the library says its fields need.
	Version        string `json:"version"`
	MinimumVersion string `json:"minimumVersion"`
}

type injection struct {
	Unresolved []string  `json:"unresolved"`
	Error      string    `json:"error"`
	Spec       *oci.Spec `json:"spec"`
}

type metadataFileInfo struct {
	Error string `json:"error"`
	// Objects holds one entry per object of the stream, in the file's order, each read by the
	// official decoder into each API version.
	Objects []metadataObject `json:"objects"`
	// StrictErrors: what the API machinery's strict JSON decoding (unknown or duplicate fields)
	// reports for each object of the stream, in order ("" for none).
	StrictErrors []string `json:"strictErrors"`
	// The container paths the library gives this file (from the first object's claim, request and driver).
	ResourceClaimPath         string `json:"resourceClaimPath"`
	ResourceClaimTemplatePath string `json:"resourceClaimTemplatePath"`
}

type metadataObject struct {
	// Source is the apiVersion the decoder found in the stream.
	Source string `json:"source"`
	// As maps a target apiVersion to the object as the library decoded it into that version.
	As         map[string]json.RawMessage `json:"as"`
	Errors     map[string]string          `json:"errors"`
	Validation map[string]string          `json:"validation"`
}

func main() {
	if len(os.Args) == 3 && os.Args[1] == "kubevirt" {
		emit(checkKubeVirt(os.Args[2]))
		return
	}
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: gocheck REQUEST.json | gocheck kubevirt MANIFEST.yaml")
		os.Exit(2)
	}
	raw, err := os.ReadFile(os.Args[1])
	if err != nil {
		fail(err)
	}
	var req request
	if err := json.Unmarshal(raw, &req); err != nil {
		fail(fmt.Errorf("request: %w", err))
	}
	out := report{CDI: checkCDI(req), Metadata: map[string]metadataFileInfo{}}
	for _, path := range req.MetadataFiles {
		out.Metadata[path] = checkMetadata(path)
	}
	emit(out)
}

func emit(out any) {
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", " ")
	if err := enc.Encode(out); err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "gocheck:", err)
	os.Exit(1)
}

func checkCDI(req request) cdiReport {
	rep := cdiReport{SpecErrors: map[string][]string{}, DirErrors: map[string]string{}, Specs: map[string]specInfo{},
		Claims: map[string]injection{}}
	// Manual refresh: the directories are read once, as they are now.
	cache, err := cdi.NewCache(cdi.WithSpecDirs(req.CDIDirs...), cdi.WithAutoRefresh(false))
	if err != nil && cache == nil {
		fail(fmt.Errorf("CDI cache: %w", err))
	}
	for path, errs := range cache.GetErrors() {
		for _, e := range errs {
			rep.SpecErrors[path] = append(rep.SpecErrors[path], e.Error())
		}
	}
	for dir, e := range cache.GetSpecDirErrors() {
		if e != nil {
			rep.DirErrors[dir] = e.Error()
		}
	}
	rep.Devices = cache.ListDevices()
	for _, vendor := range cache.ListVendors() {
		for _, spec := range cache.GetVendorSpecs(vendor) {
			minimum, err := cdispec.MinimumRequiredVersion(spec.Spec)
			if err != nil {
				rep.SpecErrors[spec.GetPath()] = append(rep.SpecErrors[spec.GetPath()], err.Error())
			}
			rep.Specs[spec.GetPath()] = specInfo{Kind: spec.Kind, Version: spec.Version, MinimumVersion: minimum}
		}
	}
	var all []string
	uids := make([]string, 0, len(req.Claims))
	for uid := range req.Claims {
		uids = append(uids, uid)
	}
	sort.Strings(uids)
	for _, uid := range uids {
		rep.Claims[uid] = inject(cache, req.Claims[uid])
		all = append(all, req.Claims[uid]...)
	}
	rep.All = inject(cache, all)
	return rep
}

// inject applies the devices to an empty runtime spec, as a runtime does for one container.
func inject(cache *cdi.Cache, ids []string) injection {
	spec := &oci.Spec{Version: oci.Version, Process: &oci.Process{}, Linux: &oci.Linux{}}
	unresolved, err := cache.InjectDevices(spec, ids...)
	res := injection{Unresolved: unresolved, Spec: spec}
	if err != nil {
		res.Error = err.Error()
	}
	return res
}

var versions = []schema.GroupVersion{v1beta1.SchemeGroupVersion, v1alpha1.SchemeGroupVersion}

func checkMetadata(path string) metadataFileInfo {
	info := metadataFileInfo{}
	data, err := os.ReadFile(path)
	if err != nil {
		info.Error = err.Error()
		return info
	}
	for _, target := range versions {
		// Each call of the library's stream decoder takes the next object it can decode.
		dec := json.NewDecoder(bytes.NewReader(data))
		for i := 0; dec.More(); i++ {
			dest, err := newVersioned(target)
			if err != nil {
				fail(err)
			}
			var gvk schema.GroupVersionKind
			var invalid error
			err = devicemetadata.DecodeMetadataFromStream(dec, dest,
				devicemetadata.DecodeMetadataStoreGVKResult(&gvk), devicemetadata.DecodeMetadataWithValidationResult(&invalid))
			if i == len(info.Objects) {
				info.Objects = append(info.Objects, metadataObject{As: map[string]json.RawMessage{},
					Errors: map[string]string{}, Validation: map[string]string{}})
			}
			obj := &info.Objects[i]
			if gvk.GroupVersion().String() != "/" {
				obj.Source = gvk.GroupVersion().String()
			}
			if err != nil {
				obj.Errors[target.String()] = err.Error()
				break
			}
			if invalid != nil {
				obj.Validation[target.String()] = invalid.Error()
			}
			encoded, err := json.Marshal(dest)
			if err != nil {
				fail(err)
			}
			obj.As[target.String()] = encoded
		}
	}
	info.StrictErrors = strictErrors(data)
	if first, err := firstInternal(data); err != nil {
		info.Error = err.Error()
	} else if len(first.Requests) > 0 && len(first.Requests[0].Devices) > 0 {
		driver, request := first.Requests[0].Devices[0].Driver, resourceclaim.BaseRequestRef(first.Requests[0].Name)
		info.ResourceClaimPath = metadata.ResourceClaimFilePath(driver, first.Name, request)
		if first.PodClaimName != nil {
			info.ResourceClaimTemplatePath = metadata.ResourceClaimTemplateFilePath(driver, *first.PodClaimName, request)
		}
	}
	return info
}

func newVersioned(gv schema.GroupVersion) (runtime.Object, error) {
	switch gv {
	case v1beta1.SchemeGroupVersion:
		return &v1beta1.DeviceMetadata{}, nil
	case v1alpha1.SchemeGroupVersion:
		return &v1alpha1.DeviceMetadata{}, nil
	}
	return nil, fmt.Errorf("no type for %s", gv)
}

// firstInternal is the file as the library's own readers take it: the first object it can decode,
// in the internal form.
func firstInternal(data []byte) (*metadata.DeviceMetadata, error) {
	var dm metadata.DeviceMetadata
	if err := devicemetadata.DecodeMetadataFromStream(json.NewDecoder(bytes.NewReader(data)), &dm); err != nil {
		return nil, err
	}
	return &dm, nil
}

// strictErrors decodes each object of the stream with the API machinery's strict JSON serializer
// over the metadata API's scheme, which reports fields the API types do not have.
func strictErrors(data []byte) []string {
	scheme := install.NewScheme()
	strict := kjson.NewSerializerWithOptions(kjson.DefaultMetaFactory, scheme, scheme, kjson.SerializerOptions{Strict: true})
	var out []string
	dec := json.NewDecoder(bytes.NewReader(data))
	for {
		var raw json.RawMessage
		if err := dec.Decode(&raw); errors.Is(err, io.EOF) {
			return out
		} else if err != nil {
			return append(out, err.Error())
		}
		if _, _, err := strict.Decode(raw, nil, nil); err != nil {
			out = append(out, err.Error())
		} else {
			out = append(out, "")
		}
	}
}
