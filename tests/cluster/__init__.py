"""Tests against the real Kubernetes control plane (docs/tests.md); a package, so that its conftest and
helpers never shadow the modules of the same name in tests/."""
