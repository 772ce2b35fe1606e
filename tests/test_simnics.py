"""The simulated machine's NIC functions in `--nvml sim`: published by the agent's own sources
(`build_sources`, as `dra-agent run`, `devices` and `slices` use them) from the simulated sysfs, with the
names, attributes and counter sets NIC discovery gives a real host's VFs, `--nic-passthrough` and
`--nic-exclude` applied as on a host; on the health stream and in the metrics as other devices."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import httpx2
import kubernetes_validate
import pytest
import yaml
from agentkit import NODE, roots
from test_metrics import scrape, value

from agent import apirules
from agent.app.assembly import build_sources
from agent.app.daemon import Agent
from agent.app.oneshot import render_slices
from agent.config import NvmlMode, Settings, build_settings
from agent.inventory import Inventory
from agent.inventory.gpus import GpuSource
from agent.kubelet import client as kc
from agent.sim.nicsource import SimNicSource
from agent.sim.nvmlopen import open_sim_nvml
from agent.sim.profiles import load_profile

DRIVER = "dra.example.com"
PF = "0000:4b:00.0"  # dgx-h100's ConnectX-7, VFs 0-3 enabled at 0000:4b:00.1-4
VFS = [f"0000:4b:00.{n}" for n in range(1, 5)]


def vfio(bus: str) -> str:
    return f"nic-{bus.replace(':', '-').replace('.', '-')}-vfio"


def sim_settings(tmp: Path, **values: Any) -> Settings:
    offline = tmp / "offline"
    offline.mkdir(parents=True, exist_ok=True)
    (offline / "node.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "uid": "6f1d2c3b-0000-4000-8000-0000000000a1"}}))
    return build_settings({"driver_name": DRIVER, "node_name": NODE, "nvml": "sim", "state_dir": str(tmp / "state"),
                           "offline": str(offline), **values})


def test_only_sim_mode_has_the_source_and_after_gpu_discovery(tmp_path: Path) -> None:
    kinds = [s.kind for s in build_sources(sim_settings(tmp_path))]
    assert "simnic" in kinds and kinds.index("gpu") < kinds.index("simnic")  # GPU discovery writes the machine
    for mode in ("auto", "real"):
        assert "simnic" not in [s.kind for s in build_sources(sim_settings(tmp_path, nvml=mode))]


def test_slices_carry_the_simulated_vfs_with_their_macs_and_counter_sets(tmp_path: Path) -> None:
    """`dra-agent slices --nvml sim`: each enabled VF's passthrough device, its MAC from the simulated
    sysfs, its own counter set consumed whole; never the PF, whose VFs are enabled. A pool the API takes."""
    objs = asyncio.run(render_slices(sim_settings(tmp_path)))
    for obj in objs:
        kubernetes_validate.validate(obj, "1.37.0", strict=True)
    assert apirules.pool_errors(objs) == []
    devices = {d["name"]: d for o in objs for d in o["spec"].get("devices", [])}
    sets = {s["name"]: s["counters"] for o in objs for s in o["spec"].get("sharedCounters", [])}
    (nic,) = load_profile("dgx-h100").nics
    assert sorted(n for n in devices if n.startswith("nic-0000-4b-")) == [vfio(b) for b in VFS]
    sysfs = tmp_path / "state" / "nvml-sim" / "sys" / "bus" / "pci" / "devices"
    for n, bus in enumerate(VFS):
        attrs = {k: next(iter(v.values())) for k, v in devices[vfio(bus)]["attributes"].items()}
        assert (sysfs / bus / "net" / f"{nic.interface}v{n}" / "address").read_text().strip() == nic.mac(n)
        assert attrs["macAddress"] == nic.mac(n)
        assert (attrs["type"], attrs["nativeType"], attrs["resource.kubernetes.io/pciBusID"]) == ("vfio", "nic", bus)
        assert attrs["iommuGroup"] == nic.iommu_group + 1 + n
        assert (attrs["vendorID"], attrs["deviceID"]) == ("0x15b3", "0x101e")
        assert attrs["resource.kubernetes.io/numaNode"] == 0
        set_name = f"nic-{bus.replace(':', '-').replace('.', '-')}-counters"
        assert sets[set_name] == {"ports": {"value": "1"}}
        assert devices[vfio(bus)]["consumesCounters"] == [
            {"counterSet": set_name, "counters": {"ports": {"value": "1"}}}]


def _names(tmp: Path, profile: str, **values: Any) -> set[str]:
    settings = sim_settings(tmp, nvml=f"sim:{profile}", **values)
    inventory = Inventory([GpuSource(settings, opener=open_sim_nvml), SimNicSource(settings)])
    inventory.open()
    try:
        asyncio.run(inventory.scan(["simnic"]))
    finally:
        inventory.close()
    return {d.name for d in inventory.devices() if d.kind == "vfio" and d.attributes.get("nativeType") == "nic"}


def test_nic_passthrough_names_a_pf_without_vfs_and_nic_exclude_wins(tmp_path: Path) -> None:
    profile = tmp_path / "two-nics.json"
    profile.write_text(json.dumps({
        "gpus": [{"busId": "0000:18:00.0", "name": "NVIDIA H100 80GB HBM3", "memoryTotal": 85520809984}],
        "nics": [{"busId": PF, "interface": "ens75f0np0", "numaNode": 0, "totalVfs": 4, "numVfs": 2},
                 {"busId": "0000:8b:00.0", "interface": "eno1", "numaNode": 1}]}))
    assert _names(tmp_path / "a", str(profile)) == {vfio(VFS[0]), vfio(VFS[1])}
    assert _names(tmp_path / "b", str(profile), nic_passthrough="eno*,ens75*") == {
        vfio(VFS[0]), vfio(VFS[1]), vfio("0000:8b:00.0")}  # not the PF whose VFs are enabled
    assert _names(tmp_path / "c", str(profile), nic_passthrough="eno1", nic_exclude="eno1,ens75f0np0v1") == {
        vfio(VFS[0])}


def test_no_simulated_machine_nothing_and_no_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    source = SimNicSource(Settings(node_name=NODE, nvml=NvmlMode("sim", "dgx-h100"), state_dir=tmp_path / "state"))
    source.open()
    assert source.scan().devices == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_running_agent_reports_them_on_the_health_stream_and_in_metrics(short_tmp: Path) -> None:
    agent = Agent(roots(short_tmp, rescan_interval=3600.0, metrics_address="127.0.0.1:0"))
    await agent.start()
    try:
        stream = kc.watch_health(agent.settings.dra_socket)
        first = await asyncio.wait_for(anext(stream), 30)
        await stream.aclose()
        health = {d.device.device_name: d.health for d in first.devices}
        assert {vfio(b): health.get(vfio(b)) for b in VFS} == {vfio(b): 1 for b in VFS}  # HEALTHY
        async with httpx2.AsyncClient(timeout=10, trust_env=False) as http:
            samples = await scrape(http, agent)
        assert value(samples, "dra_agent_discovery_scans_total", kind="simnic", result="success") >= 1
        vfio_devices = [d for d in agent.inventory.devices() if d.kind == "vfio"]
        assert len(vfio_devices) == 8 + len(VFS)  # dgx-h100's GPUs and the VFs
        assert value(samples, "dra_agent_devices", kind="vfio", health="HEALTHY") == len(vfio_devices)
    finally:
        await agent.stop()
