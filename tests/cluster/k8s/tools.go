//go:build tools

// Package k8s pins the Kubernetes control plane the cluster tests run against (tests/cluster/build.py
// builds it): kube-apiserver, kube-scheduler and kube-controller-manager from k8s.io/kubernetes, and
// etcd. The blank imports keep every module those programs need in go.mod and go.sum; the programs
// themselves are main packages, which cannot be imported, so their app packages stand in for them.
package k8s

import (
	_ "go.etcd.io/etcd/server/v3/etcdmain"
	_ "k8s.io/kubernetes/cmd/kube-apiserver/app"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	_ "k8s.io/kubernetes/cmd/kube-scheduler/app"
)
