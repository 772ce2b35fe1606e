"""What a claim's status entry is built from, and what it says of a device besides its readiness.

`DeviceLookup` is the inventory, `DeviceReadiness` the integrator's readiness source
(`agent.health.service`). `device_data` reads a device's facts (`agent.facts`): a GPU form's `data`
{uuid, productName} and a NIC's `networkData` {interfaceName, ips (CIDR), hardwareAddress}.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from agent.claims.metadata import device_network_data
from agent.health.conditions import Readiness
from agent.model import Device


class DeviceReadiness(Protocol):
    """Whether a prepared device is ready for its workload now (health, link state, ...)."""

    def readiness(self, device: Device) -> Readiness: ...


class AlwaysReady:
    def readiness(self, device: Device) -> Readiness:
        return Readiness()


class DeviceLookup(Protocol):
    def get(self, name: str) -> Device | None: ...


def device_data(device: Device, made: Mapping[str, str], mac: str, pod_interface: str = "") -> dict[str, Any]:
    """The entry's `data` of a form of a GPU that NVML knows (with the identity of a partition made for
    the claim: a MIG device's own `uuid`, a mediated device's `mdevUUID`), and the `networkData` of a NIC
    or a passthrough VF (with the MAC the claim set), as its metadata file says it
    (`agent.claims.metadata.device_network_data`); nothing for other devices."""
    out: dict[str, Any] = {}
    if (gpu := device.gpu) is not None and gpu.uuid:
        data = {"uuid": gpu.uuid}
        # The product name as the device publishes it (no fact the agent works from).
        if isinstance(product := device.attributes.get("productName"), str) and product:
            data["productName"] = product
        data.update(made)
        out["data"] = data
    if (net := device_network_data(device, mac, pod_interface)) is not None:
        out["networkData"] = net
    return out
