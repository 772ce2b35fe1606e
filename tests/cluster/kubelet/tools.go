//go:build tools

// Package kubelet pins the kubelet the node tests run (tests/cluster/build.py --node builds it): the
// same k8s.io/kubernetes release as the control plane in ../k8s, with the same staging-module pins,
// in a module of its own so that the control plane's go.sum and build stamp stay as they are. The
// kubelet's main package cannot be imported; its app package stands in for it.
package kubelet

import (
	_ "k8s.io/kubernetes/cmd/kubelet/app"
)
