"""`dra-agent pool status`: this node's pool as the cluster sees it, beside what the node itself knows.

The cluster's view is a ResourcePoolStatusRequest (`resource.k8s.io/v1alpha3`, the
`DRAResourcePoolStatus` gate, alpha in 1.37): the command creates one for this driver and this node's
pool, waits for the controller (kube-controller-manager's resourcepoolstatusrequest controller) to
fill in its status, deletes it, and shows the pool's device counts (total, allocated, available,
unavailable), its partition summary (slices that name a `partitionTypeAttribute`,
`--partition-type-attribute`) and its shareable summary (devices that allow multiple allocations).

The node's view needs no API server: the devices discovery finds (what the agent publishes), the
claims prepared here (the claim records), the taints the agent holds (`<state>/health/causes.json`),
and which devices are free: not prepared, not tainted NoSchedule or NoExecute, and no other form of
their hardware prepared (a whole GPU and its MIG placements, a function and its passthrough variant).
Forms of one kind on one GPU (two MIG placements, shares) may still exclude each other through their
counters; the cluster's partition summary says how many of each type still fit.

Run it where the agent's state is (in the agent's pod: `kubectl exec`), with the agent's settings.
The agent's service account may create and delete requests for its own driver and node's pool only
(deploy/base: ClusterRole and admission policy). Where the API is not served, or no cluster is
configured, the node's view is shown alone, with why, and the exit status is 1.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent import kube
from agent.app.output import dump, table
from agent.config import Settings
from agent.model import Device

API = "resource.k8s.io/v1alpha3"
POLL = 0.2  # seconds between reads of the request while the controller works on it
BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


@dataclass
class NodeView:
    """What this node knows of its pool."""

    devices: list[Device]
    prepared: list[tuple[str, list[str]]]  # (namespace/name, device names), per prepared claim
    taints: list[dict[str, Any]]  # the saved causes (device, key, effect, cause)
    free: list[str]
    problems: list[str] = field(default_factory=list)

    def wire(self) -> dict[str, Any]:
        return {"devices": len(self.devices), "prepared": [{"claim": c, "devices": d} for c, d in self.prepared],
                "taints": self.taints, "free": self.free, "problems": self.problems}


def _hardware(dev: Device) -> str:
    return dev.gpu_function or dev.pci_bus_id or dev.name


def free_devices(devices: Sequence[Device], held: set[str], tainted: set[str]) -> list[str]:
    """The devices a new claim could get on this node now (see the module docstring)."""
    by_name = {d.name: d for d in devices}
    held_devices = [by_name[n] for n in held if n in by_name]
    out = []
    for dev in devices:
        if dev.name in tainted or (dev.name in held and not dev.allow_multiple_allocations):
            continue
        blocked = False
        for other in held_devices:
            if other.name == dev.name or _hardware(other) != _hardware(dev):
                continue
            mine, theirs = dev.kind.gpu_form, other.kind.gpu_form
            if mine is None or theirs is None or mine.clashes(theirs) or not dev.kind.form:
                blocked = True
                break
        if not blocked:
            out.append(dev.name)
    return sorted(out)


def node_view(settings: Settings) -> NodeView:
    """Discovery, the claim records and the saved taints (blocking: runs discovery)."""
    from agent.app import oneshot
    from agent.claims.store import ClaimStore
    from agent.health import pluginholds
    from agent.health.conditions import read_saved
    from agent.health.requests import health_dir

    devices, not_published = asyncio.run(oneshot.discover_once(settings))
    records, problems = ClaimStore(settings.claims_state_dir).load_all()
    prepared = sorted((f"{r.namespace}/{r.name}", [d.device for d in r.devices]) for r in records.values())
    held = {d for _, names in prepared for d in names}
    try:
        causes, _ = read_saved(health_dir(settings))
    except FileNotFoundError:
        causes = []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        causes = []
        problems.append(("causes.json", f"unreadable: {exc}"))
    taints = [{"device": c.device, "key": f"{settings.driver_name}/{c.kind}", "value": c.value,
               "effect": c.effect, "cause": c.detail} for c in causes]
    caused = {c.device for c in causes if c.effect in BLOCKING_EFFECTS}
    # The GPUs held for a device plugin (agent.health.pluginholds): tainted NoSchedule too.
    plugin_holds: Collection[pluginholds.Hold]
    try:
        plugin_holds = list(pluginholds.read_saved(health_dir(settings)).held.values())
    except FileNotFoundError:
        plugin_holds = ()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        plugin_holds = ()
        problems.append((pluginholds.HOLDS_FILE, f"unreadable: {exc}"))
    taints += [{"device": h.device, "key": f"{settings.driver_name}/{pluginholds.KEY}", "value": h.reason,
                "effect": pluginholds.EFFECT, "cause": h.detail} for h in plugin_holds]
    caused |= {h.device for h in plugin_holds}
    # A GPU's taints are its forms' too (`Kind.form`): the same hardware.
    hardware = {_hardware(d) for d in devices if d.name in caused}
    tainted = caused | {d.name for d in devices if d.kind.form and _hardware(d) in hardware}
    return NodeView(devices, prepared, taints, free_devices(devices, held, tainted),
                    [f"unreadable record {n}: {why}" for n, why in problems] + [f"not published: {line}"
                                                                               for line in not_published])


class ClusterViewError(Exception):
    """No cluster view: no API server, the API not served, refused, or no answer in time."""


async def cluster_view(settings: Settings, timeout: float) -> dict[str, Any]:
    """The pool's status as a ResourcePoolStatusRequest gives it (the `PoolStatus` in API form)."""
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.models.resource_v1alpha3 import ResourcePoolStatusRequestSpec
    from lightkube.resources.resource_v1alpha3 import ResourcePoolStatusRequest

    if settings.offline is not None:
        raise ClusterViewError(f"offline (--offline {settings.offline}): no API server to ask")
    client, source = await kube.connect(settings)
    if client is None:
        raise ClusterViewError(source)
    try:
        meta = ObjectMeta(generateName=f"dra-agent-{settings.node_name}-"[:58])
        spec = ResourcePoolStatusRequestSpec(driver=settings.driver_name, poolName=settings.node_name, limit=1)
        try:
            async with asyncio.timeout(settings.api_timeout):
                created = await client.create(ResourcePoolStatusRequest(metadata=meta, spec=spec))
        except Exception as exc:
            raise ClusterViewError(_why(exc)) from exc
        name = str(created.metadata.name if created.metadata else "")
        try:
            return await _wait(client, name, timeout)
        finally:
            try:
                async with asyncio.timeout(settings.api_timeout):
                    await client.delete(ResourcePoolStatusRequest, name)
            except Exception:  # the controller deletes finished requests after a while anyway
                pass
    finally:
        await client.close()


async def _wait(client: Any, name: str, timeout: float) -> dict[str, Any]:
    from lightkube.resources.resource_v1alpha3 import ResourcePoolStatusRequest

    deadline = time.monotonic() + timeout
    while True:
        try:
            obj = kube.plain(await client.get(ResourcePoolStatusRequest, name))
        except Exception as exc:
            if not kube.is_retryable(exc):
                raise ClusterViewError(_why(exc)) from exc
            obj = {}
        status = obj.get("status")
        if status:
            failed = [c for c in status.get("conditions") or [] if c.get("type") == "Failed"
                      and c.get("status") == "True"]
            if failed:
                raise ClusterViewError(f"the request failed: {failed[0].get('message') or failed[0].get('reason')}")
            pools = status.get("pools") or []
            if not pools:
                raise ClusterViewError("the cluster knows no pool of this driver named after this node (nothing "
                                       "published yet?)")
            return dict(pools[0])
        if time.monotonic() > deadline:
            raise ClusterViewError(f"ResourcePoolStatusRequest {name} had no status after {timeout:g} s (is "
                                   "kube-controller-manager running its resourcepoolstatusrequest controller?)")
        await asyncio.sleep(POLL)


def _why(exc: BaseException) -> str:
    code = kube.status_code(exc)
    if code == 404:
        return (f"this API server does not serve ResourcePoolStatusRequests ({API}): they need the "
                "DRAResourcePoolStatus feature gate and --runtime-config=resource.k8s.io/v1alpha3=true")
    if code == 403:
        return (f"not allowed to create ResourcePoolStatusRequests ({kube.describe(exc)}): deploy/base grants the "
                "agent's service account requests for its own driver and node")
    return f"ResourcePoolStatusRequest: {kube.describe(exc)}"


def _count(value: Any) -> str:
    return "-" if value is None else str(value)


def format_text(settings: Settings, node: NodeView, cluster: dict[str, Any] | None, why: str) -> str:
    tainted = {t["device"] for t in node.taints if t["effect"] in BLOCKING_EFFECTS}
    c = cluster or {}
    rows = [("devices", _count(c.get("totalDevices")), f"{len(node.devices)} published"),
            ("allocated / prepared", _count(c.get("allocatedDevices")),
             f"{len({d for _, ds in node.prepared for d in ds})} prepared ({len(node.prepared)} claims)"),
            ("unavailable / tainted", _count(c.get("unavailableDevices")), f"{len(tainted)} tainted"),
            ("available / free", _count(c.get("availableDevices")), f"{len(node.free)} free")]
    lines = [f"pool {settings.node_name} of driver {settings.driver_name}"]
    if cluster is not None:
        lines.append(f"generation {c.get('generation')}, {_count(c.get('resourceSliceCount'))} slices")
        if c.get("validationError"):
            lines.append(f"the cluster says: {c['validationError']}")
    else:
        lines.append(f"no cluster view: {why}")
    lines += ["", table(rows, ("", "CLUSTER", "THIS NODE"))]
    if summary := c.get("partitionSummary"):
        lines += ["", "partition types (still allocatable of total):",
                  table([(p.get("type", ""), str(p.get("allocatable")), str(p.get("total")), p.get("attribute", ""))
                         for p in summary], ("TYPE", "ALLOCATABLE", "TOTAL", "ATTRIBUTE"))]
    if shareable := c.get("shareableSummary"):
        lines += ["", f"shareable devices: {shareable.get('fullyAvailableDevices')} fully available, "
                  f"{shareable.get('partiallyAvailableDevices')} partly",
                  table([(s.get("name", ""), str(s.get("available")), str(s.get("consumed")), str(s.get("total")))
                         for s in shareable.get("capacity") or []], ("CAPACITY", "AVAILABLE", "CONSUMED", "TOTAL"))]
    if node.prepared:
        lines += ["", table([(claim, ",".join(devs)) for claim, devs in node.prepared], ("PREPARED CLAIM", "DEVICES"))]
    if node.taints:
        lines += ["", table([(t["device"], t["key"], t["value"], t["effect"], t["cause"]) for t in node.taints],
                            ("TAINTED DEVICE", "KEY", "VALUE", "EFFECT", "CAUSE"))]
    return "\n".join(lines)


def run(settings: Settings, output: str, timeout: float) -> tuple[str, int]:
    """The command's output and exit status (1 when there is no cluster view)."""
    node = node_view(settings)
    why = ""
    try:
        cluster: dict[str, Any] | None = asyncio.run(cluster_view(settings, timeout))
    except ClusterViewError as exc:
        cluster, why = None, str(exc)
    if output == "json":
        text = dump({"pool": settings.node_name, "driver": settings.driver_name, "cluster": cluster,
                     "clusterError": why or None, "node": node.wire()}, "json")
    else:
        text = format_text(settings, node, cluster, why)
    return text, 0 if cluster is not None else 1
