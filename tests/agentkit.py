"""Building blocks for tests of the prepare path: settings in temporary roots, a node with
simulated GPUs and hand-made NICs/CPUs, and claims written where the offline source reads them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from agent import apirules, quantity
from agent.app.assembly import PublishedForm, nvml_opener, vf_links
from agent.claims.sources import DirectoryClaimSource
from agent.claims.store import ClaimStore
from agent.config import NvmlMode, Settings, build_settings
from agent.engine.prepare import PrepareEngine
from agent.facts import CpuFacts, NicFacts
from agent.inventory import Inventory, ScanResult
from agent.inventory.gpus import GpuSource
from agent.kinds import Kind
from agent.kubelet import client as kc
from agent.model import NUMA_NODE, PCI_BUS_ID, PCIE_ROOT, Device
from agent.publish.slices import build_slices

DRIVER = "dra.example.com"
REPO = Path(__file__).resolve().parents[1]
NODE = "node-a"


def sim_cli(s: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    """`dra-agent ARGS` on the simulated machine of the agent `s` runs (offline, its roots, no NIC)."""
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={**os.environ, "DRA_NVML": "sim", "DRA_STATE_DIR": str(s.state_dir),
                                         "DRA_OFFLINE": str(s.offline), "DRA_KUBELET_DIR": str(s.kubelet_dir),
                                         "DRA_DRIVER_NAME": s.driver_name, "NODE_NAME": NODE,
                                         "DRA_NIC_EXCLUDE": "*"})


def roots(tmp: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "driver_name": DRIVER, "node_name": NODE, "nvml": "sim", "kubelet_dir": tmp / "kubelet",
        "cdi_dir": tmp / "cdi", "static_cdi_dir": tmp / "cdi-static", "state_dir": tmp / "state",
        "dev_root": tmp / "dev", "offline": tmp / "offline",
        "metrics_address": "",  # off: tests that want it give 127.0.0.1:0
    }
    values.update(overrides)
    return build_settings(values)


class StaticSource:
    """A discovery source with fixed devices (for kinds the test does not need real hardware for)."""

    def __init__(self, kind: str, devices: Sequence[Device]) -> None:
        self.kind = kind
        self.devices = list(devices)

    def open(self) -> None:
        pass

    def scan(self) -> ScanResult:
        return ScanResult(devices=list(self.devices))

    def close(self) -> None:
        pass


def nic(name: str = "nic-0000-3b-00-0", ifname: str = "ens1f0", mac: str = "02:00:00:00:00:01",
        ips: Sequence[str] = ("10.0.0.5/24",), uplink: bool = False) -> Device:
    bus = "0000:3b:00.0"
    attrs: dict[str, Any] = {"type": "nic", "ifName": ifname, "macAddress": mac, "mtu": 9000, "linkUp": True,
                             "uplink": uplink, PCI_BUS_ID: bus, PCIE_ROOT: "pci0000:3a", NUMA_NODE: 0}
    if ips:
        attrs["ipv4"] = ips[0]
    return Device(name=name, kind=Kind.NIC, attributes=attrs,
                  node=NicFacts(interface=ifname, mac=mac, ips=tuple(ips), link_up=True, pci_bus_id=bus,
                                uplink_reason=f"{ifname} carries the default route 0.0.0.0/0 (table main)" * uplink))


def cpu(node: int = 0, cpus: Iterable[int] = range(0, 8)) -> Device:
    from agent.model import Capacity

    ids = tuple(cpus)
    return Device(name=f"cpu-numa{node}", kind=Kind.CPU, attributes={"type": "cpu", NUMA_NODE: node},
                  capacity={"cpus": Capacity(str(len(ids)))}, node=CpuFacts(cpus=ids))


@dataclass
class Node:
    settings: Settings
    inventory: Inventory
    engine: PrepareEngine
    nic_source: StaticSource

    @property
    def claims_dir(self) -> Path:
        assert self.settings.offline is not None
        return self.settings.offline / "resourceclaims"


async def make_node(tmp: Path, nics: Sequence[Device] = (), cpus: Sequence[Device] = (),
                    **overrides: Any) -> Node:
    settings = roots(tmp, **overrides)
    nic_source = StaticSource("nic", list(nics) or [nic()])
    sources: list[Any] = [nic_source, StaticSource("cpu", cpus)]
    if settings.nvml != NvmlMode("auto"):
        sources.insert(0, GpuSource(settings, opener=nvml_opener(settings)))
    inventory = Inventory(sources, refine=PublishedForm())
    inventory.open()
    await inventory.scan()
    assert settings.offline is not None
    store = ClaimStore(settings.claims_state_dir)
    store.ensure()
    engine = PrepareEngine(settings, inventory, DirectoryClaimSource(settings.offline), store,
                           vf_links=vf_links(settings))
    return Node(settings, inventory, engine, nic_source)


@dataclass
class Quickstart:
    """README's walk-through in `root`: the environment `make run` sets up, with claims seeded from
    examples/ as it seeds them; `cli` runs `dra-agent ARGS` in that environment."""

    root: Path
    env: dict[str, str]

    @classmethod
    def seeded(cls, root: Path, node: str) -> Quickstart:
        env = {**os.environ, "DRA_KUBELET_DIR": str(root / "kubelet"), "DRA_CDI_DIR": str(root / "cdi"),
               "DRA_STATIC_CDI_DIR": str(root / "cdi-static"), "DRA_STATE_DIR": str(root / "state"),
               "DRA_OFFLINE": str(root / "offline"), "DRA_NVML": "sim", "NODE_NAME": node}
        seeded = subprocess.run([sys.executable, str(REPO / "examples" / "seed.py"), str(root)],
                                capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
        assert seeded.returncode == 0, seeded.stderr
        return cls(root, env)

    def example(self, name: str) -> str:
        return (self.root / "offline" / "resourceclaims" / "default" / f"{name}.yaml").read_text()

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True, timeout=120,
                              env=self.env, cwd=REPO)

    def agent(self, log: Path | None = None,
              env: dict[str, str] | None = None) -> contextlib.AbstractContextManager[subprocess.Popen[str]]:
        """`dra-agent run` in this environment (plus `env`), once its registration socket exists; its
        output goes to `log` when given."""
        reg = self.root / "kubelet" / "plugins_registry" / f"{DRIVER}-reg.sock"
        return agent_process(["run", "--metrics-address", ""], {**self.env, **(env or {})}, reg, REPO, log=log)


@contextlib.contextmanager
def agent_process(args: Sequence[str], env: dict[str, str], registration_socket: Path,
                  cwd: Path, log: Path | None = None) -> Iterator[subprocess.Popen[str]]:
    """`python -m agent ARGS` in its own process, from when its registration socket exists until the
    block ends (SIGTERM, then waited for); its output goes to `log` when given."""
    out = log.open("w") if log is not None else None
    try:
        proc = subprocess.Popen([sys.executable, "-m", "agent", *args], env={**os.environ, **env}, cwd=cwd,
                                stdout=out or subprocess.PIPE, stderr=subprocess.STDOUT if out else subprocess.PIPE,
                                text=True)
    finally:
        if out is not None:
            out.close()  # (the child has its own descriptor)
    deadline = time.monotonic() + 60
    while not registration_socket.exists():
        if proc.poll() is not None:
            raise AssertionError(proc.communicate())
        assert time.monotonic() < deadline, "agent did not start"
        time.sleep(0.05)
    # The registration socket opens first; the DRA socket (GetInfo's endpoint) once devices are scanned.
    # (In a thread of its own: the caller may be running an event loop.)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        endpoint = Path(pool.submit(asyncio.run, kc.get_info(registration_socket, timeout=10)).result().endpoint)
    while not endpoint.exists():
        if proc.poll() is not None:
            raise AssertionError(proc.communicate())
        assert time.monotonic() < deadline, "agent did not open its DRA socket"
        time.sleep(0.05)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def restarted(node: Node) -> PrepareEngine:
    """A new engine over the same roots and state, as a restarted agent (or a second agent) has."""
    return PrepareEngine(node.settings, node.inventory, node.engine.claims, ClaimStore(node.settings.claims_state_dir),
                         vf_links=node.engine.passthrough.links)


def claim(name: str, uid: str, results: Sequence[dict[str, Any]], *, namespace: str = "default",
          annotations: dict[str, str] | None = None, config: Sequence[dict[str, Any]] = (),
          allocated: bool = True) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": uid},
        "spec": {"devices": {"requests": [{"name": r["request"].split("/")[0]} for r in results]}},
    }
    if annotations:
        obj["metadata"]["annotations"] = annotations
    if allocated:
        obj["status"] = {"allocation": {"devices": {"results": list(results), "config": list(config)}}}
    return obj


def result(device: str, request: str = "req", *, driver: str = DRIVER, pool: str = NODE,
           **extra: Any) -> dict[str, Any]:
    return {"request": request, "driver": driver, "pool": pool, "device": device, **extra}


def write_claim(claims_dir: Path, obj: dict[str, Any]) -> Path:
    meta = obj["metadata"]
    path = claims_dir / meta["namespace"] / f"{meta['name']}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(obj))
    return path


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root (relative path -> content), for 'nothing changed' assertions."""
    out: dict[str, bytes] = {}
    if not root.exists():
        return out
    for parent, _dirs, files in os.walk(root):
        for name in files:
            p = Path(parent) / name
            if p.is_file() and not p.is_symlink():
                out[str(p.relative_to(root))] = p.read_bytes()
    return out


def written_files(settings: Settings) -> dict[str, bytes]:
    """All files the prepare path may write: CDI dir, plugin dir, records."""
    out: dict[str, bytes] = {}
    for root in (settings.cdi_dir, settings.plugin_dir, settings.claims_state_dir):
        out.update({f"{root}/{k}": v for k, v in tree(root).items()})
    return out


def fits(devices: Iterable[Device]) -> bool:
    """Whether the devices' counter consumptions fit their counter sets together (the scheduler's sum)."""
    used: dict[str, int] = {}
    total: dict[str, str] = {}
    for dev in devices:
        for c in dev.consumes_counters:
            total.update(c.counter_set.counters)
            for k, v in c.counters.items():
                used[k] = used.get(k, 0) + quantity.parse_int(v)
    return all(n <= quantity.parse_int(total[k]) for k, n in used.items())


def valid_pool(devices: list[Device]) -> list[dict[str, Any]]:
    """The pool's slices for `devices`, each valid against the 1.37 schema and the API's pool rules."""
    objs = build_slices(devices, driver=DRIVER, node=NODE)
    for obj in objs:
        kubernetes_validate.validate(obj, "1.37.0", strict=True)
    assert apirules.pool_errors(objs) == []
    return objs
