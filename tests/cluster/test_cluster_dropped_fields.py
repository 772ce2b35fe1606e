"""An API server with DRADeviceCompatibilityGroups and DRANodeAllocatableResources off (a second,
small control plane: etcd and the API server only) drops those fields from every slice the agent
writes. The agent must notice, say so once naming the field and its gate, publish without the
field, and never rewrite a slice whose content it already sent; and with the compatibility groups
gone, its vGPU devices follow the policy for a cluster without them, so the scheduler is never
offered a MIG device and a vGPU of the same GPU."""

from __future__ import annotations

import collections
import contextlib
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from .clusterkit import NODE_ALLOCATABLE, SLICES, AgentRuns, Cluster, devices_of, slices_of
from .controlplane import start_plane
from .pki import Pki

pytestmark = pytest.mark.cluster

NODE = "dra-gates-off"
GATES_OFF = {"DRADeviceCompatibilityGroups": False, "DRANodeAllocatableResources": False}
FLAGS = ("--compatibility-groups=true", "--vgpu-types=auto", "--dynamic-mig=true")


@pytest.fixture(scope="module")
def gates_off(components: Path, cluster_root: Path, pki: Pki) -> Iterator[Cluster]:
    plane = start_plane(components, cluster_root / "gates-off", pki, gates=GATES_OFF, full=False)
    c = Cluster(plane, cluster_root / "gates-off")
    try:
        c.add_node(NODE, declared=[NODE_ALLOCATABLE])
        yield c
    finally:
        c.close()
        plane.stop()
        shutil.rmtree(plane.root, ignore_errors=True)


class SliceWatch:
    """Every ResourceSlice the API server stores, as its watch reports it, from now on."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.seen: list[dict[str, Any]] = []
        self._since = cluster.admin.get(SLICES)["metadata"]["resourceVersion"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        client = self.cluster.admin.client
        with contextlib.suppress(httpx2.TransportError), client.stream(
                "GET", SLICES, params={"watch": "1", "resourceVersion": self._since}, timeout=None) as r:
            for line in r.iter_lines():
                if self._stop.is_set():
                    return
                event = json.loads(line)
                if event["type"] in ("ADDED", "MODIFIED"):
                    self.seen.append(event["object"])

    def __enter__(self) -> SliceWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        # One more write wakes the stream up so the thread can see it is done.
        self.cluster.admin.post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                       "metadata": {"generateName": "wake-"}})
        self._thread.join(10)


def gpu_forms(slices: list[dict[str, Any]]) -> dict[str, set[str]]:
    """The kinds of device published on each GPU, by its PCI bus ID."""
    out: dict[str, set[str]] = collections.defaultdict(set)
    for dev in devices_of(slices).values():
        attrs = dev.get("attributes") or {}
        kind = attrs["type"]["string"]
        if kind in ("mig", "vgpu"):
            out[attrs["resource.kubernetes.io/pciBusID"]["string"]].add(kind)
    return out


def test_a_dropped_field_is_noticed_once_and_never_rewritten(gates_off: Cluster, agent_runs: AgentRuns) -> None:
    kubeconfig = gates_off.plane.admin_kubeconfig
    assert kubeconfig is not None

    with SliceWatch(gates_off) as watch, agent_runs.run(NODE, kubeconfig, *FLAGS, node=NODE) as agent:
        agent.wait_published()
        first = agent.metrics()
        warnings = agent.messages("warning")
    stored = slices_of(gates_off.admin, NODE)
    devices = devices_of(stored)
    assert first.get('dra_agent_publish_syncs_total{result="failure"}', 0) == 0
    # The fields are not published any more (nothing left for the server to drop) ...
    assert not any("compatibilityGroups" in c for d in devices.values() for c in d.get("consumesCounters") or [])
    assert not any("nodeAllocatableResources" in d for d in devices.values())
    # ... and each was named once, with its gate.
    for field, gate in (("compatibilityGroups", "DRADeviceCompatibilityGroups"),
                        ("nodeAllocatableResources", "DRANodeAllocatableResources")):
        said = [w for w in warnings if field in w]
        assert len(said) == 1 and gate in said[0], warnings
    # Without compatibility groups no GPU offers MIG and vGPU side by side, at any moment the
    # server stored (`--vgpu-types auto` means no vGPU at all then).
    assert all("vgpu" not in forms for forms in gpu_forms(stored).values())
    assert watch.seen, "the watch saw no slice"
    for obj in watch.seen:
        assert all(not ({"mig", "vgpu"} <= forms) for forms in gpu_forms([obj]).values()), obj["metadata"]["name"]
    assert sum(1 for d in devices.values() if d["attributes"]["type"]["string"] == "mig") > 0
    before = {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in stored}

    # A restart finds everything current: no write at all.
    with agent_runs.run(NODE, kubeconfig, *FLAGS, node=NODE) as agent:
        agent.wait_published()
        again = agent.metrics()
        warnings = agent.messages("warning")
    assert {k: v for k, v in again.items() if k.startswith("dra_agent_slice_writes_total") and v} == {}
    assert {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in slices_of(gates_off.admin, NODE)} \
        == before
