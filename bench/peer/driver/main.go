// Command driver is the bench's peer: a DRA kubelet plugin built on the official helper package
// (k8s.io/dynamic-resource-allocation/kubeletplugin) that does the per-claim work of a reference
// driver: it reads each claim through a Kubernetes client, writes one CDI spec per claim, and keeps
// every prepared claim in one checkpoint file, with each call serialized by the helper. `make bench`
// runs it beside dra-agent and calls both the same way (docs/benchmarks.md).
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	metadatav1alpha1 "k8s.io/dynamic-resource-allocation/api/metadata/v1alpha1"
	metadatav1beta1 "k8s.io/dynamic-resource-allocation/api/metadata/v1beta1"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
)

type config struct {
	driverName     string
	nodeName       string
	kubeletDir     string
	cdiDir         string
	stateDir       string
	apiServer      string
	deviceMetadata bool
	attributesFile string
}

func parseFlags() config {
	var c config
	flag.StringVar(&c.driverName, "driver-name", "dra.example.com", "DRA driver name; also the CDI vendor")
	flag.StringVar(&c.nodeName, "node-name", "", "node name: the pool whose devices are prepared")
	flag.StringVar(&c.kubeletDir, "kubelet-dir", "/var/lib/kubelet", "kubelet root: sockets under plugins/ and plugins_registry/")
	flag.StringVar(&c.cdiDir, "cdi-dir", "/var/run/cdi", "directory of the per-claim CDI specs")
	flag.StringVar(&c.stateDir, "state-dir", "", "directory of the checkpoint file")
	flag.StringVar(&c.apiServer, "api-server", "", "URL of the API server the claims are read from")
	flag.BoolVar(&c.deviceMetadata, "device-metadata", true, "let the helper write device metadata files and their CDI specs")
	flag.StringVar(&c.attributesFile, "device-attributes", "",
		"JSON file: device name -> attributes (as a ResourceSlice has them), put in the device metadata")
	flag.Parse()
	if c.nodeName == "" || c.stateDir == "" || c.apiServer == "" {
		fmt.Fprintln(os.Stderr, "--node-name, --state-dir and --api-server are required")
		os.Exit(2)
	}
	return c
}

func loadAttributes(path string) (map[string]map[string]resourceapi.DeviceAttribute, error) {
	if path == "" {
		return nil, nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var out map[string]map[string]resourceapi.DeviceAttribute
	if err := json.Unmarshal(data, &out); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return out, nil
}

func run(c config) error {
	// A real driver's client, except that nothing limits its rate: client-go's default (5 requests a
	// second, bursts of 10) would time the limiter, not the driver.
	client, err := kubernetes.NewForConfig(&rest.Config{Host: c.apiServer, QPS: -1})
	if err != nil {
		return fmt.Errorf("kubernetes client: %w", err)
	}
	attributes, err := loadAttributes(c.attributesFile)
	if err != nil {
		return fmt.Errorf("device attributes: %w", err)
	}
	pluginDir := filepath.Join(c.kubeletDir, "plugins", c.driverName)
	registryDir := filepath.Join(c.kubeletDir, "plugins_registry")
	for _, dir := range []string{pluginDir, registryDir, c.cdiDir, c.stateDir} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return err
		}
	}
	plugin := &driver{
		name:       c.driverName,
		pool:       c.nodeName,
		cdiDir:     c.cdiDir,
		checkpoint: checkpointFile{path: filepath.Join(c.stateDir, "checkpoint.json")},
		attributes: attributes,
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	helper, err := kubeletplugin.Start(ctx, plugin,
		kubeletplugin.DriverName(c.driverName),
		kubeletplugin.NodeName(c.nodeName),
		kubeletplugin.KubeClient(client),
		kubeletplugin.RegistrarDirectoryPath(registryDir),
		kubeletplugin.PluginDataDirectoryPath(pluginDir),
		kubeletplugin.HealthService(false),
		kubeletplugin.CDIDirectory(c.cdiDir),
		kubeletplugin.EnableDeviceMetadata(c.deviceMetadata,
			[]schema.GroupVersion{metadatav1beta1.SchemeGroupVersion, metadatav1alpha1.SchemeGroupVersion}),
	)
	if err != nil {
		return fmt.Errorf("start the kubelet plugin helper: %w", err)
	}
	<-ctx.Done()
	helper.Stop()
	return nil
}

func main() {
	if err := run(parseFlags()); err != nil {
		fmt.Fprintln(os.Stderr, "peer driver:", err)
		os.Exit(1)
	}
}
