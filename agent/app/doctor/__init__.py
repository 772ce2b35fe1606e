"""`dra-agent doctor`: the node checked the way a person would when a pod is stuck.

Each check gives one line: passed, failed (with the fix), or skipped (and why). A
failure is *blocking* when the agent cannot start or the kubelet cannot use it
(no registration, a CDI directory the runtime does not read, missing RBAC); other
failures are warnings (IOMMU off: only VM passthrough needs it). The exit status
is 1 when any blocking check failed.

Doctor reads; it never writes. It calls the agent's sockets the way the kubelet
does (GetInfo, and a NodePrepareResources without claims), its probes over
`--metrics-address`, and the API server (the Node, and one SelfSubjectAccessReview
per permission the agent needs). With `--offline DIR` it talks to no API server and
says which checks it skipped. Run it as the agent's user (root in the DaemonSet):
ownership and permission checks are made as the user that runs doctor.

The checks live by subject: `plugin` (the kubelet's directories, the agent's
sockets and probes, the kubelet's pod resources service), `runtime` (the container runtime's CDI configuration, the CDI
directory, the NVIDIA toolkit's CDI spec), `node` (NVML, IOMMU, vfio-pci, the NIC uplinks,
claim records, free space), `cluster` (the API server, the Node, RBAC); `results` has the
result type and the report.
"""

from __future__ import annotations

import asyncio
import platform
from collections.abc import Awaitable, Callable
from pathlib import Path

from agent import __version__
from agent.app.doctor.cluster import PERMISSIONS, ClusterChecks, Permission
from agent.app.doctor.node import LOW_FREE_BYTES, MIN_FREE_BYTES, MIN_FREE_INODES, NodeChecks
from agent.app.doctor.plugin import PluginChecks
from agent.app.doctor.results import Result, exit_status, failed, format_text, passed, skipped
from agent.app.doctor.runtime import RUNTIME_DEFAULT_CDI_DIRS, RuntimeChecks
from agent.config import Settings

__all__ = [
    "LOW_FREE_BYTES",
    "MIN_FREE_BYTES",
    "MIN_FREE_INODES",
    "PERMISSIONS",
    "RUNTIME_DEFAULT_CDI_DIRS",
    "Doctor",
    "Permission",
    "Result",
    "exit_status",
    "failed",
    "format_text",
    "passed",
    "run",
    "skipped",
]


class Doctor(PluginChecks, RuntimeChecks, NodeChecks, ClusterChecks):
    """Every check, run in the order a person would look."""

    async def run(self) -> list[Result]:
        def thread(fn: Callable[[], list[Result]]) -> Callable[[], Awaitable[list[Result]]]:
            return lambda: asyncio.to_thread(fn)

        steps: list[tuple[str, Callable[[], Awaitable[list[Result]]]]] = [
            ("kubelet plugin directories", thread(self.kubelet_dirs)),
            ("directory ownership and modes", thread(self.agent_dirs)),
            ("registration socket", self.registration),
            ("DRA socket", self.dra_socket),
            ("probes (/healthz, /readyz)", self.probes),
            ("kubelet pod resources", self.pod_resources),
            ("device plugin", thread(self.device_plugin)),
            ("container runtime CDI", thread(self.runtime_cdi)),
            ("CDI directory", thread(self.cdi_dirs)),
            ("NVIDIA toolkit CDI", thread(self.toolkit)),
            ("NVML", thread(self.nvml)),
            ("IOMMU", thread(self.iommu)),
            ("vfio-pci", thread(self.vfio)),
            ("NIC uplinks", thread(self.uplinks)),
            ("claim records", thread(self.records)),
            ("free space", thread(self.free_space)),
            ("Kubernetes API", self.cluster),
        ]
        s = self.s
        # Which doctor this is, and for which agent: a report read later says so (the agent's own version is
        # in its first log line and in its probes' answers).
        results = [passed("dra-agent", f"version {__version__} (Python {platform.python_version()}), driver "
                          f"{s.driver_name}, node {s.node_name}")]
        for name, step in steps:
            try:
                results += await step()
            except Exception as exc:  # a check that breaks says so and the others still run
                results.append(failed(name, f"the check itself failed: {type(exc).__name__}: {exc}",
                                      "report this as a bug of dra-agent doctor", blocking=False))
        return results


async def run(settings: Settings, *, host_root: Path = Path("/")) -> list[Result]:
    return await Doctor(settings, host_root=host_root).run()
