"""The prepare and unprepare of one claim, whole, in one worker thread holding the claim's locks
(`PrepareEngine.claim_locked`) and then its devices' locks. `PrepareEngine` runs them for the kubelet,
garbage collection and the CLI, and tells the listeners.

Order of side effects, so that a crash at any point leaves all or nothing (start-up recovery,
`agent.engine.recovery`, finishes the job):
- prepare: claim files (UID-named) -> record (fsync'd). Without the record the files are orphans
  that recovery removes.
- unprepare: record removed (fsync'd) -> files. Without the record, the rest are orphans.
- a claim with host side effects (PCI functions bound to vfio-pci, GPU partitions made for it;
  `agent.hostprep.effects`): intent record -> each effect, each step recorded first -> files -> final
  record; unprepare: restore intent -> files -> the effects undone in the reverse order of their
  application, each step recorded first -> record removed. A record left halfway (`binding`,
  `restoring`) is settled before anything else is done with the claim.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

from agent import failpoints
from agent.claims import cpuset
from agent.claims.allocation import NETWORK_KIND, Allocation, parse_claim
from agent.claims.book import ClaimBook
from agent.claims.files import ClaimFiles
from agent.claims.metadata import AllocatedDevice
from agent.claims.plan import plan_record
from agent.claims.records import ClaimRecord, DeviceBinding, FileRole
from agent.claims.toolkit import ToolkitSpecs
from agent.config import Settings
from agent.errors import ClaimFailure
from agent.facts import NicFacts
from agent.hostprep.effects import HostEffects
from agent.inventory import Inventory
from agent.inventory.uplinks import Leaving, node_addresses, refuse_uplinks
from agent.kinds import preparable_kinds
from agent.names import ClaimRef

log = logging.getLogger(__name__)

# The kinds of device the engine knows how to prepare; any other kind is refused, never half-prepared.

ClaimReader = Callable[[str, str], Mapping[str, Any]]


class PrepareFailed(ClaimFailure):
    """The claim is valid but this node cannot prepare it now (a device node missing, ...)."""


class ClaimEngine(Protocol):
    """What a claim operation uses of the engine (`agent.engine.prepare.PrepareEngine`)."""

    settings: Settings
    inventory: Inventory
    toolkit: ToolkitSpecs
    book: ClaimBook
    files: ClaimFiles
    effects: HostEffects

    def claim_locked(self, uid: str) -> AbstractContextManager[None]: ...

    def devices_locked(self, keys: Iterable[str], shared: Collection[str] = ()) -> AbstractContextManager[None]: ...

    def ensure_checked(self, uid: str) -> bool: ...

    def recheck(self, record: ClaimRecord) -> tuple[ClaimRecord, list[str]] | None: ...

    def unverified(self) -> list[str]: ...

    def current_or_purge(self, uid: str) -> ClaimRecord | None: ...


class Prepared(NamedTuple):
    """A prepared claim's record, and whether this call prepared it (else it was answered from the
    record an earlier call made: the kubelet asks again after its restart, and asks once per pod when
    the pods of a PodGroup share the claim)."""

    record: ClaimRecord
    fresh: bool


def prepare_blocking(engine: ClaimEngine, ref: ClaimRef, read: ClaimReader | None, *,
                     ahead: bool = False) -> Prepared | None:
    """Prepare the claim unless it is prepared; with `read` None, only look it up. A prepared claim is
    answered from its record once the record is checked against the host as it is now and made true
    again (`agent.engine.recheck`: the kubelet prepares again after its own restart or a reboot, which
    takes files, bindings and partitions); a claim that had to be rolled back by that check (a device
    that is another one now) is prepared again from its allocation (with `read`; without, None).
    `ahead`: prepared for its devices' binding conditions, before the kubelet asks (`ClaimRecord.ahead`)."""
    with engine.claim_locked(ref.uid):
        checked = engine.ensure_checked(ref.uid)  # the start-up check: the same as `recheck` below
        record = engine.current_or_purge(ref.uid)
        if record is not None and (record.namespace, record.name) != (ref.namespace, ref.name):
            raise PrepareFailed(f"UID {ref.uid} is prepared for claim {record.namespace}/{record.name}")
        if record is not None and not record.prepared:
            # A prepare or unprepare with host side effects that stopped halfway: settle it first.
            with engine.devices_locked(engine.effects.record_lock_keys(record)):
                engine.effects.settle(record, engine.files)
            record = None
        if record is not None and not checked:
            found = engine.recheck(record)
            record = found[0] if found is not None else None
        if record is not None:
            log.debug("%s already prepared", ref)
            return Prepared(record, fresh=False)
        if read is None:
            return None
        claim = read(ref.namespace, ref.name)
        alloc = parse_claim(claim, ref, driver=engine.settings.driver_name, pool=engine.settings.node_name,
                            lookup=engine.inventory.get, withheld=engine.inventory.withheld)
        keys = [engine.effects.lock_key(a.device) for a in alloc.devices]
        with engine.devices_locked(keys, shared=keys if all(a.device.kind.shared for a in alloc.devices) else ()):
            return Prepared(_apply(engine, alloc, ahead), fresh=True)


def unprepare_blocking(engine: ClaimEngine, ref: ClaimRef) -> ClaimRecord | None:
    """Unprepare the claim; the record it had, None when it was not prepared."""
    with engine.claim_locked(ref.uid):
        engine.ensure_checked(ref.uid)
        record = engine.current_or_purge(ref.uid)
        if record is None:
            return None
        keys = engine.effects.record_lock_keys(record)
        with engine.devices_locked(keys, shared=keys if _only_shares(engine, record) else ()):
            if not record.prepared:
                engine.effects.settle(record, engine.files)
                return record
            if engine.effects.held(record):
                engine.effects.unprepare_with_effects(record, engine.files)
                return record
            # The record goes first: a crash from here on leaves only files that no record
            # owns, which the next start removes.
            engine.book.delete(record.uid)
            failpoints.hit("unprepare-after-record")
            engine.files.remove_files(record)
        return record


def _only_shares(engine: ClaimEngine, record: ClaimRecord) -> bool:
    """Whether every device of the claim is handed out in shares (`agent.claims.locks`: their locks are
    held shared, the claims of one device exclude nothing among themselves)."""
    found = [engine.inventory.get(d.device) for d in record.devices]
    return bool(found) and all(d is not None and d.kind.shared for d in found) and not engine.effects.held(record)


def plan_claim(engine: ClaimEngine, alloc: Allocation, bindings: list[DeviceBinding]) -> ClaimRecord:
    """Every file of the prepared claim with its content, and the kubelet response
    (`agent.claims.plan`). Passthrough devices must be bound already (`bindings`), their VFIO nodes
    in their facts (`Passthrough.devices`)."""
    if unbound := {a.device.name for a in alloc.devices if a.device.kind.passthrough and not a.admin_access} \
            - {b.device for b in bindings}:
        raise PrepareFailed(f"passthrough device(s) {', '.join(sorted(unbound))} are not bound to vfio-pci")
    return plan_record(engine.settings, engine.toolkit, alloc, 1, bindings)


def _apply(engine: ClaimEngine, alloc: Allocation, ahead: bool) -> ClaimRecord:
    effects = engine.effects
    if unknown := sorted(a.device.name for a in alloc.devices if not a.device.kind.preparable):
        # Published ahead of their prepare path: refused before any side effect.
        raise PrepareFailed(f"device(s) {', '.join(unknown)} cannot be prepared by this agent version yet "
                            f"(it prepares {', '.join(preparable_kinds())} devices)")
    # Admin access (monitoring) gets a device as it is, beside whoever holds it: no exclusivity check and no
    # host side effect (no vfio-pci binding, MIG instance or mediated device made), as the API defines it.
    effects.check(alloc.ref.uid, [a for a in alloc.devices if not a.admin_access])
    _refuse_moving_uplinks(engine, alloc)
    alloc.devices = _with_cpus(engine, alloc)
    for a in alloc.devices:
        for node in a.device.device_nodes:
            if not os.path.exists(node.host_path):
                raise PrepareFailed(f"device {a.device.name}: device node {node.path} is missing "
                                    f"on the host ({node.host_path})")
    intent = effects.intent(dataclasses.replace(alloc, devices=[a for a in alloc.devices if not a.admin_access]))
    if intent is not None:
        # The intent first: from here on a crash leaves a record that recovery rolls back.
        record = effects.make(alloc, intent, lambda a, b: plan_claim(engine, a, b), engine.files)
    else:
        record = plan_claim(engine, alloc, [])
    record.ahead = ahead
    try:
        for f in record.files:
            engine.files.root_of(f.path).write(f.path, f.content, f.mode)
            failpoints.hit(_WRITTEN[f.role])
        engine.book.write(record)
    except BaseException:
        if effects.held(record):
            effects.roll_back(record, engine.files)
        else:
            engine.files.roll_back(record, engine.book)
        raise
    failpoints.hit("after-record")
    return record


def _refuse_moving_uplinks(engine: ClaimEngine, alloc: Allocation) -> None:
    """UplinkRefused for a NIC the claim moves into its pod that is the node's uplink, as the links are now
    or as the last scan found them (`agent.inventory.uplinks`; a passthrough device's function is checked
    where its binding is planned, `agent.hostprep.vfio`)."""
    fate = (f"Moved into a pod it would cut the node off, so it is never moved (a {NETWORK_KIND} with move: "
            "false leaves it on the host, for a host-network pod)")
    refuse_uplinks([Leaving(a.device.name, facts.interface, fate, facts.uplink_reason) for a in alloc.devices
                    if a.pod_interface and isinstance(facts := a.device.node, NicFacts)],
                   node_addresses(tuple(engine.settings.node_ips)))


def _with_cpus(engine: ClaimEngine, alloc: Allocation) -> list[AllocatedDevice]:
    """The claim's devices with the CPUs each share of a CPU device gets (`agent.claims.cpuset`), around
    what the other claims prepared here hold: the device locks are held, so none of those changes meanwhile.
    Until every record listed at start-up is checked the book does not know all of them, and the prepare
    is refused (retryable) rather than chosen blind."""
    shares = {a.device.name for a in alloc.devices if cpuset.share_size(a) is not None}
    if not shares:
        return alloc.devices
    if pending := engine.unverified():
        raise PrepareFailed(f"a share of {', '.join(sorted(shares))} waits for the start-up check of {len(pending)} "
                            "claim records, which may hold CPUs of it (retry in a moment)")
    others = [r for uid in engine.book.claims_holding(shares) if uid != alloc.ref.uid
              and (r := engine.book.current(uid)) is not None]
    return cpuset.assign(alloc.devices, cpuset.held_cpus(others, shares))


_WRITTEN = {FileRole.CLAIM_SPEC: "after-claim-spec", FileRole.METADATA_FILE: "after-metadata-file",
            FileRole.METADATA_SPEC: "after-metadata-spec"}  # the failpoint after each file of a prepare
