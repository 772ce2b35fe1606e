"""What a claim's status entries say of its devices' binding conditions (`agent.bindingconditions`).

A device published with binding conditions and prepared for the claim has the binding condition True
beside its Ready condition (`ClaimStatusWriter._entry`). A claim that could not be prepared ahead of its
pod's binding (`agent.engine.prebind`) has, for each of its devices of this driver, the binding failure
condition True with the reason: the scheduler fails that binding, and its next attempt deallocates the
claim and allocates again, perhaps elsewhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from agent import apirules
from agent.bindingconditions import BINDING_CONDITION, BINDING_FAILURE_CONDITION
from agent.health.readytimes import rfc3339

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BindingFailure:
    """A claim that could not be prepared ahead of its pod's binding: its devices of this driver (pool,
    device, shareID) get the binding failure condition, with why."""

    devices: tuple[tuple[str, str, str], ...]
    message: str
    at: float  # Unix seconds


def binding_condition(prepared_at: float) -> dict[str, Any]:
    """The binding condition of a device prepared for the claim (True since the prepare)."""
    return {"type": BINDING_CONDITION, "status": "True", "reason": "Prepared",
            "message": "prepared on the node: the pod may be bound", "lastTransitionTime": rfc3339(prepared_at)}


def failure_entries(driver: str, failure: BindingFailure) -> list[dict[str, Any]]:
    """The driver's entries for a claim that could not be prepared for its pod's binding."""
    allocated = {(driver, pool, device, share) for pool, device, share in failure.devices}
    condition = {"type": BINDING_FAILURE_CONDITION, "status": "True", "reason": "PrepareFailed",
                 "message": failure.message[:apirules.MAX_CONDITION_MESSAGE],
                 "lastTransitionTime": rfc3339(failure.at)}
    out = []
    for pool, device, share in failure.devices:
        entry: dict[str, Any] = {"driver": driver, "pool": pool, "device": device, "conditions": [condition]}
        if share:
            entry["shareID"] = share
        clipped, dropped = apirules.clip_device_status(entry, allocated)
        for why in dropped:
            log.warning("claim status, device %s: not reporting %s", device, why)
        if clipped is not None:
            out.append(clipped)
    return out
