"""Real hardware: discovery through the real NVML, checked against nvidia-smi (`make hw-check`).

Not part of `make test`: it needs an NVIDIA GPU, its driver and nvidia-smi on the machine.
"""

from __future__ import annotations

import csv
import io
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import quantity
from agent.apirules import normalize_version
from agent.config import NvmlMode, Settings
from agent.inventory import DiscoveryError
from agent.inventory.gpus import GpuSource
from agent.inventory.pci import normalize_bus_id
from agent.model import PCI_BUS_ID, Version

QUERY = "uuid,pci.bus_id,memory.total,driver_version"
MiB = 1024 * 1024


@pytest.fixture
def real_gpus(tmp_path: Path) -> Iterator[GpuSource]:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("needs nvidia-smi (the NVIDIA driver's utilities) on this machine")
    source = GpuSource(Settings(node_name="hw-check", nvml=NvmlMode("real"), state_dir=tmp_path))
    try:
        source.open()
    except DiscoveryError as exc:
        pytest.skip(f"the real NVML does not load here: {exc}")
    yield source
    source.close()


def nvidia_smi() -> list[dict[str, str]]:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    rows = [[cell.strip() for cell in row] for row in csv.reader(io.StringIO(out)) if row]
    return [dict(zip(QUERY.split(","), row, strict=True)) for row in rows]


def test_discovery_matches_nvidia_smi(real_gpus: GpuSource, capsys: pytest.CaptureFixture[str]) -> None:
    result = real_gpus.scan()
    smi = nvidia_smi()
    assert result.failed_devices == [] and result.problems == [], (result.failed_devices, result.problems)
    assert smi, "nvidia-smi lists no GPU although NVML initialized"
    by_uuid = {d.attributes["uuid"]: d for d in result.devices}
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
