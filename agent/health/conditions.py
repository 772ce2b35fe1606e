"""Device conditions: what is wrong with a device now, why, and since when.

Events come in (an XID from NVML, a GPU lost or answering again, a NIC's link state from
each inventory scan); the taint policy (`agent.health.policy`) turns each into a *cause* with
a taint effect. The same causes feed three outputs, so they always agree:

- the taints published on the device in its ResourceSlice (`taints(device)`),
- the kubelet health stream's status and message (`health(device)`),
- the `Ready` condition of the claims holding the device (`readiness(device)`).

A cause goes only when what caused it is gone (see `agent.health.policy` for each kind), or
when an operator clears it. The current causes are saved to `<state dir>/health/causes.json`
on every change (`agent.health.causes`), and `dra-agent taints` reads them from there.
Lost-GPU and link causes are observations, re-made by the running agent, so they are not
restored. XID causes are restored at start (the GPU still needs its reset) only while nothing
says the GPU was reset since, or is another GPU:
- a cause recorded in another boot (the kernel's boot ID differs) is dropped at `load`: a
  reboot resets the GPU;
- the GPU's first answer in this run (`baseline`) drops its restored causes when the recovery
  action NVML reports is none (it was reset while no agent watched) or its UUID is not the one
  the cause was recorded for (another GPU has that name now); otherwise they are kept, and
  stamped with this boot and UUID.
A cause whose boot or UUID was not recorded (an older file, a boot ID that could not be read)
counts as unknown there: only what is known can drop it.

Not thread-safe: used on the event loop only (events from the NVML thread are handed over).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from agent.fsutil import atomic_write, makedirs
from agent.health.causes import (
    CAUSES_FILE,
    GPU_LOST,
    LINK_DOWN,
    NVML_LOST,
    UNDO_FAILED,
    XID,
    Cause,
    encode,
    read_saved,
    rfc3339,
)
from agent.health.policy import EFFECT_RANK, IGNORE, TaintPolicy, xid_meaning
from agent.model import Taint

__all__ = ["CAUSES_FILE", "GPU_LOST", "LINK_DOWN", "NONE", "NVML_LOST", "READY", "UNDO_FAILED", "UNKNOWN_ACTION",
           "XID", "Cause", "DeviceConditions", "Readiness", "read_saved", "rfc3339"]

log = logging.getLogger(__name__)

# The NVML recovery actions, as the agent spells them.
NONE = "none"
UNKNOWN_ACTION = "unknown"


@dataclass(frozen=True, slots=True)
class Readiness:
    """Whether a prepared device is ready for its workload now: the `Ready` condition of the
    claims holding it (`agent.health.claimstatus`)."""

    ready: bool = True
    reason: str = "Prepared"  # CamelCase, as a condition's reason must be
    message: str = ""


READY = Readiness()


@dataclass(slots=True)
class _Device:
    xids: dict[int, Cause] = field(default_factory=dict)
    lost: Cause | None = None
    link_down: Cause | None = None
    link_up_since: float | None = None  # up again, the link taint held until the hold time passed
    undone: Cause | None = None  # host changes of a gone claim not undone (`agent.claims.leftovers`)
    nvml: Cause | None = None  # NVML does not answer as a whole (the driver unloaded)

    def causes(self) -> list[Cause]:
        out = sorted(self.xids.values(), key=lambda c: c.since)
        out += [c for c in (self.lost, self.link_down, self.undone, self.nvml) if c is not None]
        return out

    def empty(self) -> bool:
        return (not self.xids and self.lost is None and self.link_down is None and self.undone is None
                and self.nvml is None)


class DeviceConditions:
    def __init__(self, driver: str, policy: TaintPolicy, directory: Path | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.driver = driver
        self.policy = policy
        self.directory = directory
        self.clock = clock
        self.boot_id = ""  # this kernel boot's ID, given to `load` ("": unknown)
        self._devices: dict[str, _Device] = {}
        # Device -> until when an operator cleared its XIDs (unix seconds): an XID raised before then and
        # reported only after (a command the simulated machine had queued) is not taken.
        self._cleared: dict[str, float] = {}
        self._uuids: dict[str, str] = {}  # GPU name -> UUID, from each GPU's first answer
        self._restored: set[str] = set()  # devices with restored XID causes their GPU has not confirmed
        self.version = 0  # moves on every change
        self.on_change: Callable[[set[str]], None] | None = None  # told the devices whose causes changed
        self.on_cleared: Callable[[str, list[Cause]], None] | None = None  # told what an operator cleared

    # -- events -----------------------------------------------------------------------------------

    def xid(self, device: str, xid: int, action: str = UNKNOWN_ACTION, *, at: float | None = None) -> bool:
        """An XID on `device`; `at`: when it was raised (unix seconds; default now)."""
        rule = self.policy.for_xid(xid)
        what = f"XID {xid} ({xid_meaning(xid)})"
        if not rule.taints:
            log.info("%s on %s: not tainted (policy: ignore)", what, device)
            return False
        now = self.clock()
        raised = now if at is None else min(at, now)
        if raised <= self._cleared.get(device, float("-inf")):
            log.info("%s on %s: raised before an operator cleared its XID taints: not tainted", what, device)
            return False
        detail = what if action in (NONE, UNKNOWN_ACTION) else f"{what}, recovery action {action}"
        state = self._devices.setdefault(device, _Device())
        old = state.xids.get(xid)
        state.xids[xid] = Cause(device, XID, rule.effect, str(xid), detail, old.since if old else raised,
                                now + rule.clear_after if rule.clear_after else None,
                                self.boot_id, self._uuids.get(device, ""))
        log.warning("%s on %s: taint %s/xid=%d:%s", what, device, self.driver, xid, rule.effect,
                    extra={"device": device, "xid": xid})
        return self._changed({device})

    def gpu_lost(self, device: str, reason: str) -> bool:
        state = self._devices.setdefault(device, _Device())
        if state.lost is not None or not self.policy.gpu_lost.taints:
            return False
        state.lost = Cause(device, GPU_LOST, self.policy.gpu_lost.effect, "", f"GPU lost: {reason}", self.clock())
        log.warning("%s is lost (%s): taint %s/gpu-lost:%s", device, reason, self.driver,
                    self.policy.gpu_lost.effect, extra={"device": device})
        return self._changed({device})

    def gpu_answering(self, device: str, action: str) -> bool:
        """The GPU answers again (after being lost), or its recovery action changed to `action`.
        A lost GPU that answers, and a recovery action back to none, both mean it was reset:
        its lost and XID causes go."""
        state = self._devices.get(device)
        if state is None:
            return False
        reset = state.lost is not None or action == NONE
        if not reset:
            return False
        gone = [c.detail for c in state.causes() if c.kind in (XID, GPU_LOST)]
        if not gone:
            return False
        state.lost = None
        state.xids.clear()
        log.info("%s answers again with recovery action %s: cleared %s", device, action, "; ".join(gone),
                 extra={"device": device})
        return self._changed({device})

    def baseline(self, device: str, uuid: str, action: str) -> bool:
        """The GPU's first answer in this run: which GPU it is and what it needs. Its restored XID
        causes go when it needs nothing (it was reset since they were recorded) or it is not the GPU
        they were recorded for; else they stay, stamped with this boot and this UUID."""
        if uuid:
            self._uuids[device] = uuid
        state = self._devices.get(device)
        if device not in self._restored or state is None or not state.xids:
            return False
        self._restored.discard(device)
        other = bool(uuid) and any(c.gpu_uuid and c.gpu_uuid != uuid for c in state.xids.values())
        if not other and action != NONE:
            state.xids = {x: replace(c, boot_id=c.boot_id or self.boot_id, gpu_uuid=c.gpu_uuid or uuid)
                          for x, c in state.xids.items()}
            self.save()
            return False
        why = f"another GPU ({uuid}) is {device} now" if other else "its recovery action reads none: it was reset"
        log.info("%s: restored XID taints cleared, %s: %s", device, why,
                 "; ".join(c.detail for c in state.xids.values()), extra={"device": device})
        state.xids.clear()
        return self._changed({device})

    def link(self, device: str, up: bool) -> bool:
        """The link state of a NIC as the latest scan saw it (called for every NIC on every scan)."""
        rule = self.policy.link_down
        if rule.effect == IGNORE:
            return False
        now = self.clock()
        if not up:
            state = self._devices.setdefault(device, _Device())
            state.link_up_since = None
            if state.link_down is not None:
                return False
            state.link_down = Cause(device, LINK_DOWN, rule.effect, "", f"link down since {rfc3339(now)}", now)
            log.warning("%s: link down: taint %s/link-down:%s", device, self.driver, rule.effect,
                        extra={"device": device})
            return self._changed({device})
        held = self._devices.get(device)
        if held is None or held.link_down is None:
            return False
        state = held
        if state.link_up_since is None:
            state.link_up_since = now
            log.info("%s: link up again; its taint goes after %gs up", device, rule.up_hold)
        # At once when the hold time is 0; else `tick` lets it go when the time has come.
        return self._release_link(device, state, now) and self._changed({device})

    def undo_failed(self, leftovers: dict[str, str]) -> bool:
        """The devices with host changes a gone claim's unprepare could not undo now (device -> why); the
        causes of devices not named go (undone, or cleared)."""
        rule, changed = self.policy.undo_failed, set()
        for name in [n for n, state in self._devices.items() if state.undone is not None and n not in leftovers]:
            self._devices[name].undone = None
            changed.add(name)
        for name, detail in leftovers.items() if rule.taints else ():
            state = self._devices.setdefault(name, _Device())
            if state.undone is None or state.undone.detail != detail:
                since = state.undone.since if state.undone is not None else self.clock()
                state.undone = Cause(name, UNDO_FAILED, rule.effect, "", detail, since)
                log.warning("%s: %s: taint %s/undo-failed:%s", name, detail, self.driver, rule.effect,
                            extra={"device": name})
                changed.add(name)
        return bool(changed) and self._changed(changed)

    def nvml_lost(self, devices: Iterable[str], reason: str) -> bool:
        """NVML stopped answering as a whole: `devices` (the GPUs it had) can be neither read nor watched."""
        rule = self.policy.nvml_lost
        if not rule.taints:
            log.warning("NVML lost (%s): GPUs not tainted (policy: ignore)", reason)
            return False
        now, changed = self.clock(), set()
        for name in devices:
            state = self._devices.setdefault(name, _Device())
            if state.nvml is None:
                state.nvml = Cause(name, NVML_LOST, rule.effect, "",
                                   f"NVML lost since {rfc3339(now)}: {reason}", now)
                changed.add(name)
        if not changed:
            return False
        log.warning("NVML lost (%s): taint %s/nvml-lost:%s on %s", reason, self.driver, rule.effect,
                    ", ".join(sorted(changed)))
        return self._changed(changed)

    def nvml_back(self) -> bool:
        """NVML answers again: the nvml-lost causes go. It is a new session, after a driver that loaded again
        initialized every GPU (as a reset does): each GPU's XID causes wait for its next first answer, as those
        restored at a start do (`baseline`: gone when the recovery action reads none)."""
        self._restored |= {name for name, state in self._devices.items() if state.xids}
        changed = {name for name, state in self._devices.items() if state.nvml is not None}
        for name in changed:
            self._devices[name].nvml = None
        if not changed:
            return False
        log.info("NVML answers again: nvml-lost taint cleared on %s", ", ".join(sorted(changed)))
        return self._changed(changed)

    def clear(self, device: str, before: float | None = None) -> list[Cause]:
        """An operator clears the device's XID causes and its undo-failed cause (`dra-agent taints clear`);
        the causes cleared (`on_cleared` is told, to drop what the undo-failed one stood for). `before`:
        when the operator asked (unix seconds): an XID raised later stays, and one raised earlier but
        reported later is not taken. Lost-GPU and link causes are observations: they go when the
        hardware says so."""
        if before is not None:
            self._cleared[device] = max(before, self._cleared.get(device, float("-inf")))
        state = self._devices.get(device)
        if state is None or not (state.xids or state.undone):
            return []
        gone = [c for c in state.xids.values() if before is None or c.since <= before]
        for cause in gone:
            del state.xids[int(cause.value)]
        if state.undone is not None and (before is None or state.undone.since <= before):
            gone.append(state.undone)
            state.undone = None
        if not gone:
            return []
        if self.on_cleared is not None:
            self.on_cleared(device, gone)
        log.info("%s: taints cleared by an operator: %s", device, "; ".join(c.detail for c in gone),
                 extra={"device": device})
        self._changed({device})
        return gone

    def forget(self, devices: Iterable[str]) -> None:
        """Drop the link causes of NICs that are gone from the node (nothing left to taint)."""
        changed = set()
        for name in devices:
            state = self._devices.get(name)
            if state is not None and state.link_down is not None:
                state.link_down, state.link_up_since = None, None
                changed.add(name)
        if changed:
            self._changed(changed)

    # -- time -------------------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When `tick` next has something to do (unix seconds), or None."""
        times: list[float] = []
        for state in self._devices.values():
            times += [c.expires for c in state.xids.values() if c.expires is not None]
            if state.link_down is not None and state.link_up_since is not None:
                times.append(state.link_up_since + self.policy.link_down.up_hold)
        return min(times) if times else None

    def tick(self) -> int:
        """Let expired informational causes and held link taints go; how many went."""
        now = self.clock()
        changed: set[str] = set()
        for name, state in self._devices.items():
            expired = [x for x, c in state.xids.items() if c.expires is not None and c.expires <= now]
            for x in expired:
                log.info("%s: informational %s expired", name, state.xids.pop(x).detail)
                changed.add(name)
            if self._release_link(name, state, now):
                changed.add(name)
        if changed:
            self._changed(changed)
        return len(changed)

    def _release_link(self, device: str, state: _Device, now: float) -> bool:
        """Drop the link taint of a link up for the hold time; whether it went."""
        if (state.link_down is None or state.link_up_since is None
                or now - state.link_up_since < self.policy.link_down.up_hold):
            return False
        state.link_down, state.link_up_since = None, None
        log.info("%s: link up for %gs: link-down taint cleared", device, self.policy.link_down.up_hold)
        return True

    # -- outputs ----------------------------------------------------------------------------------

    def causes(self, device: str | None = None) -> list[Cause]:
        if device is not None:
            state = self._devices.get(device)
            return state.causes() if state else []
        return [c for name in sorted(self._devices) for c in self._devices[name].causes()]

    def tainted(self) -> set[str]:
        return {name for name, state in self._devices.items() if not state.empty()}

    def taints(self, device: str) -> list[Taint]:
        state = self._devices.get(device)
        if state is None:
            return []
        out: list[Taint] = []
        if state.xids:
            # One XID taint per device: the strongest effect, valued with the latest XID of that effect.
            top = max(state.xids.values(), key=lambda c: (EFFECT_RANK.get(c.effect, 0), c.since))
            out.append(Taint(f"{self.driver}/xid", top.effect, top.value, rfc3339(top.since)))
        if state.lost is not None:
            out.append(Taint(f"{self.driver}/gpu-lost", state.lost.effect, "", rfc3339(state.lost.since)))
        if state.link_down is not None:
            out.append(Taint(f"{self.driver}/link-down", state.link_down.effect, "",
                             rfc3339(state.link_down.since)))
        if state.undone is not None:
            out.append(Taint(f"{self.driver}/undo-failed", state.undone.effect, "", rfc3339(state.undone.since)))
        if state.nvml is not None:
            out.append(Taint(f"{self.driver}/nvml-lost", state.nvml.effect, "", rfc3339(state.nvml.since)))
        return out

    def taint_counts(self) -> dict[tuple[str, str], int]:
        """(cause kind, effect) -> how many taints are published now, counted as `taints` makes them
        (a device's XIDs are one taint)."""
        counts: dict[tuple[str, str], int] = {}
        for name in self._devices:
            for t in self.taints(name):
                key = (t.key.rsplit("/", 1)[-1], t.effect)
                counts[key] = counts.get(key, 0) + 1
        return counts

    def health(self, device: str) -> tuple[bool, str] | None:
        """(healthy, message) when the device has causes, else None. Informational causes
        (effect None) leave it healthy, with a message saying what happened."""
        causes = self.causes(device)
        if not causes:
            return None
        healthy = all(c.effect == "None" for c in causes)
        return healthy, "; ".join(c.detail for c in causes)

    def readiness(self, device: str) -> Readiness:
        state = self._devices.get(device)
        if state is None:
            return READY
        if state.lost is not None:
            return Readiness(False, "GpuLost", state.lost.detail)
        if state.link_down is not None:
            return Readiness(False, "LinkDown", state.link_down.detail)
        if state.nvml is not None:
            return Readiness(False, "NvmlLost", state.nvml.detail)
        evicting = [c for c in state.xids.values() if c.effect == "NoExecute"]
        if evicting:
            return Readiness(False, "XidError", "; ".join(c.detail for c in evicting))
        return READY

    # -- persistence ------------------------------------------------------------------------------

    def load(self, boot_id: str = "") -> None:
        """Restore the saved XID causes recorded in this boot (`boot_id`; a reboot reset the GPU),
        to be confirmed by each GPU's first answer (`baseline`)."""
        self.boot_id = boot_id
        if self.directory is None:
            return
        try:
            causes, _ = read_saved(self.directory)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("saved device conditions in %s cannot be read (%s): starting without them",
                        self.directory / CAUSES_FILE, exc)
            return
        restored, rebooted = 0, []
        for cause in causes:
            if cause.kind != XID or not cause.value.isdigit():
                continue
            if cause.boot_id and boot_id and cause.boot_id != boot_id:
                rebooted.append(f"{cause.device}: {cause.detail}")
                continue
            self._devices.setdefault(cause.device, _Device()).xids[int(cause.value)] = cause
            self._restored.add(cause.device)
            restored += 1
        if rebooted:
            log.info("not restored, the node rebooted since (a reboot resets the GPU): %s", "; ".join(rebooted))
        if restored:
            log.info("restored %d XID taints from %s", restored, self.directory / CAUSES_FILE)
        if restored or rebooted:
            self.version += 1

    def save(self) -> None:
        if self.directory is None:
            return
        try:
            makedirs(self.directory, 0o755)
            atomic_write(self.directory / CAUSES_FILE, encode(self.driver, self.clock(), self.causes()))
        except OSError as exc:
            log.warning("cannot save device conditions in %s: %s", self.directory, exc)

    def _changed(self, devices: set[str]) -> bool:
        for name in devices:
            if (state := self._devices.get(name)) is not None and state.empty():
                del self._devices[name]
        self.version += 1
        self.save()
        if self.on_change is not None:
            self.on_change(devices)
        return True

