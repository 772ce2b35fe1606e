"""The taint policy: which event taints a device, with which effect, and when the taint goes.

One table, with defaults that suit most nodes, replaceable in part by a YAML (or JSON) file
given with `--taint-policy FILE`:

    xid:                      # XID -> rule; XIDs not listed use `defaultXid`
      "13": {effect: None, clearAfter: 300}
      "79": {effect: NoExecute}
      "94": {effect: ignore}  # no taint at all (logged and counted only)
    defaultXid: {effect: NoSchedule}
    gpuLost: {effect: NoExecute}
    linkDown: {effect: NoSchedule, upHold: 10}
    undoFailed: {effect: NoSchedule}
    nvmlLost: {effect: NoSchedule}

A rule's `effect` is a device taint effect (`None`, `NoSchedule`, `NoExecute`) or `ignore`.
An XID taint stays until its cause is gone: the GPU was reset (the recovery action NVML
reports went back to none, or a lost GPU answers again), or `clearAfter` seconds passed (for
informational rules), or an operator cleared it (`dra-agent taints clear DEVICE`). A link
taint goes once the link has been up for `upHold` seconds without interruption: a flapping
link keeps its taint instead of flapping it.

The defaults follow what each effect does (docs/health.md, "Conditions and the default policy", has the table with
the reasons). NoExecute evicts the pods using the device at once, so it is kept for conditions
that leave the device unusable until the hardware recovers, where the pods must leave anyway for a
reset to be possible: a lost GPU, XID 79 (fallen off the bus), 95 (an uncontained ECC error: every
context on the GPU is affected), 119 and 120 (the GPU's GSP firmware timed out or failed). None
(informational: the taint tells, nothing moves) for XIDs that leave the GPU working: the
application's own errors 13, 31, 43, 45, 68 and 109, and 63, 92, 94 (a memory row remapped, a high
rate of corrected errors, an ECC error contained to the application that hit it); they go after 5
minutes. Any other XID means NoSchedule until a reset: no new work, running pods are left alone.
A link down is NoSchedule too: links come back, and a blip must not evict. So is a device whose
host changes a claim's unprepare could not undo (`undoFailed`: a lost GPU's MIG instance, a function
left on vfio-pci): its state is not what a new claim expects, and the claim that made the change is
gone already, so nothing is left to evict; the taint goes once the changes are undone (a reset, a
reboot) or an operator clears it. NVML lost as a whole (`nvmlLost`: the NVIDIA driver unloaded, as the GPU
Operator's driver container does to reload it) is NoSchedule on every GPU NVML had, and their forms: nothing
new is scheduled onto GPUs no one can see, while the pods that use them are left alone: a driver that
unloads has had them evicted already (the module does not unload while a process holds a GPU), and one
that did not unload (NVML's library gone from under the agent alone) still runs them. The GPUs stay
published as last seen rather than withheld, so their allocations, health stream entries and claim
status keep naming them; the taint goes when NVML answers again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

IGNORE = "ignore"
EFFECTS = ("None", "NoSchedule", "NoExecute")
# How strongly an effect acts, to pick the one a device's XID taint carries.
EFFECT_RANK = {"None": 0, "NoSchedule": 1, "NoExecute": 2}

APPLICATION_XIDS = (13, 31, 43, 45, 68, 109)  # the application's error, not the GPU's
WORKING_XIDS = (63, 92, 94)  # the GPU's, corrected or contained: it keeps working
UNUSABLE_XIDS = (79, 95, 119, 120)  # the GPU runs nothing until it is reset
INFORMATIONAL_CLEAR_AFTER = 300.0
LINK_UP_HOLD = 10.0

# What the common XIDs mean, for health messages and `dra-agent taints` (NVIDIA's XID catalog).
XID_MEANINGS: Mapping[int, str] = {
    13: "graphics engine exception (application error)",
    31: "GPU memory page fault (application error)",
    43: "GPU stopped processing (application error)",
    45: "preemptive cleanup after an earlier error",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    68: "video processor exception (application error)",
    69: "graphics engine class error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout (application error)",
    119: "GSP RPC timeout",
    120: "GSP error",
    121: "C2C link error",
    140: "unrecovered ECC error",
}


class PolicyError(ValueError):
    """The taint policy file cannot be used; the message says where and why."""


@dataclass(frozen=True, slots=True)
class Rule:
    effect: str  # one of EFFECTS, or IGNORE
    clear_after: float | None = None  # seconds after which the taint goes by itself

    @property
    def taints(self) -> bool:
        return self.effect != IGNORE


@dataclass(frozen=True, slots=True)
class LinkRule:
    effect: str = "NoSchedule"
    up_hold: float = LINK_UP_HOLD  # seconds the link must stay up before its taint goes


def _default_xids() -> dict[int, Rule]:
    table = {xid: Rule("None", INFORMATIONAL_CLEAR_AFTER) for xid in (*APPLICATION_XIDS, *WORKING_XIDS)}
    table.update({xid: Rule("NoExecute") for xid in UNUSABLE_XIDS})
    return table


@dataclass(frozen=True, slots=True)
class TaintPolicy:
    xid: Mapping[int, Rule] = field(default_factory=_default_xids)
    default_xid: Rule = Rule("NoSchedule")
    gpu_lost: Rule = Rule("NoExecute")
    link_down: LinkRule = LinkRule()
    undo_failed: Rule = Rule("NoSchedule")
    nvml_lost: Rule = Rule("NoSchedule")

    def for_xid(self, xid: int) -> Rule:
        return self.xid.get(xid, self.default_xid)


def xid_meaning(xid: int) -> str:
    return XID_MEANINGS.get(xid, "see NVIDIA's XID catalog")


def _rule(where: str, raw: Any, *, base: Rule | None = None) -> Rule:
    if not isinstance(raw, Mapping):
        raise PolicyError(f"{where}: must be a mapping like {{effect: NoSchedule}}")
    unknown = set(raw) - {"effect", "clearAfter"}
    if unknown:
        raise PolicyError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    effect = raw.get("effect", base.effect if base else None)
    if effect not in (*EFFECTS, IGNORE):
        raise PolicyError(f"{where}.effect: must be one of {', '.join((*EFFECTS, IGNORE))}, not {effect!r}")
    clear_after = raw.get("clearAfter", base.clear_after if base else None)
    if clear_after is not None and (isinstance(clear_after, bool) or not isinstance(clear_after, int | float)
                                    or clear_after <= 0):
        raise PolicyError(f"{where}.clearAfter: must be a positive number of seconds, not {clear_after!r}")
    return Rule(str(effect), float(clear_after) if clear_after is not None else None)


def parse_policy(doc: Any, *, source: str = "policy") -> TaintPolicy:
    """The defaults with `doc` laid over them (strict: unknown fields are errors)."""
    policy = TaintPolicy()
    if doc is None:
        return policy
    if not isinstance(doc, Mapping):
        raise PolicyError(f"{source}: must be a mapping with xid, defaultXid, gpuLost, linkDown, undoFailed and "
                          "nvmlLost")
    unknown = set(doc) - {"xid", "defaultXid", "gpuLost", "linkDown", "undoFailed", "nvmlLost"}
    if unknown:
        raise PolicyError(f"{source}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    xids = dict(policy.xid)
    raw_xids = doc.get("xid") or {}
    if not isinstance(raw_xids, Mapping):
        raise PolicyError(f"{source}.xid: must map XID numbers to rules")
    for key, raw in raw_xids.items():
        try:
            number = int(key)
        except (TypeError, ValueError):
            raise PolicyError(f"{source}.xid: {key!r} is not an XID number") from None
        if not 0 < number < 1000:
            raise PolicyError(f"{source}.xid: {number} is not an XID number (1..999)")
        xids[number] = _rule(f"{source}.xid.{number}", raw, base=xids.get(number))
    policy = replace(policy, xid=xids)
    if "defaultXid" in doc:
        policy = replace(policy, default_xid=_rule(f"{source}.defaultXid", doc["defaultXid"],
                                                   base=policy.default_xid))
    if "gpuLost" in doc:
        policy = replace(policy, gpu_lost=_rule(f"{source}.gpuLost", doc["gpuLost"], base=policy.gpu_lost))
    if "undoFailed" in doc:
        policy = replace(policy, undo_failed=_rule(f"{source}.undoFailed", doc["undoFailed"],
                                                   base=policy.undo_failed))
    if "nvmlLost" in doc:
        policy = replace(policy, nvml_lost=_rule(f"{source}.nvmlLost", doc["nvmlLost"], base=policy.nvml_lost))
    if "linkDown" in doc:
        raw = doc["linkDown"]
        if not isinstance(raw, Mapping) or set(raw) - {"effect", "upHold"}:
            raise PolicyError(f"{source}.linkDown: must be a mapping with effect and upHold")
        effect = raw.get("effect", policy.link_down.effect)
        if effect not in (*EFFECTS, IGNORE):
            raise PolicyError(f"{source}.linkDown.effect: must be one of {', '.join((*EFFECTS, IGNORE))}")
        hold = raw.get("upHold", policy.link_down.up_hold)
        if isinstance(hold, bool) or not isinstance(hold, int | float) or hold < 0:
            raise PolicyError(f"{source}.linkDown.upHold: must be a number of seconds >= 0, not {hold!r}")
        policy = replace(policy, link_down=LinkRule(str(effect), float(hold)))
    return policy


def load_policy(path: Path | None) -> TaintPolicy:
    """The policy of `--taint-policy` (the defaults without one)."""
    if path is None:
        return TaintPolicy()
    import yaml  # here: `dra-agent run` checks the policy before its first socket, and most have none

    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise PolicyError(f"--taint-policy {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise PolicyError(f"--taint-policy {path}: not YAML: {exc}") from exc
    return parse_policy(doc, source=str(path))
