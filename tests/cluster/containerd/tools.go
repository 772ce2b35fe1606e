//go:build tools

// Package containerd pins the container runtime the node tests run under the kubelet
// (tests/cluster/build.py --node builds it): containerd, ctr and containerd-shim-runc-v2 from
// github.com/containerd/containerd/v2, in a module of its own so that containerd's dependencies
// are resolved as containerd's go.mod pins them, not against the Kubernetes module's. The blank
// imports keep in go.mod and go.sum every module those three main packages need.
package containerd

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/manager"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2/task/plugin"
	_ "github.com/containerd/containerd/v2/cmd/containerd/builtins"
	_ "github.com/containerd/containerd/v2/cmd/containerd/command"
	_ "github.com/containerd/containerd/v2/cmd/ctr/app"
	_ "github.com/containerd/containerd/v2/pkg/shim"
	_ "github.com/containerd/containerd/v2/pkg/tracing/plugin"
)
