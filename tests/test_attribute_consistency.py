"""Attributes a CEL expression can rely on: every device of one `type` carries the same attribute
names with the same value types, except those docs/devices.md lists with when they are absent (which a
selector must guard with `has()`). Checked over every simulated machine, the real NVML path through the
stand-in library, and NICs of every kind (hardware functions with and without SR-IOV, a VF, ports of
a multi-port function, a virtual link, with and without addresses, up and down) in a network
namespace."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from netns import NetNS, discover
from test_nics import HW, ns, sriov_tree  # noqa: F401 (ns: a fixture)
from test_nvml_standin import cli, env, host_tree, standin  # noqa: F401 (fixtures)

from agent.app import oneshot
from agent.config import build_settings
from agent.sim.profiles import BUILTIN

REPO = Path(__file__).resolve().parents[1]
Seen = dict[str, list[dict[str, Any]]]  # type -> each device's attributes in wire form ({"int": 3}, ...)


def optional_attributes() -> dict[str, set[str]]:
    """docs/devices.md's table: type -> the attributes that may be absent."""
    text = (REPO / "docs" / "devices.md").read_text()
    section = text.split("### Attributes a CEL expression can rely on", 1)[1].split("\n## ", 1)[0]
    out: dict[str, set[str]] = defaultdict(set)
    for line in section.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 3 and cells[1].startswith("`"):
            for kind in cells[0].split(","):
                out[kind.strip()].add(cells[1].strip("`"))
    return out


def by_type(devices: Iterable[dict[str, Any]], seen: Seen) -> None:
    for d in devices:
        attrs = d["attributes"]
        seen[attrs["type"]["string"]].append(attrs)


def check(seen: Seen) -> None:
    optional = optional_attributes()
    problems = []
    for kind, devices in seen.items():
        names = {n for attrs in devices for n in attrs}
        for name in sorted(names):
            having = [attrs[name] for attrs in devices if name in attrs]
            if len(having) < len(devices) and name not in optional.get(kind, set()):
                problems.append(f"{kind}: {name} on {len(having)} of {len(devices)} devices, not listed as optional")
            value_types = {next(iter(v)) for v in having}
            if len(value_types) > 1:
                problems.append(f"{kind}: {name} is {' and '.join(sorted(value_types))}")
    assert problems == []


def simulated(profile: str, tmp: Path) -> list[dict[str, Any]]:
    settings = build_settings({"nvml": f"sim:{profile}", "state_dir": tmp / "state", "offline": tmp / "offline",
                               "node_name": "node-a", "gpu_sharing": True, "dynamic_mig": True,
                               "nic_exclude": "*"})
    devices, _ = asyncio.run(oneshot.discover_once(settings))
    return [d.summary() for d in devices]


def test_the_table_names_types_the_agent_publishes() -> None:
    assert set(optional_attributes()) <= {"gpu", "shared", "mig", "vgpu", "vfio", "nic", "cpu", "memory"}


@pytest.mark.parametrize("profile", sorted(BUILTIN))
def test_every_simulated_device_of_a_type_has_the_same_attributes(profile: str, tmp_path: Path) -> None:
    seen: Seen = defaultdict(list)
    by_type(simulated(profile, tmp_path), seen)
    assert {"gpu", "shared", "mig", "vfio", "cpu", "memory"} <= seen.keys()
    check(seen)


def test_the_real_nvml_path_publishes_what_the_simulation_does(env: dict[str, str], tmp_path: Path) -> None:  # noqa: F811
    # The stand-in's GPUs (one without a NUMA node in NVML) beside the simulated machine's: one type, one
    # set of attributes, whichever path found them.
    proc = cli(env, "devices", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    seen: Seen = defaultdict(list)
    by_type(json.loads(proc.stdout), seen)
    by_type(simulated("dgx-h100", tmp_path), seen)
    assert len(seen["gpu"]) > 8
    check(seen)


def test_every_kind_of_nic_has_the_attributes_the_table_promises(ns: NetNS, tmp_path: Path) -> None:  # noqa: F811
    ns.veth("va", "vb")  # a virtual link, published when named
    ns.ip("addr", "add", "10.9.0.2/24", "dev", "va")
    fake = sriov_tree(tmp_path, ns)
    ns.ip("-6", "addr", "add", "fd09::2/64", "dev", "pf0", "nodad")
    ns.ip("link", "set", "p1", "down")
    seen: Seen = defaultdict(list)
    scan = discover(ns, sysfs_root=str(fake.root), nic_include=f"{HW},va")
    assert scan.problems == {} and scan.failed_devices == {}
    by_type(scan.devices, seen)
    assert len(seen["nic"]) >= 5
    check(seen)
