"""The check of a prepared claim's record against the host as it is now: at start-up (recovery) and
whenever a prepare is answered from the record. The kubelet prepares a claim again after its own
restart or a node reboot (its "prepared" flag is in memory only), and a reboot takes what the record
made: CDI specs on a tmpfs `/var/run/cdi`, metadata files under a tmpfs kubelet directory, MIG
instances, vfio-pci bindings, mediated devices. It also renumbers: iommufd device files
(`/dev/vfio/devices/vfio<N>`) are numbered in bind order, an IOMMU group may get another number, and a
GPU that does not come back shifts the minors of the GPUs after it, so `gpu-<minor>` is another GPU.

The check, holding the claim's lock and its devices' locks, in order:

1. Identity: each device is the one the claim was prepared with (its PCI function, a GPU's UUID, a
   partition's GPU, a binding's function). A device that is another one now, or is gone while
   discovery works, cannot be made true again: the claim is rolled back (files and host effects
   undone, record removed), so that the kubelet's prepare prepares it again from its allocation as
   the node publishes it now, or fails with a precise error. Never is a claim served with another
   GPU's device node.
2. Host effects for this boot (`HostEffects.reassert`): functions bound to vfio-pci again (in a
   renumbered IOMMU group with the same members), mediated devices made again under their recorded
   UUID, MIG instances made again (with a new MIG UUID). One that cannot be made is the same roll back.
3. What the files say: the claim's CDI spec derived again from the devices as they are now (device
   nodes, the variables that describe the devices, `CUDA_VISIBLE_DEVICES`; the claim's own variables
   kept, `agent.claims.respec`) and, with it, the metadata files (a partition's UUID); when anything
   differs, a new record (fsync'd) first, then the files.
4. Every file the record names, with the recorded content: missing or different ones written again, with
   the agent's mode (`FILE_MODE`), never the record's.

The record was read through `agent.claims.recordcheck` (its paths the claim's own, its spec nothing but
device nodes and variables): what is written here is derived from the devices and the agent's own paths.

When everything holds nothing is written: after a kubelet restart alone the answer comes from the
record as it is.
"""

from __future__ import annotations

import dataclasses
import logging

from agent import failpoints
from agent.claims.cdispecs import env_prefix
from agent.claims.plan import recorded_allocation, refreshed
from agent.claims.records import FILE_MODE, ClaimRecord, FileRecord, FileRole, RecordState
from agent.claims.respec import claim_spec_of, derived, entries, respecified
from agent.engine.claimops import ClaimEngine
from agent.errors import ClaimFailure
from agent.fsutil import UnsafePath
from agent.host.vfio.pci import physical_function
from agent.kinds import PartitionKind

log = logging.getLogger(__name__)


class Replaced(ClaimFailure):
    """A device of a prepared claim is another device now (or gone): the claim is rolled back."""


def recheck(engine: ClaimEngine, record: ClaimRecord) -> tuple[ClaimRecord, list[str]] | None:
    """Steps 1 to 4 above for a prepared record (call with the claim locked): the record as it stands
    after them and the files written again, or None when the claim was rolled back (logged: why, and what
    the kubelet's next prepare does)."""
    with engine.devices_locked(engine.effects.record_lock_keys(record)):
        try:
            identity_changes(engine, record)
            record = engine.effects.reassert(record)
            record = _rewritten(engine, record)
        except (ClaimFailure, OSError) as exc:
            roll_back(engine, record, str(exc))
            return None
        repaired = repair_claim(engine, record)
    return record, repaired


def identity_changes(engine: ClaimEngine, record: ClaimRecord) -> None:
    """Replaced when a device of the record is another device now than the claim was prepared with."""
    inventory = engine.inventory
    described = entries(record)
    parts = {p.device: p for p in record.partitions}
    bound = {b.device: b for b in record.bindings}
    changes: list[str] = []
    moved = {d.device for d in record.devices if d.pod_interface}
    for name in dict.fromkeys(d.device for d in record.devices):
        dev = inventory.get(name)
        if dev is None:
            if name in moved:
                continue  # a NIC moved into the pod is not in the host's namespace: where it should be
            if inventory.judges(name):
                changes.append(f"device {name} is not on this node any more")
            continue  # discovery cannot tell now: judged at the next prepare answered from the record
        said = described[name].described
        prefix = env_prefix(name)
        bus = said.get(f"{prefix}_PCI_BUS_ID")
        if bus and dev.pci_bus_id and bus != dev.pci_bus_id:
            changes.append(f"device {name} is PCI function {dev.pci_bus_id} now, not {bus}")
        gpu = dev.gpu
        uuid = said.get(f"{prefix}_UUID")
        if gpu is not None and dev.kind.cuda_uuid and name not in parts and uuid and uuid != gpu.uuid:
            changes.append(f"device {name} is GPU {gpu.uuid} now, not {uuid}")
        if (part := parts.get(name)) is not None and gpu is not None:
            was = gpu.uuid if part.kind is PartitionKind.MIG else gpu.pci_bus_id
            # A vGPU on a GPU's SR-IOV VF has that VF as its parent: the GPU's all the same.
            if part.parent != was and physical_function(engine.effects.passthrough.host.sysfs, part.parent) != was:
                changes.append(f"device {name} is a partition of GPU {was} now, not of {part.parent}")
        if (b := bound.get(name)) is not None and dev.pci_bus_id and b.plan.target != dev.pci_bus_id:
            changes.append(f"device {name} is PCI function {dev.pci_bus_id} now, not {b.plan.target}")
    if changes:
        raise Replaced("; ".join(changes))


def _rewritten(engine: ClaimEngine, record: ClaimRecord) -> ClaimRecord:
    """The record whose files say what its devices are now (written, fsync'd, before the files are)."""
    lookup = engine.inventory.get
    allocated = recorded_allocation(record, lookup)
    if allocated is None:
        return record  # a device discovery cannot tell of now (step 1): nothing to compare it with
    spec = respecified(engine.settings.cdi_vendor, record, engine.effects.devices(allocated, record))
    if spec is None:
        return record
    i, _ = claim_spec_of(record)
    files = list(record.files)
    files[i] = FileRecord(files[i].path, spec, files[i].mode, files[i].role, files[i].request)
    new = dataclasses.replace(record, files=files)
    if (meta := refreshed(engine.settings, lookup, new)) is not None:
        new = meta[0]
    log.warning("claim %s/%s: its devices' nodes or variables are not what its CDI spec says (a reboot "
                "renumbered them, or a partition was made again): its files are rewritten", record.namespace,
                record.name)
    engine.book.write(new)
    failpoints.hit("recheck-after-record")
    return new


def roll_back(engine: ClaimEngine, record: ClaimRecord, why: str) -> None:
    """The prepared claim is taken back whole (files, host effects, record), as an unprepare does, and
    logged; when its host effects cannot be undone now its record stays in state `binding`, for the next
    operation on the claim or the next start."""
    log.error("claim %s/%s (%s) cannot stay prepared: %s; it is rolled back, and the kubelet's next prepare "
              "of it prepares it again from its allocation", record.namespace, record.name, record.uid, why)
    if not engine.effects.held(record):
        engine.book.delete(record.uid)
        engine.files.remove_files(record)
        return
    rolled = dataclasses.replace(record, state=RecordState.BINDING)
    engine.book.write(rolled)
    try:
        engine.effects.settle(rolled, engine.files)
    except (ClaimFailure, OSError) as exc:
        log.error("claim %s/%s (%s): could not undo its host changes (%s); its record stays, for the next "
                  "operation on it or the next start", record.namespace, record.name, record.uid, exc)


def repair_claim(engine: ClaimEngine, record: ClaimRecord) -> list[str]:
    """Rewrite exactly the claim's files whose content differs from its record (missing ones
    included), with the agent's mode; returns their paths. Call with the claim locked. Used by the check
    above and by `agent.engine.selfheal` while running. A claim spec is written only when it is what the
    devices give now (`agent.claims.respec.derived`; the check above made the record say so): one
    changed on disk since that check (by anyone but this agent) is left to the claim's next check, never
    written as it says."""
    repaired = []
    for f in record.files:
        try:
            root = engine.files.root_of(f.path)
        except UnsafePath as exc:
            log.error("claim %s/%s: cannot repair %s: %s", record.namespace, record.name, f.path, exc)
            continue
        try:
            ok = root.read(f.path) == f.content
        except OSError:
            ok = False
        if not ok:
            if f.role is FileRole.CLAIM_SPEC and not _derived_spec(engine, record, f.content):
                log.error("claim %s/%s: not repairing %s: its record's CDI spec is not what the claim's devices "
                          "give now; the claim's next check derives it again", record.namespace, record.name,
                          f.path)
                continue
            try:
                root.write(f.path, f.content, FILE_MODE)
            except UnsafePath as exc:
                log.error("claim %s/%s: cannot repair %s: %s", record.namespace, record.name, f.path, exc)
                continue
            repaired.append(f.path)
    return repaired


def _derived_spec(engine: ClaimEngine, record: ClaimRecord, content: bytes) -> bool:
    """Whether `content` is the claim spec the record's devices give now; also true when discovery cannot
    tell of a device now (the record, checked as it was read, is all there is to go by)."""
    allocated = recorded_allocation(record, engine.inventory.get)
    if allocated is None:
        return True
    try:
        return derived(engine.settings.cdi_vendor, record, engine.effects.devices(allocated, record)) == content
    except (ClaimFailure, OSError):
        return False
