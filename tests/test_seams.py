"""The seams between the agent and the machine (docs/architecture.md, "Packages"): both implementations
of each have what the agent calls, and `agent.app.assembly` hands out the one the settings ask for.

mypy holds the simulated implementations to the Protocols; the real NVML is the untyped `pynvml`
module, so its side is checked here, by name."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from agent.app.assembly import nvml_opener, vf_links
from agent.config import NvmlMode, Settings
from agent.host.vfio.sriov import NetlinkVfLinks, VfLink
from agent.inventory.gpus import GpuSource
from agent.inventory.nvmlapi import NoCommands, Nvml
from agent.inventory.nvmlopen import open_real_nvml
from agent.sim.control import control_dir
from agent.sim.nvml import SimulatedNvml
from agent.sim.nvmlopen import SimCommands, open_sim_nvml
from agent.sim.vflinks import SimVfLinks

NVML_CALLS = sorted(name for name in vars(Nvml) if name.startswith("nvml"))


def settings(tmp_path: Path, nvml: str) -> Settings:
    return Settings(node_name="node-a", nvml=NvmlMode.parse(nvml), state_dir=tmp_path / "state")


def test_the_nvml_seam_names_calls_both_nvmls_have() -> None:
    assert len(NVML_CALLS) > 30 and "nvmlDeviceGetHandleByIndex" in NVML_CALLS
    sim = SimulatedNvml.from_profile("dgx-h100")
    missing = {name for name in NVML_CALLS if not callable(getattr(pynvml, name, None))}
    missing |= {f"{name} (simulated)" for name in NVML_CALLS if not callable(getattr(sim, name, None))}
    assert not missing, sorted(missing)


@pytest.mark.parametrize("nvml", ["auto", "real"])
def test_assembly_gives_a_host_the_real_implementations(tmp_path: Path, nvml: str) -> None:
    s = settings(tmp_path, nvml)
    assert nvml_opener(s) is open_real_nvml
    assert isinstance(vf_links(s), NetlinkVfLinks)


def test_assembly_gives_nvml_sim_the_simulated_machine(tmp_path: Path) -> None:
    s = settings(tmp_path, "sim:dgx-h100")
    assert nvml_opener(s) is open_sim_nvml
    links = vf_links(s)
    assert isinstance(links, SimVfLinks)
    links.set("ens75f0np0", 1, VfLink("02:00:00:00:00:01", 7, 0), with_mac=True)
    assert SimVfLinks(s.sim_root).get("ens75f0np0", 1) == VfLink("02:00:00:00:00:01", 7, 0)  # its machine's


def test_the_simulated_opener_brings_its_commands_and_node_placeholders(tmp_path: Path) -> None:
    s = settings(tmp_path, "sim:dgx-h100")
    source = GpuSource(s, opener=open_sim_nvml)
    source.open()
    try:
        assert isinstance(source.nvml, SimulatedNvml) and source.node_placeholders
        assert source.sysfs_root == s.sim_root / "sys" and source.dev_root == s.sim_root / "dev"
        commands = source.commands
        assert isinstance(commands, SimCommands) and commands.directory == control_dir(s)
        assert commands.resets(3) == 0
        source.nvml.recover(3)
        assert commands.resets(3) == 1
    finally:
        source.close()


def test_a_host_has_no_commands() -> None:
    none = NoCommands()
    none.start()
    assert none.resets(0) == 0 and none.raised_at(object()) is None
    none.stop()
