"""Unprepare always ends. The kubelet retries an unprepare until it succeeds (pods stay Terminating until
then), so when a claim's host changes cannot be undone because the hardware is gone (a lost GPU whose MIG
instance cannot be destroyed, a function that left the bus, an original driver that is not loaded), the
unprepare removes the claim's files and record, keeps what is left (`<state>/leftovers/`), and succeeds.
The device stays tainted undo-failed and is not prepared again until the changes are undone (tried
again at start, by garbage collection and by a prepare of the device) or an operator clears it;
`dra-agent vfio status` and `dra-agent doctor` list it. On the simulated machine, with its kernel."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from agentkit import Node, claim, make_node, nic, restarted, result, write_claim, written_files
from handshakes import until

from agent.app.doctor.node import NodeChecks
from agent.claims.leftovers import Leftovers, leftovers_dir
from agent.engine.gc import ClaimCollector
from agent.engine.recovery import recover
from agent.health.requests import submit_clear
from agent.health.service import DeviceHealthService
from agent.host.vfio.pci import current_driver
from agent.hostprep.mig import nvml_of
from agent.inventory.passthrough import NicVariants
from agent.names import ClaimRef
from agent.sim.hardware import materialize
from agent.sim.kernel.emulator import KernelEmulator
from agent.sim.kernel.tree import SimTree
from agent.sim.profiles import load_profile

pytestmark = pytest.mark.filterwarnings("ignore:Callback with id:RuntimeWarning")

DRIVER = "dra.example.com"
UID = "d0e50000-0000-4000-8000-000000000001"
UID2 = "d0e50000-0000-4000-8000-000000000002"
VF_BUS, VF_VARIANT = "0000:4b:00.1", "nic-0000-4b-00-1-vfio"
GPU_BUS, GPU_VARIANT = "0000:ba:00.0", "gpu-0000-ba-00-0-vfio"  # gpu-6
MIG = "gpu-1-mig-1g10gb-4"
GPU1_BUS = "0000:2a:00.0"
NIC = "nic-0000-3b-00-0"


KERNELS: list[KernelEmulator] = []  # the machine's kernel of the running test (a restart starts another)


def kernel(node: Node) -> KernelEmulator:
    started = KernelEmulator(load_profile("dgx-h100"), node.settings.state_dir / "nvml-sim")
    started.start()
    KERNELS.append(started)
    return started


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    node = await make_node(tmp_path, dynamic_mig=True)
    node.nic_source.devices = NicVariants().apply(node.settings.state_dir / "nvml-sim" / "sys", [nic()])
    await node.inventory.scan(["nic"])
    kernel(node)
    yield node
    while KERNELS:
        KERNELS.pop().stop()


def tree(node: Node) -> SimTree:
    return SimTree(node.settings.state_dir / "nvml-sim")


async def prepare(node: Node, name: str, uid: str, device: str) -> str:
    write_claim(node.claims_dir, claim(name, uid, [result(device, "vm")]))
    (res,) = (await node.engine.prepare([ClaimRef("default", name, uid)])).values()
    return str(res.error)


async def unprepare(node: Node, name: str, uid: str) -> str:
    (err,) = (await node.engine.unprepare([ClaimRef("default", name, uid)])).values()
    return str(err)


def leftovers(node: Node) -> dict[str, Any]:
    return {lo.uid: lo for lo in Leftovers(leftovers_dir(node.settings.state_dir)).all()}


def nothing_of(node: Node, uid: str) -> bool:
    return node.engine.whole_record(uid) is None and not any(uid in p for p in written_files(node.settings))


async def no_change(_devices: set[str], _kinds: set[str]) -> None:
    return None


async def test_a_function_that_left_the_bus_unprepares_tainted_listed_and_cleared_by_an_operator(
        node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    assert await prepare(node, "vm-net", UID, VF_VARIANT) == ""
    (tree(node).devices / VF_BUS).unlink()  # the VF left the bus (its PF reset, the VFs were disabled)
    assert await unprepare(node, "vm-net", UID) == ""  # the kubelet's unprepare ends
    assert nothing_of(node, UID)
    (lo,) = leftovers(node).values()
    assert (lo.uid, lo.devices, lo.functions) == (UID, (VF_VARIANT,), (VF_BUS,))
    assert f"PCI function {VF_BUS} is not in" in lo.reason
    assert await unprepare(node, "vm-net", UID) == ""  # and stays ended

    # The operator sees it: vfio status (exit 1) and doctor.
    from agent.app import cli

    s = node.settings
    flags = ["--nvml", "sim", "--state-dir", str(s.state_dir), "--nic-exclude", "*", "--offline", str(s.offline)]
    capsys.readouterr()
    assert cli.main(["vfio", "status", *flags]) == 1
    out = capsys.readouterr()
    (row,) = [r for r in out.out.splitlines() if VF_BUS in r]
    assert row.split()[:4] == ["default/vm-net", "left", "undone", VF_VARIANT] and row.split()[-1] == "gone"
    assert "PCI function" in out.err
    (check,) = NodeChecks(s).leftovers()
    assert not check.ok and VF_VARIANT in check.detail and "dra-agent taints clear" in check.fix

    # The device carries an undo-failed taint (NoSchedule), until an operator clears it.
    health = DeviceHealthService(s, node.inventory, no_change)
    await health.start()
    try:
        health.observe(node.inventory.snapshot())
        await until(lambda: health.conditions.taints(VF_VARIANT), "the undo-failed taint")
        (taint,) = health.conditions.taints(VF_VARIANT)
        assert (taint.key, taint.effect) == (f"{DRIVER}/undo-failed", "NoSchedule")
        published = {d.name: d for d in health.published(node.inventory.snapshot())}
        assert [t.key for t in published[VF_VARIANT].taints] == [f"{DRIVER}/undo-failed"]
        await asyncio.to_thread(submit_clear, s, VF_VARIANT)  # `dra-agent taints clear`
        await until(lambda: not health.conditions.taints(VF_VARIANT), "the taint cleared")
        assert leftovers(node) == {}
    finally:
        await health.stop()


async def test_a_lost_gpus_mig_instance_is_left_and_undone_once_the_gpu_is_back(node: Node) -> None:
    assert await prepare(node, "mig", UID, MIG) == ""
    nv = nvml_of(node.inventory)()
    assert nv is not None
    nv.nvml.lose(1)  # GPU 1 falls off the bus: its MIG instance cannot be destroyed
    assert await unprepare(node, "mig", UID) == ""
    assert nothing_of(node, UID)
    (lo,) = leftovers(node).values()
    assert lo.devices == (MIG,) and lo.functions == (GPU1_BUS,) and f"pci/{GPU1_BUS}" in lo.locks
    # Another form of the GPU is refused while its instance may still be there.
    error = await prepare(node, "whole", UID2, "gpu-1")
    assert f"device(s) {MIG}: claim default/mig ({UID}) left host changes" in error, error
    nv.nvml.recover(1)  # a GPU reset: it answers again; the next prepare undoes what was left, then goes on
    assert await prepare(node, "whole", UID2, "gpu-1") == ""
    assert leftovers(node) == {}
    state = json.loads((node.settings.state_dir / "nvml-sim" / "nvml-mig.json").read_text())
    assert state["gpus"][1]["gis"] == [] and state["gpus"][1]["mode"] == 0


async def test_what_a_lost_gpu_left_holds_only_its_gpu_not_the_claims_other_devices(node: Node) -> None:
    write_claim(node.claims_dir, claim("mig-net", UID, [result(MIG, "part"), result(NIC, "net")]))
    (res,) = (await node.engine.prepare([ClaimRef("default", "mig-net", UID)])).values()
    assert res.error == ""
    nv = nvml_of(node.inventory)()
    assert nv is not None
    nv.nvml.lose(1)
    assert await unprepare(node, "mig-net", UID) == ""
    (lo,) = leftovers(node).values()
    assert lo.devices == (MIG,) and lo.locks == (f"pci/{GPU1_BUS}",)
    assert await prepare(node, "net", UID2, NIC) == ""  # the NIC is as it was: not held by the lost GPU


async def test_an_original_driver_not_loaded_is_undone_at_the_next_start(node: Node) -> None:
    assert await prepare(node, "vm-gpu", UID, GPU_VARIANT) == ""
    assert current_driver(tree(node).sys, GPU_BUS) == "vfio-pci"
    shutil.rmtree(tree(node).drivers / "nvidia")  # the NVIDIA driver was unloaded
    assert await unprepare(node, "vm-gpu", UID) == ""
    (lo,) = leftovers(node).values()
    assert "driver nvidia is not loaded" in lo.reason and current_driver(tree(node).sys, GPU_BUS) is None
    KERNELS.pop().stop()  # the agent restarts, with the driver loaded again
    materialize(load_profile("dgx-h100"), tree(node).root)
    kernel(node)
    report = recover(restarted(node))
    assert report.undone == [UID] and leftovers(node) == {}
    assert current_driver(tree(node).sys, GPU_BUS) == "nvidia"


async def test_garbage_collection_takes_the_same_path(node: Node) -> None:
    assert await prepare(node, "vm-net", UID, VF_VARIANT) == ""
    (node.claims_dir / "default" / "vm-net.yaml").unlink()  # the ResourceClaim is gone
    (tree(node).devices / VF_BUS).unlink()

    class Clock:
        now = 1000.0

        def __call__(self) -> float:
            return self.now
    clock = Clock()
    gc = ClaimCollector(node.engine, 30.0, clock=clock)
    assert await gc.sweep() == []
    clock.now += 31
    assert await gc.sweep() == [UID]
    assert nothing_of(node, UID) and set(leftovers(node)) == {UID}


async def test_a_left_undone_entry_whose_write_a_kill_cut_short_is_removed_at_start(node: Node) -> None:
    directory = leftovers_dir(node.settings.state_dir)
    directory.mkdir(parents=True, exist_ok=True)
    cut = directory / f".{UID}.json.tmp-0a1b2c3d"  # an agent killed mid-write (another thread's failpoint)
    cut.write_bytes(b'{"version": 1, "uid"')
    report = recover(restarted(node))
    assert not cut.exists() and str(cut) in report.removed and leftovers(node) == {}
