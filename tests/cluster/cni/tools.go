//go:build tools

// Package cni pins the CNI plugins of the node tests' pod network (tests/cluster/build.py --node
// builds them): bridge with host-local addresses for a node-local network, and loopback, from
// github.com/containernetworking/plugins. Without a CNI network containerd reports the runtime's
// network not ready and the kubelet keeps the Node NotReady. This file is never compiled (the
// build tag): `go mod tidy` reads its imports to keep go.mod and go.sum complete.
package cni

import (
	_ "github.com/containernetworking/plugins/plugins/ipam/host-local"
	_ "github.com/containernetworking/plugins/plugins/main/bridge"
	_ "github.com/containernetworking/plugins/plugins/main/loopback"
)
