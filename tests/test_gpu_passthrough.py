"""A GPU passed through to a VM, through a running agent on the simulated machine, whose NVML models the
real library's facts (agent/sim/nvmlview.py): a handle holds its GPU open, and a GPU bound to vfio-pci is
not listed by the next `nvmlInit` (the GPUs after it move down an index). The agent lets go of its own
NVML for the bind (else the simulated driver's unbind waits for it for ever: the prepare fails), and:

- the GPU is not lost: no `gpu-lost` taint on it or its passthrough form, health HEALTHY, the claim's
  device Ready; the GPUs NVML still lists are named right at their new indexes (an XID on one lands on it);
- it stays published as NVML last described it, with the same counter set, and so after the agent restarts
  while it is on vfio-pci (the agent's memory of it, `<state>/gpus.json`);
- given back at unprepare, NVML lists it again."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from agentkit import NODE, agent_process, claim, result, roots, sim_cli, write_claim

from agent.config import Settings
from agent.kubelet import client as kc
from agent.names import ClaimRef
from agent.sim.kernel.tree import SimTree

pytestmark = pytest.mark.filterwarnings("ignore:Callback with id:RuntimeWarning")

ROOT = Path(__file__).resolve().parents[1]
UID = "5d3f0a00-0000-4000-8000-0000000000a1"
GPU, GPU_BUS, VARIANT = "gpu-1", "0000:2a:00.0", "gpu-0000-2a-00-0-vfio"
COUNTER_SET = "gpu-0000-2a-00-0-counters"


def agent_args(s: Settings) -> list[str]:
    assert s.offline is not None
    return ["run", "--nvml", "sim", "--node-name", NODE, "--driver-name", s.driver_name, "--offline", str(s.offline),
            "--kubelet-dir", str(s.kubelet_dir), "--cdi-dir", str(s.cdi_dir), "--static-cdi-dir",
            str(s.static_cdi_dir), "--state-dir", str(s.state_dir), "--nic-exclude", "*", "--metrics-address", "",
            "--rescan-interval", "0.5", "--gpu-probe-interval", "0.2"]



def pool(s: Settings) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The published devices and counter sets, by name."""
    assert s.offline is not None
    devices: dict[str, dict[str, Any]] = {}
    sets: dict[str, dict[str, Any]] = {}
    for path in (s.offline / "resourceslices").glob("*.yaml"):
        try:
            spec = yaml.safe_load(path.read_text())["spec"]
        except (FileNotFoundError, TypeError):
            continue  # replaced meanwhile
        devices |= {d["name"]: d for d in spec.get("devices") or []}
        sets |= {c["name"]: c for c in spec.get("sharedCounters") or []}
    return devices, sets


def until(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not so after {timeout}s: {what}"
        time.sleep(0.1)


def index_of(s: Settings, device: str) -> int | None:
    dev = pool(s)[0].get(device)
    return None if dev is None else int(dev["attributes"]["index"]["int"])


def taints(s: Settings) -> dict[str, list[str]]:
    return {name: [t["key"] for t in d.get("taints") or []] for name, d in pool(s)[0].items() if d.get("taints")}


def ready(s: Settings) -> str | None:
    assert s.offline is not None
    try:
        obj = yaml.safe_load((s.offline / "resourceclaimstatus" / "default" / "vm.yaml").read_text())
    except FileNotFoundError:
        return None
    for entry in (obj.get("status") or {}).get("devices") or []:
        if entry["device"] == VARIANT:
            return next((str(c["status"]) for c in entry.get("conditions") or [] if c["type"] == "Ready"), None)
    return None


def health(s: Settings) -> dict[str, str]:
    done = sim_cli(s, "kubelet", "health", "--once", "-o", "json")
    assert done.returncode == 0, done.stderr
    return {d["device"]["device_name"]: d["health"] for d in json.loads(done.stdout)["devices"]}


def without_index(dev: dict[str, Any]) -> dict[str, Any]:
    return {**dev, "attributes": {k: v for k, v in dev["attributes"].items() if k != "index"}}


async def test_a_gpu_on_vfio_pci_stays_published_healthy_and_ready_and_comes_back(short_tmp: Path) -> None:
    s = roots(short_tmp)
    assert s.offline is not None
    write_claim(s.offline / "resourceclaims", claim("vm", UID, [result(VARIANT, "gpu")]))
    ref = ClaimRef("default", "vm", UID)
    tree = SimTree(s.state_dir / "nvml-sim")
    with agent_process(agent_args(s), {}, s.registration_socket, ROOT):
        until(lambda: index_of(s, "gpu-2") == 2, "gpu-2 published at NVML index 2")
        devices, sets = pool(s)
        gpu, counter_set = devices[GPU], sets[COUNTER_SET]
        async with kc.DRAClient(s.dra_socket) as client:
            entry = (await client.prepare([ref], timeout=60)).claims[UID]
        assert entry.error == "" and tree.driver_of(GPU_BUS) == "vfio-pci"
        # NVML lists seven GPUs now: those after gpu-1 moved down an index, and are published so.
        until(lambda: index_of(s, "gpu-2") == 1, "gpu-2 at NVML index 1 once gpu-1 left NVML")
        # The event watcher, started afresh, names them right: an XID at NVML index 1 is gpu-2's.
        done = sim_cli(s, "sim", "xid", "gpu-2", "13")
        assert done.returncode == 0, done.stderr
        until(lambda: bool(taints(s).get("gpu-2")), "gpu-2 tainted by its XID")
        # Nothing lost: no gpu-lost taint anywhere, gpu-1 and its forms untainted; gpu-2's forms carry its XID.
        tainted = taints(s)
        assert not [k for keys in tainted.values() for k in keys if k.endswith("/gpu-lost")], tainted
        assert not [n for n in tainted if n == GPU or n.startswith(("gpu-1-", "gpu-0000-2a-"))], tainted
        devices, sets = pool(s)
        assert without_index(devices[GPU]) == without_index(gpu) and sets[COUNTER_SET] == counter_set
        assert VARIANT in devices
        until(lambda: ready(s) == "True", "the claim's device Ready")
        shown = health(s)
        assert shown[GPU] == shown[VARIANT] == "HEALTHY"

    # Restarted while the GPU is on vfio-pci: NVML never describes it, the agent's memory of it does.
    with agent_process(agent_args(s), {}, s.registration_socket, ROOT):
        until(lambda: GPU in pool(s)[0] and index_of(s, "gpu-2") == 1, "gpu-1 published by the new agent")
        devices, sets = pool(s)
        assert without_index(devices[GPU]) == without_index(gpu) and sets[COUNTER_SET] == counter_set
        assert not [n for n, keys in taints(s).items() if any(k.endswith("/gpu-lost") for k in keys)]
        shown = health(s)
        assert shown[GPU] == shown[VARIANT] == "HEALTHY"
        async with kc.DRAClient(s.dra_socket) as client:
            assert (await client.unprepare([ref], timeout=60)).claims[UID].error == ""
        assert tree.driver_of(GPU_BUS) == "nvidia"
        # Given back: NVML lists it again, at its index.
        until(lambda: index_of(s, "gpu-2") == 2 and index_of(s, GPU) == 1, "gpu-1 back in NVML")
        devices, sets = pool(s)
        assert devices[GPU] == gpu and sets[COUNTER_SET] == counter_set
