"""The agent's probes and the state its metrics report (`agent.app.httpserver` serves them): alive when
the event loop and both gRPC servers answer, ready when the kubelet registered the plugin and the
node's slices are published.

Offline (`--offline`, or gone offline by `--offline-fallback`) the agent is ready once its slices are
written: there is no cluster whose rollout or endpoints wait on its readiness, and offline is how it
runs where no kubelet watches the registration directory (`make run`, a workstation). The kubelet's
registration is still reported, and a kubelet that rejected the plugin still makes it not ready.

The probes read the running agent through `Observed`: three frozen views, each taken when asked,
so nothing here reaches into the agent's parts or knows how they work out what they report.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from agent.app.httpserver import Check
from agent.kubelet import client as kubelet_client
from agent.metrics import AgentState


@dataclass(frozen=True, slots=True)
class SocketsView:
    """The kubelet's side of the agent: its sockets and what the kubelet said of the plugin."""

    registration: Path | None  # the registration socket, once it listens
    dra: Path | None  # the DRA socket, once it listens
    registry_dir: Path  # where the kubelet looks for plugins
    registered: bool | None = None  # what the kubelet last said (None: nothing yet)
    rejection: str = ""  # the kubelet's error when it rejected the plugin


@dataclass(frozen=True, slots=True)
class PublishedView:
    """The last publish that succeeded."""

    devices: int
    slices: int
    generation: int
    dropped: int  # attribute and capacity values left out


@dataclass(frozen=True, slots=True)
class PublishView:
    """The publish loop, once it runs (it starts when the Node is known)."""

    last: PublishedView | None  # None: nothing published yet
    up_to_date: bool
    failures: int  # attempts failed in a row
    last_error: str
    offline: bool = False  # the slices go to a directory (no API server)


@dataclass(frozen=True, slots=True)
class DevicesView:
    """The devices as the health stream and the taints have them, and the claims prepared."""

    health: tuple[tuple[str, str], ...]  # (device, status) as on the health stream
    kinds: Mapping[str, str]  # device -> kind, for the devices discovery has now
    failing_sources: tuple[str, ...]  # kinds whose latest scans failed
    taints: Mapping[tuple[str, str], int]  # (cause kind, effect) -> taints published now
    prepared_claims: int
    health_watchers: int
    prepared_devices: int = 0  # the devices of the claims prepared, one per allocation result
    quarantined: tuple[str, ...] = ()  # claim records set aside since the start (their paths)
    nvml_up: bool | None = None  # whether NVML answers the GPU probe (None: no NVML on this node)


class Observed(Protocol):
    """What the probes and the metrics read of the running agent (`agent.app.daemon.Agent`)."""

    def sockets_view(self) -> SocketsView: ...

    def publish_view(self) -> PublishView | None: ...

    def devices_view(self) -> DevicesView: ...


async def healthz(agent: Observed) -> list[Check]:
    """Alive: this answer comes from the event loop, and both gRPC servers answer a call."""
    checks = [Check("event-loop", True)]
    sockets = agent.sockets_view()
    if sockets.registration is None:
        why = "starting: recovering state and scanning devices before the sockets open"
        return [*checks, Check("registration-server", False, why), Check("dra-server", False, why)]
    registration_socket, dra_socket = sockets.registration, sockets.dra
    registration = _answers("registration-server", lambda: kubelet_client.get_info(registration_socket))
    if dra_socket is None:
        why = "starting: scanning devices and listing claim records before the DRA socket opens"
        return [*checks, await registration, Check("dra-server", False, why)]
    dra = _answers("dra-server", lambda: kubelet_client.empty_prepare(dra_socket))
    return [*checks, *await asyncio.gather(registration, dra)]


async def readyz(agent: Observed) -> list[Check]:
    """Ready: the kubelet registered the plugin, and this node's slices have been published."""
    sockets = agent.sockets_view()
    if sockets.registration is None:
        registration = Check("kubelet-registration", False, "starting: the sockets are not open yet")
    elif sockets.registered:
        registration = Check("kubelet-registration", True, "the kubelet registered the plugin")
    elif sockets.registered is False:
        registration = Check("kubelet-registration", False,
                             f"the kubelet rejected the plugin: {sockets.rejection or '(no reason given)'}")
    elif (publish := agent.publish_view()) is not None and publish.offline:
        registration = Check("kubelet-registration", True, "offline: no kubelet has registered the plugin, and "
                             f"readiness does not wait for one (a kubelet finds it in {sockets.registry_dir})")
    else:
        registration = Check("kubelet-registration", False, "the kubelet has not registered the plugin "
                             f"yet (it watches {sockets.registry_dir})")
    publish = agent.publish_view()
    if publish is None:
        slices_check = Check("slices", False, "not publishing yet (waiting for the Node)")
    elif publish.last is None:
        why = f": {publish.failures} failed attempts, the last: {publish.last_error}" if publish.failures else ""
        slices_check = Check("slices", False, "not published yet" + why)
    else:
        r = publish.last
        detail = f"{r.devices} devices in {r.slices} slices, generation {r.generation}"
        if not publish.up_to_date:
            detail += " (a newer inventory is being published" + (
                f": {publish.failures} failed attempts, the last: {publish.last_error})" if publish.failures
                else ")")
        slices_check = Check("slices", True, detail)
    return [registration, slices_check, _records(agent.devices_view().quarantined)]


QUARANTINED_SHOWN = 3


def _records(quarantined: tuple[str, ...]) -> Check:
    """Claim records set aside (unreadable, or saying what the agent never writes: `agent.claims.recordcheck`):
    named, never a reason to be unready (the agent serves every other claim, and readiness failing would not
    bring the record back)."""
    if not quarantined:
        return Check("claim-records", True, "every claim record read is readable and the agent's own")
    shown = ", ".join(quarantined[-QUARANTINED_SHOWN:]) + (" ..." if len(quarantined) > QUARANTINED_SHOWN else "")
    return Check("claim-records", True, f"{len(quarantined)} claim records set aside since the start, unreadable "
                 "or saying what this agent never writes (their claims are no longer prepared here; Events "
                 f"ClaimRecordQuarantined on the Node): {shown}")


def metrics_state(agent: Observed) -> AgentState:
    d = agent.devices_view()
    # A device that failed is known by name only; the names start with the kind (gpu-3, nic-...).
    devices = collections.Counter((d.kinds.get(name) or name.split("-", 1)[0], status) for name, status in d.health)
    state = AgentState(devices=dict(devices), failing_sources=list(d.failing_sources), taints=dict(d.taints),
                       prepared_claims=d.prepared_claims, prepared_devices=d.prepared_devices,
                       health_watchers=d.health_watchers, nvml_up=d.nvml_up)
    state.registered = agent.sockets_view().registered
    if (publish := agent.publish_view()) is not None:
        state.publish_up_to_date = publish.up_to_date
        state.publish_failures = publish.failures
        if (r := publish.last) is not None:
            state.published_devices, state.published_slices = r.devices, r.slices
            state.dropped_values = r.dropped
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
