"""Claims prepared ahead of their pods' binding (`--binding-conditions`, agent/engine/prebind.py), on the
simulated machine with its kernel emulator running: a passthrough GPU's claim, allocated with binding
conditions, is prepared as soon as its allocation is seen (the GPU bound to vfio-pci, the record marked
`ahead`), its status says HostPrepared, and the kubelet's prepare is then answered from the record; a
claim that cannot be prepared (a host process holds the GPU) gets HostPrepareFailed and is not tried
again for the same allocation; a claim that loses its allocation, or is deleted, is unprepared and the
GPU goes back to its driver; claims without binding conditions and the kubelet's own records are left
alone. Also the slices' fields, their API rules, and the claim status entries."""

from __future__ import annotations

import asyncio
import copy
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from agentkit import NODE, Node, claim, make_node, nic, restarted, result, write_claim
from lightkube.resources.resource_v1 import ResourceClaim
from test_vfio import fake_proc

from agent import apirules
from agent.bindingconditions import BINDING_CONDITION, BINDING_FAILURE_CONDITION, bindable_kinds
from agent.claims.watch import ClaimEvent, watch_claims
from agent.config import BINDABLE_KINDS, ConfigError, build_settings
from agent.engine.prebind import PreBinder
from agent.engine.recovery import recover
from agent.health.claimstatus import ClaimStatusWriter
from agent.health.statussinks import DirectoryStatusSink
from agent.host.vfio.pci import current_driver, current_override
from agent.inventory.passthrough import NicVariants
from agent.kinds import Kind
from agent.kube import Backoff, NodeInfo
from agent.names import ClaimRef
from agent.publish import dropped, slices
from agent.sim.kernel.emulator import KernelEmulator, WriteKind
from agent.sim.kernel.tree import SimTree
from agent.sim.profiles import load_profile

pytestmark = pytest.mark.filterwarnings("ignore:Callback with id:RuntimeWarning")

DRIVER = "dra.example.com"
GPU_BUS = "0000:18:00.0"  # gpu-0 of dgx-h100
GPU_VARIANT = "gpu-0000-18-00-0-vfio"
UID = "3b1a0000-0000-4000-8000-000000000001"
UID2 = "3b1a0000-0000-4000-8000-000000000002"
WAITS = {"bindingConditions": [BINDING_CONDITION], "bindingFailureConditions": [BINDING_FAILURE_CONDITION]}


class Bound:
    """The simulated machine, the engine, a claim status writer to a directory, and the pre-binder."""

    def __init__(self, node: Node, tree: SimTree, kernel: KernelEmulator) -> None:
        self.node = node
        self.tree = tree
        self.kernel = kernel
        assert node.settings.offline is not None
        self.writer = ClaimStatusWriter(DRIVER, DirectoryStatusSink(node.settings.offline), node.inventory,
                                        node.engine.book, backoff=Backoff(initial=0.01, maximum=0.05),
                                        binding_kinds=frozenset({Kind.VFIO}))
        node.engine.listeners.append(self.writer)
        self.binder = PreBinder(node.engine, self.writer)

    def driver(self) -> str | None:
        return current_driver(self.tree.sys, GPU_BUS)

    async def seen(self, kind: str, obj: dict[str, Any]) -> None:
        """The API server holds `obj` (the offline directory stands in for it) and the watch delivers it;
        until the pre-binder and the status writer are done with it."""
        path = write_claim(self.node.claims_dir, obj)
        if kind == "DELETED":
            path.unlink()
        self.binder.observe(ClaimEvent(kind, copy.deepcopy(obj)))  # type: ignore[arg-type]
        await self.binder.idle()
        await asyncio.wait_for(self.writer.idle(), 30)

    def status(self, name: str) -> dict[tuple[str, str], dict[str, Any]]:
        """The conditions of the claim's status entries, by device and type."""
        assert self.node.settings.offline is not None
        path = self.node.settings.offline / "resourceclaimstatus" / "default" / f"{name}.yaml"
        if not path.exists():
            return {}
        doc = yaml.safe_load(path.read_text())
        return {(e["device"], c["type"]): c for e in doc["status"]["devices"] for c in e["conditions"]}


@pytest.fixture
async def bound(tmp_path: Path) -> AsyncIterator[Bound]:
    node = await make_node(tmp_path, binding_conditions="vfio")
    root = node.settings.state_dir / "nvml-sim"
    tree = SimTree(root)
    node.nic_source.devices = NicVariants().apply(tree.sys, [nic()])
    await node.inventory.scan(["nic"])
    with KernelEmulator(load_profile("dgx-h100"), root) as kernel:
        b = Bound(node, tree, kernel)
        yield b
        await b.binder.stop()
        await b.writer.stop()


def allocated(name: str, uid: str, device: str = GPU_VARIANT, at: str = "2026-12-03T10:00:00Z",
              waits: bool = True) -> dict[str, Any]:
    obj = claim(name, uid, [result(device, "vm", **(WAITS if waits else {}))])
    obj["status"]["allocation"]["allocationTimestamp"] = at
    return obj


def deallocated(obj: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["status"] = {}
    return out


async def test_an_allocated_passthrough_gpu_is_prepared_before_binding_and_the_kubelet_finds_it(bound: Bound) -> None:
    engine = bound.node.engine
    obj = allocated("vm", UID)
    await bound.seen("ADDED", obj)
    assert bound.driver() == "vfio-pci"
    record = engine.whole_record(UID)
    assert record is not None and record.ahead and record.prepared
    assert [d.device for d in record.devices] == [GPU_VARIANT]
    cond = bound.status("vm")
    assert cond[GPU_VARIANT, BINDING_CONDITION]["status"] == "True"
    assert cond[GPU_VARIANT, "Ready"]["status"] == "True"
    # The scheduler's later changes to the claim (its reservation, our own status) prepare nothing again.
    await bound.seen("MODIFIED", obj)
    assert engine.whole_record(UID) == record

    # The kubelet's NodePrepareResources once the pod is bound: answered from that record, nothing redone.
    write_claim(bound.node.claims_dir, obj)
    (answer,) = (await engine.prepare([ClaimRef("default", "vm", UID)])).values()
    assert answer.error == "" and answer.devices == record.devices
    assert engine.whole_record(UID) == record
    # The mark survives a restart: a restarted agent still knows it prepared the claim ahead.
    again = restarted(bound.node).whole_record(UID)
    assert again is not None and again.ahead

    # The kubelet's unprepare undoes it all.
    (err,) = (await engine.unprepare([ClaimRef("default", "vm", UID)])).values()
    assert err == "" and bound.driver() == "nvidia" and engine.whole_record(UID) is None


async def test_a_claim_that_loses_its_allocation_is_unprepared(bound: Bound) -> None:
    obj = allocated("vm", UID)
    await bound.seen("ADDED", obj)
    assert bound.driver() == "vfio-pci"
    await bound.seen("MODIFIED", deallocated(obj))  # the scheduler gave the binding up
    assert bound.driver() == "nvidia" and bound.node.engine.whole_record(UID) is None
    assert bound.status("vm") == {}  # our entries removed

    # Allocated again: prepared again.
    await bound.seen("MODIFIED", allocated("vm", UID, at="2026-12-03T10:01:00Z"))
    assert bound.driver() == "vfio-pci"
    await bound.seen("DELETED", allocated("vm", UID, at="2026-12-03T10:01:00Z"))  # deleted before its pod ran
    assert bound.driver() == "nvidia" and bound.node.engine.whole_record(UID) is None


async def test_a_prepare_that_fails_says_so_once_per_allocation(bound: Bound) -> None:
    holder = bound.tree.root / "proc" / "4343"
    fake_proc(bound.tree.root / "proc", 4343, "python3", {7: "/dev/nvidia0"})  # a host process holds the GPU
    obj = allocated("vm", UID)
    await bound.seen("ADDED", obj)
    assert bound.driver() == "nvidia" and bound.node.engine.whole_record(UID) is None
    failed = bound.status("vm")[GPU_VARIANT, BINDING_FAILURE_CONDITION]
    assert failed["status"] == "True" and failed["reason"] == "PrepareFailed"
    assert f"GPU {GPU_BUS} is in use on the host: pid 4343 (python3)" in failed["message"]
    assert (GPU_VARIANT, BINDING_CONDITION) not in bound.status("vm")

    # The same allocation is not tried again (the scheduler gives it up), even once the GPU is free.
    shutil.rmtree(holder)
    await bound.seen("MODIFIED", obj)
    assert bound.node.engine.whole_record(UID) is None
    # Deallocated, then allocated again (within the same second, as the API's time says it): tried anew.
    await bound.seen("MODIFIED", deallocated(obj))
    await bound.seen("MODIFIED", obj)
    assert bound.driver() == "vfio-pci"
    assert bound.status("vm")[GPU_VARIANT, BINDING_CONDITION]["status"] == "True"
    assert await bound.node.engine.unprepare([ClaimRef("default", "vm", UID)]) == {UID: ""}


async def test_a_bind_the_kernel_refuses_is_rolled_back_and_reported(bound: Bound) -> None:
    bound.node.engine.passthrough.timeout = 1.0
    bound.kernel.fail(WriteKind.BIND, GPU_BUS, reason="probe failed")  # the simulated machine fails the bind
    await bound.seen("ADDED", allocated("vm", UID))
    failed = bound.status("vm")[GPU_VARIANT, BINDING_FAILURE_CONDITION]
    assert failed["status"] == "True" and f"bind {GPU_BUS} to vfio-pci: not done after 1s" in failed["message"]
    assert bound.driver() == "nvidia" and current_override(bound.tree.sys, GPU_BUS) is None
    assert bound.node.engine.whole_record(UID) is None


async def test_a_restarted_agent_unprepares_what_it_prepared_ahead_for_an_allocation_gone_meanwhile(
        bound: Bound) -> None:
    obj = allocated("vm", UID)
    await bound.seen("ADDED", obj)
    assert bound.driver() == "vfio-pci"
    # The agent stops; the scheduler gives the allocation up meanwhile. The next agent's watch starts with
    # the claim as it is now, once its start-up recovery has read the records.
    engine = restarted(bound.node)
    await asyncio.to_thread(recover, engine)
    binder = PreBinder(engine, bound.writer)
    write_claim(bound.node.claims_dir, deallocated(obj))
    binder.observe(ClaimEvent("ADDED", deallocated(obj)))
    await binder.idle()
    assert bound.driver() == "nvidia" and engine.whole_record(UID) is None


async def test_claims_without_binding_conditions_and_the_kubelets_records_are_left_alone(bound: Bound) -> None:
    engine = bound.node.engine
    plain = allocated("plain", UID, waits=False)
    await bound.seen("ADDED", plain)
    assert engine.whole_record(UID) is None and bound.driver() == "nvidia"

    # A claim the kubelet prepared (its record not `ahead`), then seen deallocated: its pod may still use it.
    kubelets = allocated("kubelet", UID2, device="gpu-1")
    write_claim(bound.node.claims_dir, kubelets)
    assert (await engine.prepare([ClaimRef("default", "kubelet", UID2)]))[UID2].error == ""
    await bound.seen("MODIFIED", deallocated(kubelets))
    record = engine.whole_record(UID2)
    assert record is not None and not record.ahead
    # Another driver's results, or this driver's in another node's pool, are not this agent's.
    other = claim("other", UID, [result(GPU_VARIANT, "vm", pool="node-b", **WAITS)])
    await bound.seen("ADDED", other)
    assert engine.whole_record(UID) is None
    assert await engine.unprepare([ClaimRef("default", "kubelet", UID2)]) == {UID2: ""}


async def test_claims_allocated_elsewhere_are_dropped_by_the_watch(bound: Bound, kube_api: Any) -> None:
    # The watch sends every claim of the cluster; those allocated to other nodes or other drivers (nearly
    # all of them, on a large cluster) are dropped from their heads (`PreBinder.wants`) as they arrive:
    # never decoded whole, no task, no record lookup by a handler.
    binder = bound.binder
    for i in range(1000):
        pool = f"node-{i % 50}" if i % 2 else NODE
        driver = "gpu.other.example.com" if not i % 2 else DRIVER
        kube_api.add(claim(f"far-{i:04d}", f"far-{i:04d}", [result("gpu-0", "vm", pool=pool, driver=driver, **WAITS)]))
    obj = allocated("vm", UID)
    kube_api.add(obj)
    client = kube_api.client()
    events = watch_claims(client, wanted=binder.wants)
    try:
        # One of this node's is the first the watch delivers, and it is taken at once.
        first = await asyncio.wait_for(anext(events), 30)
        assert first.claim["metadata"]["uid"] == UID
        binder.observe(first)
        assert set(binder._tasks) == {UID}
        await binder.idle()
        assert bound.node.engine.whole_record(UID) is not None and bound.driver() == "vfio-pci"
        # Its later change is delivered though it is no longer allocated here: its record is.
        await client.patch(ResourceClaim.Status, "vm", {"status": {"allocation": None}}, namespace="default")
        change = await asyncio.wait_for(anext(events), 30)
        assert change.type == "MODIFIED" and change.claim["metadata"]["uid"] == UID
        binder.observe(change)
        await binder.idle()
    finally:
        await events.aclose()
    assert bound.node.engine.whole_record(UID) is None and bound.driver() == "nvidia"


# -- the claim watch -----------------------------------------------------------------------------------

async def test_the_watch_sends_every_claim_then_each_change_and_starts_again_after_a_failure(kube_api: Any) -> None:
    def made(name: str) -> dict[str, Any]:
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": "default"}, "spec": {"devices": {"requests": []}}}

    kube_api.add(made("before"))
    watch = kube_api.fail("GET", "/apis/resource.k8s.io/v1/resourceclaims*", times=1, status=500)
    client = kube_api.client()
    events = watch_claims(client, wanted=lambda head: True, backoff=Backoff(initial=0.01, maximum=0.02))
    try:
        async def next_event() -> tuple[str, str]:
            event = await asyncio.wait_for(anext(events), 10)
            return event.type, event.claim["metadata"]["name"]

        assert await next_event() == ("ADDED", "before")  # after the failed first try
        assert watch.times == 0
        await client.create(ResourceClaim.from_dict(made("after")))
        assert await next_event() == ("ADDED", "after")
        await client.delete(ResourceClaim, "before", namespace="default")
        assert await next_event() == ("DELETED", "before")
    finally:
        await events.aclose()


# -- the published fields, their rules, the settings -------------------------------------------------

def test_only_the_named_kinds_carry_binding_conditions(tmp_path: Path) -> None:
    settings = build_settings({"node_name": "n", "binding_conditions": "vfio,mig", "state_dir": tmp_path})
    node = NodeInfo(name="n", uid="u")
    layout = dropped.layout(settings, node)
    assert layout.binding_kinds == {Kind.VFIO, Kind.MIG}
    from agent.model import Device
    chunks = slices.chunk_devices([Device("gpu-0", Kind.GPU), Device("gpu-0000-18-00-0-vfio", Kind.VFIO)],
                                  layout=layout)
    (chunk,) = chunks.slices
    by_name = {d["name"]: d for d in chunk}
    assert by_name["gpu-0000-18-00-0-vfio"]["bindingConditions"] == [BINDING_CONDITION]
    assert by_name["gpu-0000-18-00-0-vfio"]["bindingFailureConditions"] == [BINDING_FAILURE_CONDITION]
    assert "bindingConditions" not in by_name["gpu-0"] and "bindsToNode" not in by_name["gpu-0000-18-00-0-vfio"]
    assert not chunks.errors and not chunks.dropped
    # An API server that drops the fields (its gate off): they are not sent again, the kubelet prepares.
    assert dropped.layout(settings, node, {dropped.BINDING_CONDITIONS}).binding_kinds == frozenset()
    assert dropped.gate_of(dropped.BINDING_CONDITIONS) == "DRADeviceBindingConditions"


def test_the_setting_names_only_kinds_whose_prepare_changes_the_host() -> None:
    assert bindable_kinds() == BINDABLE_KINDS == ("vfio", "mig", "vgpu")
    with pytest.raises(ConfigError, match="--binding-conditions: gpu not one of vfio, mig, vgpu"):
        build_settings({"node_name": "n", "binding_conditions": "vfio,gpu"})
    assert build_settings({"node_name": "n"}).binding_kinds == frozenset()


def test_binding_condition_rules() -> None:
    assert apirules.binding_condition_errors([BINDING_CONDITION], [BINDING_FAILURE_CONDITION]) == []
    assert apirules.binding_condition_errors(["a", "b", "c", "d", "e"], ["f"]) == [
        "bindingConditions: 5 conditions, more than 4"]
    assert apirules.binding_condition_errors(["a"], []) == [
        "bindingConditions and bindingFailureConditions are each required with the other"]
    assert apirules.binding_condition_errors(["a", "a"], ["a"]) == [
        "bindingConditions has duplicates", "bindingFailureConditions must not repeat bindingConditions (a)"]
    assert apirules.binding_condition_errors(["not a name"], ["x"])[0].startswith("bindingConditions 'not a name'")
