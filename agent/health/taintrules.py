"""DeviceTaintRules: taints an administrator puts on devices (resource.k8s.io/v1, `DRADeviceTaintRules`).

A rule acts as if its taint were in the slice: the scheduler keeps untolerating claims off the
devices it selects, and a NoExecute rule has the eviction controller delete the pods using them.
It is not the agent's: the agent neither publishes nor clears it, and only whoever made the rule
removes it. `dra-agent taints` lists the rules that select this node's devices of our driver beside
the agent's own taints, so that a person at the node sees every reason a device is shunned.

A rule's `deviceSelector` selects the devices matching every field it sets (`driver`, `pool`,
`device`); an empty selector selects every device, and a rule without one selects none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import lightkube
from lightkube.resources.resource_v1 import DeviceTaintRule

from agent import kube

EVERY_DEVICE = "*"  # `device` of a rule that selects every device of the pool


@dataclass(frozen=True, slots=True)
class RuleTaint:
    """The taint of one DeviceTaintRule that selects devices of our driver on this node."""

    rule: str
    device: str  # the device it names, or EVERY_DEVICE
    key: str
    effect: str
    value: str = ""
    time_added: str = ""  # RFC 3339, as the API server set it


def selected(rule: Mapping[str, Any], driver: str, pool: str) -> str | None:
    """The device of our driver's `pool` that the rule selects (EVERY_DEVICE: all of them), or None."""
    selector = (rule.get("spec") or {}).get("deviceSelector")
    if not isinstance(selector, Mapping):
        return None
    if selector.get("driver") not in (None, "", driver) or selector.get("pool") not in (None, "", pool):
        return None
    return str(selector.get("device") or EVERY_DEVICE)


def rule_taint(rule: Mapping[str, Any], driver: str, pool: str) -> RuleTaint | None:
    device = selected(rule, driver, pool)
    taint = (rule.get("spec") or {}).get("taint")
    if device is None or not isinstance(taint, Mapping):
        return None
    return RuleTaint(rule=str((rule.get("metadata") or {}).get("name", "")), device=device,
                     key=str(taint.get("key", "")), effect=str(taint.get("effect", "")),
                     value=str(taint.get("value") or ""), time_added=str(taint.get("timeAdded") or ""))


async def read_rule_taints(client: lightkube.AsyncClient, driver: str, pool: str) -> list[RuleTaint]:
    """Every DeviceTaintRule that selects devices of `driver` in `pool`, by device, then rule name."""
    found = []
    async for rule in client.list(DeviceTaintRule):
        if (taint := rule_taint(kube.plain(rule), driver, pool)) is not None:
            found.append(taint)
    return sorted(found, key=lambda t: (t.device, t.rule))
