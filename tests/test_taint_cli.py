"""`dra-agent taints` as an operator runs it: the listing (table and JSON) read from the state
directory, and `taints clear DEVICE` through the request channel to the agent's real request
watcher (inotify), saying exactly what was cleared."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from agentkit import DRIVER, roots

from agent.app import simctl
from agent.app.daemon import Agent
from agent.config import Settings
from agent.health.conditions import DeviceConditions, read_saved
from agent.health.policy import TaintPolicy
from agent.health.requests import RequestWatcher, health_dir, requests_dir, submit_clear

ROOT = Path(__file__).resolve().parent.parent


def env_of(settings: Settings) -> dict[str, str]:
    return {**os.environ, "DRA_STATE_DIR": str(settings.state_dir), "DRA_DRIVER_NAME": DRIVER,
            "NODE_NAME": "node-taints", "DRA_NVML": "sim"}


async def taints_cli(settings: Settings, *args: str) -> tuple[int, str, str]:
    """`dra-agent taints ARGS` in a second process (the event loop keeps serving the watcher)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "agent", "taints", *args, cwd=ROOT,
                                                env=env_of(settings), stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def held(settings: Settings) -> DeviceConditions:
    """Conditions saved where the CLI reads them, as a running agent holds them."""
    c = DeviceConditions(DRIVER, TaintPolicy(), health_dir(settings))
    c.xid("gpu-1", 48)
    c.gpu_lost("gpu-4", "nvml: GPU is lost")
    return c


async def test_the_table_and_json_list_every_taint_with_its_cause(tmp_path: Path) -> None:
    settings = roots(tmp_path)
    rc, out, err = await taints_cli(settings)
    assert rc == 0 and out.split() == ["DEVICE", "KEY", "VALUE", "EFFECT", "CAUSE", "AGE"]
    assert "no agent has saved device conditions" in err

    held(settings)
    rc, out, err = await taints_cli(settings, "-o", "table")
    assert rc == 0 and err == ""
    header, *rows = out.splitlines()
    assert header.split() == ["DEVICE", "KEY", "VALUE", "EFFECT", "CAUSE", "AGE"]
    assert [r.split()[:4] for r in rows] == [["gpu-1", f"{DRIVER}/xid", "48", "NoSchedule"],
                                              ["gpu-4", f"{DRIVER}/gpu-lost", "NoExecute", "GPU"]]
    assert "XID 48 (double-bit ECC error)" in rows[0] and "GPU lost: nvml: GPU is lost" in rows[1]
    # The columns line up: each row's cause starts where the header's CAUSE does.
    assert all(r[header.index("CAUSE"):].startswith(("XID 48", "GPU lost")) for r in rows)

    rc, out, _ = await taints_cli(settings, "-o", "json")
    listed = json.loads(out)
    assert [(r["device"], r["key"], r["value"], r["effect"]) for r in listed] == [
        ("gpu-1", f"{DRIVER}/xid", "48", "NoSchedule"), ("gpu-4", f"{DRIVER}/gpu-lost", "", "NoExecute")]
    assert listed[0]["cause"] == "XID 48 (double-bit ECC error)" and listed[0]["age"].endswith("s")


async def test_clear_says_what_it_cleared_and_when_there_was_nothing(tmp_path: Path) -> None:
    settings = roots(tmp_path)
    conditions = held(settings)
    watcher = RequestWatcher(requests_dir(settings), conditions)
    await watcher.start()
    try:
        rc, out, _ = await taints_cli(settings, "clear", "gpu-1")
        assert rc == 0 and out.strip() == "cleared the XID taints of gpu-1: XID 48 (double-bit ECC error)"
        assert conditions.taints("gpu-1") == []

        rc, out, _ = await taints_cli(settings, "clear", "gpu-1")  # again: nothing left
        assert rc == 0 and out.strip() == "gpu-1 had no XID taint: nothing cleared"

        # A lost GPU's taint is no XID taint: it stays, and the answer says so.
        rc, out, _ = await taints_cli(settings, "clear", "gpu-4")
        assert rc == 0 and out.strip() == ("gpu-4 had no XID taint: nothing cleared; still tainted by: "
                                           "GPU lost: nvml: GPU is lost")
        assert [t.key for t in conditions.taints("gpu-4")] == [f"{DRIVER}/gpu-lost"]
        assert list(requests_dir(settings).iterdir()) == []  # requests and results all gone

        rc, _, err = await taints_cli(settings, "clear", "../gpu-1")
        assert rc == 2 and "dra-agent:" in err
    finally:
        await watcher.stop()


async def agent_cli(settings: Settings, *args: str) -> tuple[int, str, str]:
    """`dra-agent ARGS` in a second process."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "agent", *args, cwd=ROOT, env=env_of(settings),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def until(check: Callable[[], object], what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {limit:g} s"
        await asyncio.sleep(0.05)


async def test_clear_refuses_a_device_this_node_does_not_have(tmp_path: Path) -> None:
    settings = roots(tmp_path)
    held(settings)
    rc, out, err = await taints_cli(settings, "clear", "gpu-99")
    assert rc == 3 and out == "" and "no device gpu-99 on this node" in err, err  # 3: not found
    assert not list(requests_dir(settings).glob("*.json"))  # nothing queued for an agent
    # One the saved conditions name is known even when discovery would not find it (a lost GPU).
    rc, out, _ = await taints_cli(settings, "clear", "gpu-4")
    assert rc == 0 and "queued" in out


async def test_commands_queued_while_no_agent_ran_apply_in_the_order_written(short_tmp: Path, agents) -> None:
    """An XID for the simulated machine and a clear, both written while no agent runs: the clear written
    after the XID clears it, the one written before it does not."""
    settings = roots(short_tmp, rescan_interval=3600.0)
    simctl.submit(settings, simctl.make_command(settings, "xid", "gpu-1", 48))
    submit_clear(settings, "gpu-1")
    submit_clear(settings, "gpu-2")
    simctl.submit(settings, simctl.make_command(settings, "xid", "gpu-2", 48))
    agent = Agent(settings)
    agents.append(agent)
    await agent.start()
    conditions = agent.health.conditions
    # The machine applies its commands in the order written, so gpu-1's XID came before gpu-2's.
    await until(lambda: not list(simctl.control_dir(settings).glob("*.json"))
                and not list(requests_dir(settings).glob("*.json")) and conditions.taints("gpu-2"),
                "both commands and both requests applied")
    assert conditions.taints("gpu-1") == []
    assert [t.value for t in conditions.taints("gpu-2")] == ["48"]


async def test_sim_says_applied_once_the_taints_follow(short_tmp: Path, agents) -> None:
    """`sim xid` and `sim recover` answer "applied" when `taints` shows what they did, not before (the
    agent sees a GPU answer again at its next probe)."""
    settings = roots(short_tmp, rescan_interval=3600.0, gpu_probe_interval=2.0)
    agent = Agent(settings)
    agents.append(agent)
    await agent.start()
    rc, out, _ = await agent_cli(settings, "sim", "xid", "gpu-3", "48", "--wait", "20")
    assert rc == 0 and "applied" in out, out
    assert [c.value for c in read_saved(health_dir(settings))[0] if c.device == "gpu-3"] == ["48"]
    rc, out, _ = await agent_cli(settings, "sim", "recover", "gpu-3", "--wait", "20")
    assert rc == 0 and "applied" in out, out
    assert [c for c in read_saved(health_dir(settings))[0] if c.device == "gpu-3"] == []
    rc, out, _ = await agent_cli(settings, "sim", "lose", "gpu-5", "--wait", "20")
    assert rc == 0 and "applied" in out, out
    assert [c.kind for c in read_saved(health_dir(settings))[0] if c.device == "gpu-5"] == ["gpu-lost"]
