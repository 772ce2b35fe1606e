"""Real hardware: discovery through the real NVML, checked against nvidia-smi and the simulated MIG
tables (`make hw-check`).

Not part of `make test`: it needs an NVIDIA GPU, its driver and nvidia-smi on the machine. Every
check is read-only: queries, never a configuration change. In CI the same code path runs against
the stand-in library (tests/test_nvml_standin.py); this is where the stand-in is checked against
a real driver.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import quantity
from agent.apirules import normalize_version
from agent.config import NvmlMode, Settings
from agent.host.pci import normalize_bus_id
from agent.inventory import DiscoveryError
from agent.inventory.gpus import GpuSource, driver_minors
from agent.inventory.mig import read_layout
from agent.inventory.nvmlopen import open_real_nvml
from agent.kinds import Kind
from agent.model import PCI_BUS_ID, Device, Version
from agent.sim.hardware import NVIDIA_MAJOR
from agent.sim.migprofiles import MIG_TABLES

QUERY = "uuid,pci.bus_id,memory.total,driver_version"
MiB = 1024 * 1024


@pytest.fixture
def real_gpus(tmp_path: Path) -> Iterator[GpuSource]:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("needs nvidia-smi (the NVIDIA driver's utilities) on this machine")
    source = GpuSource(Settings(node_name="hw-check", nvml=NvmlMode("real"), state_dir=tmp_path), opener=open_real_nvml)
    try:
        source.open()
    except DiscoveryError as exc:
        pytest.skip(f"the real NVML does not load here: {exc}")
    yield source
    source.close()


def nvidia_smi(query: str = QUERY) -> list[dict[str, str]]:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    rows = [[cell.strip() for cell in row] for row in csv.reader(io.StringIO(out)) if row]
    return [dict(zip(query.split(","), row, strict=True)) for row in rows]


def optional_query(field: str) -> dict[str, str]:
    """uuid -> the field, or a skip when this driver's nvidia-smi does not know the field."""
    try:
        rows = nvidia_smi(f"uuid,{field}")
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"nvidia-smi here cannot query {field}: {exc.stdout or exc.stderr}")
    return {row["uuid"]: row[field] for row in rows}


def scanned(source: GpuSource) -> dict[str, Device]:
    """The whole GPUs by UUID (the scan also gives each GPU's MIG placements and passthrough form)."""
    result = source.scan()
    assert result.failed_devices == [] and result.problems == [], (result.failed_devices, result.problems)
    return {str(d.attributes["uuid"]): d for d in result.devices if d.kind is Kind.GPU}


def test_discovery_matches_nvidia_smi(real_gpus: GpuSource, capsys: pytest.CaptureFixture[str]) -> None:
    result = real_gpus.scan()
    smi = nvidia_smi()
    assert result.failed_devices == [] and result.problems == [], (result.failed_devices, result.problems)
    assert smi, "nvidia-smi lists no GPU although NVML initialized"
    by_uuid = {d.attributes["uuid"]: d for d in result.devices if d.kind is Kind.GPU}
    assert sorted(by_uuid) == sorted(row["uuid"] for row in smi)
    table = [("device", "uuid", "pciBusID", "memory MiB", "driver", "nvidia-smi agrees")]
    for row in smi:
        dev = by_uuid[row["uuid"]]
        memory_mib = quantity.parse_int(dev.capacity["memory"].value) // MiB
        assert dev.attributes[PCI_BUS_ID] == normalize_bus_id(row["pci.bus_id"])
        assert memory_mib == int(row["memory.total"])
        assert dev.attributes["driverVersion"] == Version(normalize_version(row["driver_version"]) or "")
        table.append((dev.name, row["uuid"], str(dev.attributes[PCI_BUS_ID]), str(memory_mib),
                      str(dev.attributes["driverVersion"]), "yes"))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    with capsys.disabled():
        print()
        for r in table:
            print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)))


def test_names_indexes_and_device_nodes(real_gpus: GpuSource) -> None:
    by_uuid = scanned(real_gpus)
    for row in nvidia_smi("uuid,index,name"):
        dev = by_uuid[row["uuid"]]
        assert dev.attributes["productName"] == row["name"]
        assert dev.attributes["index"] == int(row["index"])
        # The minor names the device, and its /dev node is the one the CDI spec will inject.
        minor = dev.attributes["minor"]
        assert dev.name == f"gpu-{minor}"
        st = os.stat(f"/dev/nvidia{minor}")
        assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (NVIDIA_MAJOR, minor)


def test_the_driver_list_names_every_gpu(real_gpus: GpuSource) -> None:
    # What names a GPU that fails before it says its minor: /proc/driver/nvidia/gpus must agree.
    listed = driver_minors(real_gpus.proc_root)
    published = {str(d.attributes[PCI_BUS_ID]): d.attributes["minor"] for d in scanned(real_gpus).values()}
    assert listed == published


def test_compute_capability(real_gpus: GpuSource) -> None:
    caps = optional_query("compute_cap")
    for uuid, dev in scanned(real_gpus).items():
        assert dev.attributes["cudaComputeCapability"] == Version(f"{caps[uuid]}.0")


def test_mig_mode(real_gpus: GpuSource) -> None:
    # Read only: the current mode as nvidia-smi reports it, never a change.
    modes = optional_query("mig.mode.current")
    for uuid, dev in scanned(real_gpus).items():
        mode = modes[uuid]
        assert dev.attributes["migCapable"] is (mode in ("Enabled", "Disabled")), mode
        assert dev.attributes["migEnabled"] is (mode == "Enabled"), mode


def test_brand_and_architecture_have_names(real_gpus: GpuSource, capsys: pytest.CaptureFixture[str]) -> None:
    for dev in scanned(real_gpus).values():
        for attr in ("brand", "architecture"):
            value = str(dev.attributes.get(attr, ""))
            if value.startswith("unknown-"):
                with capsys.disabled():
                    print(f"\nnote: {dev.name} {attr}={value}: a code this agent has no name for yet")
            assert value, f"{dev.name}: no {attr}"


def test_the_cli_shows_what_discovery_finds(real_gpus: GpuSource, tmp_path: Path) -> None:
    # `dra-agent devices --nvml real` in its own process, as a person at the node runs it.
    env = {**os.environ, "DRA_STATE_DIR": str(tmp_path / "state"), "DRA_OFFLINE": str(tmp_path / "offline")}
    proc = subprocess.run([sys.executable, "-m", "agent", "devices", "--nvml", "real", "-o", "json"],
                          capture_output=True, text=True, timeout=120, env=env,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    shown = {d["name"]: d for d in json.loads(proc.stdout) if d["kind"] == "gpu"}
    # The CLI adds the PCI function's driver and IOMMU group, which the published device does not carry.
    functions = {name: d.pop("pciFunction", None) for name, d in shown.items()}
    expected = {d.name: d.summary() for d in scanned(real_gpus).values()}
    assert shown == expected
    assert all(f is not None and f["driver"] == "nvidia" for f in functions.values()), functions


def test_mig_profiles_match_the_simulated_tables(real_gpus: GpuSource, capsys: pytest.CaptureFixture[str]) -> None:
    # The simulated GPUs' MIG tables (agent/sim/migprofiles.py) against what the real NVML answers,
    # read-only: profile info and possible placements, never a mode change or an instance.
    nvml = real_gpus.nvml
    compared = 0
    for dev in scanned(real_gpus).values():
        if not dev.attributes["migCapable"]:
            continue
        handle = nvml.nvmlDeviceGetHandleByUUID(str(dev.attributes["uuid"]))
        layout = read_layout(nvml, handle)
        with capsys.disabled():
            print(f"\n{dev.name} ({dev.attributes['productName']}): "
                  f"{'no MIG layout' if layout is None else f'{layout.memory_slices} memory slices'}")
            for p in layout.profiles if layout else ():
                print(f"  id {p.id:2} {p.name:12} slices {p.compute_slices} instances {p.instances} "
                      f"engines(sm,ce,dec,enc,jpg,ofa) {p.engines} memory {p.memory // MiB} MiB "
                      f"starts {p.starts} size {p.size}")
        if layout is None:
            continue
        whole = max(layout.profiles, key=lambda p: p.size).name
        table = next((t for t in MIG_TABLES.values() if max(t, key=lambda s: s.size).name == whole), None)
        if table is None:
            with capsys.disabled():
                print(f"note: no simulated table has a {whole} profile")
            continue
        real = {p.id: (p.name, p.compute_slices, p.instances, p.engines, p.memory // MiB, p.starts, p.size)
                for p in layout.profiles}
        simulated = {s.id: (s.name, s.slices, s.instances, (s.multiprocessors, s.copy_engines, s.decoders,
                                                              s.encoders, s.jpegs, s.ofas),
                            s.memory_mib, s.starts, s.size) for s in table}
        assert real == simulated
        compared += 1
    if compared == 0:
        pytest.skip("no MIG-capable GPU here whose profiles a simulated table models")
