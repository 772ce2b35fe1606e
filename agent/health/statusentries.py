"""What this driver says about one prepared device in a ResourceClaim's `status.devices`: the entry
(`driver`, `pool`, `device`, `shareID`), its `Ready` condition and the device's data, built from the
claim's record and the device as discovery sees it now (`agent.health.claimstatus` writes them).

- `Ready`: True (reason `Prepared`) unless the `DeviceReadiness` given by the integrator says
  otherwise (False with its reason, e.g. `LinkDown`); a device gone from the inventory is `Ready`
  False, `DeviceMissing`. `lastTransitionTime` moves only when the status does (the first one is
  the time of the prepare);
- GPUs: `data` {uuid, productName};
- NICs: `networkData` {interfaceName, ips (CIDR), hardwareAddress}.

The API rules (`agent.apirules.clip_device_status`) are applied to every entry: an offending part is
dropped and logged, never sent.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agent import apirules
from agent.health.conditions import Readiness
from agent.model import Device

log = logging.getLogger(__name__)

READY = "Ready"


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


@dataclass(frozen=True, slots=True)
class Transition:
    status: str
    time: str


def rfc3339(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class StatusEntries:
    """Builds this driver's entries of a claim, and remembers when each device's `Ready` last changed."""

    def __init__(self, driver: str, inventory: DeviceLookup, readiness: DeviceReadiness) -> None:
        self.driver = driver
        self.inventory = inventory
        self.readiness = readiness
        # (uid, device, share) -> its Ready condition since the last change; a first True dated from the
        # prepare is not kept (`_condition`).
        self._transitions: dict[tuple[str, str, str], Transition] = {}

    def forget(self, record: ClaimView) -> None:
        """The claim was unprepared: its devices' transitions go (O(devices), not a scan of every claim's)."""
        for d in record.devices:
            self._transitions.pop((record.uid, d.device, d.share_id), None)

    def entries(self, record: ClaimView) -> list[dict[str, Any]]:
        """This driver's entries for the claim, as the API accepts them."""
        allocated = {(self.driver, d.pool, d.device, d.share_id) for d in record.devices}
        out = []
        for d in record.devices:
            entry, dropped = apirules.clip_device_status(self._entry(record, d), allocated)
            for why in dropped:
                log.warning("claim %s/%s, device %s: not reporting %s", record.namespace, record.name,
                            d.device, why)
            if entry is not None:
                out.append(entry)
        return out

    def _entry(self, record: ClaimView, d: DeviceView) -> dict[str, Any]:
        entry: dict[str, Any] = {"driver": self.driver, "pool": d.pool, "device": d.device}
        if d.share_id:
            entry["shareID"] = d.share_id
        device = self.inventory.get(d.device)
        if device is None:
            ready = Readiness(False, "DeviceMissing", f"device {d.device} is no longer found on the node")
        else:
            try:
                ready = self.readiness.readiness(device)
            except Exception as exc:  # a readiness source's bug must not cost the whole status
                log.exception("readiness of %s could not be read", d.device)
                ready = Readiness(False, "ReadinessUnknown", f"readiness could not be read: {exc!r}")
        entry["conditions"] = [self._condition(record, d, ready)]
        if device is not None:
            if device.node.gpu_uuid:
                data = {"uuid": device.node.gpu_uuid}
                if isinstance(product := device.attributes.get("productName"), str) and product:
                    data["productName"] = product
                entry["data"] = data
            if device.kind == "nic":
                net: dict[str, Any] = {"ips": list(device.node.ips)}
                if device.node.interface:
                    net["interfaceName"] = device.node.interface
                if device.node.mac:
                    net["hardwareAddress"] = device.node.mac
                entry["networkData"] = net
        return entry

    def _condition(self, record: ClaimView, d: DeviceView, ready: Readiness) -> dict[str, Any]:
        status = "True" if ready.ready else "False"
        key = (record.uid, d.device, d.share_id)
        last = self._transitions.get(key)
        if last is None and ready.ready and record.prepared_at:
            # The first Ready=True dates from the prepare. Not kept: it is the same on every write
            # until a change, and 10,000 prepared claims would hold 10,000 of them.
            when = rfc3339(record.prepared_at)
        elif last is None or last.status != status:
            # Any later change (or a first False) dates from now.
            last = self._transitions[key] = Transition(status, rfc3339(time.time()))
            when = last.time
        else:
            when = last.time
        return {"type": READY, "status": status, "reason": ready.reason, "message": ready.message,
                "lastTransitionTime": when}
