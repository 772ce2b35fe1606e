"""GPU discovery through the simulated NVML: the same pynvml calls, on a described machine."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pynvml
import pytest
from conftest import need_root

from agent import apirules
from agent.config import NvmlMode, Settings
from agent.inventory import DeviceFailure, DiscoveryError, Inventory, ScanError, ScanResult, SourceProblem
from agent.inventory.gpus import GpuSource, probe
from agent.inventory.nvmlopen import open_real_nvml
from agent.model import NUMA_NODE, PCI_BUS_ID, PCIE_ROOT, Capacity, Device, DeviceNode, Version
from agent.sim.nvml import SimulatedNvml, materialize
from agent.sim.nvmlopen import open_sim_nvml
from agent.sim.profiles import DEVICE_FUNCTIONS, SYSTEM_FUNCTIONS, load_profile

DGX_LAYOUT = {  # bus ID -> (PCIe root, NUMA node)
    "0000:18:00.0": ("pci0000:17", 0), "0000:2a:00.0": ("pci0000:29", 0),
    "0000:3a:00.0": ("pci0000:39", 0), "0000:5d:00.0": ("pci0000:5c", 0),
    "0000:9a:00.0": ("pci0000:99", 1), "0000:ab:00.0": ("pci0000:aa", 1),
    "0000:ba:00.0": ("pci0000:b9", 1), "0000:db:00.0": ("pci0000:da", 1),
}
UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def gpus(result: ScanResult) -> list[Device]:
    """The native GPU devices of a scan, without the passthrough variants (tests/test_passthrough_slices.py)."""
    return [d for d in result.devices if d.kind == "gpu"]


def sim_settings(tmp_path: Path, profile: str = "dgx-h100") -> Settings:
    return Settings(node_name="node-a", nvml=NvmlMode("sim", profile), state_dir=tmp_path / "state")


def opened(settings: Settings) -> GpuSource:
    source = GpuSource(settings, opener=open_sim_nvml)
    source.open()
    return source


@pytest.fixture
def dgx(tmp_path: Path):  # type: ignore[no-untyped-def]
    # With --dynamic-mig on (off by default until MIG prepare is built), every fact is published.
    source = opened(dataclasses.replace(sim_settings(tmp_path), dynamic_mig=True))
    yield source
    source.close()


def text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def nvml_is_real() -> bool:
    return probe() == "real"


def test_dgx_h100_publishes_every_fact(dgx: GpuSource, tmp_path: Path) -> None:
    result = dgx.scan()
    assert result.failed_devices == [] and result.problems == []
    assert [d.name for d in gpus(result)] == [f"gpu-{i}" for i in range(8)]
    # Besides them, one passthrough variant per GPU (tests/test_passthrough_slices.py checks them) and
    # 13 MIG placements per GPU, of the profiles --mig-profiles names by default (tests/test_mig.py checks them).
    assert sum(d.kind == "mig" for d in result.devices) == 8 * 13
    assert sorted(d.name for d in result.devices if d not in gpus(result) and d.kind != "mig") == sorted(
        f"gpu-{bus.replace(':', '-').replace('.', '-')}-vfio" for bus in DGX_LAYOUT)
    sim_root = tmp_path / "state" / "nvml-sim"
    uuids = set()
    layout = DGX_LAYOUT.items()
    for index, (dev, (bus_id, (root, numa))) in enumerate(zip(gpus(result), layout, strict=True)):
        uuid = dev.attributes["uuid"]
        assert isinstance(uuid, str) and UUID.match(uuid)
        uuids.add(uuid)
        assert dev.kind == "gpu"
        assert dev.attributes == {
            "type": "gpu", "uuid": uuid, "index": index, "minor": index,
            "productName": "NVIDIA H100 80GB HBM3", "brand": "NVIDIA", "architecture": "Hopper",
            "cudaComputeCapability": Version("9.0.0"), "driverVersion": Version("570.124.6"),
            "cudaDriverVersion": Version("12.8.0"), "migCapable": True, "migEnabled": False,
            PCI_BUS_ID: bus_id, PCIE_ROOT: root, NUMA_NODE: numa,
        }
        assert dev.capacity == {"memory": Capacity("81559Mi")}
        assert dev.taints == [] and not dev.allow_multiple_allocations and dev.node_allocatable is None
        dev_dir = sim_root / "dev"
        assert dev.node.gpu.uuid == uuid and dev.node.gpu.index == index
        assert dev.device_nodes == (
            DeviceNode(f"/dev/nvidia{index}", str(dev_dir / f"nvidia{index}")),
            DeviceNode("/dev/nvidiactl", str(dev_dir / "nvidiactl")),
            DeviceNode("/dev/nvidia-uvm", str(dev_dir / "nvidia-uvm")),
            DeviceNode("/dev/nvidia-uvm-tools", str(dev_dir / "nvidia-uvm-tools")),
        )
        for node in dev.device_nodes:
            assert os.path.lexists(node.host_path)
        # The root the slice claims is the one the materialized sysfs resolves to.
        real = Path(os.path.realpath(sim_root / "sys" / "bus" / "pci" / "devices" / bus_id))
        assert real.relative_to(sim_root / "sys" / "devices").parts[0] == root
        assert (real / "numa_node").read_text().strip() == str(numa)
        assert apirules.device_wire_errors(dev.wire()) == []
        assert apirules.dns_label_errors(dev.name) == []
    assert len(uuids) == 8
    assert sum(1 for d in gpus(result) if d.attributes[NUMA_NODE] == 0) == 4


def test_same_profile_same_uuids(tmp_path: Path) -> None:
    first, second = opened(sim_settings(tmp_path / "a")), opened(sim_settings(tmp_path / "b"))
    try:
        uuids = [[d.node.gpu.uuid for d in gpus(s.scan())] for s in (first, second)]
        assert uuids[0] == uuids[1]
    finally:
        first.close()
        second.close()


def test_sim_answers_with_pynvml_shapes(dgx: GpuSource) -> None:
    sim = dgx.nvml
    assert isinstance(sim, SimulatedNvml)
    handle = sim.nvmlDeviceGetHandleByIndex(3)
    assert isinstance(handle, pynvml.c_nvmlDevice_t)
    pci = sim.nvmlDeviceGetPciInfo(handle)
    assert type(pci) is pynvml.nvmlPciInfo_t
    # nvidia-ml-py's structs decode their char fields to str on access (older releases gave bytes).
    assert (text(pci.busId), text(pci.busIdLegacy)) == ("00000000:5D:00.0", "0000:5D:00.0")
    assert (pci.domain, pci.bus, pci.device, pci.pciDeviceId) == (0, 0x5D, 0, 0x233010DE)
    mem = sim.nvmlDeviceGetMemoryInfo(handle)
    assert type(mem) is pynvml.c_nvmlMemory_t and mem.total == 85520809984
    assert type(sim.nvmlDeviceGetMemoryInfo(handle, pynvml.nvmlMemory_v2)) is pynvml.c_nvmlMemory_v2_t
    assert isinstance(sim.nvmlDeviceGetUUID(handle), str) and isinstance(sim.nvmlDeviceGetName(handle), str)
    assert sim.nvmlSystemGetDriverVersion() == "570.124.06" and sim.nvmlSystemGetCudaDriverVersion() == 12080
    assert sim.nvmlDeviceGetBrand(handle) == pynvml.NVML_BRAND_NVIDIA
    assert sim.nvmlDeviceGetArchitecture(handle) == pynvml.NVML_DEVICE_ARCH_HOPPER
    assert sim.nvmlDeviceGetCudaComputeCapability(handle) == (9, 0)
    assert sim.nvmlDeviceGetMigMode(handle) == [pynvml.NVML_DEVICE_MIG_DISABLE] * 2
    assert sim.nvmlDeviceGetIndex(sim.nvmlDeviceGetHandleByUUID(sim.nvmlDeviceGetUUID(handle))) == 3
    assert sim.nvmlDeviceGetIndex(sim.nvmlDeviceGetHandleByPciBusId("00000000:5D:00.0")) == 3
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetNumaNodeId(handle)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlDeviceGetHandleByIndex(8)
    with pytest.raises(pynvml.NVMLError_NotFound):
        sim.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
    assert sim.NVML_ERROR_GPU_IS_LOST == pynvml.NVML_ERROR_GPU_IS_LOST and sim.NVMLError is pynvml.NVMLError


def test_sim_functions_have_pynvml_signatures() -> None:
    for name in sorted(DEVICE_FUNCTIONS | SYSTEM_FUNCTIONS):
        ours = inspect.signature(getattr(SimulatedNvml, name))
        theirs = inspect.signature(getattr(pynvml, name))
        assert list(ours.parameters)[1:] == list(theirs.parameters), name


def test_sim_refuses_calls_before_init_and_after_shutdown(tmp_path: Path) -> None:
    sim = SimulatedNvml.from_profile("dgx-h100")
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        sim.nvmlDeviceGetCount()
    source = opened(sim_settings(tmp_path))
    sim = source.nvml
    assert sim.nvmlDeviceGetCount() == 8
    source.close()
    assert not sim.initialized
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        sim.nvmlDeviceGetCount()
    source.close()  # a second close is harmless


def test_failing_gpu_is_skipped_and_named(dgx: GpuSource, caplog: pytest.LogCaptureFixture) -> None:
    dgx.nvml.inject_error(2, "nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_UNKNOWN)
    with caplog.at_level(logging.WARNING, logger="agent.inventory.gpus"):
        result = dgx.scan()
    assert [d.name for d in gpus(result)] == [f"gpu-{i}" for i in (0, 1, 3, 4, 5, 6, 7)]
    assert result.failed_devices == [
        DeviceFailure("gpu-2", "nvmlDeviceGetMemoryInfo failed: Unknown Error (NVML_ERROR_UNKNOWN)")]
    assert result.problems == []
    lines = [r.getMessage() for r in caplog.records]
    assert any("gpu-2" in line and "Unknown Error" in line for line in lines), lines
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="agent.inventory.gpus"):
        assert [f.device for f in dgx.scan().failed_devices] == ["gpu-2"]
        assert not any("gpu-2" in r.getMessage() for r in caplog.records)  # said once, not every rescan
        dgx.nvml.clear_errors()
        assert len(gpus(dgx.scan())) == 8
    assert any("gpu-2 answers again" in r.getMessage() for r in caplog.records)


def test_gpu_lost_after_publishing_keeps_its_name(dgx: GpuSource) -> None:
    assert len(gpus(dgx.scan())) == 8
    dgx.nvml.lose(5)
    result = dgx.scan()
    assert "gpu-5" not in {d.name for d in gpus(result)} and len(gpus(result)) == 7
    [failure] = result.failed_devices
    assert failure.device == "gpu-5" and "GPU is lost" in failure.reason


def lost_profile(tmp_path: Path, lost: set[int]) -> str:
    profile = tmp_path / "lost.json"
    profile.write_text(json.dumps({"gpus": [
        {"name": "NVIDIA A100-SXM4-80GB", "busId": bus, "memoryTotal": 85899345920, "minor": minor,
         "lost": index in lost}
        for index, (bus, minor) in enumerate((("0000:07:00.0", 0), ("0000:0f:00.0", 2), ("0000:47:00.0", 1)))
    ]}))
    return str(profile)


LOST = "nvmlDeviceGetHandleByIndex failed: GPU is lost (NVML_ERROR_GPU_IS_LOST)"


def test_gpu_lost_from_the_start_is_named_from_the_driver_list(tmp_path: Path) -> None:
    source = opened(sim_settings(tmp_path, lost_profile(tmp_path, {1})))
    try:
        result = source.scan()
        assert [d.name for d in gpus(result)] == ["gpu-0", "gpu-1"]
        # It never said its minor; the driver lists minors 0, 1, 2 and the others said 0 and 1.
        assert result.failed_devices == [DeviceFailure("gpu-2", f"NVML index 1, 0000:0f:00.0: {LOST}")]
        assert result.problems == []
        assert source.proc_root == tmp_path / "state" / "nvml-sim" / "proc"
        # Named now, it keeps the name when the driver's list is gone.
        shutil.rmtree(source.proc_root)
        assert source.scan().failed_devices == [DeviceFailure("gpu-2", LOST)]
    finally:
        source.close()


def test_gpus_lost_from_the_start_are_all_named_when_the_rest_answer(tmp_path: Path) -> None:
    source = opened(sim_settings(tmp_path, lost_profile(tmp_path, {0, 1})))
    result = source.scan()
    source.close()
    assert [d.name for d in gpus(result)] == ["gpu-1"]
    # Both failing GPUs are among minors 0 and 2, and both fail: each is named, which reason is whose
    # does not matter when they agree.
    assert result.failed_devices == [DeviceFailure(f"gpu-{m}", f"one of NVML indexes 0, 1: {LOST}") for m in (0, 2)]


def test_gpu_lost_from_the_start_without_the_driver_list_names_no_device(tmp_path: Path) -> None:
    source = opened(sim_settings(tmp_path, lost_profile(tmp_path, {1})))
    # No list, or one that does not match NVML's GPUs: no name it would be published under.
    for damage in ("remove one", "remove all"):
        top = source.proc_root / "driver" / "nvidia" / "gpus"
        shutil.rmtree(top / "0000:47:00.0" if damage == "remove one" else top)
        result = source.scan()
        assert [d.name for d in gpus(result)] == ["gpu-0", "gpu-1"]
        assert result.failed_devices == []
        assert result.problems == [SourceProblem("GPU at NVML index 1", LOST)]
    source.close()


def test_an_unexpected_exception_costs_one_gpu(dgx: GpuSource, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    sim = dgx.nvml
    real_name = sim.nvmlDeviceGetName

    def name(handle):  # type: ignore[no-untyped-def]
        if sim.nvmlDeviceGetIndex(handle) == 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real_name(handle)

    monkeypatch.setattr(sim, "nvmlDeviceGetName", name)
    with caplog.at_level(logging.WARNING, logger="agent.inventory.gpus"):
        result = dgx.scan()
    assert [d.name for d in gpus(result)] == [f"gpu-{i}" for i in (0, 1, 2, 3, 5, 6, 7)]
    assert result.failed_devices == [DeviceFailure(
        "gpu-4", "unexpected UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position 0: "
                 "invalid start byte")]
    assert any(r.exc_info for r in caplog.records), "the first time, with its traceback"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="agent.inventory.gpus"):
        assert [f.device for f in dgx.scan().failed_devices] == ["gpu-4"]
    assert caplog.records == []  # said once, not on every rescan


def test_codes_the_agent_has_no_name_for_are_published_by_number(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    profile = tmp_path / "future.json"
    profile.write_text(json.dumps({"gpus": [
        {"name": "NVIDIA Next", "busId": "0000:07:00.0", "memoryTotal": 1 << 30, "brand": 42, "architecture": 77},
        {"name": "NVIDIA Next", "busId": "0000:0f:00.0", "memoryTotal": 1 << 30,
         "brand": "NVML_BRAND_UNKNOWN", "architecture": "NVML_DEVICE_ARCH_UNKNOWN"},
    ]}))
    with caplog.at_level(logging.WARNING, logger="agent.inventory.gpus"):
        source = opened(sim_settings(tmp_path, str(profile)))
        first, second = gpus(source.scan())
        source.close()
    assert (first.attributes["brand"], first.attributes["architecture"]) == ("unknown-42", "unknown-77")
    assert apirules.device_wire_errors(first.wire()) == []
    # NVML's own "unknown" says nothing: omitted.
    assert "brand" not in second.attributes and "architecture" not in second.attributes
    said = [r.getMessage() for r in caplog.records]
    assert "gpu-0: NVML brand code 42 has no name in this agent; published as brand=unknown-42" in said


def test_json_profile_with_faults(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    profile = tmp_path / "l40s-node.json"
    profile.write_text(json.dumps({
        "driverVersion": "550.54.15",
        "cudaDriverVersion": 12040,
        "errors": {"nvmlSystemGetDriverVersion": "NOT_SUPPORTED"},
        "defaults": {"name": "NVIDIA L40S", "memoryTotal": 48305799168, "architecture": "ADA",
                     "computeCapability": [8, 9], "pciDeviceId": "0x26b910de"},
        "gpus": [
            {"busId": "0000:41:00.0", "numaNode": -1},
            {"busId": "00000000:C1:00.0", "inSysfs": False, "nvmlNumaNode": 1, "minor": 4},
            {"busId": "0000:e1:00.0", "numaNode": 1,
             "errors": {"nvmlDeviceGetUUID": "NVML_ERROR_CORRUPTED_INFOROM"}},
        ],
    }))
    with caplog.at_level(logging.WARNING, logger="agent.inventory.gpus"):
        source = opened(sim_settings(tmp_path, str(profile)))
        result = source.scan()
        source.close()
    first, second = gpus(result)
    assert first.name == "gpu-0" and second.name == "gpu-4"
    assert "driverVersion" not in first.attributes  # the system call failed: omitted, not fatal
    assert first.attributes["cudaDriverVersion"] == Version("12.4.0")
    assert first.attributes["architecture"] == "Ada Lovelace"
    assert first.attributes["cudaComputeCapability"] == Version("8.9.0")
    assert first.attributes["migCapable"] is False and first.attributes["migEnabled"] is False
    assert first.attributes[PCIE_ROOT] == "pci0000:40" and NUMA_NODE not in first.attributes  # sysfs says -1
    # Not in sysfs: the bus ID and NUMA node still come from NVML, the PCIe root cannot.
    assert second.attributes[PCI_BUS_ID] == "0000:c1:00.0" and second.attributes[NUMA_NODE] == 1
    assert PCIE_ROOT not in second.attributes
    assert second.capacity["memory"] == Capacity("46068Mi")
    assert result.failed_devices == [
        DeviceFailure("gpu-2", "nvmlDeviceGetUUID failed: Corrupted infoROM (NVML_ERROR_CORRUPTED_INFOROM)")]
    assert any("nvmlSystemGetDriverVersion" in r.getMessage() for r in caplog.records)
    for dev in gpus(result):
        assert apirules.device_wire_errors(dev.wire()) == []


GPU = {"name": "x", "busId": "0000:01:00.0", "memoryTotal": 1}


@pytest.mark.parametrize("raw, complaint", [
    ({"gpus": [{**GPU, "errors": {"nvmlGetUUID": 15}}]}, "nvmlGetUUID"),
    ({"gpus": [{**GPU, "errors": {"nvmlDeviceGetUUID": "LOST"}}]}, "'LOST' is not an NVML error code"),
    ({"gpus": [{"name": "x", "busId": "0000:01:00.0", "memorytotal": 1}]}, "memorytotal"),
    ({"gpus": [{**GPU, "busId": "01:00"}]}, "not a PCI bus ID"),
    ({"gpus": [GPU, GPU]}, "two GPUs share busId 0000:01:00.0"),
    ({"gpu": []}, "unknown keys ['gpu']"),
])
def test_bad_profile_is_a_discovery_error(tmp_path: Path, raw: object, complaint: str) -> None:
    profile = tmp_path / "bad.json"
    profile.write_text(json.dumps(raw))
    with pytest.raises(DiscoveryError, match=re.escape(complaint)):
        GpuSource(sim_settings(tmp_path, str(profile)), opener=open_sim_nvml).open()


def test_unknown_profile_name(tmp_path: Path) -> None:
    with pytest.raises(DiscoveryError, match="neither a builtin profile"):
        GpuSource(sim_settings(tmp_path, "dgx-z900"), opener=open_sim_nvml).open()


def test_device_count_failing_fails_the_source(dgx: GpuSource) -> None:
    dgx.nvml.inject_error(None, "nvmlDeviceGetCount", "UNKNOWN")
    # A failure of the whole scan, not an empty result: the inventory keeps the GPUs it has.
    with pytest.raises(ScanError, match="nvmlDeviceGetCount failed"):
        dgx.scan()


def test_inventory_runs_the_source(tmp_path: Path) -> None:
    import asyncio

    inventory = Inventory([GpuSource(sim_settings(tmp_path), opener=open_sim_nvml)])
    inventory.open()
    try:
        assert asyncio.run(inventory.scan())
        assert inventory.get("gpu-7") is not None and len([d for d in inventory.devices() if d.kind == "gpu"]) == 8
    finally:
        inventory.close()


def test_materialize_is_idempotent_with_real_device_nodes(tmp_path: Path) -> None:
    need_root()
    profile = load_profile("dgx-h100")

    def tree() -> list[tuple[str, str]]:
        out = []
        for dirpath, dirnames, filenames in os.walk(tmp_path):
            for name in sorted(dirnames + filenames):
                p = Path(dirpath) / name
                st = os.lstat(p)
                kind = os.readlink(p) if p.is_symlink() else f"{st.st_mode:o} {st.st_rdev} {st.st_size}"
                out.append((str(p.relative_to(tmp_path)), kind))
        return sorted(out)

    materialize(profile, tmp_path)
    before = tree()
    materialize(profile, tmp_path)
    assert tree() == before
    for name, major, minor in (("nvidia0", 195, 0), ("nvidia7", 195, 7), ("nvidiactl", 195, 255),
                               ("nvidia-uvm", 235, 0), ("nvidia-uvm-tools", 235, 1)):
        st = os.lstat(tmp_path / "dev" / name)
        assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (major, minor)
        assert stat.S_IMODE(st.st_mode) == 0o666
    gpu = tmp_path / "sys" / "bus" / "pci" / "devices" / "0000:9a:00.0"
    assert {n: (gpu / n).read_text().strip() for n in ("vendor", "device", "class", "numa_node")} == {
        "vendor": "0x10de", "device": "0x2330", "class": "0x030200", "numa_node": "1"}
    assert os.path.basename(os.path.realpath(gpu / "driver")) == "nvidia"


def test_materialize_unprivileged_writes_placeholders() -> None:
    need_root()  # to become an ordinary user for the run
    # Not under tmp_path: pytest's base directory is private to root.
    with tempfile.TemporaryDirectory() as top:
        os.chmod(top, 0o755)
        materialize_as_nobody(Path(top) / "sim")


def materialize_as_nobody(root: Path) -> None:
    root.mkdir()
    os.chown(root, 65534, 65534)
    # Import first: the interpreter's own files may not be readable by that user.
    script = ("import os, sys; from pathlib import Path; from agent.sim.nvml import SimulatedNvml; "
              "sim = SimulatedNvml.from_profile('dgx-h100'); os.setgid(65534); os.setuid(65534); "
              "sim.materialize(Path(sys.argv[1]))")
    subprocess.run([sys.executable, "-c", script, str(root)], check=True,
                   cwd=Path(__file__).resolve().parents[1])
    for name in ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        st = os.lstat(root / "dev" / name)
        assert stat.S_ISREG(st.st_mode) and st.st_size == 0
    assert (root / "sys" / "bus" / "pci" / "devices" / "0000:db:00.0" / "vendor").read_text() == "0x10de\n"


# Choosing the real NVML. The library is absent on these machines, so these run the real pynvml.nvmlInit.

def host_tree(tmp_path: Path) -> Settings:
    """A host with eight NVIDIA GPUs in sysfs and /dev (as the driver would show them)."""
    materialize(load_profile("dgx-h100"), tmp_path / "host")
    return Settings(node_name="node-a", nvml=NvmlMode("auto"), state_dir=tmp_path / "state",
                    sysfs_root=tmp_path / "host" / "sys", dev_root=tmp_path / "host" / "dev")


def test_auto_with_nvidia_hardware_but_no_nvml_is_an_error(tmp_path: Path) -> None:
    if nvml_is_real():
        pytest.skip("NVML loads on this machine; this checks a node where it does not")
    settings = host_tree(tmp_path)
    with pytest.raises(DiscoveryError) as err:
        GpuSource(settings, opener=open_real_nvml).open()
    text = str(err.value)
    assert "nvidiactl" in text and "0000:18:00.0" in text and "no libnvidia-ml.so.1 under the driver root /" in text
    # Either sign alone is enough.
    (settings.dev_root / "nvidiactl").unlink()
    with pytest.raises(DiscoveryError, match="NVIDIA display functions"):
        GpuSource(settings, opener=open_real_nvml).open()
    for entry in (settings.sysfs_root / "bus" / "pci" / "devices").iterdir():
        entry.unlink()
    (settings.dev_root / "nvidiactl").touch()
    with pytest.raises(DiscoveryError, match="nvidiactl"):
        GpuSource(settings, opener=open_real_nvml).open()


def test_auto_without_nvidia_hardware_publishes_nothing(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    if nvml_is_real():
        pytest.skip("NVML loads on this machine; this checks a node without NVIDIA hardware")
    # A typical server: only the BMC's VGA function (ASPEED, vendor 0x1a03) is a display device.
    bmc = tmp_path / "sys" / "devices" / "pci0000:00" / "0000:00:1c.0" / "0000:03:00.0"
    bmc.mkdir(parents=True)
    (bmc / "vendor").write_text("0x1a03\n")
    (bmc / "class").write_text("0x030000\n")
    (tmp_path / "sys" / "bus" / "pci" / "devices").mkdir(parents=True)
    (tmp_path / "sys" / "bus" / "pci" / "devices" / "0000:03:00.0").symlink_to(bmc)
    (tmp_path / "dev").mkdir()
    settings = Settings(node_name="node-a", nvml=NvmlMode("auto"), state_dir=tmp_path / "state",
                        sysfs_root=tmp_path / "sys", dev_root=tmp_path / "dev")
    source = GpuSource(settings, opener=open_real_nvml)
    with caplog.at_level(logging.INFO, logger="agent.inventory.gpus"):
        source.open()
    assert source.scan() == ScanResult()
    assert [r.levelname for r in caplog.records if "no NVIDIA GPUs" in r.getMessage()] == ["WARNING"]
    source.close()
    assert not (tmp_path / "state" / "nvml-sim").exists()  # never a quiet switch to the simulation


def test_real_mode_without_nvml_is_an_error(tmp_path: Path) -> None:
    if nvml_is_real():
        pytest.skip("NVML loads on this machine")
    settings = Settings(node_name="node-a", nvml=NvmlMode("real"), state_dir=tmp_path)
    with pytest.raises(DiscoveryError, match="^--nvml real: no libnvidia-ml.so.1 under the driver root / "
                       r"\(tried /etc/ld.so.cache ") as err:
        GpuSource(settings, opener=open_real_nvml).open()
    assert "--driver-root" in str(err.value) and "\n" not in str(err.value)


def test_probe_says_sim_without_nvml() -> None:
    if nvml_is_real():
        pytest.skip("NVML loads on this machine")
    out = subprocess.run([sys.executable, "-m", "agent.inventory.gpus", "--probe"], capture_output=True,
                         text=True, check=False, cwd=Path(__file__).resolve().parents[1])
    assert (out.returncode, out.stdout) == (0, "sim\n"), out.stderr
