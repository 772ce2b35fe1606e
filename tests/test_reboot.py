"""The kubelet prepares every claim again after its own restart or a node reboot (its "prepared" flag is
in memory only). After a reboot the agent rebuilds what the reboot took (CDI specs on a tmpfs
/var/run/cdi, metadata files under a tmpfs kubelet directory, MIG instances, vfio-pci bindings, mediated
devices) and what it renumbered (iommufd device files are numbered in bind order, GPU minors shift when
a GPU does not come back), with every file consistent with the device it names; after a kubelet restart
alone, nothing is rewritten. On the simulated machine, whose reboot (`agent.sim.hardware.reboot`) models
these facts."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from agentkit import Node, claim, make_node, nic, result, write_claim

from agent.claims import metadata
from agent.claims.records import ClaimRecord
from agent.engine.recovery import begin_recovery, check_records, finish_recovery
from agent.host.mdev import sysfs as mdev
from agent.host.vfio.pci import current_driver, function_dir
from agent.hostprep.mig import nvml_of
from agent.hostprep.migquery import ci_handles
from agent.inventory.passthrough import NicVariants
from agent.names import ClaimRef
from agent.sim.hardware import reboot
from agent.sim.kernel.emulator import KernelEmulator
from agent.sim.kernel.tree import SimTree
from agent.sim.profiles import load_profile

pytestmark = pytest.mark.filterwarnings("ignore:Callback with id:RuntimeWarning")

DRIVER = "dra.example.com"
PROFILE = "dgx-h100"


def uid(i: int) -> str:
    return f"b0070000-0000-4000-8000-{i:012d}"


def vfio(**fields: Any) -> list[dict[str, Any]]:
    return [{"source": "FromClaim", "requests": ["vm"], "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": f"{DRIVER}/v1alpha1", "kind": "VfioConfig", **fields}}}]


# name -> (device, request, config): one claim of every kind the node prepares.
CLAIMS: dict[str, tuple[str, str, list[dict[str, Any]]]] = {
    "gpu": ("gpu-0", "gpu", []),
    "mig": ("gpu-1-mig-1g10gb-4", "gpu", []),
    "vgpu": ("gpu-5-vgpu-nvidia-1022-0", "vm", []),
    "vm-gpu": ("gpu-0000-ba-00-0-vfio", "vm", vfio(iommu="iommufd")),
    "vm-vf": ("nic-0000-4b-00-1-vfio", "vm", vfio(mac="02:00:00:00:01:05", vlan=15)),
    "net": ("nic-0000-3b-00-0", "net", []),
}


@dataclasses.dataclass
class Agent:
    """One start of the agent on the simulated machine: its engine and its machine's kernel."""

    node: Node
    kernel: KernelEmulator

    @property
    def tree(self) -> SimTree:
        return SimTree(self.node.settings.state_dir / "nvml-sim")

    async def prepare(self, name: str, i: int) -> Any:
        (res,) = (await self.node.engine.prepare([ClaimRef("default", name, uid(i))])).values()
        return res

    def record(self, i: int) -> ClaimRecord:
        found = self.node.engine.whole_record(uid(i))
        assert found is not None
        return found


async def start(tmp: Path) -> Agent:
    """An agent start over the roots in `tmp`: discovery (the VF variants as NIC discovery finds them in
    the machine's sysfs), the engine and the machine's kernel (the daemon starts it before recovery)."""
    node = await make_node(tmp, compatibility_groups=True, dynamic_mig=True)
    sysfs = node.settings.state_dir / "nvml-sim" / "sys"
    node.nic_source.devices = NicVariants().apply(sysfs, [nic()])
    await node.inventory.scan(["nic"])
    kernel = KernelEmulator(load_profile(PROFILE), node.settings.state_dir / "nvml-sim")
    kernel.start()
    return Agent(node, kernel)


def power_cycle(agent: Agent, missing: tuple[str, ...] = ()) -> None:
    """The node reboots: the agent's process ends, the machine reboots (`missing`: GPUs that do not come
    back), and the tmpfs CDI directory and kubelet directory come back empty."""
    agent.kernel.stop()
    agent.node.inventory.close()
    s = agent.node.settings
    reboot(load_profile(PROFILE), s.state_dir / "nvml-sim", missing=missing)
    for tmpfs in (s.cdi_dir, s.kubelet_dir):
        shutil.rmtree(tmpfs)
        tmpfs.mkdir()


@pytest.fixture
async def agents(tmp_path: Path) -> AsyncIterator[list[Agent]]:
    """The agent's starts in a test (each stopped at the end)."""
    started: list[Agent] = []
    yield started
    for a in started:
        a.kernel.stop()


def write_claims(node: Node, names: Iterator[str] | list[str]) -> dict[str, int]:
    out = {}
    for i, name in enumerate(names):
        device, request, config = CLAIMS[name]
        write_claim(node.claims_dir, claim(name, uid(i), [result(device, request)], config=config))
        out[name] = i
    return out


def files_as_recorded(record: ClaimRecord) -> list[str]:
    """The files of the record that are not on disk as the record says."""
    bad = []
    for f in record.files:
        try:
            ok = Path(f.path).read_bytes() == f.content
        except OSError:
            ok = False
        if not ok:
            bad.append(f.path)
    return bad


def spec_device(agent: Agent, i: int) -> dict[str, Any]:
    spec = json.loads((agent.node.settings.cdi_dir / f"{DRIVER}-claim_{uid(i)}.json").read_text())
    (dev,) = spec["devices"]
    return dict(dev)


def env_of(dev: dict[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in dev["containerEdits"]["env"])


def minors(tree: SimTree) -> dict[int, str]:
    """GPU minor -> UUID, as the kernel driver lists its GPUs now."""
    out = {}
    for info in (tree.root / "proc" / "driver" / "nvidia" / "gpus").glob("*/information"):
        fields = dict(line.split(":", 1) for line in info.read_text().splitlines())
        out[int(fields["Device Minor"])] = fields["GPU UUID"].strip()
    return out


def consistent(agent: Agent, i: int) -> None:
    """The claim's files hold what its record says, and say what its devices are on the host now."""
    record = agent.record(i)
    assert files_as_recorded(record) == []
    dev = spec_device(agent, i)
    nodes = dev["containerEdits"].get("deviceNodes", [])
    assert all(os.path.exists(n["hostPath"]) for n in nodes), nodes
    env = env_of(dev)
    stream = metadata.parse_stream(Path(next(f.path for f in record.files if f.path.endswith("metadata.json")))
                                   .read_bytes())
    (device,) = stream[0]["requests"][0]["devices"]
    attrs = device["attributes"]
    name = record.devices[0].device
    prefix = "DRA_" + name.upper().replace("-", "_")
    gpus = minors(agent.tree)
    for n in nodes:  # a GPU's node is the GPU whose UUID the variable and the metadata name
        if n["path"].startswith("/dev/nvidia") and n["path"][len("/dev/nvidia"):].isdigit():
            minor = int(n["path"][len("/dev/nvidia"):])
            parent = attrs.get("parentUUID", attrs.get("uuid"))
            assert parent == {"string": gpus[minor]}, (name, minor, gpus)
            if name.startswith("gpu-") and "-mig-" not in name:
                assert env[f"{prefix}_UUID"] == gpus[minor]
    for part in record.partitions:
        if part.kind == "mig":
            assert env[f"{prefix}_UUID"] == part.uuid == attrs["uuid"]["string"]
            nv = nvml_of(agent.node.inventory)()
            assert nv is not None
            handle = nv.nvml.nvmlDeviceGetHandleByUUID(part.parent)
            gi = nv.nvml.nvmlDeviceGetGpuInstanceById(handle, part.gpu_instance)
            assert nv.nvml.nvmlGpuInstanceGetInfo(gi).placement.start == part.start
        else:
            assert mdev.exists(agent.tree.sys, part.uuid) and attrs["mdevUUID"] == {"string": part.uuid}
    for b in record.bindings:
        assert current_driver(agent.tree.sys, b.plan.target) == "vfio-pci"
        if b.iommu == "iommufd":  # the cdev the spec names is the one the function has now
            (cdev,) = os.listdir(function_dir(agent.tree.sys, b.plan.target) / "vfio-dev")
            assert f"/dev/vfio/devices/{cdev}" in [n["path"] for n in nodes], (cdev, nodes)


async def prepare_all(agent: Agent, numbers: dict[str, int]) -> dict[str, Any]:
    out = {}
    for name, i in numbers.items():
        res = await agent.prepare(name, i)
        assert res.error == "", (name, res.error)
        out[name] = res.devices
    return out


# -- a reboot --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("checked", ["at start", "by the kubelet's prepare"])
async def test_after_a_reboot_the_kubelets_prepare_gets_every_claim_back_whole(
        tmp_path: Path, agents: list[Agent], checked: str) -> None:
    first = await start(tmp_path)
    agents.append(first)
    numbers = write_claims(first.node, list(CLAIMS))
    answers = await prepare_all(first, numbers)
    old_mig = first.record(numbers["mig"]).partitions[0].uuid
    old_mdev = first.record(numbers["vgpu"]).partitions[0].uuid
    power_cycle(first)

    after = await start(tmp_path)
    agents.append(after)
    report = begin_recovery(after.node.engine)
    if checked == "at start":
        check_records(after.node.engine, after.node.engine.unverified())
    # The kubelet's prepare of each claim (the remaining records are checked first, under their locks).
    assert await prepare_all(after, numbers) == answers  # the same kubelet answer: CDI IDs and all
    finish_recovery(after.node.engine, report)
    for i in numbers.values():
        consistent(after, i)
    assert after.record(numbers["mig"]).partitions[0].uuid != old_mig  # made again: NVML gave a new UUID
    assert after.record(numbers["vgpu"]).partitions[0].uuid == old_mdev  # made again under its own UUID
    for name, i in numbers.items():  # and everything goes away again
        assert (await after.node.engine.unprepare([ClaimRef("default", name, uid(i))]))[uid(i)] == ""
    assert after.node.engine.store.uids() == [] and mdev.mdevs_of(after.tree.sys, "0000:b3:00.0") == {}
    assert current_driver(after.tree.sys, "0000:ba:00.0") == "nvidia"


async def test_after_a_kubelet_restart_alone_the_answer_comes_from_the_record_unchanged(
        tmp_path: Path, agents: list[Agent]) -> None:
    agent = await start(tmp_path)
    agents.append(agent)
    numbers = write_claims(agent.node, list(CLAIMS))
    answers = await prepare_all(agent, numbers)

    def stamps() -> dict[str, tuple[int, int]]:
        s = agent.node.settings
        out = {}
        for root in (s.cdi_dir, s.kubelet_dir, s.claims_state_dir):
            for parent, _dirs, files in os.walk(root):
                for f in files:
                    st = os.stat(os.path.join(parent, f))
                    out[os.path.join(parent, f)] = (st.st_ino, st.st_mtime_ns)
        return out
    before = stamps()
    assert await prepare_all(agent, numbers) == answers
    assert stamps() == before  # nothing rewritten
    for i in numbers.values():
        consistent(agent, i)


async def test_a_prepare_answered_from_the_record_redoes_what_went_missing(tmp_path: Path,
                                                                          agents: list[Agent]) -> None:
    """Without a restart of the agent: the claim's files and host effects went (removed by hand, a GPU
    reset): the kubelet's next prepare of the claim puts them back before it answers."""
    agent = await start(tmp_path)
    agents.append(agent)
    numbers = write_claims(agent.node, ["mig", "vgpu", "vm-gpu"])
    answers = await prepare_all(agent, numbers)
    s = agent.node.settings
    os.unlink(s.cdi_dir / f"{DRIVER}-claim_{uid(numbers['vm-gpu'])}.json")
    vgpu_part = agent.record(numbers["vgpu"]).partitions[0]
    mdev.remove(agent.tree.sys, vgpu_part.uuid, timeout=10)
    mig_part = agent.record(numbers["mig"]).partitions[0]
    nv = nvml_of(agent.node.inventory)()
    assert nv is not None
    handle = nv.nvml.nvmlDeviceGetHandleByUUID(mig_part.parent)
    gi = nv.nvml.nvmlDeviceGetGpuInstanceById(handle, mig_part.gpu_instance)
    for ci in ci_handles(nv.nvml, gi):  # as a GPU reset does
        nv.nvml.nvmlComputeInstanceDestroy(ci)
    nv.nvml.nvmlGpuInstanceDestroy(gi)
    assert await prepare_all(agent, numbers) == answers
    for i in numbers.values():
        consistent(agent, i)


# -- renumbering ------------------------------------------------------------------------------------------------

async def test_after_a_reboot_iommufd_device_files_follow_the_binding_order(tmp_path: Path,
                                                                           agents: list[Agent]) -> None:
    """Two VMs' GPUs on iommufd: bound in one order at prepare (vfio0, vfio1), in the other after the
    reboot. Each claim's spec names its own function's device file, never the other VM's."""
    first = await start(tmp_path)
    agents.append(first)
    a, b = uid(1), uid(0)  # claim b is checked (and bound) first after the reboot
    write_claim(first.node.claims_dir, claim("vm-a", a, [result("gpu-0000-ba-00-0-vfio", "vm")],
                                             config=vfio(iommu="iommufd")))
    write_claim(first.node.claims_dir, claim("vm-b", b, [result("gpu-0000-ab-00-0-vfio", "vm")],
                                             config=vfio(iommu="iommufd")))
    for name, u in (("vm-a", a), ("vm-b", b)):
        (res,) = (await first.node.engine.prepare([ClaimRef("default", name, u)])).values()
        assert res.error == ""
    cdev_a = os.listdir(function_dir(first.tree.sys, "0000:ba:00.0") / "vfio-dev")
    assert cdev_a == ["vfio0"]
    power_cycle(first)

    after = await start(tmp_path)
    agents.append(after)
    report = begin_recovery(after.node.engine)
    check_records(after.node.engine, after.node.engine.unverified())
    finish_recovery(after.node.engine, report)
    assert os.listdir(function_dir(after.tree.sys, "0000:ab:00.0") / "vfio-dev") == ["vfio0"]  # b bound first
    for i, u in ((1, a), (0, b)):
        assert u in report.records
        consistent(after, i)


async def test_after_a_reboot_without_a_gpu_no_claim_gets_another_gpus_node(tmp_path: Path,
                                                                           agents: list[Agent]) -> None:
    """GPU 0 does not come back: every GPU after it has a minor one lower, so `gpu-1` is the GPU that was
    `gpu-2`. A claim answered from its record is never served with another GPU's device node: it is
    prepared again from its allocation (the device its allocation names, as published now), or refused."""
    first = await start(tmp_path)
    agents.append(first)
    names = {1: "gpu-1", 2: "gpu-2", 3: "gpu-7"}
    for i, device in names.items():
        write_claim(first.node.claims_dir, claim(f"c{i}", uid(i), [result(device, "gpu")]))
        assert (await first.prepare(f"c{i}", i)).error == ""
    gpus_before = minors(first.tree)
    power_cycle(first, missing=("0000:18:00.0",))

    after = await start(tmp_path)
    agents.append(after)
    gpus = minors(after.tree)
    assert len(gpus) == 7 and gpus[1] == gpus_before[2]  # the minors shifted
    begin_recovery(after.node.engine)  # the kubelet's prepares come before the background check
    for i in (1, 2):
        res = await after.prepare(f"c{i}", i)
        assert res.error == ""
        consistent(after, i)
        assert env_of(spec_device(after, i))[f"DRA_GPU_{i}_UUID"] == gpus[i]
    res = await after.prepare("c3", 3)
    assert "gpu-7" in res.error and "not on this node" in res.error, res.error
    assert after.node.engine.whole_record(uid(3)) is None
    assert not (after.node.settings.cdi_dir / f"{DRIVER}-claim_{uid(3)}.json").exists()


def test_the_simulated_reboot_without_a_gpu_shifts_minors_and_keeps_each_gpus_mig_mode(tmp_path: Path) -> None:
    from agent.sim.nvml import SimulatedNvml

    profile = load_profile(PROFILE)
    sim = SimulatedNvml(profile)
    sim.materialize(tmp_path)
    sim.nvmlInit()
    sim.nvmlDeviceSetMigMode(sim.nvmlDeviceGetHandleByIndex(2), 1)  # GPU 2 in MIG mode
    reboot(profile, tmp_path, missing=(profile.gpus[0].bus_id,))
    after = SimulatedNvml(profile)
    after.materialize(tmp_path)
    after.nvmlInit()
    assert after.nvmlDeviceGetCount() == 7
    for i, gpu in enumerate(profile.gpus[1:]):
        handle = after.nvmlDeviceGetHandleByIndex(i)
        assert after.nvmlDeviceGetUUID(handle) == gpu.uuid and after.nvmlDeviceGetMinorNumber(handle) == i
        assert after.nvmlDeviceGetMigMode(handle)[0] == (1 if gpu.uuid == profile.gpus[2].uuid else 0)
    tree = SimTree(tmp_path)
    assert not (tree.dev / "nvidia7").exists() and not (tree.devices / profile.gpus[0].bus_id).exists()
    assert minors(tree) == {i: g.uuid for i, g in enumerate(profile.gpus[1:])}
    reboot(profile, tmp_path)  # it comes back at the next boot, and the minors are as before
    again = SimulatedNvml(profile)
    again.materialize(tmp_path)
    assert minors(tree) == {g.minor: g.uuid for g in profile.gpus}
