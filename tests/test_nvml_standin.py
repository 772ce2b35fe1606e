"""The real NVML code path without a GPU: the agent finds the stand-in libnvidia-ml.so.1
(tests/nvml_standin/, built by `make nvml-standin`) below a driver root laid out as Debian installs the
driver (`--driver-root`, tests/driverroots.py) and hands it to the unpatched `pynvml`, exactly as it does
the driver's library, so library loading, handles, structure layouts, versioned functions, byte strings
and NVML return codes are all exercised. A process loads one library, so everything here runs the agent
in a subprocess.

The machine is tests/nvml_standin/machine.txt: three GPUs (Hopper, MIG capable; Ada, without a NUMA
node in NVML; a GPU newer than the agent, MIG mode pending a reset, minor 3 at index 2). The `legacy` build lacks
nvmlDeviceGetNumaNodeId and nvmlDeviceGetMemoryInfo_v2, as an older driver's library does. Faults
come from a control file the library reads on every call (see nvml_standin.c). The library also holds
each GPU it hands out a handle of open, lists only the GPUs the host tree shows on nvidia, and does MIG
(nvml_standin_mig.c): MIG prepare and a GPU's passthrough run here on the real path too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import agentkit
import kubernetes_validate
import orjson
import pytest
import yaml
from agentkit import DRIVER, NODE, claim, make_node, result, write_claim
from conftest import need_command, need_root
from driverroots import make_driver_root

from agent.host.driverroot import library_dirs
from agent.inventory.gpus import probe
from agent.sim.hardware import materialize
from agent.sim.kernel.emulator import KernelEmulator
from agent.sim.kernel.tree import SimTree
from agent.sim.profiles import parse_profile

ROOT = Path(__file__).resolve().parent.parent
STANDIN = ROOT / "tests" / "nvml_standin" / "build"
LEGACY = STANDIN / "legacy"
UID = "5a7e1d00-0000-4000-8000-000000000001"

H100_UUID = "GPU-3f9a6c1e-2b4d-4e8f-9a1c-5d7e3b2a1f00"
L40S_UUID = "GPU-8c2e4a6b-1d3f-4b5a-8e7c-9f0a2b4c6d01"
NEXT_UUID = "GPU-d41f7b2c-6e8a-4c9d-b1f3-2a5e7c9b0d02"
DRIVER_ATTRS = {"driverVersion": {"version": "570.124.6"}, "cudaDriverVersion": {"version": "12.8.0"}}

# What discovery must publish for machine.txt, in `devices -o json` form. gpu-0 is in the host's
# sysfs tree (PCIe root and NUMA node from there); gpu-1 and gpu-3 are not, so their NUMA node is
# NVML's (NOT_SUPPORTED for gpu-1).
EXPECTED: dict[str, dict[str, Any]] = {
    "gpu-0": {
        "attributes": {
            "type": {"string": "gpu"}, "uuid": {"string": H100_UUID}, "index": {"int": 0}, "minor": {"int": 0},
            "productName": {"string": "NVIDIA H100 80GB HBM3"}, "brand": {"string": "NVIDIA"},
            "architecture": {"string": "Hopper"}, "cudaComputeCapability": {"version": "9.0.0"},
            "migCapable": {"bool": True}, "migEnabled": {"bool": False},
            "resource.kubernetes.io/pciBusID": {"string": "0000:18:00.0"},
            "resource.kubernetes.io/pcieRoot": {"string": "pci0000:17"},
            "resource.kubernetes.io/numaNode": {"int": 0}, **DRIVER_ATTRS,
        },
        "capacity": {"memory": {"value": "81559Mi"}},
    },
    "gpu-1": {
        "attributes": {
            "type": {"string": "gpu"}, "uuid": {"string": L40S_UUID}, "index": {"int": 1}, "minor": {"int": 1},
            "productName": {"string": "NVIDIA L40S"}, "brand": {"string": "NVIDIA"},
            "architecture": {"string": "Ada Lovelace"}, "cudaComputeCapability": {"version": "8.9.0"},
            "migCapable": {"bool": False}, "migEnabled": {"bool": False},
            "resource.kubernetes.io/pciBusID": {"string": "0000:3b:00.0"}, **DRIVER_ATTRS,
        },
        "capacity": {"memory": {"value": "46068Mi"}},
    },
    "gpu-3": {
        "attributes": {
            "type": {"string": "gpu"}, "uuid": {"string": NEXT_UUID}, "index": {"int": 2}, "minor": {"int": 3},
            "productName": {"string": "NVIDIA Next-Gen GPU"},
            # Codes the agent has no name for: the documented fallback, not dropped.
            "brand": {"string": "unknown-42"}, "architecture": {"string": "unknown-77"},
            # MIG mode on only once the GPU is reset: NVML's current mode, off, is what it publishes.
            "cudaComputeCapability": {"version": "12.1.0"}, "migCapable": {"bool": True},
            "migEnabled": {"bool": False}, "resource.kubernetes.io/pciBusID": {"string": "0000:af:00.0"},
            "resource.kubernetes.io/numaNode": {"int": 1}, **DRIVER_ATTRS,
        },
        "capacity": {"memory": {"value": "180Gi"}},
    },
}


@pytest.fixture(scope="module")
def standin() -> Path:
    need_command("make", "gcc")
    built = subprocess.run(["make", "-s", "nvml-standin"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stdout + built.stderr
    return STANDIN


HOST_PROFILE: dict[str, Any] = {"gpus": [
    {"name": "NVIDIA H100 80GB HBM3", "uuid": H100_UUID, "busId": "0000:18:00.0", "memoryTotal": 1,
     "minor": 0, "numaNode": 0, "pciDeviceId": "0x233010de"},
    {"name": "NVIDIA L40S", "uuid": L40S_UUID, "busId": "0000:3b:00.0", "memoryTotal": 1, "minor": 1,
     "inSysfs": False},
    {"name": "NVIDIA Next-Gen GPU", "uuid": NEXT_UUID, "busId": "0000:af:00.0", "memoryTotal": 1, "minor": 3,
     "inSysfs": False},
]}


def host_tree(top: Path) -> None:
    """The host as the driver shows it: gpu-0's PCI function in sysfs, every GPU in the driver's
    procfs list and in /dev."""
    materialize(parse_profile("standin", HOST_PROFILE), top)


@pytest.fixture
def env(standin: Path, short_tmp: Path) -> dict[str, str]:
    host_tree(short_tmp / "host")
    make_driver_root(short_tmp / "driver", standin, "debian")
    return {
        "DRA_DRIVER_ROOT": str(short_tmp / "driver"), "NVML_STANDIN_MACHINE": str(standin / "machine.txt"),
        "NVML_STANDIN_CONTROL": str(short_tmp / "control"), "DRA_NVML": "real", "NODE_NAME": NODE,
        # The host as the library sees it: which GPUs the NVIDIA driver drives, their nodes (a handle
        # holds one open), the driver's MIG capability files.
        "NVML_STANDIN_SYSFS": str(short_tmp / "host" / "sys"), "NVML_STANDIN_DEV": str(short_tmp / "host" / "dev"),
        "NVML_STANDIN_PROC": str(short_tmp / "host" / "proc"),
        "DRA_DRIVER_NAME": DRIVER,
        "DRA_SYSFS_ROOT": str(short_tmp / "host" / "sys"), "DRA_DEV_ROOT": str(short_tmp / "host" / "dev"),
        "DRA_STATE_DIR": str(short_tmp / "state"), "DRA_OFFLINE": str(short_tmp / "offline"),
        "DRA_KUBELET_DIR": str(short_tmp / "kubelet"), "DRA_CDI_DIR": str(short_tmp / "cdi"),
        "DRA_STATIC_CDI_DIR": str(short_tmp / "cdi-static"), "DRA_NIC_EXCLUDE": "*", "DRA_LOG_FORMAT": "json",
    }


def control(env: dict[str, str], *lines: str) -> None:
    Path(env["NVML_STANDIN_CONTROL"]).write_text("".join(f"{line}\n" for line in lines))


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, cwd=ROOT)


def gpus(env: dict[str, str], *args: str) -> tuple[dict[str, Any], list[str]]:
    """`dra-agent devices -o json`: the GPUs by name, and what it warns is not published."""
    proc = cli(env, "devices", "-o", "json", *args)
    assert proc.returncode == 0, proc.stderr
    found = {d.pop("name"): d for d in json.loads(proc.stdout) if d["kind"] == "gpu"}
    for name, d in found.items():
        assert d.pop("kind") == "gpu"
        # gpu-0 is in the stand-in host's sysfs (its driver and IOMMU group shown); the others are not.
        function = d.pop("pciFunction", None)
        assert function == ({"driver": "nvidia", "iommuGroup": 100} if name == "gpu-0" else None), (name, function)
    said = "WARNING agent.inventory: gpu not published: "
    return found, [line.removeprefix(said) for line in proc.stderr.splitlines() if line.startswith(said)]


def test_pynvml_reads_the_standin_like_the_driver_library(env: dict[str, str]) -> None:
    # The stand-in itself, through pynvml's ctypes layer: if it drifted from NVML's ABI, the
    # discovery tests below would test nothing.
    script = textwrap.dedent("""
        import json, pynvml as n
        out = {}
        try:
            n.nvmlDeviceGetCount()
        except n.NVMLError as e:
            out["before init"] = type(e).__name__
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(2)
        pci = n.nvmlDeviceGetPciInfo(h)
        out["pci"] = [pci.busId, pci.busIdLegacy, pci.domain, pci.bus, pci.device, pci.pciDeviceId,
                      pci.pciSubSystemId]
        m1, m2 = n.nvmlDeviceGetMemoryInfo(h), n.nvmlDeviceGetMemoryInfo(h, n.nvmlMemory_v2)
        out["memory"] = [m1.total, m1.free + m1.used, m2.total, m2.reserved + m2.free + m2.used]
        for bad in (0x01000028, 0x02000020):
            try:
                n.nvmlDeviceGetMemoryInfo(h, bad)
            except n.NVMLError as e:
                out.setdefault("memory v2 with a wrong version", []).append(type(e).__name__)
        out["strings"] = [n.nvmlDeviceGetName(h), n.nvmlDeviceGetUUID(h), n.nvmlSystemGetDriverVersion()]
        out["numbers"] = [n.nvmlDeviceGetMinorNumber(h), n.nvmlDeviceGetBrand(h), n.nvmlDeviceGetArchitecture(h),
                          list(n.nvmlDeviceGetCudaComputeCapability(h)), n.nvmlDeviceGetMigMode(h),
                          n.nvmlDeviceGetNumaNodeId(h), n.nvmlSystemGetCudaDriverVersion()]
        try:
            n.nvmlDeviceGetMinorNumber(n.c_nvmlDevice_t())
        except n.NVMLError as e:
            out["null handle"] = type(e).__name__
        try:
            n.nvmlDeviceGetHandleByIndex(3)
        except n.NVMLError as e:
            out["index 3"] = type(e).__name__
        out["error 1234"] = str(n.NVMLError(1234))
        n.nvmlShutdown()
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env, "LD_LIBRARY_PATH": str(STANDIN)}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "before init": "NVMLError_Uninitialized",
        "pci": ["00000000:AF:00.0", "0000:AF:00.0", 0, 0xAF, 0, 0x2FFF10DE, 0x20FF10DE],
        "memory": [193273528320] * 4,
        "memory v2 with a wrong version": ["NVMLError_ArgumentVersionMismatch"] * 2,
        "strings": ["NVIDIA Next-Gen GPU", NEXT_UUID, "570.124.06"],
        "numbers": [3, 42, 77, [12, 1], [0, 1], 1, 12080],
        "null handle": "NVMLError_InvalidArgument",
        "index 3": "NVMLError_InvalidArgument",
        "error 1234": "Unknown Error",  # asked of the library's nvmlErrorString
    }
    legacy = subprocess.run(
        [sys.executable, "-c", "import pynvml as n; n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)\n"
         "for f in (lambda: n.nvmlDeviceGetNumaNodeId(h), lambda: n.nvmlDeviceGetMemoryInfo(h, n.nvmlMemory_v2)):\n"
         "    try: f()\n    except n.NVMLError as e: print(type(e).__name__)"],
        capture_output=True, text=True, timeout=60, env={**os.environ, **env, "LD_LIBRARY_PATH": str(LEGACY)})
    assert legacy.stdout.split() == ["NVMLError_FunctionNotFound"] * 2, legacy.stderr


@pytest.mark.parametrize("mode", ["real", "auto"])
def test_discovery_publishes_exactly_what_the_library_says(env: dict[str, str], mode: str) -> None:
    found, problems = gpus(env, "--nvml", mode)
    assert found == EXPECTED
    assert problems == []


def test_slices_from_the_real_path_are_valid(env: dict[str, str]) -> None:
    proc = cli(env, "slices")
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    for d in docs:
        kubernetes_validate.validate(d, "1.37.0", strict=True)
    names = [dev["name"] for d in docs for dev in d["spec"].get("devices", [])]
    assert sorted(n for n in names if not n.endswith("-vfio") and "-mig-" not in n) == sorted(EXPECTED)
    # gpu-0's MIG placements, from the library's MIG profiles (the H100 80GB's: 25 placements, 13 of them of
    # the profiles --mig-profiles names by default).
    assert len([n for n in names if n.startswith("gpu-0-mig-")]) == 13
    # Each GPU has one counter set; the one in sysfs (with its IOMMU group) has a passthrough variant.
    assert [n for n in names if n.endswith("-vfio")] == ["gpu-0000-18-00-0-vfio"]
    assert sum(len(d["spec"].get("sharedCounters", [])) for d in docs) == len(EXPECTED)


def test_an_older_driver_library_lacks_functions_and_discovery_falls_back(env: dict[str, str],
                                                                         short_tmp: Path) -> None:
    # nvmlDeviceGetNumaNodeId is not in the library: pynvml answers FUNCTION_NOT_FOUND, and the GPU
    # is published without the attribute, like a GPU whose NVML says NOT_SUPPORTED.
    make_driver_root(short_tmp / "legacy-driver", LEGACY, "rhel")
    found, problems = gpus({**env, "DRA_DRIVER_ROOT": str(short_tmp / "legacy-driver")})
    expected = json.loads(json.dumps(EXPECTED))
    del expected["gpu-3"]["attributes"]["resource.kubernetes.io/numaNode"]
    assert found == expected
    assert problems == []


def test_faults_in_one_gpu_cost_that_gpu_only(env: dict[str, str]) -> None:
    control(env, "garble 2",  # its name is not UTF-8: pynvml raises UnicodeDecodeError, not an NVMLError
            "error 0 nvmlDeviceGetMemoryInfo 1234",  # a code pynvml has no name for
            "error 1 nvmlDeviceGetCudaComputeCapability 3")  # NOT_SUPPORTED: the attribute is omitted
    found, problems = gpus(env)
    expected = json.loads(json.dumps(EXPECTED["gpu-1"]))
    del expected["attributes"]["cudaComputeCapability"]
    assert found == {"gpu-1": expected}
    assert problems == [
        "gpu-0: nvmlDeviceGetMemoryInfo failed: Unknown Error (1234)",
        "gpu-3: unexpected UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in "
        "position 20: invalid start byte",
    ]


def test_a_gpu_lost_from_the_start_is_named_by_its_device(env: dict[str, str]) -> None:
    control(env, "lost 1")
    found, problems = gpus(env)
    assert sorted(found) == ["gpu-0", "gpu-3"]
    # It never said its minor: the driver's procfs list, less the minors of the GPUs that answered.
    assert problems == ["gpu-1: NVML index 1, 0000:3b:00.0: nvmlDeviceGetHandleByIndex failed: "
                        "GPU is lost (NVML_ERROR_GPU_IS_LOST)"]
    control(env, "lost 0", "lost 2")
    found, problems = gpus(env)
    assert sorted(found) == ["gpu-1"]
    why = "one of NVML indexes 0, 2: nvmlDeviceGetHandleByIndex failed: GPU is lost (NVML_ERROR_GPU_IS_LOST)"
    assert problems == [f"gpu-0: {why}", f"gpu-3: {why}"]
    # Without the driver's list there is no name to give it.
    (Path(env["DRA_SYSFS_ROOT"]).parent / "proc" / "driver" / "nvidia" / "gpus" / "0000:18:00.0" /
     "information").unlink()
    control(env, "lost 1")
    found, problems = gpus(env)
    assert sorted(found) == ["gpu-0", "gpu-3"]
    assert problems == ["GPU at NVML index 1: nvmlDeviceGetHandleByIndex failed: GPU is lost "
                        "(NVML_ERROR_GPU_IS_LOST)"]


def test_without_the_library(env: dict[str, str], short_tmp: Path) -> None:
    # A driver root with no driver in it (a wrong --driver-root, or a mount that is missing).
    empty = short_tmp / "no-driver"
    (empty / "etc").mkdir(parents=True)
    missing = {**env, "DRA_DRIVER_ROOT": str(empty)}
    tried = ", ".join(["/etc/ld.so.cache (No such file or directory)",
                       *(f"/{d}/libnvidia-ml.so.1" for d in library_dirs())])
    for command in ("devices", "slices"):
        proc = cli(missing, command)
        assert proc.returncode == 1, proc.stdout
        assert proc.stderr.splitlines() == [
            f"dra-agent: --nvml real: no libnvidia-ml.so.1 under the driver root {empty} (tried {tried}); set "
            "--driver-root to where the NVIDIA driver is installed (mounted)"], proc.stderr
    # auto on a node with NVIDIA hardware (the host tree has /dev/nvidiactl and NVIDIA display functions):
    # an error too, naming the hardware, the root and the paths tried.
    proc = cli({**missing, "DRA_NVML": "auto"}, "devices")
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "NVIDIA hardware is present" in proc.stderr and f"under the driver root {empty} (tried {tried})" \
        in proc.stderr and "Traceback" not in proc.stderr
    # auto on a node without: no GPUs, and a warning that says why; never simulated ones.
    bare = short_tmp / "bare"
    (bare / "sys").mkdir(parents=True)
    (bare / "dev").mkdir()
    proc = cli({**missing, "DRA_NVML": "auto", "DRA_SYSFS_ROOT": str(bare / "sys"), "DRA_DEV_ROOT": str(bare / "dev")},
               "devices", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    assert [d for d in json.loads(proc.stdout) if d["kind"] == "gpu"] == []
    assert f"WARNING agent.inventory.nvmlopen: no NVIDIA GPUs on this node (no libnvidia-ml.so.1 under the " \
        f"driver root {empty}" in proc.stderr
    assert not (Path(env["DRA_STATE_DIR"]) / "nvml-sim").exists()


def test_the_agent_s_own_root_is_searched_as_its_linker_would(env: dict[str, str]) -> None:
    # --driver-root / (the default: the agent on the host itself, or a container given the library by
    # the NVIDIA runtime): LD_LIBRARY_PATH, then the machine's ld.so.cache and directories.
    if probe() == "real":
        pytest.skip("the driver's NVML loads on this machine; this checks one where it does not")
    found, problems = gpus({**env, "DRA_DRIVER_ROOT": "/", "LD_LIBRARY_PATH": str(STANDIN)})
    assert found == EXPECTED and problems == []


# The agent as a process on the real path: prepare, and a GPU lost while it runs.

@pytest.fixture
def agent(env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    write_claim(Path(env["DRA_OFFLINE"]) / "resourceclaims", claim("gpu-one", UID, [result("gpu-0", "gpu")]))
    reg = Path(env["DRA_KUBELET_DIR"]) / "plugins_registry" / f"{DRIVER}-reg.sock"
    with agentkit.agent_process(["run", "--rescan-interval", "0.5"], env, reg, ROOT) as proc:
        yield proc


def spec_shape(spec: dict[str, Any]) -> dict[str, Any]:
    """A claim CDI spec without the values that differ between two machines (UUIDs, bus IDs, host
    paths): its kind, version, device names, device node paths and variable names."""
    devices = []
    for d in spec["devices"]:
        edits = d["containerEdits"]
        devices.append({
            "name": d["name"], "edits": sorted(edits),
            "env": sorted(e.split("=", 1)[0] for e in edits.get("env", [])),
            "deviceNodes": [{k: v for k, v in n.items() if k != "hostPath"} for n in edits.get("deviceNodes", [])],
        })
    return {"kind": spec["kind"], "cdiVersion": spec["cdiVersion"], "keys": sorted(spec), "devices": devices}


async def test_prepare_on_the_real_path_gives_the_simulation_s_spec_shape(
        agent: subprocess.Popen[str], env: dict[str, str], tmp_path: Path) -> None:
    proc = cli(env, "kubelet", "prepare", "default/gpu-one", "--uid", UID)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    real = orjson.loads((Path(env["DRA_CDI_DIR"]) / f"{DRIVER}-claim_{UID}.json").read_bytes())
    edits = real["devices"][0]["containerEdits"]
    assert f"DRA_GPU_0_UUID={H100_UUID}" in edits["env"] and "DRA_GPU_0_PCI_BUS_ID=0000:18:00.0" in edits["env"]
    assert {n["hostPath"] for n in edits["deviceNodes"]} == {
        str(Path(env["DRA_DEV_ROOT"]) / n) for n in ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")}

    node = await make_node(tmp_path)
    try:
        write_claim(node.claims_dir, claim("gpu-one", UID, [result("gpu-0", "gpu")]))
        [prepared] = (await node.engine.prepare([_ref(UID)])).values()
        assert prepared.error == ""
        sim = orjson.loads((node.settings.cdi_dir / f"{DRIVER}-claim_{UID}.json").read_bytes())
    finally:
        node.inventory.close()
    assert spec_shape(real) == spec_shape(sim)


def _ref(uid: str) -> Any:
    from agent.names import ClaimRef

    return ClaimRef("default", "gpu-one", uid)


def health(env: dict[str, str]) -> dict[str, tuple[str, str]]:
    proc = cli(env, "kubelet", "health", "--once", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    return {d["device"]["device_name"]: (d["health"], d.get("message", ""))
            for d in json.loads(proc.stdout)["devices"]}


def wait_health(env: dict[str, str], device: str, status: str) -> tuple[str, str]:
    deadline = time.monotonic() + 30
    while True:
        now = health(env)
        if now.get(device, ("", ""))[0] == status:
            return now[device]
        assert time.monotonic() < deadline, f"{device} never became {status}: {now}"
        time.sleep(0.2)


def published_taints(env: dict[str, str]) -> dict[str, dict[str, dict[str, Any]]]:
    """Published device -> its taints by key."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for path in (Path(env["DRA_OFFLINE"]) / "resourceslices").glob("*.yaml"):
        try:
            for dev in yaml.safe_load(path.read_text())["spec"].get("devices", []):
                out[dev["name"]] = {t["key"]: t for t in dev.get("taints") or []}
        except FileNotFoundError:
            continue
    return out


def published(env: dict[str, str]) -> set[str]:
    names = set()
    for path in (Path(env["DRA_OFFLINE"]) / "resourceslices").glob("*.yaml"):
        try:
            names |= {dev["name"] for dev in yaml.safe_load(path.read_text())["spec"].get("devices", [])}
        except FileNotFoundError:
            continue  # a stale slice deleted meanwhile
    return names


def test_a_gpu_lost_while_the_agent_runs_is_unhealthy_under_its_name(
        agent: subprocess.Popen[str], env: dict[str, str]) -> None:
    assert {name: h[0] for name, h in health(env).items() if re.fullmatch(r"gpu-\d+", name)} == {
        "gpu-0": "HEALTHY", "gpu-1": "HEALTHY", "gpu-3": "HEALTHY"}
    control(env, "lost 1")
    _, message = wait_health(env, "gpu-1", "UNHEALTHY")
    assert "GPU is lost (NVML_ERROR_GPU_IS_LOST)" in message
    # Still published as last seen, tainted NoExecute, so the pods using it are evicted (issue 8).
    deadline = time.monotonic() + 30
    while (taint := published_taints(env).get("gpu-1", {}).get(f"{DRIVER}/gpu-lost")) is None:
        assert time.monotonic() < deadline, f"gpu-1 is not published with a gpu-lost taint: {published(env)}"
        time.sleep(0.2)
    assert taint["effect"] == "NoExecute" and "gpu-1" in published(env)
    control(env)
    wait_health(env, "gpu-1", "HEALTHY")
    deadline = time.monotonic() + 30
    while published_taints(env).get("gpu-1"):
        assert time.monotonic() < deadline, "the gpu-lost taint of gpu-1 stays after it answers again"
        time.sleep(0.2)


# The library's facts the agent relies on: a handle holds the GPU open, a GPU on vfio-pci is not listed,
# MIG instances are made and destroyed, each MIG device with a UUID of its own.

def test_the_standin_holds_what_it_hands_out_and_lists_what_the_driver_drives(env: dict[str, str]) -> None:
    host = Path(env["DRA_SYSFS_ROOT"]).parent
    script = textwrap.dedent("""
        import json, os, sys, pynvml as n
        node = sys.argv[1]
        def held():
            return sum(os.readlink(f"/proc/self/fd/{fd}") == node for fd in os.listdir("/proc/self/fd")
                       if os.path.islink(f"/proc/self/fd/{fd}"))
        out = {}
        n.nvmlInit()
        out["initialized"] = held()
        h = n.nvmlDeviceGetHandleByIndex(0)
        out["a handle"] = held()
        s = n.nvmlEventSetCreate()
        n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, s)
        out["registered"] = held()
        n.nvmlEventSetFree(s)
        n.nvmlShutdown()
        out["shut down"] = held()
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(host / "dev" / "nvidia0")], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env, "LD_LIBRARY_PATH": str(STANDIN)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"initialized": 0, "a handle": 1, "registered": 2, "shut down": 0}
    # gpu-0 on vfio-pci: the next initialization lists the other two, one index down.
    tree = SimTree(host)
    tree.unbind("0000:18:00.0")
    tree.bind("0000:18:00.0", "vfio-pci")
    listing = textwrap.dedent("""
        import json, pynvml as n
        n.nvmlInit()
        minors = [n.nvmlDeviceGetMinorNumber(n.nvmlDeviceGetHandleByIndex(i)) for i in range(n.nvmlDeviceGetCount())]
        try:
            n.nvmlDeviceGetHandleByPciBusId("0000:18:00.0")
            gone = "found"
        except n.NVMLError as e:
            gone = type(e).__name__
        print(json.dumps([minors, gone]))
    """)
    proc = subprocess.run([sys.executable, "-c", listing], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env, "LD_LIBRARY_PATH": str(STANDIN)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [[1, 3], "NVMLError_NotFound"]


MIG_UID = "5a7e1d00-0000-4000-8000-000000000002"
MIG = "gpu-0-mig-1g10gb-3"


def test_mig_on_the_real_path_makes_a_new_mig_device_each_time(agent: subprocess.Popen[str],
                                                                env: dict[str, str]) -> None:
    need_root()  # the agent makes the /dev/nvidia-caps nodes (mknod)
    write_claim(Path(env["DRA_OFFLINE"]) / "resourceclaims", claim("mig", MIG_UID, [result(MIG, "gpu")]))
    host = Path(env["DRA_SYSFS_ROOT"]).parent
    caps = host / "proc" / "driver" / "nvidia" / "capabilities" / "gpu0" / "mig"
    uuids = []
    for _ in range(2):
        proc = cli(env, "kubelet", "prepare", "default/mig", "--uid", MIG_UID)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        spec = orjson.loads((Path(env["DRA_CDI_DIR"]) / f"{DRIVER}-claim_{MIG_UID}.json").read_bytes())
        edits = spec["devices"][0]["containerEdits"]
        (uuid,) = [e.split("=", 1)[1] for e in edits["env"] if e.startswith("DRA_GPU_0_MIG_1G10GB_3_UUID=")]
        assert re.fullmatch(r"MIG-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", uuid), uuid
        nodes = [n["hostPath"] for n in edits["deviceNodes"] if n["path"].startswith("/dev/nvidia-caps/")]
        assert len(nodes) == 2
        for node in nodes:  # made by the agent, with the nvidia-caps major of the host's /proc/devices
            assert os.major(os.stat(node).st_rdev) == 508
        # The driver's capability files of the GPU instance and its compute instance.
        assert len(list(caps.glob("gi*/**/access"))) == 2
        uuids.append(uuid)
        proc = cli(env, "kubelet", "unprepare", "default/mig", "--uid", MIG_UID)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert not list(caps.glob("gi*"))
    assert uuids[0] != uuids[1]  # made again at the same place: another MIG device


VFIO_UID = "5a7e1d00-0000-4000-8000-000000000003"


def test_passthrough_on_the_real_path_lets_go_of_the_library(agent: subprocess.Popen[str], env: dict[str, str]) -> None:
    # The agent holds gpu-0 open through the library (its handles); the simulated kernel's NVIDIA unbind
    # waits for every holder. The agent lets go of NVML around the bind (pynvml's nvmlShutdown, then
    # nvmlInit on the library it loaded from the driver root), and the next initialization no longer
    # lists gpu-0, which stays published.
    host = Path(env["DRA_SYSFS_ROOT"]).parent
    write_claim(Path(env["DRA_OFFLINE"]) / "resourceclaims",
                claim("vm", VFIO_UID, [result("gpu-0000-18-00-0-vfio", "vm")]))
    profile = parse_profile("standin", HOST_PROFILE)
    with KernelEmulator(profile, host):
        proc = cli(env, "kubelet", "prepare", "default/vm", "--uid", VFIO_UID)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert SimTree(host).driver_of("0000:18:00.0") == "vfio-pci"
        deadline = time.monotonic() + 30
        while (index := _published_index("gpu-3", env)) != 1:
            assert time.monotonic() < deadline, f"gpu-3 still at NVML index {index}"
            time.sleep(0.2)
        assert "gpu-0" in published(env) and not published_taints(env).get("gpu-0")
        proc = cli(env, "kubelet", "unprepare", "default/vm", "--uid", VFIO_UID)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert SimTree(host).driver_of("0000:18:00.0") == "nvidia"


def _published_index(device: str, env: dict[str, str]) -> int | None:
    for path in (Path(env["DRA_OFFLINE"]) / "resourceslices").glob("*.yaml"):
        try:
            for dev in yaml.safe_load(path.read_text())["spec"].get("devices", []):
                if dev["name"] == device:
                    return int(dev["attributes"]["index"]["int"])
        except (FileNotFoundError, TypeError):
            continue
    return None
