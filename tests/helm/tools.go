//go:build tools

// Package tools pins the Helm command line that tests/helm/build.py builds (`go build
// helm.sh/helm/v4/cmd/helm`): go.mod and go.sum fix its version and every module it needs, so the
// tests render and install the chart with one known Helm (docs/tests.md).
package tools

import _ "helm.sh/helm/v4/cmd/helm"
