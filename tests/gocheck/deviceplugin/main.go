// Command deviceplugin is a device plugin for the tests: it serves one extended resource to the real kubelet
// through the device plugin API (k8s.io/kubelet's deviceplugin/v1beta1, over grpc-go): it listens on a socket
// in the kubelet's device-plugins directory, registers there, lists its devices healthy on ListAndWatch and
// answers Allocate with the IDs in an environment variable, as a GPU device plugin does. It is the device
// plugin a node moves off in tests/cluster/test_cluster_kubelet.py; the device IDs are the simulated GPUs'
// UUIDs, as the NVIDIA device plugin's default ID strategy names them.
//
// Usage: deviceplugin DIR RESOURCE ID[,ID...]
//
// DIR is the kubelet's device-plugins directory (its kubelet.sock is the registration socket). It prints
// "serving" once registered, and stops on SIGTERM or SIGINT, removing its socket: the kubelet sees its
// ListAndWatch stream end and reports the resource's allocatable as 0.
package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	api "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	api.UnimplementedDevicePluginServer
	ids  []string
	stop chan struct{}
}

func (p *plugin) GetDevicePluginOptions(context.Context, *api.Empty) (*api.DevicePluginOptions, error) {
	return &api.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *api.Empty, stream api.DevicePlugin_ListAndWatchServer) error {
	devices := make([]*api.Device, 0, len(p.ids))
	for _, id := range p.ids {
		devices = append(devices, &api.Device{ID: id, Health: api.Healthy})
	}
	if err := stream.Send(&api.ListAndWatchResponse{Devices: devices}); err != nil {
		return err
	}
	select {
	case <-p.stop:
	case <-stream.Context().Done():
	}
	return nil
}

func (p *plugin) Allocate(_ context.Context, req *api.AllocateRequest) (*api.AllocateResponse, error) {
	out := &api.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		out.ContainerResponses = append(out.ContainerResponses, &api.ContainerAllocateResponse{
			Envs: map[string]string{"DEVICE_PLUGIN_DEVICES": strings.Join(c.DevicesIds, ",")},
		})
	}
	return out, nil
}

func (p *plugin) PreStartContainer(context.Context, *api.PreStartContainerRequest) (*api.PreStartContainerResponse, error) {
	return &api.PreStartContainerResponse{}, nil
}

func (p *plugin) GetPreferredAllocation(context.Context, *api.PreferredAllocationRequest) (*api.PreferredAllocationResponse, error) {
	return &api.PreferredAllocationResponse{}, nil
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "deviceplugin:", err)
	os.Exit(1)
}

func main() {
	if len(os.Args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: deviceplugin DIR RESOURCE ID[,ID...]")
		os.Exit(2)
	}
	dir, resource, ids := os.Args[1], os.Args[2], strings.Split(os.Args[3], ",")
	endpoint := "dra-test-" + strings.NewReplacer("/", "-", ".", "-").Replace(resource) + ".sock"
	path := filepath.Join(dir, endpoint)
	_ = os.Remove(path)
	listener, err := net.Listen("unix", path)
	if err != nil {
		fail(err)
	}
	p := &plugin{ids: ids, stop: make(chan struct{})}
	server := grpc.NewServer()
	api.RegisterDevicePluginServer(server, p)
	go func() { _ = server.Serve(listener) }()

	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "kubelet.sock"),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fail(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	_, err = api.NewRegistrationClient(conn).Register(ctx, &api.RegisterRequest{
		Version: api.Version, Endpoint: endpoint, ResourceName: resource,
		Options: &api.DevicePluginOptions{},
	})
	cancel()
	conn.Close()
	if err != nil {
		fail(fmt.Errorf("register with the kubelet: %w", err))
	}
	fmt.Println("serving")

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	<-signals
	close(p.stop)
	server.Stop()
	_ = os.Remove(path)
}
