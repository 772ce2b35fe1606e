"""The NVIDIA driver reloaded on a node the agent runs on, as the GPU Operator's driver container does
(docs/health.md, "NVML lost"): through a real `dra-agent run` process on the simulated machine, whose
driver `dra-agent sim driver unload|load` takes away and brings back (its device nodes go, NVML stops
answering, and a session opened before the unload is over once the driver is back).

- Under the running agent: while NVML is gone every GPU and its forms stay published, tainted
  `nvml-lost` (NoSchedule), UNHEALTHY on the health stream, the claims holding them not Ready, and
  `dra_agent_nvml_up` 0; a claim prepared before unprepares, a new GPU claim is refused (its device
  node is gone: the kubelet retries it). Once the driver is back, without a restart, the taints go
  (an XID taint too: loading the driver reset the GPU), NVML events reach the agent again, the
  claims prepared before are as they were (records and CDI specs byte for byte) and unprepare
  cleanly, and the refused claim prepares.
- The documented way (the agent's pod evicted for the reload): an agent that starts while the driver
  is gone stops at once, touching nothing; the one started after the reload serves the claims
  prepared before it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from agentkit import DRIVER, NODE, agent_process, claim, result, roots, sim_cli, write_claim, written_files

from agent.config import Settings
from agent.kubelet import client as kc
from agent.names import ClaimRef

pytestmark = pytest.mark.filterwarnings("ignore:Callback with id:RuntimeWarning")

ROOT = Path(__file__).resolve().parents[1]
BEFORE = ClaimRef("default", "before", "7d1a0000-0000-4000-8000-0000000000b1")  # gpu-1: unprepared during
KEPT = ClaimRef("default", "kept", "7d1a0000-0000-4000-8000-0000000000b2")  # gpu-2: across the reload
DURING = ClaimRef("default", "during", "7d1a0000-0000-4000-8000-0000000000b3")  # gpu-4: asked for during
LOST = f"{DRIVER}/nvml-lost"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agent_args(s: Settings, port: int) -> list[str]:
    assert s.offline is not None
    return ["run", "--nvml", "sim", "--node-name", NODE, "--driver-name", s.driver_name, "--offline", str(s.offline),
            "--kubelet-dir", str(s.kubelet_dir), "--cdi-dir", str(s.cdi_dir), "--static-cdi-dir",
            str(s.static_cdi_dir), "--state-dir", str(s.state_dir), "--nic-exclude", "*",
            "--metrics-address", f"127.0.0.1:{port}", "--rescan-interval", "0.5", "--gpu-probe-interval", "0.2",
            "--gpu-sharing", "true"]



def driver(s: Settings, state: str) -> None:
    done = sim_cli(s, "sim", "driver", state)
    assert done.returncode == 0 and f"NVIDIA driver {state}ed" in done.stdout, done


def pool(s: Settings) -> dict[str, dict[str, Any]]:
    assert s.offline is not None
    devices: dict[str, dict[str, Any]] = {}
    for path in (s.offline / "resourceslices").glob("*.yaml"):
        try:
            devices |= {d["name"]: d for d in yaml.safe_load(path.read_text())["spec"].get("devices") or []}
        except (FileNotFoundError, TypeError):
            continue  # replaced meanwhile
    return devices


def gpu_forms(s: Settings) -> dict[str, dict[str, Any]]:
    """The GPUs and their forms, as published."""
    return {n: d for n, d in pool(s).items() if n.startswith("gpu-")}


def lost_taints(s: Settings) -> dict[str, str]:
    return {n: t["effect"] for n, d in gpu_forms(s).items() for t in d.get("taints") or [] if t["key"] == LOST}


def health(s: Settings) -> dict[str, dict[str, Any]]:
    done = sim_cli(s, "kubelet", "health", "--once", "-o", "json")
    assert done.returncode == 0, done.stderr
    return {d["device"]["device_name"]: d for d in json.loads(done.stdout)["devices"]}


def nvml_up(port: int) -> str | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return next((line.split()[1] for line in text.splitlines() if line.startswith("dra_agent_nvml_up ")), None)


def ready(s: Settings, ref: ClaimRef) -> dict[str, Any] | None:
    """The Ready condition the agent wrote for the claim (offline: a file)."""
    assert s.offline is not None
    try:
        obj = yaml.safe_load((s.offline / "resourceclaimstatus" / ref.namespace / f"{ref.name}.yaml").read_text())
    except FileNotFoundError:
        return None
    for entry in (obj.get("status") or {}).get("devices") or []:
        return next((c for c in entry.get("conditions") or [] if c["type"] == "Ready"), None)
    return None


def until(check: Callable[[], Any], what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"not so after {timeout}s: {what}"
        time.sleep(0.1)
    return value


def files_of(s: Settings, ref: ClaimRef) -> dict[str, bytes]:
    """The claim's record, CDI specs and metadata files."""
    return {k: v for k, v in written_files(s).items() if ref.uid in k}


async def prepare(s: Settings, ref: ClaimRef) -> str:
    async with kc.DRAClient(s.dra_socket) as client:
        return (await client.prepare([ref], timeout=60)).claims[ref.uid].error


async def unprepare(s: Settings, ref: ClaimRef) -> str:
    async with kc.DRAClient(s.dra_socket) as client:
        return (await client.unprepare([ref], timeout=60)).claims[ref.uid].error


def settings_with_claims(tmp: Path) -> Settings:
    s = roots(tmp)
    assert s.offline is not None
    for ref, device in ((BEFORE, "gpu-1"), (KEPT, "gpu-2"), (DURING, "gpu-4")):
        write_claim(s.offline / "resourceclaims", claim(ref.name, ref.uid, [result(device, "gpu")]))
    return s


async def test_the_driver_reloaded_under_the_agent_taints_the_gpus_and_they_come_back(short_tmp: Path) -> None:
    s = settings_with_claims(short_tmp)
    port = free_port()
    with agent_process(agent_args(s, port), {}, s.registration_socket, ROOT):
        until(lambda: "gpu-2" in pool(s), "the GPUs published")
        assert await prepare(s, BEFORE) == "" and await prepare(s, KEPT) == ""
        kept = files_of(s, KEPT)
        assert any(k.endswith(".rec") for k in kept) and any(k.endswith(".json") for k in kept)
        until(lambda: (r := ready(s, KEPT)) and r["status"] == "True", "the kept claim Ready")
        assert nvml_up(port) == "1.0" and not lost_taints(s)
        xid = sim_cli(s, "sim", "xid", "gpu-5", "48")  # gpu-5 needs a reset: the reload will be one
        assert xid.returncode == 0 and "applied" in xid.stdout, xid

        driver(s, "unload")
        # Every GPU and every form of one (passthrough, shared, MIG), still published as last seen, tainted
        # NoSchedule.
        names = set(gpu_forms(s))
        for form in ("-vfio", "-shared"):
            assert len([n for n in names if n.endswith(form)]) == 8, sorted(names)
        assert [n for n in names if "-mig-" in n]
        # (Every form published now: read again each time, since a scan may land between the unload and the taint.)
        until(lambda: set(lost_taints(s)) == set(gpu_forms(s)) >= names, "nvml-lost on every GPU and its forms")
        assert set(lost_taints(s).values()) == {"NoSchedule"}
        shown = until(lambda: (h := health(s)) and all(h[n]["health"] == "UNHEALTHY" for n in names) and h,
                      "every GPU UNHEALTHY on the health stream")
        assert "NVML lost since" in shown["gpu-2"]["message"] and "Driver Not Loaded" in shown["gpu-2"]["message"]
        assert nvml_up(port) == "0.0"
        not_ready = until(lambda: (r := ready(s, KEPT)) and r["status"] == "False" and r, "the kept claim not Ready")
        assert not_ready["reason"] == "NvmlLost"
        # What it holds records of it serves: a claim prepared before unprepares ...
        assert await unprepare(s, BEFORE) == ""
        assert files_of(s, BEFORE) == {}
        # ... and a new GPU claim is refused (the kubelet retries it) while the driver is away.
        assert "device node /dev/nvidia4 is missing" in await prepare(s, DURING)
        assert files_of(s, DURING) == {}
        assert files_of(s, KEPT) == kept

        driver(s, "load")
        until(lambda: not lost_taints(s), "the nvml-lost taints gone once NVML answers")
        until(lambda: not pool(s)["gpu-5"].get("taints"), "gpu-5's XID taint gone: the driver's load reset it")
        until(lambda: all(h["health"] == "HEALTHY" for n, h in health(s).items() if n in names),
              "the GPUs HEALTHY again")
        assert nvml_up(port) == "1.0"
        until(lambda: (r := ready(s, KEPT)) and r["status"] == "True", "the kept claim Ready again")
        # NVML's events reach the agent again (a new session, the GPUs registered afresh).
        done = sim_cli(s, "sim", "xid", "gpu-3", "48")
        assert done.returncode == 0, done.stderr
        until(lambda: any(t["key"] == f"{DRIVER}/xid" for t in pool(s)["gpu-3"].get("taints") or []),
              "an XID after the reload taints its GPU")
        # The claim prepared before the reload is as it was, and unprepares cleanly; the refused one prepares.
        assert files_of(s, KEPT) == kept
        assert await prepare(s, KEPT) == "" and files_of(s, KEPT) == kept  # the kubelet's retry: the record
        assert await unprepare(s, KEPT) == "" and files_of(s, KEPT) == {}
        assert await prepare(s, DURING) == ""


async def test_the_agent_stopped_for_the_reload_keeps_its_prepared_claims(short_tmp: Path) -> None:
    s = settings_with_claims(short_tmp)
    with agent_process(agent_args(s, free_port()), {}, s.registration_socket, ROOT):
        until(lambda: "gpu-2" in pool(s), "the GPUs published")
        assert await prepare(s, KEPT) == ""
    kept = files_of(s, KEPT)

    # The GPU Operator evicted the agent and reloads the driver. An agent started meanwhile stops at once,
    # saying why, and touches nothing: its pod restarts until the driver is back.
    driver(s, "unload")
    early = subprocess.run([sys.executable, "-m", "agent", *agent_args(s, free_port())], capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
    assert early.returncode == 1 and "Driver Not Loaded" in early.stderr, early
    assert files_of(s, KEPT) == kept

    driver(s, "load")
    with agent_process(agent_args(s, free_port()), {}, s.registration_socket, ROOT):
        until(lambda: "gpu-2" in pool(s) and not lost_taints(s), "the GPUs published, untainted")
        until(lambda: (r := ready(s, KEPT)) and r["status"] == "True", "the kept claim Ready")
        assert files_of(s, KEPT) == kept
        assert await prepare(s, KEPT) == "" and files_of(s, KEPT) == kept
        assert await unprepare(s, KEPT) == "" and files_of(s, KEPT) == {}
