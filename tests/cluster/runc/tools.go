//go:build tools

// Package runc pins the OCI runtime the node tests' containerd runs containers with
// (tests/cluster/build.py --node builds it): runc from github.com/opencontainers/runc, whose
// main package is its module's root. Debian 12's runc (1.1) predates `linux.netDevices`, the OCI
// field CDI's `containerEdits.netDevices` becomes, which runc applies from 1.4 on. A module of its
// own, so runc's dependencies resolve as runc's go.mod pins them. This file is never compiled
// (the build tag): `go mod tidy` reads its import to keep go.mod and go.sum complete.
package runc

import (
	_ "github.com/opencontainers/runc"
)
