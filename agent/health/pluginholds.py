"""GPUs a device plugin holds: published with a NoSchedule taint of the agent's own until no pod of a
device plugin can be using them (docs/migration.md).

A node that moves from a device plugin (the NVIDIA device plugin's `nvidia.com/gpu`) to the agent has both
for a while: the device plugin gives GPUs to pods by their extended resource, the agent publishes the same
GPUs for claims. Nothing in Kubernetes stops the scheduler giving one GPU to both. So the agent holds them:

- while a device plugin serves one of the names (`--device-plugin-resources`) on this node (the Node's
  allocatable for it above 0: the kubelet reports a registered plugin's healthy devices there, and 0 once
  the plugin has gone), every GPU is held, and with it every form of it (MIG placement, share,
  passthrough twin: `agent.health.service.DeviceHealthService.published` lays a GPU's taints over its
  forms);
- once none serves, a GPU is held while a container on the node still has it as a device-plugin device
  (the kubelet's pod resources service, `agent.kube.podresources`), and free at once otherwise.

The device IDs are the device plugin's: a GPU's UUID (`GPU-...`) or NVML index (`3`) as the NVIDIA device
plugin's `deviceIDStrategy` (uuid or index) names them, a MIG device's UUID (`MIG-...`) or `<gpu>:<mig>`
index, each possibly with a `::<replica>` suffix (time-slicing's replicas). An ID that names no GPU the
agent knows holds every GPU: the agent cannot tell which GPU the container has, and giving it out twice
is the one thing this exists to prevent.

What cannot be known is held as last known: when the pod resources service does not answer, the GPUs held
at its last answer stay held (before any answer, every GPU is held while the Node lists one of the names in
its capacity: a device plugin was here and its pods may still run).

The taint is the hold's own key (`<driver>/device-plugin`), beside the health taints and never instead of
them: a GPU that an XID taints stays tainted when its hold goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import msgspec
import orjson

from agent.facts import GpuFacts
from agent.kinds import Kind
from agent.model import Device, Taint
from agent.names import PluginResources

if TYPE_CHECKING:
    import lightkube

    from agent.events import NodeEvents
    from agent.kube.podresources import NodePods
    from agent.kube.watch import Head

log = logging.getLogger(__name__)

KEY = "device-plugin"  # the taint's key is `<driver>/device-plugin`
EFFECT = "NoSchedule"
SERVING, IN_USE, UNKNOWN = "serving", "in-use", "unknown"  # the taint's value: why the GPU is held
POLL_INTERVAL = 5.0  # seconds between pod resources reads while a GPU is held or a device plugin serves
DEFAULT_NAMES = "nvidia.com/gpu,nvidia.com/mig-*"


@dataclass(frozen=True, slots=True)
class GpuRef:
    """A GPU as the device plugin's IDs may name it."""

    device: str  # the agent's device name (gpu-0)
    uuid: str  # GPU-...
    index: int  # NVML's index


def gpus_of(devices: Iterable[Device]) -> list[GpuRef]:
    """The whole GPUs among `devices` (their forms follow them by their PCI function)."""
    return [GpuRef(d.name, d.node.gpu.uuid, d.node.gpu.index) for d in devices
            if d.kind is Kind.GPU and isinstance(d.node, GpuFacts)]


@dataclass(frozen=True, slots=True)
class Hold:
    """Why one GPU is held now."""

    device: str
    reason: str  # SERVING | IN_USE | UNKNOWN
    detail: str  # for people


@dataclass(frozen=True, slots=True)
class NodeResources:
    """The Node's extended resources of the plugin's names, as its status says: name -> count."""

    allocatable: Mapping[str, int]
    capacity: Mapping[str, int]

    def serving(self) -> dict[str, int]:
        return {name: n for name, n in self.allocatable.items() if n > 0}


def node_resources(status_allocatable: Mapping[str, str], status_capacity: Mapping[str, str],
                   names: PluginResources) -> NodeResources:
    return NodeResources({k: _count(v) for k, v in status_allocatable.items() if names.matches(k)},
                         {k: _count(v) for k, v in status_capacity.items() if names.matches(k)})


def _count(quantity: str) -> int:
    """An extended resource's count (a whole number; anything else that is not zero counts as one)."""
    try:
        return int(quantity)
    except ValueError:
        return 0 if quantity.strip() in ("", "0") else 1


def assigned_ids(pods: NodePods, names: PluginResources) -> dict[str, list[str]]:
    """Device ID -> the pods (`namespace/name`) whose containers have it, for the plugin's names."""
    out: dict[str, list[str]] = {}
    for pod in pods.pods:
        for container in pod.containers:
            for devices in container.plugin_devices:
                if names.matches(devices.resource):
                    for device_id in devices.ids:
                        holders = out.setdefault(device_id, [])
                        if (who := f"{pod.namespace}/{pod.name}") not in holders:
                            holders.append(who)
    return out


def gpu_of(device_id: str, gpus: Iterable[GpuRef], mig_parents: Mapping[str, str]) -> GpuRef | None:
    """The GPU a device plugin's device ID names, or None."""
    base = device_id.split("::", 1)[0]  # a time-slicing replica of the device
    if base.startswith("MIG-"):
        base = mig_parents.get(base, "")
    elif ":" in base:  # <gpu index>:<mig index>
        base = base.split(":", 1)[0]
    for gpu in gpus:
        if base == gpu.uuid or base == str(gpu.index):
            return gpu
    return None


def holds(gpus: list[GpuRef], node: NodeResources | None, assigned: Mapping[str, list[str]] | None,
          mig_parents: Mapping[str, str] | None = None) -> dict[str, Hold]:
    """Device name -> why it is held: every GPU while a device plugin serves (`node`); else the GPUs the
    device-plugin devices of pods on this node (`assigned`) are on; every GPU for an ID that names none,
    or when `assigned` is not known and the Node's capacity says a device plugin was here."""
    if node is not None and (serving := node.serving()):
        said = ", ".join(f"{name} (allocatable {n})" for name, n in sorted(serving.items()))
        return {g.device: Hold(g.device, SERVING, f"a device plugin serves {said} on this node") for g in gpus}
    if assigned is None:
        if node is not None and node.capacity:
            return {g.device: Hold(g.device, UNKNOWN, "a device plugin served " + ", ".join(sorted(node.capacity))
                                   + " here and the kubelet's pod resources service does not say which GPUs its "
                                   "pods still hold") for g in gpus}
        return {}
    out: dict[str, Hold] = {}
    for device_id, pods in sorted(assigned.items()):
        gpu = gpu_of(device_id, gpus, mig_parents or {})
        if gpu is None:
            detail = (f"device-plugin device {device_id!r} of pod {', '.join(pods)} names no GPU the agent knows: "
                      "every GPU is held while it is assigned")
            return {g.device: Hold(g.device, UNKNOWN, detail) for g in gpus}
        if gpu.device not in out:
            out[gpu.device] = Hold(gpu.device, IN_USE, f"pod {', '.join(pods)} has it from a device plugin "
                                                       f"({device_id})")
    return out


HOLDS_FILE = "device-plugin.json"  # in the health directory, beside causes.json
FORMAT_VERSION = 1


def encode(view: HoldsView) -> bytes:
    """`<state>/health/device-plugin.json`: what the running agent holds for a device plugin now, for `doctor` and
    `pool status` (processes of their own)."""
    return orjson.dumps({"version": FORMAT_VERSION, "names": view.names, "serving": dict(view.serving),
                         "podsError": view.pods_error,
                         "held": [{"device": h.device, "reason": h.reason, "detail": h.detail}
                                  for h in sorted(view.held.values(), key=lambda h: h.device)]},
                        option=orjson.OPT_INDENT_2)


def read_saved(directory: Path) -> HoldsView:
    """The holds the running agent saved; FileNotFoundError when it saved none (it has not run here, or looks
    for no device plugin), ValueError when the file is not one it writes."""
    doc = orjson.loads((directory / HOLDS_FILE).read_bytes())
    if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
        raise ValueError(f"{directory / HOLDS_FILE}: not a version {FORMAT_VERSION} holds file")
    held = {str(h["device"]): Hold(str(h["device"]), str(h["reason"]), str(h["detail"])) for h in doc["held"]}
    return HoldsView(str(doc["names"]), {str(k): int(v) for k, v in doc["serving"].items()}, held,
                     str(doc["podsError"]))


class PodDevices(Protocol):
    """What the pods on this node hold (`agent.kube.podresources.PodResourcesClient`)."""

    async def list(self) -> NodePods: ...


class _StatusHead(msgspec.Struct, frozen=True):
    allocatable: dict[str, str] = msgspec.field(default_factory=dict)
    capacity: dict[str, str] = msgspec.field(default_factory=dict)


@functools.cache
def _node_head() -> type[Head]:
    """The part of a Node the watch reads (made at first use: the watch's module loads the API client)."""
    from agent.kube.watch import Head

    class NodeHead(Head, frozen=True):
        status: _StatusHead = msgspec.field(default_factory=_StatusHead)

    return NodeHead


@dataclass(frozen=True, slots=True)
class HoldsView:
    """For `doctor`, the metrics and the log: what is held and why, and what the agent reads it from."""

    names: str
    serving: Mapping[str, int]
    held: Mapping[str, Hold]
    pods_error: str  # why the pod resources service did not answer last ("": it did)


class PluginHolds:
    """The running agent's holds: the own Node's status (one field-selected watch) and the pod resources service
    read while anything may be held; `on_change` is called when the held set changes (the slices follow)."""

    def __init__(self, names: PluginResources, driver: str, pods: PodDevices | None,
                 gpus: Callable[[], list[GpuRef]], on_change: Callable[[], Awaitable[None]], *,
                 mig_parents: Callable[[], Mapping[str, str]] | None = None,
                 events: NodeEvents | None = None, directory: Path | None = None) -> None:
        self.names = names
        self.key = f"{driver}/{KEY}"
        self.pods = pods
        self.gpus = gpus
        self.on_change = on_change
        self.mig_parents = mig_parents
        self.events = events
        self.directory = directory  # where the holds are saved for `doctor` and `pool status` (None: not saved)
        self.node: NodeResources | None = None
        self.assigned: dict[str, list[str]] | None = None
        self.pods_error = ""
        self.held: dict[str, Hold] = {}
        self._since: dict[str, float] = {}
        self._saved = False
        self._parents: dict[str, str] = {}  # MIG device UUID -> its GPU's UUID, as NVML said last
        self._wake = asyncio.Event()
        self._event_tasks: set[asyncio.Task[bool]] = set()

    # -- inputs -------------------------------------------------------------------------------------

    def node_seen(self, allocatable: Mapping[str, str], capacity: Mapping[str, str]) -> bool:
        """The Node's status as last read; whether what it says of the plugin's names changed."""
        node = node_resources(allocatable, capacity, self.names)
        if node == self.node:
            return False
        self.node = node
        self._wake.set()  # read the pods now: a plugin that stopped may have left pods on GPUs
        return True

    async def read_pods(self) -> None:
        """Ask the kubelet which device-plugin devices pods on this node have."""
        from agent.kube.podresources import PodResourcesUnavailable

        if self.pods is None:
            return
        try:
            pods = await self.pods.list()
        except PodResourcesUnavailable as exc:
            if str(exc) != self.pods_error:
                # Said as a warning only where it matters now: garbage collection warns of the socket already.
                matters = bool(self.held) or bool(self.node and (self.node.serving() or self.node.capacity))
                log.log(logging.WARNING if matters else logging.INFO,
                        "device plugin holds: %s; the GPUs held stay held", exc)
            self.pods_error = str(exc)
            return
        self.pods_error = ""
        self.assigned = assigned_ids(pods, self.names)

    async def refresh(self, notify: bool = True) -> bool:
        """Work out the holds again; when they changed, log it, post a Node event and call `on_change` (unless
        not `notify`: the caller publishes). Whether they changed."""
        gpus = self.gpus()
        # NVML is asked only for a MIG UUID not placed yet: a MIG device stays on its GPU while it exists, and
        # the pods are read every few seconds while anything is held.
        migs = {i.split("::", 1)[0] for i in self.assigned or ()} - set(self._parents)
        if self.mig_parents is not None and any(m.startswith("MIG-") for m in migs):
            self._parents = dict(await asyncio.to_thread(self.mig_parents))
        # `assigned` is the last answer: a read that failed kept it (None: none yet).
        new = holds(gpus, self.node, self.assigned, self._parents)
        if new == self.held:
            if not self._saved:  # the first: what an earlier run saved is replaced
                await self.save()
            return False
        now, old = time.time(), self.held
        gone = sorted(set(old) - set(new))
        came = sorted(set(new) - set(old))
        for name in came:
            self._since[name] = now
        for name in gone:
            self._since.pop(name, None)
        self.held = new
        if came or any(old[n] != h for n, h in new.items() if n in old):
            log.warning("device plugin holds: %s held (taint %s): %s", ", ".join(sorted(new)) or "none", self.key,
                        _reasons(new))
        if gone:
            log.info("device plugin holds: %s free now (no device plugin serves them and no pod of one holds "
                     "them)", ", ".join(gone))
        self._post(came, gone)
        await self.save()
        if notify:
            await self.on_change()
        return True

    # -- outputs ------------------------------------------------------------------------------------

    async def save(self) -> None:
        if self.directory is None:
            return
        from agent.fsutil import atomic_write, makedirs

        path, data = self.directory / HOLDS_FILE, encode(self.view())
        try:
            await asyncio.to_thread(makedirs, self.directory)
            await asyncio.to_thread(atomic_write, path, data)
            self._saved = True
        except OSError as exc:
            log.warning("could not save the device plugin holds for doctor and pool status in %s: %s", path, exc)

    def taints(self, device: str) -> list[Taint]:
        hold = self.held.get(device)
        if hold is None:
            return []
        since = datetime.datetime.fromtimestamp(int(self._since.get(device, time.time())), datetime.UTC)
        return [Taint(self.key, EFFECT, hold.reason, since.strftime("%Y-%m-%dT%H:%M:%SZ"))]

    def view(self) -> HoldsView:
        return HoldsView(str(self.names), dict(self.node.serving()) if self.node else {}, dict(self.held),
                         self.pods_error)

    # -- the loop -----------------------------------------------------------------------------------

    async def run(self, client: lightkube.AsyncClient | None, node: str) -> None:
        """Follow the Node (when there is a client) and read the pods while anything may be held."""
        tasks = [asyncio.create_task(self._poll(), name="device plugin holds")]
        if client is not None:
            tasks.append(asyncio.create_task(self._watch(client, node), name="device plugin holds: Node"))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            for done in (*tasks, *self._event_tasks):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await done

    async def _watch(self, client: lightkube.AsyncClient, node: str) -> None:
        from lightkube.resources.core_v1 import Node

        from agent.kube.watch import watch_forever

        async for event in watch_forever(client, Node, f"Node {node}", head=_node_head(),
                                         fields={"metadata.name": node}):
            status: _StatusHead = cast(Any, event.head).status  # NodeHead's
            if event.type != "DELETED" and self.node_seen(status.allocatable, status.capacity):
                await self.read_pods()  # first: a device plugin that just stopped may have given a GPU out since
                await self.refresh()

    async def _poll(self) -> None:
        while True:
            # Idle (nothing held, no device plugin serving) it waits for the Node: a device plugin's pods can get
            # GPUs only once one serves, which the Node shows first.
            busy = bool(self.held) or bool(self.node and self.node.serving())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL_INTERVAL if busy else None)
            self._wake.clear()
            await self.read_pods()
            await self.refresh()

    def _post(self, came: list[str], gone: list[str]) -> None:
        from agent.events import NodeEvent

        if self.events is None:
            return
        posted: list[NodeEvent] = []
        if came:
            posted.append(NodeEvent("DevicePluginHoldsGpus", "Taint", (
                f"{', '.join(came)} published with taint {self.key} (NoSchedule): {_reasons(self.held, came)}; no "
                "claim gets them until no device plugin serves them and no pod of one has them")))
        if gone:
            posted.append(NodeEvent("GpusReleasedByDevicePlugin", "Untaint", (
                f"{', '.join(gone)} no longer held for a device plugin: taint {self.key} removed; claims may get "
                "them now"), type="Normal"))
        for event in posted:
            posting = asyncio.get_running_loop().create_task(self.events.post(event), name=f"event {event.reason}")
            self._event_tasks.add(posting)
            posting.add_done_callback(self._event_tasks.discard)


def _reasons(held: Mapping[str, Hold], names: Iterable[str] | None = None) -> str:
    """The distinct reasons, each with the GPUs it holds."""
    by: dict[str, list[str]] = {}
    for name in sorted(names if names is not None else held):
        by.setdefault(held[name].detail, []).append(name)
    return "; ".join(f"{', '.join(devs)}: {detail}" if len(by) > 1 else detail for detail, devs in by.items())
