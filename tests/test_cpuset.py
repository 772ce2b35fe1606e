"""The CPUs a claim gets of a CPU device: a share's own CPUs chosen at prepare (whole cores first, never
those another prepared claim holds), in its metadata file and environment, kept by refreshes and restarts;
through the real engine with claims shaped as KubeVirt's CPUsWithDRA makes them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest
from agentkit import DRIVER, NODE, claim, make_node, restarted, result, write_claim
from topology import build_topology

from agent.claims import metadata
from agent.claims.cpuset import choose
from agent.config import build_settings
from agent.engine.recovery import begin_recovery, check_records
from agent.facts import CpuFacts
from agent.inventory.cpus import KUBEVIRT_CPU_CAPACITY, CpuSource
from agent.inventory.numa import parse_cpulist
from agent.names import ClaimRef

UIDS = [f"7a1c0d58-0000-4000-8000-00000000000{i}" for i in range(1, 6)]


def test_whole_cores_first_then_split_ones() -> None:
    facts = CpuFacts(cpus=(0, 1, 2, 3, 8, 9, 10, 11), cores=((0, 8), (1, 9), (2, 10), (3, 11)))
    assert choose(facts, 4, set()) == (0, 1, 8, 9)
    assert choose(facts, 3, set()) == (0, 1, 8)  # a third thread from the next whole core
    # A core already split gives its free thread before a whole core is split.
    assert choose(facts, 3, {0}) == (1, 8, 9)
    assert choose(facts, 2, {0, 1, 8}) == (2, 10)
    assert choose(facts, 5, {0, 1, 2, 8}) is None
    assert choose(CpuFacts(cpus=(4, 5)), 1, {4}) == (5,)  # no core facts: each CPU its own core


def cpu_node_settings(tmp: Path) -> dict[str, Any]:
    return {"sysfs_root": build_topology(tmp / "sys"), "kubevirt_cpu": True}


async def kubevirt_node(tmp: Path):  # type: ignore[no-untyped-def]
    extra = cpu_node_settings(tmp)
    cpus = CpuSource(build_settings({"driver_name": DRIVER, "node_name": NODE, **extra})).scan().devices
    return await make_node(tmp, cpus=cpus, nvml="auto", **extra)


def vm_claim(name: str, uid: str, sockets: list[tuple[str, int]]) -> dict[str, Any]:
    """A VM's `<vmi>-cpu-claim` as allocated: request `req-cpu-socket-<i>` per guest socket, each a share
    of a CPU device with `consumedCapacity: {dra.cpu/cpu: N}`."""
    results = [result(device, f"req-cpu-socket-{i}", shareID=f"5e0c1a2b-0000-4000-8000-{uid[-6:]}{i:06d}",
                      consumedCapacity={KUBEVIRT_CPU_CAPACITY: str(n)})
               for i, (device, n) in enumerate(sockets)]
    return claim(name, uid, results, namespace="vms")


def cpusets(node: Any, uid: str) -> dict[str, tuple[set[int], set[int]]]:
    """Request -> (the metadata file's cpuset, the CPUs of the container's DRA_<D>_CPUS) of a prepared claim."""
    s = node.settings
    spec = orjson.loads((s.cdi_dir / f"{DRIVER}-claim_{uid}.json").read_bytes())
    env = {e.split("=", 1)[0]: e.split("=", 1)[1] for d in spec["devices"] for e in d["containerEdits"]["env"]}
    out = {}
    for req_dir in sorted((s.plugin_dir / "dra-device-metadata" / uid).iterdir()):
        (obj, _) = metadata.parse_stream((req_dir / "metadata.json").read_bytes())
        (req,) = obj["requests"]
        (dev,) = req["devices"]
        assert dev["consumedCapacity"] == {KUBEVIRT_CPU_CAPACITY: str(len(parse_cpulist(dev["cpuset"])))}
        variable = "DRA_" + dev["name"].upper().replace("-", "_") + "_CPUS"
        out[req["name"]] = (set(parse_cpulist(dev["cpuset"])), set(parse_cpulist(env[variable])))
    return out


async def prepare(node: Any, name: str, uid: str, engine: Any = None) -> str:
    results = await (engine or node.engine).prepare([ClaimRef("vms", name, uid)])
    return str(results[uid].error)


async def test_vm_shares_get_cpus_of_their_own_on_their_sockets(tmp_path: Path) -> None:
    node = await kubevirt_node(tmp_path)
    # Two sockets: one share on each socket's first node (cpu-numa0: CPUs 0,1,8,9; cpu-numa2: 4,5,12,13).
    write_claim(node.claims_dir, vm_claim("vm-1-cpu-claim", UIDS[0], [("cpu-numa0", 2), ("cpu-numa2", 2)]))
    assert await prepare(node, "vm-1-cpu-claim", UIDS[0]) == ""
    first = cpusets(node, UIDS[0])
    assert first == {"req-cpu-socket-0": ({0, 8}, {0, 8}), "req-cpu-socket-1": ({4, 12}, {4, 12})}

    # A second VM on the first socket's node gets the other core; a third, asking for more than is
    # left, is refused with the reason, and prepared once the first VM is gone.
    write_claim(node.claims_dir, vm_claim("vm-2-cpu-claim", UIDS[1], [("cpu-numa0", 2)]))
    assert await prepare(node, "vm-2-cpu-claim", UIDS[1]) == ""
    assert cpusets(node, UIDS[1]) == {"req-cpu-socket-0": ({1, 9}, {1, 9})}
    write_claim(node.claims_dir, vm_claim("vm-3-cpu-claim", UIDS[2], [("cpu-numa0", 1)]))
    error = await prepare(node, "vm-3-cpu-claim", UIDS[2])
    assert "asks for 1 CPUs and 0 are free" in error, error
    assert not (node.settings.cdi_dir / f"{DRIVER}-claim_{UIDS[2]}.json").exists()
    await node.engine.unprepare([ClaimRef("vms", "vm-1-cpu-claim", UIDS[0])])
    assert await prepare(node, "vm-3-cpu-claim", UIDS[2]) == ""
    ((cpus, env),) = cpusets(node, UIDS[2]).values()
    assert cpus == env and len(cpus) == 1 and cpus <= {0, 8}

    # A restarted agent knows what each prepared claim holds once its records are checked: until then a
    # new share is refused (retryable) rather than chosen blind, and then it gets what is free.
    engine = restarted(node)
    report = begin_recovery(engine)
    write_claim(node.claims_dir, vm_claim("vm-4-cpu-claim", UIDS[3], [("cpu-numa0", 1)]))
    error = await prepare(node, "vm-4-cpu-claim", UIDS[3], engine)
    assert "waits for the start-up check" in error, error
    await asyncio.to_thread(check_records, engine, engine.unverified())
    assert report is not None and engine.unverified() == []
    assert await prepare(node, "vm-4-cpu-claim", UIDS[3], engine) == ""
    ((cpus4, _),) = cpusets(node, UIDS[3]).values()
    assert cpus4 == {0, 8} - cpus
    # The claims prepared before the restart still say what they said.
    assert cpusets(node, UIDS[1]) == {"req-cpu-socket-0": ({1, 9}, {1, 9})}


async def test_a_refresh_keeps_a_shares_cpus_and_a_whole_device_follows_its_cpus(tmp_path: Path) -> None:
    node = await kubevirt_node(tmp_path)
    write_claim(node.claims_dir, vm_claim("vm-1-cpu-claim", UIDS[0], [("cpu-numa1", 2)]))
    assert await prepare(node, "vm-1-cpu-claim", UIDS[0]) == ""
    before = cpusets(node, UIDS[0])
    # A whole CPU device (no share): all of its CPUs.
    write_claim(node.claims_dir, claim("whole", UIDS[1], [result("cpu-numa3", "cpu")], namespace="vms"))
    assert await prepare(node, "whole", UIDS[1]) == ""
    (obj, _) = metadata.parse_stream(next((node.settings.plugin_dir / "dra-device-metadata" / UIDS[1]).glob(
        "*/metadata.json")).read_bytes())
    assert set(parse_cpulist(obj["requests"][0]["devices"][0]["cpuset"])) == {6, 7, 14, 15}
    # A refresh of every prepared claim (the agent's start-up pass) rewrites nothing for them.
    assert await node.engine.refresh_claims(UIDS[:2]) == 0
    assert cpusets(node, UIDS[0]) == before


@pytest.mark.parametrize("amount", ["0", "1500m", "9", "x"])
async def test_a_share_that_is_no_whole_number_of_the_devices_cpus_is_refused(tmp_path: Path, amount: str) -> None:
    node = await kubevirt_node(tmp_path)
    write_claim(node.claims_dir, claim("bad", UIDS[0], [result(
        "cpu-numa0", "req-cpu-socket-0", shareID="5e0c1a2b-0000-4000-8000-000000000001",
        consumedCapacity={KUBEVIRT_CPU_CAPACITY: amount})], namespace="vms"))
    error = await prepare(node, "bad", UIDS[0])
    assert "is not a share of device cpu-numa0" in error or "must be a quantity" in error, error
