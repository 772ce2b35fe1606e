"""Network namespaces for tests: make one, fill it with veth pairs, run Python inside, always remove it.

`ip netns exec` runs its command in a new mount namespace with a sysfs of the
target network namespace mounted on /sys, so discovery run that way sees
netlink and sysfs agree, exactly as the agent does on a node. Hardware that
the test machine lacks is a `FakeSysfs` tree describing links of the namespace.
`discover()` runs NIC discovery inside a namespace; `next_matching()` waits for
a netlink event.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.apirules import device_wire_errors
from agent.inventory.netwatch import NetEvent, NetlinkWatcher

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class NetNS:
    name: str

    def ip(self, *args: str) -> str:
        done = subprocess.run(["ip", "-n", self.name, *args], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise AssertionError(f"ip -n {self.name} {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def batch(self, commands: Iterable[str]) -> None:
        """Many `ip` commands in one process: a burst of changes."""
        text = "".join(f"{c}\n" for c in commands)
        done = subprocess.run(["ip", "-n", self.name, "-batch", "-"], input=text, capture_output=True,
                              text=True, timeout=30)
        if done.returncode != 0:
            raise AssertionError(f"ip -n {self.name} -batch: {done.stderr.strip()}")

    def veth(self, name: str, peer: str, *, up: bool = True) -> None:
        self.ip("link", "add", name, "type", "veth", "peer", "name", peer)
        if up:
            self.ip("link", "set", name, "up")
            self.ip("link", "set", peer, "up")

    def links(self) -> dict[str, dict[str, Any]]:
        """`ip -j link` by interface name."""
        return {link["ifname"]: link for link in json.loads(self.ip("-j", "link", "show"))}

    def python(self, code: str, *args: str, timeout: float = 60) -> str:
        """Run `code` with this tree's interpreter inside the namespace; its stdout."""
        env = dict(os.environ, PYTHONPATH=str(REPO))
        done = subprocess.run(["ip", "netns", "exec", self.name, sys.executable, "-c", code, *args],
                              capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
        if done.returncode != 0:
            raise AssertionError(f"python in netns {self.name} failed ({done.returncode}):\n{done.stderr}")
        return done.stdout


def unique_name(prefix: str = "dra-t") -> str:
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"


@contextmanager
def network_namespace(prefix: str = "dra-t") -> Iterator[NetNS]:
    """A fresh, empty network namespace, deleted on the way out whatever happened inside."""
    name = unique_name(prefix)
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=30)
    try:
        yield NetNS(name)
    finally:
        # Its links go with it once nothing holds the namespace any more.
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)


class FakeSysfs:
    """A sysfs tree shaped like the kernel's: PCI functions under devices/, netdevs below them."""

    def __init__(self, root: Path, ns: NetNS) -> None:
        self.root = root
        self.links = ns.links()
        for ifname in self.links:  # every link has its class/net entry, as in real sysfs
            self.netdev(None, ifname)

    def function(self, *path: str, vendor: str, device: str, numa: int, driver: str | None = None,
                 **files: str) -> Path:
        fn = self.root.joinpath("devices", *path)
        fn.mkdir(parents=True, exist_ok=True)
        for name, text in {"vendor": vendor, "device": device, "class": "0x020000",
                           "numa_node": str(numa), **files}.items():
            (fn / name).write_text(f"{text}\n")
        if driver:
            drv = self.root / "bus" / "pci" / "drivers" / driver
            drv.mkdir(parents=True, exist_ok=True)
            os.symlink(drv, fn / "driver")
        return fn

    def netdev(self, fn: Path | None, ifname: str, *, dev_port: int = 0, speed: str = "100000",
               ifindex: int | None = None) -> Path:
        parent = fn if fn is not None else self.root / "devices" / "virtual"
        netdir = parent / "net" / ifname
        netdir.mkdir(parents=True, exist_ok=True)
        index = ifindex if ifindex is not None else self.links[ifname]["ifindex"]
        (netdir / "ifindex").write_text(f"{index}\n")
        (netdir / "dev_port").write_text(f"{dev_port}\n")
        (netdir / "speed").write_text(f"{speed}\n")
        if fn is not None:
            os.symlink(fn, netdir / "device")
        entry = self.root / "class" / "net" / ifname
        entry.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(entry):
            entry.unlink()
        os.symlink(netdir, entry)
        return netdir


DISCOVER = """
import json, sys
from agent.config import build_settings
from agent.inventory.nics import NicSource
result = NicSource(build_settings(json.loads(sys.argv[1]))).scan()
print(json.dumps({
    "devices": [dict(d.summary(), node={"interface": getattr(d.node, "interface", ""), "mac": d.node.mac,
                                        "ips": list(getattr(d.node, "ips", ())),
                                        "uplink": getattr(d.node, "uplink_reason", "")}, wire=d.wire())
                for d in result.devices],
    "failed_devices": {f.device: f.reason for f in result.failed_devices},
    "problems": {p.what: p.reason for p in result.problems},
}))
"""


@dataclass
class Scan:
    devices: list[dict[str, Any]]
    failed_devices: dict[str, str]  # device name -> why it could not be read
    problems: dict[str, str]  # what failed, naming no device ("interface x") -> why

    @property
    def by_name(self) -> dict[str, dict[str, Any]]:
        return {d["name"]: d for d in self.devices}

    @property
    def by_ifname(self) -> dict[str, dict[str, Any]]:
        return {d["node"]["interface"]: d for d in self.devices}

    def uplink(self, ifname: str) -> str:
        """Why the device on `ifname` is the node's uplink, "" when it is not."""
        return str(self.by_ifname[ifname]["node"]["uplink"])

    def attrs(self, ifname: str) -> dict[str, Any]:
        """Attributes of the device on `ifname`, as plain values."""
        wire = self.by_ifname[ifname]["attributes"]
        return {k: next(iter(v.values())) for k, v in wire.items()}


def discover(ns: NetNS, **settings: Any) -> Scan:
    """NIC discovery with these settings, run inside the namespace."""
    out = json.loads(ns.python(DISCOVER, json.dumps(settings)))
    scan = Scan(out["devices"], out["failed_devices"], out["problems"])
    for dev in scan.devices:
        assert device_wire_errors(dev["wire"]) == [], dev  # the API server would accept every one
    return scan


async def next_matching(watcher: NetlinkWatcher, match: Callable[[NetEvent], bool], what: str,
                        limit: float = 20) -> NetEvent:
    """The first event that `match`es; a test failure naming `what` (and the events seen) if none comes."""
    seen: list[NetEvent] = []

    async def find() -> NetEvent:
        async for event in watcher:
            seen.append(event)
            if match(event):
                return event
        raise AssertionError(f"the watcher ended before {what}; saw {seen}")

    try:
        return await asyncio.wait_for(find(), limit)
    except TimeoutError:
        pytest.fail(f"no {what} within {limit} s; saw {seen}")


def exactly(expected: NetEvent) -> Callable[[NetEvent], bool]:
    return lambda event: event == expected
