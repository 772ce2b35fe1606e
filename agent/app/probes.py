"""The agent's probes and the state its metrics report (`agent.metrics` serves them): alive when the
event loop and both gRPC servers answer, ready when the kubelet registered the plugin and the node's
slices are published."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from agent.kubelet import client as kubelet_client
from agent.metrics import AgentState, Check

if TYPE_CHECKING:
    from agent.config import Settings
    from agent.engine.prepare import PrepareEngine
    from agent.health.service import DeviceHealthService
    from agent.inventory import Inventory
    from agent.kubelet.health import HealthTracker
    from agent.kubelet.server import Servers
    from agent.publish.loop import PublishLoop


class Agent(Protocol):
    """What the probes read of the running agent (`agent.app.daemon.Agent`)."""

    settings: Settings
    servers: Servers | None
    publish: PublishLoop | None
    inventory: Inventory
    tracker: HealthTracker
    health: DeviceHealthService
    engine: PrepareEngine | None


async def healthz(agent: Agent) -> list[Check]:
    """Alive: this answer comes from the event loop, and both gRPC servers answer a call."""
    checks = [Check("event-loop", True)]
    if agent.servers is None:
        why = "starting: recovering state and scanning devices before the sockets open"
        return [*checks, Check("registration-server", False, why), Check("dra-server", False, why)]
    s = agent.settings
    registration = _answers("registration-server", lambda: kubelet_client.get_info(s.registration_socket))
    if not agent.servers.dra_started:
        why = "starting: scanning devices and listing claim records before the DRA socket opens"
        return [*checks, await registration, Check("dra-server", False, why)]
    return [*checks, *await asyncio.gather(
        registration, _answers("dra-server", lambda: kubelet_client.empty_prepare(s.dra_socket)))]


async def readyz(agent: Agent) -> list[Check]:
    """Ready: the kubelet registered the plugin, and this node's slices have been published."""
    if agent.servers is None:
        registration = Check("kubelet-registration", False, "starting: the sockets are not open yet")
    else:
        state = agent.servers.registration_state
        if state.registered:
            registration = Check("kubelet-registration", True, "the kubelet registered the plugin")
        elif state.registered is False:
            registration = Check("kubelet-registration", False,
                                 f"the kubelet rejected the plugin: {state.error or '(no reason given)'}")
        else:
            registration = Check("kubelet-registration", False, "the kubelet has not registered the plugin "
                                 f"yet (it watches {agent.settings.registry_dir})")
    loop = agent.publish
    if loop is None:
        slices_check = Check("slices", False, "not publishing yet (waiting for the Node)")
    elif loop.last_result is None:
        why = f": {loop.failures} failed attempts, the last: {loop.last_error}" if loop.failures else ""
        slices_check = Check("slices", False, "not published yet" + why)
    else:
        r = loop.last_result
        detail = f"{r.devices} devices in {r.slices} slices, generation {r.generation}"
        if not loop.up_to_date:
            detail += " (a newer inventory is being published" + (
                f": {loop.failures} failed attempts, the last: {loop.last_error})" if loop.failures else ")")
        slices_check = Check("slices", True, detail)
    return [registration, slices_check]


def metrics_state(agent: Agent) -> AgentState:
    snapshot = agent.inventory.snapshot()
    kinds = {name: d.kind for name, d in snapshot.devices.items()}
    # A device that failed is known by name only; the names start with the kind (gpu-3, nic-...).
    devices = collections.Counter((kinds.get(h.device) or h.device.split("-", 1)[0], h.status)
                                  for h in agent.tracker.current())
    # One per published taint: a device's XIDs make one taint (agent.health.conditions).
    taints = collections.Counter((c.kind, c.effect) for c in agent.health.conditions.causes()
                                 if c.kind != "xid")
    taints.update(("xid", t.effect) for name in agent.health.conditions.tainted()
                  for t in agent.health.conditions.taints(name) if t.key.endswith("/xid"))
    state = AgentState(devices=dict(devices), failing_sources=[f.kind for f in snapshot.failing_sources],
                       taints=dict(taints),
                       prepared_claims=len(agent.engine.book) if agent.engine else 0,
                       health_watchers=agent.tracker.watchers)
    if agent.servers is not None:
        state.registered = agent.servers.registration_state.registered
    if agent.publish is not None:
        state.publish_up_to_date = agent.publish.up_to_date
        state.publish_failures = agent.publish.failures
        if (r := agent.publish.last_result) is not None:
            state.published_devices, state.published_slices = r.devices, r.slices
            state.dropped_values = len(r.dropped)
    return state


PROBE_TIMEOUT = 2.0


async def _answers(name: str, call: Callable[[], Awaitable[Any]]) -> Check:
    started = time.monotonic()
    try:
        async with asyncio.timeout(PROBE_TIMEOUT):
            await call()
    except TimeoutError:
        return Check(name, False, f"no answer within {PROBE_TIMEOUT:g}s")
    except grpc.aio.AioRpcError as exc:
        return Check(name, False, f"{exc.code().name}: {exc.details()}")
    except Exception as exc:
        return Check(name, False, f"{type(exc).__name__}: {exc}")
    return Check(name, True, f"answered in {(time.monotonic() - started) * 1000:.1f} ms")
