"""vGPU mediated devices: the types the simulated machine's GPUs offer, read and created through
`agent.host.mdev` against the kernel emulator; the vGPU devices published on each GPU's counter set (valid
under the 1.37 schema and the API's counter rules, and what the counters allow against what the host
driver accepts); the mdev Partitioner's create and destroy, and its convergence after a crash at any
step."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from agentkit import fits, valid_pool

from agent import apirules, counters, failpoints
from agent.claims.metadata import AllocatedDevice
from agent.claims.records import DevicePartition, PartitionKind
from agent.config import ConfigError, NvmlMode, Settings
from agent.facts import GpuFacts, VgpuType
from agent.host.mdev import sysfs as mdev
from agent.host.mdev.errors import MdevStepFailed, NoInstanceAvailable, ParentUnavailable, TypeNotOffered
from agent.host.vfio.host import VfioHost
from agent.hostprep.vgpu import CREATED, VgpuPartitioner
from agent.inventory import vgpu
from agent.inventory.gpus import GpuSource
from agent.model import Device
from agent.sim.hardware import materialize
from agent.sim.kernel import mdev as simmdev
from agent.sim.kernel.emulator import KernelEmulator, WriteKind
from agent.sim.kernel.tree import SimTree
from agent.sim.nvmlopen import open_sim_nvml
from agent.sim.profiles import load_profile

DRIVER = "dra.example.com"
NODE = "node-a"
GPU = "0000:18:00.0"
LIMITS = {"nvidia-1021": 20, "nvidia-1022": 10, "nvidia-1023": 8, "nvidia-1024": 4, "nvidia-1025": 2,
          "nvidia-1026": 1}


def wait_for(check: Callable[[], bool], timeout: float = 30.0) -> None:
    """Until the simulated kernel has acted (its emulator thread applies sysfs writes)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the simulated kernel did not act in time"
        time.sleep(0.01)


@dataclass
class Machine:
    tree: SimTree
    kernel: KernelEmulator
    host: VfioHost
    devices: list[Device]


def scan(state: Path, profile: str = "dgx-h100", **settings: Any) -> list[Device]:
    """The GPU source's devices; by default every vGPU type (with compatibility groups)."""
    settings = {"compatibility_groups": True, **settings}
    source = GpuSource(Settings(node_name=NODE, nvml=NvmlMode("sim", profile), state_dir=state, **settings),
                       opener=open_sim_nvml)
    source.open()
    try:
        return source.scan().devices
    finally:
        source.close()


@pytest.fixture(scope="module")
def dgx(tmp_path_factory: pytest.TempPathFactory) -> list[Device]:
    return scan(tmp_path_factory.mktemp("vgpu") / "state")


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[Machine]:
    state = tmp_path / "state"
    devices = scan(state)
    root = state / "nvml-sim"
    with KernelEmulator(load_profile("dgx-h100"), root) as kernel:
        yield Machine(SimTree(root), kernel, VfioHost(root / "sys", root / "proc", root / "dev"), devices)


def alloc(devices: list[Device], name: str) -> AllocatedDevice:
    return AllocatedDevice("vm", DRIVER, next(d for d in devices if d.name == name))


# -- agent.host.mdev against the simulated kernel ------------------------------------------------------------

def test_types_read_and_devices_made_and_removed(machine: Machine) -> None:
    sysfs = machine.host.sysfs
    assert GPU in mdev.parents(sysfs)
    types = {t.id: t for t in mdev.list_types(sysfs, GPU)}
    assert {k: t.max_instances for k, t in types.items()} == LIMITS
    assert types["nvidia-1023"] == mdev.MdevType("nvidia-1023", "GRID H100-10C", "vfio-pci", 8, 10 << 30, 8)
    u = "0f7a4d39-2c4e-4a43-9d8b-7c1f6a2b9e01"
    mdev.create(sysfs, GPU, "nvidia-1023", u, timeout=30)
    assert mdev.exists(sysfs, u) and mdev.parent_of(sysfs, u) == GPU and mdev.type_of(sysfs, u) == "nvidia-1023"
    assert mdev.mdevs_of(sysfs, GPU) == {u: "nvidia-1023"}
    mdev.create(sysfs, GPU, "nvidia-1023", u, timeout=30)  # there already: nothing written
    assert len(machine.kernel.refusals) == 0
    group = mdev.iommu_group(sysfs, u)
    assert [n.path for n in mdev.vfio_nodes(sysfs, machine.host.dev, u)] == ["/dev/vfio/vfio", f"/dev/vfio/{group}"]
    with pytest.raises(MdevStepFailed, match="available_instances is 0"):
        mdev.create(sysfs, GPU, "nvidia-1021", "1f7a4d39-2c4e-4a43-9d8b-7c1f6a2b9e01", timeout=0.5)
    mdev.remove(sysfs, u, timeout=30)
    mdev.remove(sysfs, u, timeout=30)  # gone already: nothing to do
    assert not mdev.exists(sysfs, u) and mdev.read_type(sysfs, GPU, "nvidia-1021") is not None
    machine.kernel.fail(WriteKind.MDEV_CREATE, GPU, reason="the GPU is resetting")
    with pytest.raises(MdevStepFailed, match="did not appear"):
        mdev.create(sysfs, GPU, "nvidia-1021", u, timeout=0.5)


# -- publication -----------------------------------------------------------------------------------------

def test_vgpu_devices_published_per_instance_within_the_api_limits(dgx: list[Device]) -> None:
    objs = valid_pool(dgx)
    published = {d["name"] for o in objs for d in o["spec"].get("devices", [])}
    assert published == {d.name for d in dgx}  # nothing dropped
    vgpus = [d for d in dgx if d.kind == "vgpu"]
    assert len(vgpus) == 8 * sum(LIMITS.values())
    gpu0 = next(d for d in dgx if d.name == "gpu-0")
    mine = {d.name: d for d in vgpus if d.name.startswith("gpu-0-")}
    assert set(mine) == {f"gpu-0-vgpu-{t}-{i}" for t, n in LIMITS.items() for i in range(n)}
    dev = mine["gpu-0-vgpu-nvidia-1022-9"]
    assert {k: dev.attributes[k] for k in ("type", "vgpuType", "mdevType", "parentUUID")} == {
        "type": "vgpu", "vgpuType": "GRID H100-8C", "mdevType": "nvidia-1022", "parentUUID": gpu0.attributes["uuid"]}
    for key in ("productName", "architecture", "driverVersion", "resource.kubernetes.io/pciBusID",
                "resource.kubernetes.io/numaNode"):
        assert dev.attributes[key] == gpu0.attributes[key]
    assert dev.capacity["memory"].value == "8Gi"
    [use] = dev.consumes_counters
    assert use.counter_set == gpu0.consumes_counters[0].counter_set and set(use.counters) == {"memory"}
    assert (dev.node.gpu.pci_bus_id, dev.node.target.id) == (GPU, "nvidia-1022")
    assert all(not apirules.dns_label_errors(n) for n in published)


def test_what_the_counters_allow_against_what_the_driver_accepts(dgx: list[Device]) -> None:
    gpu0 = [d for d in dgx if d.attributes.get("resource.kubernetes.io/pciBusID") == GPU]
    whole = [d for d in gpu0 if d.kind in ("gpu", "vfio")]
    by_type = {t: [d for d in gpu0 if d.attributes.get("mdevType") == t] for t in LIMITS}
    assert len(whole) == 2
    for t, devs in by_type.items():
        assert len(devs) == LIMITS[t] and fits(devs)  # every instance of one type together: the driver's limit
        for w in whole:
            assert not fits([w, devs[0]])  # never with the whole GPU or its passthrough form
    # Counters are sums: two types of which two or more fit alone also fit one and one, which the
    # driver refuses (one type per GPU). Compatibility groups, or prepare, keep them apart.
    assert fits([by_type["nvidia-1021"][0], by_type["nvidia-1022"][0]])
    assert vgpu.compatibility_group("nvidia-1021") != vgpu.compatibility_group("nvidia-1022")


def test_no_vgpu_devices_where_the_host_driver_offers_no_types(tmp_path: Path) -> None:
    source = GpuSource(Settings(node_name=NODE, nvml=NvmlMode("sim", "dgx-h100"), state_dir=tmp_path,
                                compatibility_groups=True), opener=open_sim_nvml)
    source.open()
    try:
        for types in (tmp_path / "nvml-sim" / "sys").glob("bus/pci/devices/*/mdev_supported_types"):
            shutil.rmtree(types.resolve())  # a host without a vGPU manager
        devices = source.scan().devices
    finally:
        source.close()
    assert [d for d in devices if d.kind == "vgpu"] == []


def kinds_per_gpu(devices: list[Device]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for d in devices:
        if d.kind == "vgpu":
            out.setdefault(d.name.split("-vgpu-")[0], set()).add(str(d.attributes["mdevType"]))
    return out


def test_without_compatibility_groups_only_a_set_the_counters_keep_exact_is_published(tmp_path: Path) -> None:
    # auto: every type needs groups to keep types (and MIG) apart, so none without them.
    assert kinds_per_gpu(scan(tmp_path / "a", compatibility_groups=False)) == {}
    # One named type: on every GPU without MIG placements; a GPU with them gets none.
    one = scan(tmp_path / "b", compatibility_groups=False, vgpu_types="GRID H100-8C", dynamic_mig=False)
    assert kinds_per_gpu(one) == {f"gpu-{i}": {"nvidia-1022"} for i in range(8)}
    assert all(c.compatibility_groups == () for d in one for c in d.consumes_counters)
    with_mig = scan(tmp_path / "c", compatibility_groups=False, vgpu_types="nvidia-1022", dynamic_mig=True)
    assert kinds_per_gpu(with_mig) == {} and any(d.kind == "mig" for d in with_mig)
    # With groups: every type beside MIG, each type in its own group (slices.py publishes them).
    both = scan(tmp_path / "d", dynamic_mig=True)
    assert kinds_per_gpu(both)["gpu-0"] == set(LIMITS)
    with pytest.raises(ConfigError, match="one vGPU type"):
        Settings(node_name=NODE, vgpu_types="nvidia-1021,nvidia-1022")
    assert Settings(node_name=NODE, vgpu_types="nvidia-1021,nvidia-1022", compatibility_groups=True)


# -- the Partitioner ----------------------------------------------------------------------------------------

DEVICE = "gpu-0-vgpu-nvidia-1024-1"


def test_plan_checks_without_a_side_effect(machine: Machine) -> None:
    p = VgpuPartitioner(machine.host, timeout=30)
    part = p.plan("uid-1", alloc(machine.devices, DEVICE))
    assert part == DevicePartition(DEVICE, PartitionKind.MDEV, GPU, "nvidia-1024", boot_id=machine.host.boot_id())
    assert mdev.mdevs_of(machine.host.sysfs, GPU) == {}
    done = p.create(part, lambda _: None)
    with pytest.raises(NoInstanceAvailable, match="one type at a time"):
        p.plan("uid-2", alloc(machine.devices, "gpu-0-vgpu-nvidia-1021-0"))
    p.destroy(done, None)
    real = alloc(machine.devices, DEVICE).device
    gone = dataclasses.replace(real, name="gpu-0-vgpu-nvidia-9999-0",
                               node=GpuFacts(real.node.gpu, VgpuType("nvidia-9999", "gone", None, 1)))
    with pytest.raises(TypeNotOffered, match="nvidia-9999"):
        p.plan("uid-3", AllocatedDevice("vm", DRIVER, gone))
    (machine.tree.drivers / "nvidia" / "unbind").write_text(GPU)
    wait_for(lambda: machine.tree.driver_of(GPU) is None)
    (machine.tree.devices / GPU / "driver_override").write_text("vfio-pci")
    wait_for(lambda: machine.tree.override_of(GPU) == "vfio-pci")
    (machine.tree.drivers / "vfio-pci" / "bind").write_text(GPU)
    wait_for(lambda: machine.tree.driver_of(GPU) == "vfio-pci")
    with pytest.raises(ParentUnavailable, match="passed through"):
        p.plan("uid-4", alloc(machine.devices, DEVICE))


def test_create_records_the_uuid_first_then_destroy(machine: Machine) -> None:
    p = VgpuPartitioner(machine.host, timeout=30)
    allocated = alloc(machine.devices, DEVICE)
    written: list[DevicePartition] = []

    def write(part: DevicePartition) -> None:
        assert part.uuid and not mdev.exists(machine.host.sysfs, part.uuid)  # recorded before it is made
        written.append(part)

    done = p.create(p.plan("uid-1", allocated), write)
    assert [w.step for w in written] == [0] and done.step == CREATED and done.uuid == written[0].uuid
    assert p.exists(done) and mdev.type_of(machine.host.sysfs, done.uuid) == "nvidia-1024"
    assert p.create(done, write) == done and len(written) == 1  # made already: nothing again
    ready = p.device(done, allocated)
    assert ready.attributes["mdevUUID"] == done.uuid and ready.device.name == DEVICE
    assert all(os.path.exists(n.host_path) for n in ready.device.device_nodes)
    assert [n.path for n in ready.device.device_nodes] == [
        "/dev/vfio/vfio", f"/dev/vfio/{mdev.iommu_group(machine.host.sysfs, done.uuid)}"]
    p.destroy(done, None)
    assert not p.exists(done) and mdev.mdevs_of(machine.host.sysfs, GPU) == {}
    p.destroy(done, None)  # idempotent


def test_a_reboot_forgets_the_device_and_create_makes_it_again_under_its_uuid(machine: Machine) -> None:
    p = VgpuPartitioner(machine.host, timeout=30)
    done = p.create(p.plan("uid-1", alloc(machine.devices, DEVICE)), lambda _: None)
    root = machine.tree.root
    materialize(load_profile("dgx-h100"), root, boot=True)
    simmdev.materialize(load_profile("dgx-h100"), root, boot=True)
    assert not p.exists(done)
    again = p.create(done, lambda _: None)
    assert again.uuid == done.uuid and again.boot_id != done.boot_id and p.exists(again)


class Crash(Exception):
    pass


@pytest.mark.parametrize("where", ["write", "mdev-before-create", "mdev-after-create"])
def test_destroy_converges_after_a_crash_at_any_step_of_create(machine: Machine, where: str) -> None:
    p = VgpuPartitioner(machine.host, timeout=30)
    last: list[DevicePartition] = []

    def write(part: DevicePartition) -> None:
        last.append(part)
        if where == "write":
            raise Crash

    failpoints.configure(f"{where}=raise" if where != "write" else "")
    try:
        with pytest.raises((Crash, failpoints.FailpointError)):
            p.create(p.plan("uid-1", alloc(machine.devices, DEVICE)), write)
    finally:
        failpoints.configure("")
    [recorded] = last  # what the record says after the crash
    assert recorded.uuid and recorded.step == 0
    assert mdev.exists(machine.host.sysfs, recorded.uuid) == (where == "mdev-after-create")
    p.destroy(recorded, None)  # recovery rolls the prepare back
    assert mdev.mdevs_of(machine.host.sysfs, GPU) == {} and not p.exists(recorded)
    assert mdev.read_type(machine.host.sysfs, GPU, "nvidia-1021") == mdev.MdevType(
        "nvidia-1021", "GRID H100-4C", "vfio-pci", 20, 4 << 30, 20)


def test_destroy_converges_after_a_crash_in_destroy_and_waits_out_a_pending_create(machine: Machine) -> None:
    p = VgpuPartitioner(machine.host, timeout=30)
    done = p.create(p.plan("uid-1", alloc(machine.devices, DEVICE)), lambda _: None)
    failpoints.configure("mdev-before-remove=raise")
    try:
        with pytest.raises(failpoints.FailpointError):
            p.destroy(done, None)
    finally:
        failpoints.configure("")
    assert p.exists(done)
    p.destroy(done, None)
    assert not p.exists(done)
    # A write to `create` the (slow) kernel has not applied when a crashed prepare is rolled back: the
    # device that appears a moment later is removed too.
    machine.kernel.delay = 0.3
    pending = DevicePartition(DEVICE, PartitionKind.MDEV, GPU, "nvidia-1024",
                              uuid="2f7a4d39-2c4e-4a43-9d8b-7c1f6a2b9e01")
    (machine.tree.devices / GPU / "mdev_supported_types" / "nvidia-1024" / "create").write_text(pending.uuid)
    p.destroy(pending, None)
    assert mdev.mdevs_of(machine.host.sysfs, GPU) == {}


def allocatable(devices: list[Device]) -> bool:
    """The scheduler's rule with compatibility groups on: the counters fit, and devices consuming one
    counter set share a group (a device without groups goes only with devices without groups)."""
    groups = [set(c.compatibility_groups) for d in devices for c in d.consumes_counters]
    together = all(g == set() for g in groups) or (all(groups) and bool(set.intersection(*groups)))
    return fits(devices) and together


def test_with_compatibility_groups_the_scheduler_never_mixes_what_the_driver_refuses(tmp_path: Path) -> None:
    published = [counters.with_compatibility_groups(d) for d in scan(tmp_path / "s", dynamic_mig=True)]
    gpu0 = [d for d in published if d.attributes.get("resource.kubernetes.io/pciBusID") == GPU]
    small_mig = [d for d in gpu0 if d.kind == "mig" and d.attributes.get("profile") == "1g.10gb"]
    types = {t: [d for d in gpu0 if d.attributes.get("mdevType") == t] for t in ("nvidia-1021", "nvidia-1022")}
    # What the driver refuses, the groups refuse though the counters fit: MIG with vGPU, two vGPU types.
    assert fits([small_mig[0], types["nvidia-1021"][0]]) and not allocatable([small_mig[0], types["nvidia-1021"][0]])
    mixed = [types["nvidia-1021"][0], types["nvidia-1022"][0]]
    assert fits(mixed) and not allocatable(mixed)
    # What the driver accepts stays allocatable: every instance of one type, disjoint MIG placements.
    assert allocatable(types["nvidia-1021"]) and allocatable(types["nvidia-1022"])
    assert allocatable(small_mig[:2])
    # Whole forms (no group) never go with a grouped device (and their counters say the same).
    whole = next(d for d in gpu0 if d.kind == "gpu")
    assert not allocatable([whole, small_mig[0]]) and not allocatable([whole, types["nvidia-1021"][0]])


def fresh_machine(tmp_path: Path) -> tuple[Path, SimTree]:
    """A simulated machine's files (PCI tree and mediated devices), as its first start writes them."""
    root = tmp_path / "sim"
    restart(root)
    return root, SimTree(root)


def restart(root: Path) -> None:
    """The simulated machine's next start (not a reboot): what is there is kept, and made whole."""
    profile = load_profile("dgx-h100")
    materialize(profile, root)
    simmdev.materialize(profile, root)


def cut_create(tree: SimTree, bdf: str, u: str, type_id: str | None) -> None:
    """A create a kill cut short in the emulator: the device's directory, and its type when `type_id`."""
    parent = tree.function(bdf)
    (parent / u).mkdir()
    if type_id is not None:
        os.symlink(os.path.relpath(parent / "mdev_supported_types" / type_id, parent / u), parent / u / "mdev_type")


def test_a_create_the_emulator_began_and_a_kill_cut_short_is_finished_or_undone(tmp_path: Path) -> None:
    # The emulator runs in the agent's process: a SIGKILL can stop it mid-create, which a kernel
    # never does. The next start of the simulated machine finishes one that got its type, and undoes
    # one that did not, so no half device is left that nobody can see or remove.
    root, tree = fresh_machine(tmp_path)
    typed, bare = "2f7a4d39-2c4e-4a43-9d8b-7c1f6a2b9e01", "3f7a4d39-2c4e-4a43-9d8b-7c1f6a2b9e01"
    cut_create(tree, GPU, typed, "nvidia-1022")
    cut_create(tree, GPU, bare, None)
    restart(root)
    sysfs, parent = root / "sys", tree.function(GPU)
    assert mdev.exists(sysfs, typed) and mdev.type_of(sysfs, typed) == "nvidia-1022"
    assert mdev.iommu_group(sysfs, typed) is not None and (parent / typed / "remove").is_file()
    assert not (parent / bare).exists() and mdev.mdevs_of(sysfs, GPU) == {typed: "nvidia-1022"}


def test_a_finished_create_gets_an_iommu_group_no_other_mediated_device_has(tmp_path: Path) -> None:
    # The machine's next start gives a create a kill cut short (no IOMMU group yet) a group of its own,
    # never one a mediated device of a GPU later in the scan already has: the PCI tree's rewrite drops
    # every mdev group from iommu_groups/ until its device's turn. Two mdevs in one group made the
    # removal of one take the other's /dev/vfio/<group> node (the crash suite's vGPU claim on a VF
    # that "was prepared but is not").
    root, tree = fresh_machine(tmp_path)
    later = "4f7a4d39-2c4e-4a43-9d8b-7c1f6a2b9e01"  # on gpu-7's first VF, after GPU in the scan order
    simmdev.create(tree, VFS[0], simmdev.types_for({"vendor": "0x10de", "device": "0x2330"}), "nvidia-1023", later)
    sysfs = root / "sys"
    assert mdev.iommu_group(sysfs, later) == 0
    cut = "5f7a4d39-2c4e-4a43-9d8b-7c1f6a2b9e01"  # on gpu-0: its type linked, no group yet
    cut_create(tree, GPU, cut, "nvidia-1022")
    restart(root)
    assert mdev.iommu_group(sysfs, later) == 0 and mdev.iommu_group(sysfs, cut) not in (None, 0)
    simmdev.remove(tree, tree.function(GPU) / cut)
    assert mdev.vfio_nodes(sysfs, root / "dev", later)  # its group's node is still there


# -- a GPU whose vGPU types are on its SR-IOV VFs (gpu-7 of dgx-h100) ------------------------------------------

SRIOV_GPU = "0000:db:00.0"
VFS = [f"0000:db:{(4 + n) // 8:02x}.{(4 + n) % 8}" for n in range(20)]


def test_a_gpu_with_sriov_vfs_lists_its_types_on_each_vf_not_on_itself(machine: Machine) -> None:
    sysfs = machine.host.sysfs
    assert mdev.vgpu_parents(sysfs, SRIOV_GPU) == VFS and VFS[:5] == [
        "0000:db:00.4", "0000:db:00.5", "0000:db:00.6", "0000:db:00.7", "0000:db:01.0"]
    assert mdev.list_types(sysfs, SRIOV_GPU) == [] and mdev.vgpu_parents(sysfs, GPU) == [GPU]
    assert {t.id: t.available for t in mdev.list_types(sysfs, VFS[0])} == {t: 1 for t in LIMITS}  # one vGPU a VF
    assert {t.id: (t.max_instances, t.available) for t in mdev.gpu_types(sysfs, SRIOV_GPU)} == {
        t: (n, 20) for t, n in LIMITS.items()}


def test_the_vgpu_devices_of_a_sriov_gpu_are_the_gpus_on_its_counter_set(dgx: list[Device]) -> None:
    gpu7 = next(d for d in dgx if d.name == "gpu-7")
    mine = [d for d in dgx if d.name.startswith("gpu-7-vgpu-")]
    assert {d.name for d in mine} == {f"gpu-7-vgpu-{t}-{i}" for t, n in LIMITS.items() for i in range(n)}
    assert all(d.node.gpu.pci_bus_id == SRIOV_GPU and d.attributes["parentUUID"] == gpu7.attributes["uuid"]
               and d.consumes_counters[0].counter_set == gpu7.consumes_counters[0].counter_set for d in mine)
    # A VF is no GPU of its own: neither a GPU nor a passthrough variant of one.
    assert not [d for d in dgx if any(vf.replace(":", "-").replace(".", "-") in d.name for vf in VFS)]


def test_a_vgpu_of_a_sriov_gpu_is_made_on_a_free_vf(machine: Machine) -> None:
    sysfs = machine.host.sysfs
    p = VgpuPartitioner(machine.host, timeout=30)
    made = []
    for i in range(LIMITS["nvidia-1024"]):
        part = p.plan(f"uid-{i}", alloc(machine.devices, f"gpu-7-vgpu-nvidia-1024-{i}"))
        assert part.parent == VFS[i]  # the first VF with an instance free: one vGPU per VF
        made.append(p.create(part, lambda _: None))
        assert p.exists(made[-1]) and mdev.parent_of(sysfs, made[-1].uuid) == VFS[i]
    assert mdev.gpu_mdevs(sysfs, SRIOV_GPU) == {m.uuid: "nvidia-1024" for m in made}
    # The type's limit and the one type per GPU hold across the VFs.
    with pytest.raises(NoInstanceAvailable, match="all instances of nvidia-1024 are in use"):
        p.plan("uid-x", alloc(machine.devices, "gpu-7-vgpu-nvidia-1024-0"))
    with pytest.raises(NoInstanceAvailable, match="one type at a time"):
        p.plan("uid-y", alloc(machine.devices, "gpu-7-vgpu-nvidia-1021-0"))
    # The GPU itself is never a parent: a create written to it is refused by the driver.
    assert not (sysfs / "bus" / "pci" / "devices" / SRIOV_GPU / "mdev_supported_types").exists()
    p.destroy(made[1], None)
    assert p.plan("uid-z", alloc(machine.devices, "gpu-7-vgpu-nvidia-1024-1")).parent == VFS[1]
    for m in made:
        p.destroy(m, None)
    assert mdev.gpu_mdevs(sysfs, SRIOV_GPU) == {} and machine.kernel.refusals == []
