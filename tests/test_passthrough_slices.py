"""Passthrough (VFIO) variants and shared counter sets: discovered on the simulated machine (its sysfs,
IOMMU groups and SR-IOV NIC), published as slices the 1.37 API accepts, split by the counter limits,
and planned so that an unchanged pool writes nothing."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubeapi import RESOURCE_SLICES, KubeApi

from agent import apirules, counters
from agent.config import NvmlMode, Settings
from agent.facts import NicFacts
from agent.inventory.gpus import GpuSource
from agent.inventory.passthrough import GpuVariants, NicVariants
from agent.kinds import Kind
from agent.kube import Backoff, NodeInfo, read_node
from agent.model import NUMA_NODE, PCI_BUS_ID, PCIE_ROOT, CounterConsumption, CounterSet, Device
from agent.publish.apiserver import ApiPublisher, DirectoryPublisher
from agent.publish.slices import CounterChunk, build_slices, chunk_devices, plan_pool, pool_rule_errors
from agent.sim.kernel.tree import SimTree
from agent.sim.nvmlopen import open_sim_nvml

DRIVER = "dra.example.com"
NODE = "node-a"
H100 = {"name": "NVIDIA H100 80GB HBM3", "memoryTotal": 85520809984}
# A GPU with its audio function, two GPUs sharing one IOMMU group, a GPU whose root port is in its
# group; a NIC with two VFs enabled and a NIC without SR-IOV.
MIXED = {
    "gpus": [
        {**H100, "busId": "0000:18:00.0", "audio": True},
        {**H100, "busId": "0000:2a:00.0", "iommuGroup": 7},
        {**H100, "busId": "0000:3a:00.0", "iommuGroup": 7},
        {**H100, "busId": "0000:5d:00.0", "bridgeInGroup": True},
    ],
    "nics": [
        {"busId": "0000:4b:00.0", "interface": "ens75f0np0", "numaNode": 0, "totalVfs": 4, "numVfs": 2},
        {"busId": "0000:8b:00.0", "interface": "eno1", "numaNode": 1},
    ],
}


def vfio(bus: str, prefix: str = "gpu") -> str:
    return f"{prefix}-{bus.replace(':', '-').replace('.', '-')}-vfio"


def scanned(tmp_path: Path, profile: str, dynamic_mig: bool = False) -> tuple[GpuSource, list[Device]]:
    """The profile's GPUs and variants; MIG placements only when asked (tests/test_mig.py covers them)."""
    source = GpuSource(Settings(node_name=NODE, nvml=NvmlMode("sim", profile), state_dir=tmp_path / "state"),
                       dynamic_mig=dynamic_mig, opener=open_sim_nvml)
    source.open()
    return source, source.scan().devices


@pytest.fixture
def mixed(tmp_path: Path) -> Iterator[GpuSource]:
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(MIXED))
    source = GpuSource(Settings(node_name=NODE, nvml=NvmlMode("sim", str(path)), state_dir=tmp_path / "state"),
                       opener=open_sim_nvml)
    source.open()
    yield source
    source.close()


def sim_sys(source: GpuSource) -> Path:
    return source.sysfs_root


def valid_pool(objs: list[dict[str, Any]]) -> None:
    for obj in objs:
        kubernetes_validate.validate(obj, "1.37.0", strict=True)
    assert apirules.pool_errors(objs) == []


def consumption(obj_devices: dict[str, dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return list(obj_devices[name]["consumesCounters"])


def by_name(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for o in objs for d in o["spec"].get("devices", [])}


def counter_sets(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s["counters"] for o in objs for s in o["spec"].get("sharedCounters", [])}


# -- the simulated machines ---------------------------------------------------------------------------

@pytest.mark.parametrize(("profile", "gpus", "counter_slices"), [("dgx-h100", 8, 1), ("hgx-16", 16, 2)])
def test_every_gpu_has_a_variant_and_one_counter_set_both_consume_whole(
        tmp_path: Path, profile: str, gpus: int, counter_slices: int) -> None:
    source, devices = scanned(tmp_path, profile, dynamic_mig=True)
    source.close()
    objs = build_slices(devices, driver=DRIVER, node=NODE)
    valid_pool(objs)

    # Counter slices first, at most 8 sets each, then the devices; every slice knows the count.
    kinds = ["counters" if "sharedCounters" in o["spec"] else "devices" for o in objs]
    assert kinds == ["counters"] * counter_slices + ["devices"] * (len(objs) - counter_slices)
    assert all(len(o["spec"]["sharedCounters"]) <= 8 for o in objs[:counter_slices])
    assert all(o["spec"]["pool"]["resourceSliceCount"] == len(objs) for o in objs)
    assert all(len(o["spec"]["devices"]) <= 64 for o in objs[counter_slices:])

    sets = counter_sets(objs)
    assert len(sets) == gpus
    devs = by_name(objs)
    natives = {n: d for n, d in devs.items() if d["attributes"]["type"] == {"string": "gpu"}}
    migs = {n for n, d in devs.items() if d["attributes"]["type"] == {"string": "mig"}}
    # 13 placements a GPU: the profiles --mig-profiles names by default (tests/test_mig.py has them).
    assert len(natives) == gpus and len(migs) == 13 * gpus and len(devs) == 2 * gpus + len(migs)
    for name, native in natives.items():
        bus = native["attributes"][PCI_BUS_ID]["string"]
        variant = devs[vfio(bus)]
        # The same set, the whole GPU of it, for both forms: `gpu` and all of `memory` (every placement
        # takes some memory), not the counters the placements share out.
        [mine] = consumption(devs, name)
        assert consumption(devs, vfio(bus)) == [mine]
        assert mine["counterSet"] == f"gpu-{bus.replace(':', '-').replace('.', '-')}-counters"
        assert mine["counters"] == {k: sets[mine["counterSet"]][k] for k in ("gpu", "memory")}
        assert mine["counters"]["gpu"] == {"value": "1"}
        assert mine["counters"]["memory"] == native["capacity"]["memory"]
        attrs = variant["attributes"]
        assert attrs["type"] == {"string": "vfio"} and attrs["nativeType"] == {"string": "gpu"}
        for key in (PCI_BUS_ID, PCIE_ROOT, NUMA_NODE):
            assert attrs[key] == native["attributes"][key], (name, key)
        assert set(attrs["iommuGroup"]) == {"int"}
        assert attrs["vendorID"] == {"string": "0x10de"} and attrs["deviceID"] == {"string": "0x2330"}


def test_a_variant_keeps_its_name_and_set_while_bound_to_vfio(tmp_path: Path) -> None:
    source, before = scanned(tmp_path, "dgx-h100")
    try:
        bus = "0000:18:00.0"
        tree = SimTree(sim_sys(source).parent)
        tree.unbind(bus)
        tree.bind(bus, "vfio-pci")
        after = source.scan().devices
    finally:
        source.close()
    old = next(d for d in before if d.name == vfio(bus))
    new = next(d for d in after if d.name == vfio(bus))
    assert (old.node.driver, old.node.host_driver) == ("nvidia", "nvidia")
    assert (new.node.driver, new.node.host_driver) == ("vfio-pci", "nvidia")
    assert new.node.pci_bus_id == bus and new.node.iommu_group == old.node.iommu_group >= 0
    assert new.attributes == old.attributes and new.consumes_counters == old.consumes_counters


def test_a_shared_group_gets_no_variant_companions_and_bridges_do_not_block(
        mixed: GpuSource, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="agent.inventory.passthrough"):
        devices = mixed.scan().devices
        mixed.scan()
    names = {d.name for d in devices}
    assert {vfio("0000:18:00.0"), vfio("0000:5d:00.0")} <= names  # audio companion, bridge: fine
    assert vfio("0000:2a:00.0") not in names and vfio("0000:3a:00.0") not in names
    # Both natives still consume their own sets (the later MIG work builds on them).
    natives = [d for d in devices if d.kind == "gpu"]
    assert len(natives) == 4 and all(len(d.consumes_counters) == 1 for d in natives)
    said = [r.getMessage() for r in caplog.records if "no passthrough variant" in r.getMessage()]
    # One line per function, not one per scan, naming the neighbour it would take.
    assert len(said) == 2
    assert any("0000:2a:00.0" in m and "0000:3a:00.0" in m and "IOMMU group 7" in m for m in said)
    valid_pool(build_slices(devices, driver=DRIVER, node=NODE))


def test_no_iommu_groups_no_variants_said_once(mixed: GpuSource, caplog: pytest.LogCaptureFixture) -> None:
    groups = sim_sys(mixed) / "kernel" / "iommu_groups"
    shutil.rmtree(groups)
    groups.mkdir()
    with caplog.at_level(logging.WARNING, logger="agent.inventory.passthrough"):
        first = mixed.scan().devices
        mixed.scan()
    assert [d for d in first if d.kind == "vfio"] == []
    assert all(d.consumes_counters for d in first)  # the natives keep their sets
    assert sum("no IOMMU groups" in r.getMessage() for r in caplog.records) == 1


def test_no_iommu_groups_is_said_only_of_functions_that_miss_a_variant(
        mixed: GpuSource, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A host with SR-IOV VFs and its IOMMU off: the warning names the VFs that get no variant.
    sys = sim_sys(mixed)
    groups = sys / "kernel" / "iommu_groups"
    shutil.rmtree(groups)
    groups.mkdir()
    with caplog.at_level(logging.WARNING, logger="agent.inventory.passthrough"):
        assert NicVariants().apply(sys, []) == []
    said = [r.getMessage() for r in caplog.records if "no IOMMU groups" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("no passthrough variant for NIC function 0000:4b:00.1, 0000:4b:00.2")
    # A host without a VF (nor a GPU) has nothing to pass through: its IOMMU being off is not worth a
    # warning on every `dra-agent devices` (doctor's IOMMU line says it).
    caplog.clear()
    bare = tmp_path / "bare-sys"
    (bare / "bus" / "pci" / "devices").mkdir(parents=True)
    with caplog.at_level(logging.INFO, logger="agent.inventory.passthrough"):
        assert NicVariants().apply(bare, []) == []
        assert GpuVariants().apply(bare, []) == []
    assert caplog.records == []


# -- NIC functions -------------------------------------------------------------------------------------

def test_vfs_get_variants_with_their_mac_and_pfs_only_when_named(mixed: GpuSource) -> None:
    sys = sim_sys(mixed)
    plain = NicVariants().apply(sys, [])
    vfs = {"0000:4b:00.1", "0000:4b:00.2"}
    assert {d.name for d in plain} == {vfio(b, "nic") for b in vfs}
    for dev in plain:
        bus = dev.node.pci_bus_id
        mac = next((sys / "bus" / "pci" / "devices" / bus / "net").iterdir()) / "address"
        assert dev.attributes["macAddress"] == mac.read_text().strip() == dev.node.mac
        assert dev.attributes["nativeType"] == "nic" and dev.attributes[PCI_BUS_ID] == bus
        assert dev.attributes["vendorID"] == "0x15b3" and dev.attributes["deviceID"] == "0x101e"
        assert dev.consumes_counters == (CounterConsumption.all_of(counters.nic_counter_set(bus, 1)),)
        assert dev.node.host_driver == "mlx5_core"

    # A PF without VFs when --nic-passthrough names it; never the PF whose VFs are enabled.
    named = {d.name for d in NicVariants(passthrough=("eno*", "ens75*")).apply(sys, [])}
    assert named == {vfio(b, "nic") for b in vfs} | {vfio("0000:8b:00.0", "nic")}
    # --nic-exclude wins.
    excluded = {d.name for d in NicVariants(passthrough=("eno*",), exclude=("eno1", "ens75f0np0v1")).apply(sys, [])}
    assert excluded == {vfio("0000:4b:00.1", "nic")}


def test_a_vf_on_vfio_keeps_its_variant_and_mac(mixed: GpuSource) -> None:
    sys = sim_sys(mixed)
    variants = NicVariants()
    bus = "0000:4b:00.2"
    before = {d.name: d for d in variants.apply(sys, [])}[vfio(bus, "nic")]
    tree = SimTree(sys.parent)
    tree.unbind(bus)
    tree.bind(bus, "vfio-pci")
    shutil.rmtree(sys / "bus" / "pci" / "devices" / bus / "net")  # the netdev goes with mlx5_core
    after = {d.name: d for d in variants.apply(sys, [])}[vfio(bus, "nic")]
    assert after.attributes == before.attributes and after.node.mac == before.node.mac
    assert (after.node.driver, after.node.host_driver) == ("vfio-pci", "mlx5_core")


def test_ports_of_one_function_share_its_set_and_the_variant_takes_them_all(mixed: GpuSource) -> None:
    sys = sim_sys(mixed)
    bus = "0000:8b:00.0"
    ports = [Device(name=f"nic-{bus.replace(':', '-').replace('.', '-')}{suffix}", kind=Kind.NIC,
                    attributes={"type": "nic", PCI_BUS_ID: bus}, node=NicFacts("", pci_bus_id=bus))
             for suffix in ("", "-p1")]
    out = {d.name: d for d in NicVariants(passthrough=("eno1",)).apply(sys, ports)}
    full = counters.nic_counter_set(bus, 2)
    assert [d.consumes_counters for d in out.values() if d.kind == "nic"] == [
        (CounterConsumption(full, {"ports": "1"}),)] * 2
    assert out[vfio(bus, "nic")].consumes_counters == (CounterConsumption.all_of(full),)
    valid_pool(build_slices(list(out.values()), driver=DRIVER, node=NODE))


# -- API rules ----------------------------------------------------------------------------------------

def counter_slice(n_sets: int, n_counters: int = 1) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "s"},
            "spec": {"driver": DRIVER, "nodeName": NODE,
                     "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
                     "sharedCounters": [{"name": f"set-{i}", "counters": {f"c-{j}": {"value": "1"}
                                                                          for j in range(n_counters)}}
                                        for i in range(n_sets)]}}


def test_counter_rules_are_the_api_servers() -> None:
    assert apirules.slice_errors(counter_slice(8, 32)) == []
    assert any("more than 8" in e for e in apirules.slice_errors(counter_slice(9)))
    assert any("more than 32" in e for e in apirules.slice_errors(counter_slice(1, 33)))
    both = counter_slice(1)
    both["spec"]["devices"] = [{"name": "d"}]
    assert any("mutually exclusive" in e for e in apirules.slice_errors(both))
    bad = counter_slice(1)
    bad["spec"]["sharedCounters"][0]["counters"] = {"Memory_1": {"value": "1"}, "gpu": {"value": "lots"}}
    errs = apirules.slice_errors(bad)
    assert any("'Memory_1' name" in e for e in errs) and any("'lots' is not a quantity" in e for e in errs)

    use = {"counterSet": "set-0", "counters": {"c-0": {"value": "1"}}}
    assert apirules.device_wire_errors({"name": "d", "consumesCounters": [use]}) == []
    three = [dict(use, counterSet=f"set-{i}") for i in range(3)]
    assert any("more than 2" in e for e in apirules.device_wire_errors({"name": "d", "consumesCounters": three}))
    assert any("twice" in e for e in apirules.device_wire_errors({"name": "d", "consumesCounters": [use, use]}))
    # The same limits hold for what the emulator's schema check cannot see.
    kubernetes_validate.validate(counter_slice(9), "1.37.0", strict=True)


def test_pool_rules_span_slices() -> None:
    sets = counter_slice(1)
    devices = {**sets, "spec": {**sets["spec"], "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 2}}}
    sets["spec"]["pool"]["resourceSliceCount"] = 2
    del devices["spec"]["sharedCounters"]
    devices["spec"]["devices"] = [
        {"name": "ok", "consumesCounters": [{"counterSet": "set-0", "counters": {"c-0": {"value": "1"}}}]},
        {"name": "lost", "consumesCounters": [{"counterSet": "nowhere", "counters": {"c-0": {"value": "1"}}}]},
        {"name": "odd", "consumesCounters": [{"counterSet": "set-0", "counters": {"c-9": {"value": "1"}}}]}]
    errs = apirules.pool_errors([sets, devices])
    assert len(errs) == 2
    assert "'lost'" in errs[0] and "'nowhere'" in errs[0] and "'odd'" in errs[1] and "c-9" in errs[1]
    thrice = apirules.pool_errors([sets, devices, sets])
    assert any("'set-0' is published twice" in e for e in thrice)
    assert any("resourceSliceCount is 2 but the pool has 3 slices" in e for e in thrice)


def consuming(n: int, definition: dict[str, str] | None = None) -> list[Device]:
    out = []
    for i in range(n):
        cs = CounterSet(f"set-{i:03d}", definition or {"gpu": "1"})
        out.append(Device(name=f"dev-{i:03d}", kind=Kind.GPU, consumes_counters=(CounterConsumption.all_of(cs),)))
    return out


def test_many_functions_split_8_sets_and_64_devices_per_slice() -> None:
    chunks = chunk_devices(consuming(130))
    shapes = [("c", len(c.sets)) if isinstance(c, CounterChunk) else ("d", len(c)) for c in chunks.slices]
    assert shapes == [("c", 8)] * 16 + [("c", 2)] + [("d", 64), ("d", 64), ("d", 2)]
    objs = build_slices(consuming(130), driver=DRIVER, node=NODE)
    valid_pool(objs)
    assert chunks.counter_set_count == 130 and chunks.device_count == 130


def test_a_device_whose_set_disagrees_or_breaks_a_rule_is_not_published(caplog: pytest.LogCaptureFixture) -> None:
    first, second = consuming(2)
    other = CounterSet("set-000", {"gpu": "2"})  # the same name, another definition
    clash = Device(name="dev-zzz", kind=Kind.VFIO, consumes_counters=(CounterConsumption.all_of(other),))
    broken = Device(name="dev-bad", kind=Kind.GPU,
                    consumes_counters=(CounterConsumption.all_of(CounterSet("Bad_Set", {"gpu": "1"})),))
    greedy = Device(name="dev-more", kind=Kind.GPU,
                    consumes_counters=(CounterConsumption(first.consumes_counters[0].counter_set, {"x": "1"}),))
    with caplog.at_level(logging.WARNING, logger="agent.publish.slices"):
        chunks = chunk_devices([first, second, clash, broken, greedy])
    published = {d["name"] for c in chunks.slices if not isinstance(c, CounterChunk) for d in c}
    assert published == {"dev-000", "dev-001"}
    assert len(chunks.dropped) == 3 and all("not published" in r.getMessage() for r in caplog.records)
    valid_pool(build_slices([first, second, clash, broken, greedy], driver=DRIVER, node=NODE))


def test_a_device_with_more_than_two_counter_consumptions_is_not_published(
        caplog: pytest.LogCaptureFixture) -> None:
    sets = [CounterSet(f"set-{i}", {"gpu": "1"}) for i in range(3)]
    three = Device(name="dev-three", kind=Kind.GPU, consumes_counters=tuple(CounterConsumption.all_of(s) for s in sets))
    two = Device(name="dev-two", kind=Kind.GPU, consumes_counters=tuple(CounterConsumption.all_of(s) for s in sets[:2]))
    with caplog.at_level(logging.WARNING, logger="agent.publish.slices"):
        chunks = chunk_devices([three, two])
    published = [d["name"] for c in chunks.slices if not isinstance(c, CounterChunk) for d in c]
    assert published == ["dev-two"]
    assert chunks.dropped == ["device 'dev-three' dropped: 3 counter consumptions, more than 2"]
    # Only the sets a published device consumes are published: set-2 was dev-three's alone.
    assert [s["name"] for c in chunks.slices if isinstance(c, CounterChunk) for s in c.sets] == ["set-0", "set-1"]
    assert "not published: device 'dev-three' dropped" in caplog.text
    valid_pool(build_slices([three, two], driver=DRIVER, node=NODE))


def test_the_split_is_checked_against_the_pool_rules() -> None:
    chunks = chunk_devices(consuming(130))
    assert chunks.errors == [] and pool_rule_errors([]) == []
    (*counter_chunks, first, second, third) = chunks.slices
    assert all(isinstance(c, CounterChunk) for c in counter_chunks)
    assert pool_rule_errors(chunks.slices) == []
    # A split that broke them: 65 consuming devices in one slice, a set published twice, and devices
    # whose sets are in no counter slice.
    assert not isinstance(first, CounterChunk) and not isinstance(second, CounterChunk)
    errors = pool_rule_errors([*counter_chunks, counter_chunks[0], [*first, second[0]]])
    assert any("spec.devices has 65 entries, more than 64" in e for e in errors)
    assert any("counter set 'set-000' is published twice in the pool" in e for e in errors)
    unpublished = pool_rule_errors([*counter_chunks[:16], first, second, third])  # without set-128, set-129
    assert any("device 'dev-128' consumes counter set 'set-128'" in e for e in unpublished)


def test_long_names_are_cut_to_distinct_stable_labels() -> None:
    a, b = "x" * 70 + "-vfio", "x" * 71 + "-vfio"
    assert len(counters.fit_label(a)) <= 63 and counters.fit_label(a) == counters.fit_label(a)
    assert counters.fit_label(a) != counters.fit_label(b) and not apirules.dns_label_errors(counters.fit_label(a))
    assert counters.passthrough_name("gpu", "0000:18:00.0") == "gpu-0000-18-00-0-vfio"
    assert counters.passthrough_name("nic", "10000:4b:00.2") == "nic-10000-4b-00-2-vfio"


# -- the publish plan ---------------------------------------------------------------------------------

def served(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The objects named as the API server names them: generateName (the slice's place) and 5 characters."""
    named = [f"{o['metadata']['generateName']}s{i:04d}" for i, o in enumerate(objs)]
    return {name: {**o, "metadata": {**o["metadata"], "name": name}} for name, o in zip(named, objs, strict=True)}


def test_plan_an_unchanged_pool_with_counter_slices_writes_nothing(tmp_path: Path) -> None:
    source, devices = scanned(tmp_path, "hgx-16")
    source.close()
    chunks = chunk_devices(devices).slices
    existing = served(build_slices(devices, driver=DRIVER, node=NODE))
    assert plan_pool(existing, chunks, driver=DRIVER, node=NODE).noop

    # One variant gone: a new generation, every slice rewritten, the counter slices still first.
    fewer = [d for d in devices if d.name != vfio("0000:0c:00.0")]
    plan = plan_pool(existing, chunk_devices(fewer).slices, driver=DRIVER, node=NODE)
    assert plan.generation == 2 and not plan.deletes
    assert ["sharedCounters" in w.obj["spec"] for w in plan.writes] == [True, True, False]
    valid_pool([w.obj for w in plan.writes])

    # A counter value changing (a GPU's memory) rewrites that counter slice in place only.
    plan = plan_pool(existing, _with_memory(devices, "0000:0c:00.0", "1Gi"), driver=DRIVER, node=NODE)
    assert plan.generation == 1 and len(plan.writes) == 2  # the counter slice and the device slice


def _with_memory(devices: list[Device], bus: str, memory: str) -> list[Any]:
    name = counters.counter_set_name("gpu", bus)
    cs = CounterSet(name, {"gpu": "1", "memory": memory})
    out = [Device(name=d.name, kind=d.kind, attributes=d.attributes, capacity=d.capacity,
                  consumes_counters=(CounterConsumption.all_of(cs),))
           if d.consumes_counters[0].counter_set.name == name else d for d in devices]
    return chunk_devices(out).slices


# -- through the API emulator ---------------------------------------------------------------------------

async def test_the_api_accepts_the_pool_and_a_second_publish_writes_nothing(kube_api: KubeApi,
                                                                           tmp_path: Path) -> None:
    source, devices = scanned(tmp_path, "hgx-16")
    devices += NicVariants().apply(source.sysfs_root, [])  # the profile's NIC: 4 VFs
    source.close()
    kube_api.add_node(NODE, uid="0d0c0b0a-1111-4222-8333-444455556666")
    settings = Settings(driver_name=DRIVER, node_name=NODE, state_dir=tmp_path / "state")
    node = await read_node(kube_api.client(), NODE)
    publisher = ApiPublisher(kube_api.client(timeout=2.0), settings, node,
                             backoff=Backoff(initial=0.01, maximum=0.05, attempts=4))

    result = await publisher.sync(devices)
    assert result.dropped == [] and result.devices == len(devices) == 16 * 2 + 4
    stored = [s for s in kube_api.items(RESOURCE_SLICES) if s["spec"]["nodeName"] == NODE]
    assert len(stored) == result.slices == 3 + 1  # two counter slices of 8 GPU sets, one of 4 VF sets
    valid_pool(stored)
    assert sorted(len(o["spec"]["sharedCounters"]) for o in stored if "sharedCounters" in o["spec"]) == [4, 8, 8]
    assert {n for n in by_name(stored) if n.startswith("nic-")} == {
        vfio(f"0000:f5:00.{i}", "nic") for i in range(1, 5)}

    kube_api.mark()
    again = await publisher.sync(devices)
    assert not again.changed and kube_api.writes() == []


async def test_the_directory_publisher_writes_counter_slices_once(tmp_path: Path) -> None:
    source, devices = scanned(tmp_path, "hgx-16")
    source.close()
    settings = Settings(driver_name=DRIVER, node_name=NODE, state_dir=tmp_path / "state")
    publisher = DirectoryPublisher(tmp_path / "out", settings, NodeInfo(NODE))
    first = await publisher.sync(devices)
    assert (first.slices, first.devices, len(first.created)) == (3, 32, 3)
    files = sorted((tmp_path / "out" / "resourceslices").iterdir())
    objs = [yaml.safe_load(f.read_text()) for f in files]
    valid_pool(objs)
    assert ["sharedCounters" in o["spec"] for o in objs] == [True, True, False]
    stamps = [f.stat().st_mtime_ns for f in files]
    again = await publisher.sync(devices)
    assert not again.changed and [f.stat().st_mtime_ns for f in files] == stamps


async def test_a_counter_slice_whose_create_answer_is_lost_is_not_stored_twice(kube_api: KubeApi,
                                                                              tmp_path: Path) -> None:
    kube_api.add_node(NODE, uid="0d0c0b0a-1111-4222-8333-444455556666")
    settings = Settings(driver_name=DRIVER, node_name=NODE, state_dir=tmp_path / "state")
    publisher = ApiPublisher(kube_api.client(timeout=1.0), settings, await read_node(kube_api.client(), NODE),
                             backoff=Backoff(initial=0.01, maximum=0.05, attempts=4))
    devices = consuming(20)  # three counter slices (8, 8, 4 sets), then one device slice
    fault = kube_api.lose_answer("POST", "/apis/resource.k8s.io/v1/resourceslices", hang=0.0)
    await publisher.sync(devices)
    assert fault.hits == 1
    stored = [s for s in kube_api.items(RESOURCE_SLICES) if s["spec"]["nodeName"] == NODE]
    assert len(stored) == 4
    names = sorted(s["name"] for o in stored for s in o["spec"].get("sharedCounters", []))
    assert names == [f"set-{i:03d}" for i in range(20)]  # each set exactly once
    valid_pool(sorted(stored, key=lambda o: "devices" in o["spec"]))
    kube_api.mark()
    assert not (await publisher.sync(devices)).changed and kube_api.writes() == []
