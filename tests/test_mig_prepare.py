"""MIG at prepare (issue 9, part 2), through the engine on the simulated DGX H100 (MIG mode off at
start): the GPU instance and compute instance made at the allocated placement, the MIG UUID in the CDI
spec and the metadata, the caps device nodes, MIG mode turned on and back off; overlap and the clash
with the full GPU or its passthrough variant refused; and a crash at every step converging at restart
(no orphan GPU instance in the simulated hardware's persisted state, no record left)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import orjson
import pytest
from agentkit import Node, claim, make_node, restarted, result, write_claim
from conftest import need_root

from agent import failpoints
from agent.claims import metadata
from agent.claims.records import PartitionKind, RecordState
from agent.engine.recovery import recover
from agent.host.nvcaps import caps_dir, char_major, read_access
from agent.hostprep.mig import nvml_of
from agent.names import ClaimRef
from agent.sim.hardware import materialize
from agent.sim.migstate import STATE_FILE
from agent.sim.profiles import load_profile

UID = "9a1e0000-0000-4000-8000-000000000001"
UID2 = "9a1e0000-0000-4000-8000-000000000002"
DRIVER = "dra.example.com"
TESTS = Path(__file__).resolve().parent
MIG = "gpu-0-mig-1g10gb-4"


@pytest.fixture
async def node(tmp_path: Path) -> Node:
    return await make_node(tmp_path, dynamic_mig=True)


@pytest.fixture(autouse=True)
def no_failpoints() -> Any:
    yield
    failpoints.configure("")


def hardware(node: Node) -> dict[str, Any]:
    """The simulated machine's persisted MIG state (what survives the agent)."""
    data: dict[str, Any] = orjson.loads((node.settings.state_dir / "nvml-sim" / STATE_FILE).read_bytes())
    return data


def gpu0(node: Node) -> dict[str, Any]:
    """GPU 0's MIG mode and instances (the state names the GPU by its UUID too)."""
    state: dict[str, Any] = hardware(node)["gpus"][0]
    return {k: v for k, v in state.items() if k != "uuid"}


async def prepare(node: Node, name: str, uid: str, *devices: str) -> str:
    write_claim(node.claims_dir, claim(name, uid, [result(d, f"r{i}") for i, d in enumerate(devices)]))
    (res,) = (await node.engine.prepare([ClaimRef("default", name, uid)])).values()
    return str(res.error)


async def unprepare(node: Node, name: str, uid: str) -> str:
    (err,) = (await node.engine.unprepare([ClaimRef("default", name, uid)])).values()
    return str(err)


async def test_mig_device_is_created_given_to_the_container_and_destroyed(node: Node) -> None:
    assert gpu0(node) == {"mode": 0, "gis": []}
    assert await prepare(node, "m", UID, MIG) == ""
    state = gpu0(node)
    assert state["mode"] == 1 and [(g["start"], g["cis"]) for g in state["gis"]] == [(4, {"0": 1})]
    record = node.engine.whole_record(UID)
    assert record is not None and record.state is RecordState.PREPARED
    (part,) = record.partitions
    assert (part.kind, part.profile, part.start, part.mode_changed) == (PartitionKind.MIG, "1g.10gb", 4, True)
    assert part.uuid.startswith("MIG-") and part.gpu_instance == state["gis"][0]["id"]
    assert (node.settings.claims_state_dir / f"{UID}.rec").read_bytes().startswith(b"DRAREC 3 ")
    spec = json.loads((node.settings.cdi_dir / f"{DRIVER}-claim_{UID}.json").read_text())
    (dev,) = spec["devices"]
    edits = dev["containerEdits"]
    assert f"DRA_GPU_0_MIG_1G10GB_4_UUID={part.uuid}" in edits["env"]
    paths = [n["path"] for n in edits["deviceNodes"]]
    caps = [p for p in paths if p.startswith("/dev/nvidia-caps/nvidia-cap")]
    assert "/dev/nvidia0" in paths and len(caps) == 2, paths
    assert all(os.path.exists(n["hostPath"]) for n in edits["deviceNodes"])
    stream = metadata.parse_stream(metadata.host_file(node.settings.metadata_dir, UID, "r0").read_bytes())
    (device,) = stream[0]["requests"][0]["devices"]
    assert device["attributes"]["uuid"] == {"string": part.uuid}
    # Answered from the record the second time; then gone, with MIG mode back off (the full GPU is free).
    assert await prepare(node, "m", UID, MIG) == "" and len(gpu0(node)["gis"]) == 1
    assert await unprepare(node, "m", UID) == ""
    assert gpu0(node) == {"mode": 0, "gis": []}
    assert node.engine.whole_record(UID) is None
    assert await prepare(node, "full", UID2, "gpu-0") == ""


def caps_nodes(node: Node, uid: str) -> dict[str, Path]:
    """Container path -> host path of the claim's /dev/nvidia-caps nodes."""
    spec = json.loads((node.settings.cdi_dir / f"{DRIVER}-claim_{uid}.json").read_text())
    return {n["path"]: Path(n["hostPath"]) for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]
            if n["path"].startswith("/dev/nvidia-caps/")}


async def test_the_caps_nodes_the_driver_does_not_make_are_made_as_nvidia_modprobe_makes_them(node: Node) -> None:
    # The driver (and the simulated machine) only publishes the capability's access file and the
    # nvidia-caps major in /proc/devices; the node is the agent's to make.
    need_root()  # mknod
    sim = node.settings.state_dir / "nvml-sim"
    assert not (sim / "dev" / "nvidia-caps").exists()
    major = char_major(sim / "proc")
    assert major is not None
    assert char_major(Path("/proc"), "mem") == 1  # the kernel's own /proc/devices reads the same way
    assert await prepare(node, "m", UID, MIG) == ""
    (part,) = node.engine.whole_record(UID).partitions  # type: ignore[union-attr]
    where = caps_dir(sim / "proc", 0) / f"gi{part.gpu_instance}"
    minors = [read_access(where / "access").minor, read_access(where / f"ci{part.compute_instance}" / "access").minor]
    nodes = caps_nodes(node, UID)
    assert sorted(nodes) == sorted(f"/dev/nvidia-caps/nvidia-cap{m}" for m in minors)
    for minor in minors:
        st = os.lstat(sim / "dev" / "nvidia-caps" / f"nvidia-cap{minor}")
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(major, minor)
        assert stat.S_IMODE(st.st_mode) == 0o444  # DeviceFileMode: 292
    assert await unprepare(node, "m", UID) == ""
    # A node left with other numbers (from before a driver reload) is made again.
    stale = sim / "dev" / "nvidia-caps" / f"nvidia-cap{minors[0]}"
    stale.unlink()
    os.mknod(stale, stat.S_IFCHR | 0o600, os.makedev(major + 1, minors[0]))
    assert await prepare(node, "m", UID, MIG) == ""
    assert os.lstat(stale).st_rdev == os.makedev(major, minors[0])
    assert await unprepare(node, "m", UID) == ""


async def test_without_the_nvidia_caps_device_mig_prepare_fails_and_says_why(node: Node) -> None:
    proc = node.settings.state_dir / "nvml-sim" / "proc"
    (proc / "devices").write_text("Character devices:\n195 nvidia-frontend\n\nBlock devices:\n  7 loop\n")
    error = await prepare(node, "m", UID, MIG)
    assert f"device {MIG}: the NVIDIA driver has no nvidia-caps character device in {proc / 'devices'}" in error
    assert node.engine.whole_record(UID) is None and gpu0(node) == {"mode": 0, "gis": []}  # rolled back


async def test_two_placements_share_a_gpu_and_mig_mode_stays_on_while_one_is_left(node: Node) -> None:
    assert await prepare(node, "a", UID, "gpu-0-mig-3g40gb-0") == ""
    assert await prepare(node, "b", UID2, "gpu-0-mig-3g40gb-4") == ""
    assert sorted(g["start"] for g in gpu0(node)["gis"]) == [0, 4]
    assert await unprepare(node, "a", UID) == ""
    assert gpu0(node)["mode"] == 1 and [g["start"] for g in gpu0(node)["gis"]] == [4]
    assert await unprepare(node, "b", UID2) == ""
    # The last claim to leave the GPU turns MIG mode off, though another claim turned it on.
    assert gpu0(node) == {"mode": 0, "gis": []}


async def test_mig_mode_the_operator_turned_on_stays_on(node: Node) -> None:
    access = nvml_of(node.inventory)()
    assert access is not None
    sim = access.nvml
    sim.nvmlDeviceSetMigMode(sim.nvmlDeviceGetHandleByIndex(0), 1)  # as `nvidia-smi -mig 1` would
    assert await prepare(node, "a", UID, MIG) == "" and await unprepare(node, "a", UID) == ""
    assert gpu0(node) == {"mode": 1, "gis": []}


async def test_an_overlapping_placement_is_refused_before_any_change(node: Node) -> None:
    assert await prepare(node, "a", UID, "gpu-0-mig-3g40gb-0") == ""
    error = await prepare(node, "b", UID2, "gpu-0-mig-1g10gb-2")
    assert "overlap GPU instance" in error and node.engine.whole_record(UID2) is None
    assert len(gpu0(node)["gis"]) == 1


@pytest.mark.parametrize("whole", ["gpu-0", "gpu-0000-18-00-0-vfio"])
async def test_mig_and_its_full_gpu_or_passthrough_variant_are_refused_together(node: Node, whole: str) -> None:
    assert await prepare(node, "mig", UID, MIG) == ""
    error = await prepare(node, "whole", UID2, whole)
    assert f"GPU 0000:18:00.0 is prepared as {MIG}" in error, error
    assert await unprepare(node, "mig", UID) == ""
    assert await prepare(node, "whole", UID2, "gpu-0") == ""
    error = await prepare(node, "mig", UID, MIG)
    assert "is prepared as gpu-0" in error and gpu0(node)["gis"] == [] and gpu0(node)["mode"] == 0
    # In one claim, too.
    assert await unprepare(node, "whole", UID2) == ""
    assert "a claim can have only one" in await prepare(node, "both", UID2, "gpu-0", MIG)


async def test_mig_mode_that_needs_a_reset_is_refused_precisely(node: Node) -> None:
    nvml: Any = node.inventory.sources[0].nvml  # type: ignore[attr-defined]
    nvml.inject_error(0, "nvmlDeviceSetMigMode", "RESET_REQUIRED")
    error = await prepare(node, "m", UID, MIG)
    assert "MIG mode of GPU" in error and "cannot be turned on" in error
    assert node.engine.whole_record(UID) is None and gpu0(node) == {"mode": 0, "gis": []}


async def test_a_reboot_forgets_the_instance_and_recovery_makes_it_again_under_a_new_uuid(
        node: Node, tmp_path: Path) -> None:
    assert await prepare(node, "m", UID, MIG) == ""
    before = node.engine.whole_record(UID)
    assert before is not None
    (old,) = before.partitions
    root = node.settings.state_dir / "nvml-sim"
    materialize(load_profile("dgx-h100"), root, boot=True)
    after = await make_node(tmp_path, dynamic_mig=True)  # the agent of the new boot
    assert gpu0(after) == {"mode": 1, "gis": []}  # an H100 keeps its MIG mode across a reboot
    report = recover(after.engine)
    assert set(report.records) == {UID} and report.dropped == []
    record = after.engine.whole_record(UID)
    assert record is not None and record.devices == before.devices  # the kubelet's answer is the same
    (part,) = record.partitions
    assert part.uuid.startswith("MIG-") and part.uuid != old.uuid  # NVML gives a new instance a new UUID
    assert [(g["id"], g["start"], g["cis"]) for g in gpu0(after)["gis"]] == [
        (part.gpu_instance, 4, {str(part.compute_instance): 1})]
    # Every file says the new instance: the variable, the caps nodes, the metadata.
    spec = json.loads((after.settings.cdi_dir / f"{DRIVER}-claim_{UID}.json").read_text())
    (dev,) = spec["devices"]
    assert f"DRA_GPU_0_MIG_1G10GB_4_UUID={part.uuid}" in dev["containerEdits"]["env"]
    assert all(os.path.exists(n["hostPath"]) for n in dev["containerEdits"]["deviceNodes"])
    recorded = next(f.content for f in record.files if f.path.endswith(f"claim_{UID}.json"))
    assert dev == json.loads(recorded)["devices"][0]
    stream = metadata.parse_stream(metadata.host_file(after.settings.metadata_dir, UID, "r0").read_bytes())
    assert stream[0]["requests"][0]["devices"][0]["attributes"]["uuid"] == {"string": part.uuid}
    assert await unprepare(after, "m", UID) == ""
    assert gpu0(after) == {"mode": 0, "gis": []}


# -- crash suite: a kill at every step, then a restart converges ---------------------------------------------

PREPARE_STEPS = [f"mig-{w}-{s}" for s in ("mode", "gpu-instance", "compute-instance", "uuid")
                 for w in ("before", "after")] + ["after-bind-intent", "after-claim-spec", "after-record"]
UNPREPARE_STEPS = ["unprepare-after-restore-intent", "mig-destroy-after-ci", "mig-destroy-after-gi",
                   "unprepare-after-record"]


def _in_child(tmp: Path, step: str, op: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(f"""
        import asyncio, sys
        sys.path.insert(0, {str(TESTS)!r})
        import agentkit
        from agent.names import ClaimRef
        async def main():
            node = await agentkit.make_node(__import__('pathlib').Path({str(tmp)!r}), dynamic_mig=True)
            print(await node.engine.{op}([ClaimRef('default', 'm', {UID!r})]))
        asyncio.run(main())
    """)
    env = dict(os.environ, DRA_AGENT_FAILPOINTS=f"{step}=kill")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("step", PREPARE_STEPS)
async def test_killed_mid_prepare_restart_leaves_no_orphan_instance(node: Node, tmp_path: Path, step: str) -> None:
    write_claim(node.claims_dir, claim("m", UID, [result(MIG, "r0")]))
    child = _in_child(tmp_path, step, "prepare")
    assert child.returncode == -9, child.stdout + child.stderr
    engine = restarted(node)
    report = recover(engine)
    if step == "after-record":
        assert set(report.records) == {UID} and len(gpu0(node)["gis"]) == 1
        return
    assert report.records == {} and engine.whole_record(UID) is None
    assert gpu0(node) == {"mode": 0, "gis": []}, (step, report)
    # The kubelet's retry prepares it from scratch.
    node.engine = engine
    assert await prepare(node, "m", UID, MIG) == "" and len(gpu0(node)["gis"]) == 1


@pytest.mark.parametrize("step", UNPREPARE_STEPS)
async def test_killed_mid_unprepare_restart_finishes_it(node: Node, tmp_path: Path, step: str) -> None:
    assert await prepare(node, "m", UID, MIG) == ""
    child = _in_child(tmp_path, step, "unprepare")
    assert child.returncode == -9, child.stdout + child.stderr
    engine = restarted(node)
    report = recover(engine)
    assert report.records == {} and engine.whole_record(UID) is None
    assert gpu0(node) == {"mode": 0, "gis": []}, (step, report)


async def test_a_metadata_refresh_keeps_the_mig_uuid(node: Node) -> None:
    assert await prepare(node, "m", UID, MIG) == ""
    record = node.engine.whole_record(UID)
    assert record is not None
    (part,) = record.partitions
    path = metadata.host_file(node.settings.metadata_dir, UID, "r0")
    # The start-up refresh (and any device change) renders the devices from the inventory again.
    await node.engine.refresh_claims([UID])
    (device,) = metadata.parse_stream(path.read_bytes())[0]["requests"][0]["devices"]
    assert device["attributes"]["uuid"] == {"string": part.uuid}
    assert node.engine.whole_record(UID).generation == record.generation  # nothing changed: not rewritten


# -- a GPU in MIG mode: its MIG devices, not the whole GPU ---------------------------------------------------

def operator_sets_mig_mode(node: Node, index: int, mode: int) -> None:
    """As `nvidia-smi -i <index> -mig <mode>` would (the simulated H100 needs no reset)."""
    access = nvml_of(node.inventory)()
    assert access is not None
    sim = access.nvml
    sim.nvmlDeviceSetMigMode(sim.nvmlDeviceGetHandleByIndex(index), mode)


def published(node: Node) -> dict[str, Any]:
    """The devices and counter sets of the node's slices, by name."""
    from agent.publish.slices import build_slices

    out: dict[str, Any] = {}
    for s in build_slices(node.inventory.devices(), driver=DRIVER, node=node.settings.node_name):
        out |= {d["name"]: d for d in s["spec"].get("devices", [])}
        out |= {c["name"]: c for c in s["spec"].get("sharedCounters", [])}
    return out


async def test_a_gpu_in_mig_mode_publishes_its_mig_devices_not_the_whole_gpu(node: Node) -> None:
    assert "gpu-0" in published(node)
    operator_sets_mig_mode(node, 0, 1)
    await node.inventory.scan()
    shown = published(node)
    assert "gpu-0" not in shown and node.inventory.get("gpu-0") is None
    # Its MIG devices and its counter set stay, and so does its passthrough variant (a VM gets the whole
    # function, MIG mode with it); the other GPUs are whole.
    assert {MIG, "gpu-0000-18-00-0-vfio", "gpu-1"} <= set(shown)
    assert any(n.startswith("gpu-0000-18-00-0") and "consumesCounters" not in d and "counters" in d
               for n, d in shown.items())
    withheld = node.inventory.withheld("gpu-0")
    assert withheld is not None and "is in MIG mode" in str(withheld)
    assert any(line.startswith("gpu-0: GPU 0000:18:00.0") for line in node.inventory.snapshot().not_published())
    # A claim the scheduler allocated the whole GPU before: a precise per-claim error naming the GPU.
    error = await prepare(node, "whole", UID, "gpu-0")
    assert f"claim default/whole ({UID}): device gpu-0: GPU 0000:18:00.0 (GPU-" in error, error
    assert "is in MIG mode" in error, error
    assert "internal error" not in error and node.engine.whole_record(UID) is None
    # Its MIG devices prepare as before.
    assert await prepare(node, "m", UID2, MIG) == "" and await unprepare(node, "m", UID2) == ""
    # MIG mode off: the whole GPU is back.
    operator_sets_mig_mode(node, 0, 0)
    await node.inventory.scan()
    assert "gpu-0" in published(node) and node.inventory.withheld("gpu-0") is None
    assert await prepare(node, "whole", UID, "gpu-0") == ""


async def test_a_whole_gpu_put_in_mig_mode_after_the_scan_is_refused_at_prepare(node: Node) -> None:
    """The mode changed after the claim was allocated and before a scan saw it: prepare asks NVML."""
    operator_sets_mig_mode(node, 1, 1)
    assert node.inventory.get("gpu-1") is not None  # not scanned since
    error = await prepare(node, "whole", UID, "gpu-1")
    assert f"claim default/whole ({UID}): device gpu-1: GPU 0000:2a:00.0 (GPU-" in error, error
    assert "is in MIG mode" in error, error
    assert node.engine.whole_record(UID) is None
    assert not list(node.settings.cdi_dir.glob(f"*{UID}*"))
    operator_sets_mig_mode(node, 1, 0)
    assert await prepare(node, "whole", UID, "gpu-1") == ""


def test_the_shared_form_of_a_gpu_in_mig_mode_is_withheld_too(tmp_path: Path) -> None:
    from agent.config import NvmlMode, Settings
    from agent.errors import WholeGpuInMigMode
    from agent.inventory.gpus import GpuSource
    from agent.sim.nvmlopen import open_sim_nvml

    source = GpuSource(Settings(node_name="n", nvml=NvmlMode("sim", "dgx-h100"), state_dir=tmp_path / "state"),
                       sharing=True, opener=open_sim_nvml)
    source.open()
    try:
        assert {"gpu-0", "gpu-0-shared"} <= {d.name for d in source.scan().devices}
        source.nvml.nvmlDeviceSetMigMode(source.nvml.nvmlDeviceGetHandleByIndex(0), 1)
        result = source.scan()
    finally:
        source.close()
    names = {d.name for d in result.devices}
    assert "gpu-0" not in names and "gpu-0-shared" not in names and "gpu-1-shared" in names
    assert sorted(w.device for w in result.withheld) == ["gpu-0", "gpu-0-shared"]
    assert all(isinstance(w.failure(), WholeGpuInMigMode) for w in result.withheld)


async def test_a_mig_device_names_its_gpu_for_the_device_plugin_holds(node: Node) -> None:
    # A device plugin names the MIG devices it gives out by their UUIDs (agent/health/pluginholds.py): NVML
    # says which GPU each one is on while it exists.
    from agent.inventory.gpus import GpuSource

    (gpus,) = [s for s in node.inventory.sources if isinstance(s, GpuSource)]
    assert gpus.mig_parents() == {}
    assert await prepare(node, "m", UID, MIG) == ""
    record = node.engine.whole_record(UID)
    assert record is not None
    (part,) = record.partitions
    gpu0_uuid = node.inventory.get("gpu-0").node.gpu.uuid  # type: ignore[union-attr]
    assert gpus.mig_parents() == {part.uuid: gpu0_uuid}
    assert await unprepare(node, "m", UID) == ""
    assert gpus.mig_parents() == {}
