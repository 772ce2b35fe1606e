"""An unchanged node writes nothing: ten rescans and syncs against the API emulator and the offline
directory, with the inventory `make run` publishes (simulated GPUs, this host's NICs, CPU and memory)
and with synthetic devices that carry every field the server may add to or read differently."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
from agentkit import DRIVER, NODE, roots
from kubeapi import RESOURCE_SLICES, KubeApi

from agent.app.assembly import PublishedForm, build_sources, set_node_features
from agent.inventory import Inventory
from agent.inventory.nics import NicSource
from agent.kinds import Kind
from agent.kube import NODE_ALLOCATABLE_FEATURE, Backoff, NodeInfo, read_node
from agent.model import NUMA_NODE, Capacity, Device, Taint, Version
from agent.publish.apiserver import ApiPublisher, DirectoryPublisher, Publisher
from agent.publish.slices import chunk_devices

RESCANS = 10
FAST = Backoff(initial=0.01, maximum=0.05, attempts=4)


@contextlib.asynccontextmanager
async def make_run_inventory(tmp: Path, node: NodeInfo) -> AsyncIterator[Inventory]:
    # As `make run` builds it (daemon.Agent): every real source, this host's /sys as it is, the
    # simulated DGX H100. Memory capacity comes from the online memory blocks, which stay put even
    # where a node's MemTotal grows with use (a lazily initialised VM, see agent.inventory.numa).
    settings = roots(tmp, sysfs_root=Path("/sys"), dev_root=Path("/dev"))
    inventory = Inventory(build_sources(settings), refine=PublishedForm())
    inventory.open()
    try:
        set_node_features(inventory, node)
        await inventory.scan()
        yield inventory
    finally:
        inventory.close()


def synthetic() -> list[Device]:
    """Devices with what is easy to get wrong on a round trip: taints the server stamps, versions,
    consumable capacity with a request policy, node-allocatable mappings, strings YAML would read
    as numbers or dates, and enough devices for several slices."""
    devices = [Device(name=f"nic-{i:03d}", kind=Kind.NIC, attributes={
        "type": "nic", "mtu": 9000, "linkUp": i % 2 == 0, "ipv4": f"10.0.{i}.5/24",
        "resource.kubernetes.io/pciBusID": f"0000:{i % 256:02x}:00.0", "macAddress": "02:00:00:00:00:01",
        "note": "1e3", "when": "2026-03-01", "yes": "no", "octal": "0755"}) for i in range(150)]
    devices[3].taints = [Taint(key=f"{DRIVER}/link-down", effect="NoSchedule")]
    devices[4].taints = [Taint(key=f"{DRIVER}/xid", value="79", effect="NoExecute",
                               time_added="2026-03-01T10:00:00Z")]
    devices.append(Device(name="gpu-0", kind=Kind.GPU, attributes={
        "type": "gpu", "driverVersion": Version("570.124.6"), NUMA_NODE: 0},
        capacity={"memory": Capacity("81559Mi")}))
    devices.append(Device(
        name="cpu-numa0", kind=Kind.CPU, attributes={"type": "cpu", NUMA_NODE: 0},
        capacity={"cpus": Capacity("96", request_policy={"default": "1", "validRange": {"min": "1", "step": "1"}})},
        allow_multiple_allocations=True,
        node_allocatable={"cpu": {"mapping": {"capacityKey": "cpus", "capacityMultiplier": "1"}}}))
    return devices


def identities(directory: Path) -> dict[str, tuple[int, int, int]]:
    """Inode, size and mtime of every entry: an atomic rewrite changes the inode, any write the mtime."""
    out = {}
    for name in sorted(os.listdir(directory)):
        st = os.lstat(directory / name)
        out[name] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


async def rescan_and_sync(inventory: Inventory | None, publisher: Publisher, devices: Sequence[Device]) -> None:
    """One periodic round as the daemon runs it: rescan, then publish what the inventory holds."""
    if inventory is not None:
        assert not await inventory.scan(), "the inventory itself changed between rescans"
        devices = inventory.devices()
    result = await publisher.sync(devices)
    assert not result.changed, result


# -- offline directory --------------------------------------------------------------------------

async def check_directory(tmp: Path, inventory: Inventory | None, devices: Sequence[Device],
                          node: NodeInfo) -> None:
    settings = roots(tmp)
    publisher = DirectoryPublisher(tmp / "offline", settings, node)
    first = await publisher.sync(inventory.devices() if inventory is not None else devices)
    assert first.created and first.generation == 1
    directory = tmp / "offline" / "resourceslices"
    before = identities(directory)
    dir_mtime = os.stat(directory).st_mtime_ns
    for _ in range(RESCANS):
        await rescan_and_sync(inventory, publisher, devices)
    # A restarted agent (no memory of what it wrote) reads the files back and agrees.
    await rescan_and_sync(inventory, DirectoryPublisher(tmp / "offline", settings, node), devices)
    assert identities(directory) == before
    assert os.stat(directory).st_mtime_ns == dir_mtime  # not even a temp file came and went


async def test_directory_make_run_inventory_rescanned_writes_nothing(tmp_path: Path) -> None:
    node = NodeInfo(NODE)
    async with make_run_inventory(tmp_path, node) as inventory:
        kinds = {d.kind for d in inventory.devices()}
        assert {"gpu", "cpu", "memory"} <= kinds
        # The NICs are this host's.
        host = NicSource(roots(tmp_path / "host", sysfs_root=Path("/sys")))
        host_nics = (await asyncio.to_thread(host.scan)).devices  # a scan blocks (netlink, sysfs)
        assert sorted(d.name for d in inventory.devices() if d.kind == "nic") == sorted(d.name for d in host_nics)
        await check_directory(tmp_path, inventory, [], node)


@pytest.mark.parametrize("uid", ["", "0d0c0b0a-1111-4222-8333-444455556666"])
async def test_directory_synthetic_inventory_writes_nothing(tmp_path: Path, uid: str) -> None:
    assert len(chunk_devices(synthetic()).slices) > 1
    await check_directory(tmp_path, None, synthetic(), NodeInfo(NODE, uid))


# -- API server ---------------------------------------------------------------------------------

async def check_api(kube_api: KubeApi, tmp: Path, inventory: Inventory | None, devices: Sequence[Device],
                    node: NodeInfo) -> None:
    publisher = ApiPublisher(kube_api.client(timeout=5.0), roots(tmp), node, backoff=FAST)
    first = await publisher.sync(inventory.devices() if inventory is not None else devices)
    assert first.created and first.generation == 1
    stored = {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in kube_api.items(RESOURCE_SLICES)}
    kube_api.mark()
    for _ in range(RESCANS):
        await rescan_and_sync(inventory, publisher, devices)
    # A restarted agent reads the pool back and agrees.
    await rescan_and_sync(inventory, ApiPublisher(kube_api.client(timeout=5.0), roots(tmp), node, backoff=FAST),
                          devices)
    assert kube_api.writes() == []
    assert [(r.method, r.status) for r in kube_api.since_mark()] == [("GET", 200)] * (RESCANS + 1)
    assert {s["metadata"]["name"]: s["metadata"]["resourceVersion"]
            for s in kube_api.items(RESOURCE_SLICES)} == stored


@pytest.mark.parametrize("declared", [False, True], ids=["plain", "node-allocatable"])
async def test_api_make_run_inventory_rescanned_writes_nothing(
        kube_api: KubeApi, tmp_path: Path, declared: bool) -> None:
    kube_api.add_node(NODE, declared_features=[NODE_ALLOCATABLE_FEATURE] if declared else [])
    node = await read_node(kube_api.client(), NODE)
    async with make_run_inventory(tmp_path, node) as inventory:
        if declared:  # consumable capacity and node-allocatable mappings are published too
            assert any(d.node_allocatable for d in inventory.devices())
        await check_api(kube_api, tmp_path, inventory, [], node)


async def test_api_synthetic_inventory_writes_nothing(kube_api: KubeApi, tmp_path: Path) -> None:
    kube_api.add_node(NODE, uid="0d0c0b0a-1111-4222-8333-444455556666",
                      declared_features=[NODE_ALLOCATABLE_FEATURE])
    node = await read_node(kube_api.client(), NODE)
    await check_api(kube_api, tmp_path, None, synthetic(), node)
    # The server stamped the taint that came without a time, and that stamp is kept, not fought over.
    stamped = [t for s in kube_api.items(RESOURCE_SLICES) for d in s["spec"]["devices"]
               for t in d.get("taints", []) if t["key"] == f"{DRIVER}/link-down"]
    assert len(stamped) == 1 and stamped[0]["timeAdded"]
