"""The process's parts meet through narrow interfaces: the daemon needs no command module, and the
probes read the agent through frozen views (`agent.app.probes.Observed`) only."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from agentkit import Quickstart
from test_layout import graph

from agent.app import probes
from agent.app.probes import DevicesView, PublishedView, PublishView, SocketsView
from agent.health.conditions import DeviceConditions
from agent.health.policy import TaintPolicy

COMMANDS = {"agent.app.cli", "agent.app.taints", "agent.app.simctl", "agent.app.oneshot", "agent.app.vfiostatus",
            "agent.app.output", "agent.app.doctor"}


def reached(start: str) -> set[str]:
    edges = graph()
    seen: set[str] = set()
    todo = [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += edges.get(module, ())
    return seen


def test_the_daemon_imports_no_command_module() -> None:
    found = {m for m in reached("agent.app.daemon") if m in COMMANDS or m.startswith("agent.app.doctor.")}
    assert not found, found
    assert "agent.app.daemon" in reached("agent.app.process")  # the check is not vacuous: the walk follows imports


def test_the_probes_know_the_agent_by_its_views_only() -> None:
    agent_parts = ("agent.engine", "agent.health", "agent.publish", "agent.inventory", "agent.claims")
    direct = graph()["agent.app.probes"]
    assert not [m for m in direct if m.startswith(agent_parts)], direct


class Views:
    """An agent as the probes see it."""

    def __init__(self, sockets: SocketsView, publish: PublishView | None, devices: DevicesView) -> None:
        self.sockets, self.publish, self.devices = sockets, publish, devices

    def sockets_view(self) -> SocketsView:
        return self.sockets

    def publish_view(self) -> PublishView | None:
        return self.publish

    def devices_view(self) -> DevicesView:
        return self.devices


def test_readiness_and_metrics_state_from_the_views(tmp_path: Path) -> None:
    conditions = DeviceConditions("dra.example.com", TaintPolicy())
    conditions.xid("gpu-1", 48)
    conditions.xid("gpu-1", 79)  # two XIDs of one device: one taint
    conditions.gpu_lost("gpu-4", "nvml: GPU is lost")
    devices = DevicesView(health=(("gpu-1", "HEALTHY"), ("gpu-4", "UNHEALTHY"), ("nic-x", "HEALTHY")),
                          kinds={"gpu-1": "gpu", "nic-x": "nic"}, failing_sources=("gpu",),
                          taints=conditions.taint_counts(), prepared_claims=3, health_watchers=1)
    sockets = SocketsView(registration=tmp_path / "reg.sock", dra=tmp_path / "dra.sock", registry_dir=tmp_path,
                          registered=False, rejection="version mismatch")
    publish = PublishView(PublishedView(devices=9, slices=2, generation=4, dropped=1), up_to_date=False, failures=2,
                          last_error="the API server is away")
    view = Views(sockets, publish, devices)

    state = probes.metrics_state(view)
    assert state.taints == {("xid", "NoExecute"): 1, ("gpu-lost", "NoExecute"): 1}
    assert state.devices == {("gpu", "HEALTHY"): 1, ("gpu", "UNHEALTHY"): 1, ("nic", "HEALTHY"): 1}
    assert (state.prepared_claims, state.registered, state.published_devices, state.dropped_values) == (3, False, 9, 1)
    assert state.failing_sources == ["gpu"] and state.publish_failures == 2 and not state.publish_up_to_date


async def test_readyz_says_why_from_the_views(tmp_path: Path) -> None:
    devices = DevicesView(health=(), kinds={}, failing_sources=(), taints={}, prepared_claims=0, health_watchers=0)
    starting = Views(SocketsView(None, None, tmp_path), None, devices)
    assert [(c.name, c.ok, c.detail) for c in await probes.readyz(starting)] == [
        ("kubelet-registration", False, "starting: the sockets are not open yet"),
        ("slices", False, "not publishing yet (waiting for the Node)"),
        ("claim-records", True, "every claim record read is readable and the agent's own")]
    # Records set aside are named (the last three), and do not make the agent unready.
    aside = dataclasses.replace(devices, quarantined=tuple(f"/s/{i}.rec.corrupt" for i in range(4)))
    rejected = Views(SocketsView(tmp_path / "r", tmp_path / "d", tmp_path, registered=False, rejection="no"),
                     PublishView(PublishedView(9, 2, 4, 0), up_to_date=True, failures=0, last_error=""), aside)
    checks = await probes.readyz(rejected)
    assert [(c.name, c.ok) for c in checks] == [("kubelet-registration", False), ("slices", True),
                                                 ("claim-records", True)]
    assert checks[0].detail == "the kubelet rejected the plugin: no"
    assert checks[1].detail == "9 devices in 2 slices, generation 4"
    assert checks[2].detail.startswith("4 claim records set aside since the start, unreadable or saying what this "
                                       "agent never writes")
    assert checks[2].detail.endswith(": /s/1.rec.corrupt, /s/2.rec.corrupt, /s/3.rec.corrupt ...")


API_CLIENT = ("lightkube", "httpx2")  # the API client and its HTTP transport


def test_offline_the_running_agent_never_loads_the_api_client(short_tmp: Path) -> None:
    # Offline there is no API server to talk to: the client's modules (tens of MiB of RSS with their
    # dependencies, and start-up time) stay unloaded. The running daemon's own imports, as the
    # interpreter reports each one (PYTHONPROFILEIMPORTTIME), after it has started, scanned, served a
    # prepare and an unprepare, and stopped.
    quick = Quickstart.seeded(short_tmp, "node-offline")
    log = short_tmp / "agent.log"
    with quick.agent(log=log, env={"PYTHONPROFILEIMPORTTIME": "1"}):
        for action in ("prepare", "unprepare"):
            done = quick.cli("kubelet", action, "default/gpu-one")
            assert done.returncode == 0 and '"error"' not in done.stdout, (done.stdout, done.stderr)
    text = log.read_text()
    # (A report line may be cut by a log line written at the same time: each is looked for on its own.)
    assert re.search(r"^import time:.*\|\s+agent\.kubelet\.server$", text, re.M)  # the running agent's report
    assert not re.findall(rf"^import time:.*\|\s+((?:{'|'.join(API_CLIENT)})[.\w]*)$", text, re.M)
