"""Prepare refuses the node's uplink as the links and routes are when it prepares, not as the last scan
found them: the running agent (`dra-agent run` inside a network namespace the test makes, rescanning on
netlink link and address events only, `--rescan-interval 3600`) is called as the kubelet calls it.

The uplink here is `up0`, the port of bridge `br0`, which holds the node's address; the default route
comes after the agent's scan, in a routing table other than main, so the published `uplink` still says
false. A claim that moves `up0` into its pod, and one that passes the PCI function whose interface is
`up0` through (a simulated NIC function, `--nvml sim` with a profile naming its interface `up0`, bound to
vfio-pci by the simulated kernel), are both refused; a plain veth is moved all the same (the control).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agentkit import DRIVER, NODE, claim, result, write_claim
from conftest import need_command, need_root
from netns import REPO, network_namespace
from test_agent_netlink import RunningAgent, agent_in_namespace

from agent.host.vfio.pci import current_driver

FUNCTION = "0000:8b:00.0"  # the simulated NIC function whose interface is named up0
VARIANT = "nic-0000-8b-00-0-vfio"
UIDS = {name: f"5c0a1e00-0000-4000-8000-00000000000{i}" for i, name in enumerate(("move", "vm", "plain"), 1)}
ROUTE = "br0 carries the default route 0.0.0.0/0 (table 100), and up0 is a port of br0"


@pytest.fixture
def agent(short_tmp: Path) -> Iterator[RunningAgent]:
    need_root()
    need_command("ip")
    profile = short_tmp / "uplink-nic.json"
    profile.write_text(json.dumps({
        "gpus": [{"busId": "0000:18:00.0", "name": "NVIDIA H100 80GB HBM3", "memoryTotal": 85520809984}],
        "nics": [{"busId": FUNCTION, "interface": "up0", "numaNode": 0}]}))
    values: dict[str, Any] = {
        "driver_name": DRIVER, "node_name": NODE, "nvml": f"sim:{profile}", "nic_include": "up0,c0",
        "nic_passthrough": "up0", "kubelet_dir": short_tmp / "kubelet", "cdi_dir": short_tmp / "cdi",
        "static_cdi_dir": short_tmp / "cdi-static", "state_dir": short_tmp / "state",
        "dev_root": short_tmp / "dev", "offline": short_tmp / "offline", "rescan_interval": 3600,
        "netlink_debounce": 0.2, "log_format": "json", "metrics_address": "",
    }
    with network_namespace("dra-upl") as ns:
        ns.veth("up0", "wire0")
        ns.veth("c0", "c1")
        ns.ip("link", "add", "br0", "type", "bridge")
        ns.ip("link", "set", "up0", "master", "br0")
        ns.ip("link", "set", "br0", "up")
        ns.ip("addr", "add", "10.9.0.2/24", "dev", "br0")
        with agent_in_namespace(ns, values, short_tmp) as running:
            running.until(lambda: VARIANT in running.published() and len(running.nics()) == 2,
                          "up0, c0 and the function's passthrough variant published")
            yield running


def inside(agent: RunningAgent, *args: str) -> subprocess.CompletedProcess[str]:
    """`dra-agent ARGS` with the agent's settings, in the agent's network namespace."""
    return subprocess.run(["ip", "netns", "exec", agent.ns.name, sys.executable, "-m", "agent", *args, *agent.flags],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))


def prepare(agent: RunningAgent, name: str, device: str) -> str:
    """The kubelet's prepare of a claim for `device`: its error, "" when it was prepared."""
    assert agent.settings.offline is not None
    write_claim(agent.settings.offline / "resourceclaims", claim(name, UIDS[name], [result(device, "r")]))
    done = agent.cli("kubelet", "prepare", f"default/{name}")
    assert done.returncode in (0, 1), done.stdout + done.stderr
    return str(json.loads(done.stdout)["claims"][UIDS[name]].get("error", ""))


def claim_specs(agent: RunningAgent, name: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in agent.settings.cdi_dir.glob(f"*claim_{UIDS[name]}.json")]


def test_the_uplink_is_refused_as_the_links_are_at_prepare(agent: RunningAgent) -> None:
    names = {attrs["ifName"]: name for name, attrs in agent.nics().items()}
    assert agent.nics()[names["up0"]]["uplink"] is False  # no default route yet: the scan found none
    agent.ns.ip("route", "add", "default", "via", "10.9.0.1", "dev", "br0", "table", "100")

    # Before, the claim prepared from the scan's `uplink: false`: its CDI spec moved up0 into the pod
    # (netDevices: [{hostInterfaceName: up0}]), leaving br0 with no port.
    error = prepare(agent, "move", names["up0"])
    assert f"device {names['up0']} (up0) is this node's uplink: {ROUTE}. Moved into a pod it would cut the " \
           "node off, so it is never moved" in error
    assert claim_specs(agent, "move") == []
    # Before, the function was bound to vfio-pci, and its interface up0 gone from the host with it.
    error = prepare(agent, "vm", VARIANT)
    assert f"device {VARIANT} (up0) is this node's uplink: {ROUTE}. Passed through with PCI function " \
           f"{FUNCTION} it would cut the node off" in error
    assert current_driver(agent.settings.state_dir / "nvml-sim" / "sys", FUNCTION) == "mlx5_core"
    assert claim_specs(agent, "vm") == []

    # The control: a link that is nobody's way out moves as before.
    assert prepare(agent, "plain", names["c0"]) == ""
    (spec,) = claim_specs(agent, "plain")
    assert spec["devices"][0]["containerEdits"]["netDevices"] == [{"hostInterfaceName": "c0", "name": "c0"}]

    # `devices` and `doctor` say why (a scan of their own, now: the route is there).
    shown = json.loads(inside(agent, "devices", "-o", "json").stdout)
    assert {d["name"]: d.get("uplinkReason") for d in shown if d["kind"] == "nic"} == {
        names["up0"]: ROUTE, names["c0"]: None}
    assert f"ifName=up0, uplink: {ROUTE}" in inside(agent, "devices").stdout
    done = inside(agent, "doctor", "-o", "json")
    (check,) = [c for c in json.loads(done.stdout) if c["check"] == "NIC uplinks"]
    assert check["ok"] is True and f"up0: {ROUTE}" in check["detail"] and "c0" not in check["detail"], check
