"""Tests against the real Kubernetes control plane (README "Tests"); a package, so that its conftest and
helpers never shadow the modules of the same name in tests/."""
