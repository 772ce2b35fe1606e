"""What a claim's status entry is built from, and what it says of a device besides its readiness.

The views (`ClaimView`, `DeviceView`) are a prepared claim as the writer sees it (a whole record or
the book's summary), `DeviceLookup` the inventory, `DeviceReadiness` the integrator's readiness
source (`agent.health.service`). `device_data` reads a device's facts (`agent.facts`): a GPU form's
`data` {uuid, productName} and a NIC's `networkData` {interfaceName, ips (CIDR), hardwareAddress}.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from agent.facts import NicFacts
from agent.health.conditions import Readiness
from agent.model import Device


class DeviceView(Protocol):
    """A prepared device, as a status entry names it (`PreparedDevice` or the book's `DeviceSummary`)."""

    @property
    def pool(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def share_id(self) -> str: ...


class ClaimView(Protocol):
    """What a claim's status is built from: a whole record (from an operation) or the book's summary."""

    @property
    def uid(self) -> str: ...

    @property
    def namespace(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def devices(self) -> Sequence[DeviceView]: ...

    @property
    def prepared_at(self) -> float: ...


class DeviceReadiness(Protocol):
    """Whether a prepared device is ready for its workload now (health, link state, ...)."""

    def readiness(self, device: Device) -> Readiness: ...


class AlwaysReady:
    def readiness(self, device: Device) -> Readiness:
        return Readiness()


class DeviceLookup(Protocol):
    def get(self, name: str) -> Device | None: ...


def device_data(device: Device) -> dict[str, Any]:
    """The entry's `data` of a form of a GPU that NVML knows, `networkData` of a NIC (none for others)."""
    out: dict[str, Any] = {}
    if (gpu := device.gpu) is not None and gpu.uuid:
        data = {"uuid": gpu.uuid}
        # The product name as the device publishes it (no fact the agent works from).
        if isinstance(product := device.attributes.get("productName"), str) and product:
            data["productName"] = product
        out["data"] = data
    if isinstance(facts := device.node, NicFacts):
        net: dict[str, Any] = {"ips": list(facts.ips)}
        if facts.interface:
            net["interfaceName"] = facts.interface
        if facts.mac:
            net["hardwareAddress"] = facts.mac
        out["networkData"] = net
    return out
