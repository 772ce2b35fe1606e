"""The running agent (`dra-agent run`, a process inside a network namespace) follows netlink.

The agent publishes offline with `--rescan-interval 3600`, so within a test only a
netlink event can explain a republish. Every change is made with `ip` in the
namespace, and the test polls the files the agent writes: the offline slices, and
the metadata file of a prepared NIC claim.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from agentkit import DRIVER, NODE, claim, result, write_claim
from conftest import need_command, need_root
from netns import REPO, NetNS, network_namespace

from agent.claims import metadata
from agent.claims import records as state
from agent.claims.store import ClaimStore
from agent.config import OPTIONS, Settings, build_settings
from agent.inventory.nics import mac_device_name

MAC_A0, MAC_A1 = "02:00:00:00:a0:00", "02:00:00:00:a1:00"
DEV_A0, DEV_A1 = mac_device_name(MAC_A0), mac_device_name(MAC_A1)
NIC_CLAIM_UID = "6e2f0a00-0000-4000-8000-000000000001"
WAIT = 30.0  # a bound for the agent to catch up, never an expected duration
LINK_UP_HOLD = 2.0  # the taint policy's hold time in these tests
READY_LINE = "watching netlink link and address events"

T = TypeVar("T")


@dataclass
class RunningAgent:
    ns: NetNS
    settings: Settings
    flags: list[str]
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def published(self) -> dict[str, dict[str, Any]]:
        """The published devices, by name, as in the slices."""
        assert self.settings.offline is not None
        out: dict[str, dict[str, Any]] = {}
        for path in sorted((self.settings.offline / "resourceslices").glob("*.yaml")):
            try:
                obj = yaml.safe_load(path.read_text())
            except FileNotFoundError:
                continue  # replaced or deleted while we looked: the next poll sees the new set
            for dev in obj["spec"].get("devices") or []:
                out[dev["name"]] = dev
        return out

    def nics(self) -> dict[str, dict[str, Any]]:
        """The published NIC devices, by name, with plain attribute values."""
        out: dict[str, dict[str, Any]] = {}
        for name, dev in self.published().items():
            attrs = {k: next(iter(v.values())) for k, v in (dev.get("attributes") or {}).items()}
            if attrs.get("type") == "nic":
                out[name] = attrs
        return out

    def taints(self, device: str) -> dict[str, dict[str, Any]]:
        """The device's published taints, by key."""
        return {t["key"]: t for t in self.published().get(device, {}).get("taints") or []}

    def health(self) -> dict[str, dict[str, Any]]:
        """The health stream's first answer, by device name."""
        done = self.cli("kubelet", "health", "--once", "-o", "json")
        assert done.returncode == 0, done.stdout + done.stderr
        return {d["device"]["device_name"]: d for d in json.loads(done.stdout)["devices"]}

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`dra-agent ARGS` with the agent's own settings, from outside the namespace."""
        return subprocess.run([sys.executable, "-m", "agent", *args, *self.flags], capture_output=True,
                              text=True, timeout=120, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))

    def until(self, probe: Callable[[], T | None], what: str, limit: float = WAIT) -> T:
        """Poll `probe` until it returns something truthy; fail with the agent's log if it never does."""
        deadline = time.monotonic() + limit
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"the agent exited ({self.proc.returncode}) waiting for {what}:\n{self.log()}")
            value = probe()
            if value:
                return value
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: not within {limit:g} s; published NICs {self.nics()}\n"
                            f"agent log:\n{self.log()[-6000:]}")
            time.sleep(0.05)


def flags_of(values: dict[str, Any]) -> list[str]:
    by_dest = {opt.dest: opt.flag for opt in OPTIONS}
    return [part for dest, value in values.items() for part in (by_dest[dest], str(value))]


@contextlib.contextmanager
def agent_in_namespace(ns: NetNS, values: dict[str, Any], short_tmp: Path) -> Iterator[RunningAgent]:
    """`dra-agent run` with these settings inside `ns`, once it watches netlink; stopped on the way out."""
    flags = flags_of(values)
    log_path = short_tmp / "agent.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(["ip", "netns", "exec", ns.name, sys.executable, "-m", "agent", "run", *flags],
                                stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO,
                                env=dict(os.environ, PYTHONPATH=str(REPO)))
    running = RunningAgent(ns, build_settings(values), flags, proc, log_path)
    try:
        # Changes made before the watcher is subscribed would be seen by a scan, not by an event.
        running.until(lambda: READY_LINE in running.log(), "the agent watching netlink")
        yield running
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture
def ns() -> Iterator[NetNS]:
    """A namespace with one veth pair the agent publishes and one it is not asked to."""
    need_root()
    need_command("ip")
    with network_namespace("dra-agt") as made:
        made.veth("vethA0", "vethA1")
        made.ip("link", "set", "vethA0", "address", MAC_A0)
        made.ip("link", "set", "vethA1", "address", MAC_A1)
        made.veth("other0", "other1")
        yield made


@pytest.fixture
def agent(ns: NetNS, short_tmp: Path) -> Iterator[RunningAgent]:
    policy = short_tmp / "taint-policy.yaml"
    policy.write_text(f"linkDown: {{effect: NoSchedule, upHold: {LINK_UP_HOLD}}}\n")
    values: dict[str, Any] = {
        "driver_name": DRIVER, "node_name": NODE, "nvml": "sim", "nic_include": "veth*",
        "kubelet_dir": short_tmp / "kubelet", "cdi_dir": short_tmp / "cdi",
        "static_cdi_dir": short_tmp / "cdi-static", "state_dir": short_tmp / "state",
        "dev_root": short_tmp / "dev", "offline": short_tmp / "offline",
        "rescan_interval": 3600, "netlink_debounce": 0.2, "log_format": "json", "taint_policy": policy,
    }
    with agent_in_namespace(ns, values, short_tmp) as running:
        running.until(lambda: {DEV_A0, DEV_A1} <= set(running.nics()), "the veth pair published")
        yield running


# -- slices follow the links -----------------------------------------------------------------------

def test_veth_devices_are_published_from_the_start(agent: RunningAgent) -> None:
    nics = agent.nics()
    assert set(nics) == {DEV_A0, DEV_A1}  # other0/other1 are software links nobody asked for
    a0 = nics[DEV_A0]
    assert a0["ifName"] == "vethA0" and a0["macAddress"] == MAC_A0 and a0["linkUp"] is True
    assert a0["isVf"] is False and "ipv4" not in a0
    assert nics[DEV_A1]["ifName"] == "vethA1"


def test_addresses_added_and_removed_are_republished(agent: RunningAgent) -> None:
    agent.ns.ip("addr", "add", "10.20.0.1/24", "dev", "vethA0")
    agent.ns.ip("addr", "add", "fd00:20::1/64", "dev", "vethA0", "nodad")
    a0 = agent.until(lambda: (n := agent.nics().get(DEV_A0)) and "ipv6" in n and "ipv4" in n and n,
                     "the addresses of vethA0 published")
    assert a0["ipv4"] == "10.20.0.1/24" and a0["ipv6"] == "fd00:20::1/64"
    assert "ipv4" not in agent.nics()[DEV_A1]

    agent.ns.ip("addr", "del", "10.20.0.1/24", "dev", "vethA0")
    a0 = agent.until(lambda: (n := agent.nics().get(DEV_A0)) and "ipv4" not in n and n,
                     "the IPv4 address of vethA0 withdrawn")
    assert a0["ipv6"] == "fd00:20::1/64"


def test_a_link_set_down_is_republished(agent: RunningAgent) -> None:
    agent.ns.ip("link", "set", "vethA0", "down")
    agent.until(lambda: agent.nics().get(DEV_A0, {}).get("linkUp") is False, "vethA0 published as down")
    # The peer lost its carrier with it.
    agent.until(lambda: agent.nics().get(DEV_A1, {}).get("linkUp") is False, "vethA1 published as down")

    agent.ns.ip("link", "set", "vethA0", "up")
    agent.until(lambda: all(n["linkUp"] is True for n in agent.nics().values()), "the pair up again")


def test_a_link_down_taints_the_nic_until_it_has_stayed_up(agent: RunningAgent) -> None:
    key = f"{DRIVER}/link-down"
    assert agent.taints(DEV_A0) == {} and agent.health()[DEV_A0]["health"] == "HEALTHY"
    agent.ns.ip("link", "set", "vethA0", "down")
    taint = agent.until(lambda: agent.taints(DEV_A0).get(key), "the link-down taint published")
    assert taint["effect"] == "NoSchedule" and taint["timeAdded"].endswith("Z") and "value" not in taint
    agent.until(lambda: agent.taints(DEV_A1).get(key), "the peer, without carrier, tainted too")
    health = agent.until(lambda: (h := agent.health()[DEV_A0]) and h["health"] == "UNHEALTHY" and h,
                         "UNHEALTHY on the health stream")
    assert health["message"].startswith("link down since ")
    listed = agent.cli("taints", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    rows = {(r["device"], r["key"]): r for r in json.loads(listed.stdout)}
    assert rows[(DEV_A0, key)]["effect"] == "NoSchedule"
    assert rows[(DEV_A0, key)]["cause"] == health["message"]

    agent.ns.ip("link", "set", "vethA0", "up")
    agent.until(lambda: not agent.taints(DEV_A0) and not agent.taints(DEV_A1), "both taints gone")
    agent.until(lambda: agent.health()[DEV_A0]["health"] == "HEALTHY", "HEALTHY again")
    # The taint went only once the link had been up for the hold time, by the agent's own clock.
    events = [json.loads(line) for line in agent.log().splitlines() if line.startswith("{")]
    up = next(e for e in events if e["msg"].startswith(f"{DEV_A0}: link up again"))
    cleared = next(e for e in events if e["msg"].startswith(f"{DEV_A0}: link up for"))
    assert _seconds(cleared) - _seconds(up) >= LINK_UP_HOLD - 0.01


def status_entry(agent: RunningAgent, name: str, device: str = DEV_A0) -> dict[str, Any] | None:
    """This driver's `status.devices` entry for `device` in the claim's offline status file."""
    assert agent.settings.offline is not None
    path = agent.settings.offline / "resourceclaimstatus" / "default" / f"{name}.yaml"
    try:
        obj = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        return None
    for entry in (obj.get("status") or {}).get("devices") or []:
        if entry["driver"] == DRIVER and entry["device"] == device:
            return entry  # type: ignore[no-any-return]
    return None


def ready_of(entry: dict[str, Any] | None) -> dict[str, Any] | None:
    return next((c for c in (entry or {}).get("conditions") or [] if c["type"] == "Ready"), None)


def test_a_link_down_makes_a_prepared_claims_device_not_ready(agent: RunningAgent) -> None:
    s = agent.settings
    assert s.offline is not None
    write_claim(s.offline / "resourceclaims", claim("nic-claim", NIC_CLAIM_UID, [result(DEV_A0, "nic")]))
    done = agent.cli("kubelet", "prepare", "default/nic-claim")
    assert done.returncode == 0, done.stdout + done.stderr
    ready = agent.until(lambda: ready_of(status_entry(agent, "nic-claim")), "the claim's Ready condition")
    assert (ready["status"], ready["reason"]) == ("True", "Prepared")

    agent.ns.ip("link", "set", "vethA0", "down")
    ready = agent.until(lambda: (r := ready_of(status_entry(agent, "nic-claim"))) and r["status"] == "False" and r,
                        "Ready False while the link is down")
    assert ready["reason"] == "LinkDown" and ready["message"].startswith("link down since ")
    agent.ns.ip("link", "set", "vethA0", "up")
    agent.until(lambda: (r := ready_of(status_entry(agent, "nic-claim"))) and r["status"] == "True",
                "Ready True once the link has stayed up")
    # The slices follow from the same change (published by another task than the status).
    agent.until(lambda: not agent.taints(DEV_A0), "the link-down taint gone")

    done = agent.cli("kubelet", "unprepare", "default/nic-claim", "--uid", NIC_CLAIM_UID)
    assert done.returncode == 0, done.stdout + done.stderr
    agent.until(lambda: status_entry(agent, "nic-claim") is None, "the status entry removed at unprepare")


def _seconds(event: dict[str, Any]) -> float:
    import datetime

    return datetime.datetime.fromisoformat(event["ts"]).timestamp()


def test_a_renamed_link_keeps_its_device_name(agent: RunningAgent) -> None:
    # The kernel renames only a link that is down.
    agent.ns.batch(["link set vethA0 down", "link set vethA0 name vethR0", "link set vethR0 up"])
    nics = agent.until(lambda: (n := agent.nics()) and n.get(DEV_A0, {}).get("ifName") == "vethR0" and n,
                       "the rename published")
    assert set(nics) == {DEV_A0, DEV_A1}
    assert nics[DEV_A0]["macAddress"] == MAC_A0
    agent.until(lambda: agent.nics()[DEV_A0]["linkUp"] is True, "the renamed link published as up")


def test_a_new_pair_appears_and_a_removed_pair_disappears(agent: RunningAgent) -> None:
    mac_n0, mac_n1 = "02:00:00:00:b0:00", "02:00:00:00:b1:00"
    agent.ns.batch([f"link add vethN0 address {mac_n0} type veth peer name vethN1 address {mac_n1}",
                    "link set vethN0 up", "link set vethN1 up"])
    new = {mac_device_name(mac_n0), mac_device_name(mac_n1)}
    nics = agent.until(lambda: (n := agent.nics()) and new <= set(n) and n, "the new pair published")
    assert nics[mac_device_name(mac_n0)]["ifName"] == "vethN0"
    assert set(nics) == {DEV_A0, DEV_A1, *new}

    agent.ns.ip("link", "del", "vethA0")  # takes its peer with it
    nics = agent.until(lambda: (n := agent.nics()) and DEV_A0 not in n and DEV_A1 not in n and n,
                       "the removed pair withdrawn")
    assert set(nics) == new


# -- a prepared claim's metadata follows its device ------------------------------------------------

def test_metadata_of_a_prepared_nic_claim_gets_the_address_added_later(agent: RunningAgent) -> None:
    s = agent.settings
    assert s.offline is not None
    write_claim(s.offline / "resourceclaims", claim("nic-claim", NIC_CLAIM_UID, [result(DEV_A0, "nic")]))
    done = agent.cli("kubelet", "prepare", "default/nic-claim")
    assert done.returncode == 0, done.stdout + done.stderr
    (entry,) = json.loads(done.stdout)["claims"].values()
    assert [d["device_name"] for d in entry["devices"]] == [DEV_A0]

    path = metadata.host_file(s.metadata_dir, NIC_CLAIM_UID, "nic")
    before = metadata.parse_stream(path.read_bytes())
    assert [o["apiVersion"] for o in before] == list(metadata.API_VERSIONS)
    for obj in before:
        assert obj["metadata"]["generation"] == 1
        (dev,) = obj["requests"][0]["devices"]
        assert dev["networkData"] == {"interfaceName": "vethA0", "hardwareAddress": MAC_A0}

    agent.ns.ip("addr", "add", "10.30.0.7/24", "dev", "vethA0")

    def rewritten() -> list[dict[str, Any]] | None:
        objs = metadata.parse_stream(path.read_bytes())
        return objs if all(o["metadata"]["generation"] == 2 for o in objs) else None

    after = agent.until(rewritten, "the metadata file rewritten with generation 2")
    assert [o["apiVersion"] for o in after] == list(metadata.API_VERSIONS)
    for obj in after:
        assert obj["metadata"]["uid"] == NIC_CLAIM_UID
        (dev,) = obj["requests"][0]["devices"]
        assert dev["name"] == DEV_A0
        assert "10.30.0.7/24" in dev["networkData"]["ips"]
        assert dev["attributes"]["ipv4"] == {"string": "10.30.0.7/24"}

    # The claim's status follows too (offline: DIR/resourceclaimstatus/<namespace>/<name>.yaml).
    entry = agent.until(lambda: (e := status_entry(agent, "nic-claim")) and "10.30.0.7/24" in
                        e.get("networkData", {}).get("ips", []) and e, "the claim status with the new IP")
    assert entry["networkData"]["interfaceName"] == "vethA0"
    assert entry["networkData"]["hardwareAddress"] == MAC_A0

    # The durable record follows, so a restart restores generation 2, not the stale file.
    record_path = ClaimStore(s.claims_state_dir).path(NIC_CLAIM_UID)
    record = agent.until(lambda: (r := state.decode(record_path.read_bytes())).generation == 2 and r,
                         "the claim's record at generation 2")
    assert {f.path: f.content for f in record.files}[str(path)] == path.read_bytes()
