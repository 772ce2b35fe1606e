"""Shared test setup.

Tests that need something from the environment (root, a network namespace,
podman) skip with a reason saying what. CI sets DRA_TEST_NO_SKIP=1, which
turns every such skip into a failure, so CI always runs them all.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

NO_SKIP = os.environ.get("DRA_TEST_NO_SKIP", "") not in ("", "0")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if NO_SKIP and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, but DRA_TEST_NO_SKIP is set: {reason}"


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, device nodes)")


def need_command(*names: str) -> None:
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (Debian packages; .ci/run installs them)")

@pytest.fixture
async def agents():  # type: ignore[no-untyped-def]
    """In-process agents a test started; every one is stopped at teardown, whatever the test did."""
    started: list = []
    yield started
    for agent in started:
        await agent.stop()


# The Kubernetes API emulator's `kube_api` fixture, for every test that talks to an API server.
pytest_plugins = ("kubeapi",)


@pytest.fixture(scope="session")
def checker() -> Path:
    """The Go checker of tests/gocheck (the official CDI and metadata libraries), built or reused once."""
    from gocheck import build

    return build.GOCHECK.for_test("gocheck")


@pytest.fixture
def short_tmp():
    """A temporary directory with a short path: unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
