"""`dra-agent devices` as a table on the simulated machine: the DRIVER and IOMMU columns show each PCI
function's current driver and IOMMU group as sysfs has them, and follow a function moved to vfio-pci."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.app import cli
from agent.host.vfio.bind import apply_step, plan_bind
from agent.sim.kernel.emulator import KernelEmulator
from agent.sim.kernel.tree import SimTree
from agent.sim.profiles import load_profile

GPU1_BUS, GPU1_GROUP = "0000:2a:00.0", 101  # gpu-1 of dgx-h100
GPU1_VARIANT = "gpu-0000-2a-00-0-vfio"


def table(capsys: pytest.CaptureFixture[str], state: Path) -> dict[str, dict[str, str]]:
    """Each row of the table by device name, cut at the header's column starts (cells may be empty)."""
    assert cli.main(["devices", "--nvml", "sim", "--state-dir", str(state), "--nic-exclude", "*",
                     "--offline", str(state / "offline")]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    names = header.split()
    names[names.index("PCI"):names.index("ID") + 1] = ["PCI BUS ID"]
    starts = [header.index(n) for n in names]
    ends = [*starts[1:], None]
    rows = [{n: line[s:e].strip() for n, s, e in zip(names, starts, ends, strict=True)} for line in lines]
    return {r["NAME"]: r for r in rows}


def test_devices_table_shows_driver_and_iommu_group(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    rows = table(capsys, state)
    for name in ("gpu-1", GPU1_VARIANT):
        assert (rows[name]["PCI BUS ID"], rows[name]["DRIVER"], rows[name]["IOMMU"]) == \
            (GPU1_BUS, "nvidia", str(GPU1_GROUP)), rows[name]
    assert (rows["gpu-0"]["DRIVER"], rows["gpu-0"]["IOMMU"]) == ("nvidia", "100")
    assert (rows["memory-numa0"]["DRIVER"], rows["memory-numa0"]["IOMMU"]) == ("", "")  # no PCI function

    # The GPU moved to vfio-pci (as a passthrough prepare does): the next listing says so.
    root = state / "nvml-sim"
    with KernelEmulator(load_profile("dgx-h100"), root):
        sysfs = SimTree(root).sys
        for step in plan_bind(sysfs, GPU1_BUS).steps:
            apply_step(sysfs, step)
        rows = table(capsys, state)
        assert (rows[GPU1_VARIANT]["DRIVER"], rows[GPU1_VARIANT]["IOMMU"]) == ("vfio-pci", str(GPU1_GROUP))
        assert rows["gpu-0"]["DRIVER"] == "nvidia"


def test_with_simulated_gpus_one_story_of_the_iommu_from_devices_and_doctor(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    # The simulated machine's VF gets its passthrough device; the host (a sysfs without IOMMU groups
    # here) has no NIC function that would get one, so `devices` says nothing of the IOMMU, and doctor
    # tells both machines' groups. Before, every `devices` run warned that "no NIC function of this host
    # gets a passthrough variant" while doctor said "IOMMU: on".
    state = tmp_path / "state"
    host = tmp_path / "host-sys"
    (host / "class" / "net").mkdir(parents=True)
    settings = ["--nvml", "sim", "--state-dir", str(state), "--sysfs-root", str(host), "--offline",
                str(state / "offline")]
    assert cli.main(["devices", *settings]) == 0
    listed = capsys.readouterr().out
    assert "nic-0000-4b-00-1-vfio" in listed
    assert [r.getMessage() for r in caplog.records if "IOMMU" in r.getMessage()] == []

    cli.main(["doctor", *settings, "--kubelet-dir", str(tmp_path / "kubelet"), "--metrics-address", ""])
    (iommu,) = [x for x in capsys.readouterr().out.splitlines() if x[2:].startswith("IOMMU:")]
    assert iommu.startswith("✓ IOMMU: on: ") and "groups in the simulated machine's" in iommu, iommu
    assert f"none in this host's {host / 'kernel' / 'iommu_groups'} (its IOMMU is off)" in iommu, iommu
