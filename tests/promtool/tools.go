//go:build tools

// Package tools pins promtool, Prometheus's rule checker and rule unit-test runner, as a module
// requirement: tests/promtool/build.py builds `github.com/prometheus/prometheus/cmd/promtool` from
// this module for tests/test_monitoring.py.
package tools

import _ "github.com/prometheus/prometheus/cmd/promtool"
