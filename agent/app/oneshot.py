"""One-shot work for the CLI: discover, render the slices, read a claim, as the agent would."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from agent.app.assembly import PublishedForm, build_sources, set_node_features
from agent.app.connection import Connection, StartupError, connect
from agent.config import Settings
from agent.inventory import Inventory
from agent.kube import NodeInfo
from agent.model import Device
from agent.publish import dropped, slices

log = logging.getLogger(__name__)


async def _inventory_once(settings: Settings, node: NodeInfo | None) -> Inventory:
    inventory = Inventory(build_sources(settings), refine=PublishedForm(settings))
    await asyncio.to_thread(inventory.open)
    try:
        set_node_features(inventory, node, settings)
        await inventory.scan()
    finally:
        await asyncio.to_thread(inventory.close)
    return inventory


async def _node_for_cli(settings: Settings) -> tuple[Connection | None, NodeInfo]:
    try:
        conn = await connect(settings)
    except StartupError as exc:
        log.warning("%s: showing what this node would publish without cluster information", exc)
        return None, NodeInfo(name=settings.node_name)
    return conn, conn.node or NodeInfo(name=settings.node_name)


async def discover_once(settings: Settings) -> tuple[list[Device], list[str]]:
    """The devices this node would publish, and one line for each thing discovery could not read."""
    conn, node = await _node_for_cli(settings)
    if conn is not None:
        await conn.close()
    inventory = await _inventory_once(settings, node)
    return inventory.devices(), inventory.snapshot().not_published()


async def render_slices(settings: Settings) -> list[dict[str, Any]]:
    conn, node = await _node_for_cli(settings)
    if conn is not None:
        await conn.close()
    inventory = await _inventory_once(settings, node)
    owner = slices.NodeRef(name=node.name, uid=node.uid) if node.uid else None
    return slices.build_slices(inventory.devices(), driver=settings.driver_name, node=settings.node_name,
                               owner=owner, compatibility_groups=settings.compatibility_groups,
                               layout=dropped.layout(settings, node))


async def fetch_claim(settings: Settings, namespace: str, name: str) -> dict[str, Any]:
    conn = await connect(settings)
    try:
        return dict(await conn.claim_source(settings).get(namespace, name))
    finally:
        await conn.close()


async def claim_names(settings: Settings) -> list[str]:
    """`namespace/name` of the claims an offline claim directory holds and of those prepared on this
    node: what a claim that was not found is compared with, its namespace as much as its name. (The API
    server is not asked: the agent's role may get a claim, not list them.)"""
    from agent.claims.store import ClaimStore

    records, _ = await asyncio.to_thread(ClaimStore(settings.claims_state_dir).load_all)
    names = {f"{r.namespace}/{r.name}" for r in records.values()}
    offline = settings.offline or settings.offline_fallback
    if offline is not None:
        directory = offline / "resourceclaims"
        files = await asyncio.to_thread(lambda: list(directory.glob("*/*.yaml")))
        names |= {f"{p.parent.name}/{p.stem}" for p in files}
    return sorted(names)


async def device_names(settings: Settings) -> set[str]:
    """The devices discovery finds with these settings (those it names but cannot read too), without
    asking a cluster: whether a device an operator names is this node's."""
    inventory = await _inventory_once(settings, NodeInfo(name=settings.node_name))
    snapshot = inventory.snapshot()
    return set(snapshot.devices) | {f.device for f in snapshot.failed_devices}
