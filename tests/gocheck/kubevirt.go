package main

// The `kubevirt` mode: every VirtualMachine of a manifest file decoded into KubeVirt's own API types
// (kubevirt.io/api at the release go.mod pins, the module KubeVirt's components are built with),
// strictly: a field the types do not have, a key given twice or a value of the wrong type is an
// error. Without KubeVirt's CRDs in the cluster this is how far a VirtualMachine can be checked
// here; tests/test_workload_examples.py compares the decoded object with the manifest, so a value
// the types drop or change shows too. VirtualMachineInstanceSpec decodes itself with a plain
// json.Unmarshal (its UnmarshalJSON), which ignores unknown fields whatever the caller asked, so
// the template's spec is decoded strictly a second time into the same fields without that method.

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"os"

	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// vmiSpecFields is VirtualMachineInstanceSpec without its methods, so without its lenient UnmarshalJSON.
type vmiSpecFields kubevirtv1.VirtualMachineInstanceSpec

type manifestObject struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Name       string `json:"name"`
	// Error is what the strict decoding into KubeVirt's type said ("" for none); VirtualMachines only.
	Error string `json:"error"`
	// Decoded is the VirtualMachine as KubeVirt's type holds it, encoded again (null for other kinds).
	Decoded json.RawMessage `json:"decoded"`
}

// strictTemplateSpec decodes a VirtualMachine's spec.template.spec, refusing fields its type lacks.
func strictTemplateSpec(doc []byte) error {
	var vm struct {
		Spec struct {
			Template struct {
				Spec json.RawMessage `json:"spec"`
			} `json:"template"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(doc, &vm); err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(vm.Spec.Template.Spec))
	dec.DisallowUnknownFields()
	var spec vmiSpecFields
	return dec.Decode(&spec)
}

func checkKubeVirt(path string) []manifestObject {
	f, err := os.Open(path)
	if err != nil {
		fail(err)
	}
	defer f.Close()
	out := []manifestObject{}
	reader := utilyaml.NewYAMLReader(bufio.NewReader(f))
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			return out
		} else if err != nil {
			fail(err)
		}
		var head struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
			Metadata   struct {
				Name string `json:"name"`
			} `json:"metadata"`
		}
		if err := yaml.Unmarshal(doc, &head); err != nil {
			fail(err)
		}
		if head.Kind == "" {
			continue // an empty document (comments only)
		}
		obj := manifestObject{APIVersion: head.APIVersion, Kind: head.Kind, Name: head.Metadata.Name}
		if head.APIVersion == kubevirtv1.SchemeGroupVersion.String() && head.Kind == "VirtualMachine" {
			var vm kubevirtv1.VirtualMachine
			if err := yaml.UnmarshalStrict(doc, &vm); err != nil {
				obj.Error = err.Error()
			} else if err := strictTemplateSpec(doc); err != nil {
				obj.Error = "spec.template.spec: " + err.Error()
			} else if obj.Decoded, err = json.Marshal(&vm); err != nil {
				fail(err)
			}
		}
		out = append(out, obj)
	}
}
