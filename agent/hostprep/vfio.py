"""Passthrough (VFIO) devices in prepare, unprepare and recovery.

A claim for a passthrough device (`gpu-0000-18-00-0-vfio`, a NIC VF's `nic-...-vfio`) moves the PCI
function (with its group's companions) from its host driver to vfio-pci. That is a side effect
outside the agent's files, so the claim's record says what is about to happen before it happens:

- prepare: checks first (no other form of the function prepared, the GPU idle, the group passable,
  the VFIO interface present), all without a write; then an intent record (state `binding`, every
  step of every plan and each function's original driver), then per step: record "step k is next",
  apply it. Then the CDI spec (VFIO device nodes, never /dev/nvidia*), the metadata file, and the
  final record (state `prepared`).
- unprepare: a `restoring` record first, the files removed, each function back on its original
  driver (override cleared) step by step as above, then the record removed.
- recovery: `binding` is rolled back (the kubelet retries the prepare), `restoring` is finished,
  `prepared` is re-applied (after a reboot the kernel forgot it; otherwise a no-op).

`Passthrough` is the `HostEffect` of the record's bindings (`agent.hostprep.hosteffect`); the sequences
above are run, the same for every kind of effect, by `agent.hostprep.effects.HostEffects`.

Steps are idempotent and judged against what sysfs shows now (`agent.host.vfio.bind`), so replaying a
step a crash interrupted, or rolling back from any prefix of a plan, converges: each function ends
bound to exactly the driver the record says. Every write and wait is bounded (a GPU in use is a
retryable DeviceBusy before anything moves; a step the kernel does not complete is StepFailed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable, Iterator, Sequence

from agent import counters, failpoints
from agent.claims.allocation import Allocation, VfioSettings
from agent.claims.book import ClaimBook
from agent.claims.metadata import AllocatedDevice
from agent.claims.records import ClaimRecord, DeviceBinding
from agent.errors import ClaimFailure
from agent.facts import NicFacts
from agent.host.pci import nvidia_display_functions
from agent.host.vfio.bind import DEFAULT_TIMEOUT, BindStep, FunctionBinding, StepKind, apply_step, plan_bind
from agent.host.vfio.errors import StepFailed, UsageUnknown, VfioError
from agent.host.vfio.host import VfioHost
from agent.host.vfio.inuse import check_no_vfs, check_not_open, open_holders
from agent.host.vfio.nodes import IommuBackend, host_has_iommufd, vfio_device_nodes
from agent.host.vfio.pci import VFIO_PCI, current_driver, iommu_group, passthrough_set
from agent.host.vfio.persistence import check_persistence_off
from agent.host.vfio.sriov import VfLinks, read_vf, set_vf
from agent.hostprep.hosteffect import WriteRecord
from agent.hostprep.mig import nvml_of
from agent.inventory import Inventory
from agent.inventory.gpuminors import driver_minors
from agent.inventory.passthrough import netdevs
from agent.inventory.uplinks import Leaving, node_addresses, refuse_uplinks
from agent.kinds import Kind
from agent.model import Device, DeviceNode

log = logging.getLogger(__name__)

NVIDIA_DRIVER = "nvidia"


class GroupChanged(VfioError):
    """After a reboot, a function's IOMMU group holds other functions than recorded, or is gone."""


class FormConflict(ClaimFailure):
    """The other form of a PCI function is prepared here (the scheduler's counters keep them apart)."""


def function_of(device: Device) -> str | None:
    """The PCI function a GPU, NIC or passthrough device is (its bus ID); None for others."""
    return (device.pci_bus_id or None) if device.kind.function else None


def lock_key(device: Device) -> str:
    """One lock per PCI function for both of its forms, so a native prepare and a passthrough prepare
    of one function never run at once; `device/<name>` for devices that are no function."""
    bus = function_of(device)
    return f"pci/{bus}" if bus else f"device/{device.name}"


class Passthrough:
    """The engine's passthrough side and the `HostEffect` of `bindings`; blocking (claim's thread, its locks)."""

    name = "PCI functions bound to vfio-pci"

    def __init__(self, host: VfioHost, inventory: Inventory, book: ClaimBook, *, links: VfLinks,
                 timeout: float = DEFAULT_TIMEOUT, node_ips: tuple[str, ...] = ()) -> None:
        """`links`: where the PF's driver keeps its VFs' MAC and VLAN (`agent.app.assembly.vf_links` chooses);
        `node_ips`: the Node's addresses (`--node-ips`), whose interfaces are never passed through."""
        self.host = host
        self.node_ips = node_addresses(node_ips)
        self.links = links
        self.inventory = inventory
        self.book = book
        self.timeout = timeout  # per binding step

    # -- locks and exclusion ---------------------------------------------------------------------

    def record_lock_keys(self, record: ClaimRecord) -> list[str]:
        """The lock keys of a prepared claim's devices (a passthrough device by its recorded function)."""
        bound = {b.device: b.plan.target for b in record.bindings}
        keys = set()
        for d in record.devices:
            if d.device in bound:
                keys.add(f"pci/{bound[d.device]}")
            elif (device := self.inventory.get(d.device)) is not None:
                keys.add(lock_key(device))
            else:
                keys.add(f"device/{d.device}")
        return sorted(keys)

    def check_forms(self, uid: str, allocated: Sequence[AllocatedDevice]) -> None:
        """FormConflict when a device's other form is prepared (or asked for by this same claim)."""
        natives: dict[str, list[str]] | None = None
        wanted: dict[str, set[str]] = {}
        for a in allocated:
            if (bus := function_of(a.device)) is not None:
                wanted.setdefault(bus, set()).add(a.device.name)
        for a in allocated:
            dev, bus = a.device, function_of(a.device)
            if bus is None:
                continue
            if dev.kind.passthrough:
                if natives is None:
                    natives = {}
                    for d in self.inventory.devices():
                        if not d.kind.passthrough and (b := function_of(d)) is not None:
                            natives.setdefault(b, []).append(d.name)
                others = set(natives.get(bus, ())) | {dev.name}
            else:
                others = {counters.passthrough_name(dev.kind, bus)}
            # In one claim: a passthrough device with anything else of its function, or a native one with
            # its passthrough form (two ports of one NIC function are fine).
            same_claim = wanted[bus] - {dev.name} if dev.kind.passthrough else wanted[bus] & others
            if same_claim:
                raise FormConflict(f"devices {dev.name} and {', '.join(sorted(same_claim))} are two forms of PCI "
                                   f"function {bus}: a claim can have only one")
            for other_uid in self.book.claims_holding(others, exclusive=True):
                if other_uid == uid:
                    continue
                other = self.book.record_of(other_uid)
                held = sorted(d.device for d in other.devices if d.device in others) if other else sorted(others)
                who = f"claim {other.namespace}/{other.name} ({other_uid})" if other else f"claim {other_uid}"
                why = ("a passthrough device takes the whole function" if dev.kind.passthrough
                       else "its passthrough form has it")
                raise FormConflict(f"device {dev.name}: PCI function {bus} is prepared as {', '.join(held)} for "
                                   f"{who}; {why} (retry once that claim is unprepared)")

    # -- prepare -----------------------------------------------------------------------------------

    def held(self, record: ClaimRecord) -> bool:
        return bool(record.bindings)

    def planned(self, alloc: Allocation, intent: ClaimRecord) -> ClaimRecord:
        return dataclasses.replace(intent, bindings=self.plan(alloc))

    def plan(self, alloc: Allocation) -> list[DeviceBinding]:
        """A binding per passthrough device, from what sysfs shows now; raises (nothing written) when a
        device cannot be passed through now."""
        out: list[DeviceBinding] = []
        seen: set[str] = set()
        boot: str | None = None  # read once, and only for a claim with passthrough devices
        for a in alloc.devices:
            dev = a.device
            if not dev.kind.passthrough or dev.name in seen:
                continue
            seen.add(dev.name)
            cfg = alloc.vfio.get(dev.name, VfioSettings())
            bdf = function_of(dev)
            if bdf is None:
                raise VfioError(f"device {dev.name}: its PCI function is not known")
            if cfg.iommu == IommuBackend.IOMMUFD and not host_has_iommufd(self.host.dev):
                raise VfioError(f"{cfg.where}.iommu: iommufd was asked for, but this host has no "
                                f"{self.host.dev / 'iommu'} (a kernel with CONFIG_IOMMUFD and "
                                "CONFIG_VFIO_DEVICE_CDEV); ask for legacy")
            if dev.gpu_function is not None:
                self._check_gpu_free(bdf)
            plan = plan_bind(self.host.sysfs, bdf)
            self._refuse_uplinks(dev.name, plan.functions)
            if boot is None:
                boot = self.host.boot_id()
            # What the VF has now (a previous tenant's MAC and VLAN), in the intent record before it changes.
            previous = read_vf(self.host.sysfs, self.links, bdf) if cfg.mac or cfg.vlan is not None else None
            out.append(DeviceBinding(dev.name, plan, 0, boot, cfg.iommu, cfg.mac, cfg.vlan, previous))
        return out

    def _refuse_uplinks(self, device: str, functions: Iterable[FunctionBinding]) -> None:
        """UplinkRefused when an interface of a function the binding would move is the node's uplink, as the
        links are now or as the last scan found them (`agent.inventory.uplinks`): bound to vfio-pci, the
        function's interfaces leave the host."""
        known = {(f.pci_bus_id, f.interface): f.uplink_reason for d in self.inventory.devices()
                 if isinstance(f := d.node, NicFacts)}
        refuse_uplinks([Leaving(device, name, f"Passed through with PCI function {fn.bdf} it would cut the node off, "
                                "so that function is never bound to vfio-pci", known.get((fn.bdf, name), ""))
                        for fn in functions for name in netdevs(self.host.sysfs, fn.bdf)], self.node_ips)

    def _check_gpu_free(self, bdf: str) -> None:
        """DeviceBusy when GPU `bdf` is in use on the host (SR-IOV VFs enabled, NVML persistence mode on,
        `/dev/nvidia<minor>` open), UsageUnknown when it is on the NVIDIA driver with no known minor;
        nothing for a GPU already on vfio-pci (nothing on the host can hold it)."""
        driver = current_driver(self.host.sysfs, bdf)
        if driver == VFIO_PCI:
            return
        check_no_vfs(self.host.sysfs, bdf)
        access = nvml_of(self.inventory)()
        if access is None or access.gate is None:
            check_persistence_off(access.nvml if access is not None else None, bdf)
        else:
            # Not while another claim's GPU changes drivers (NVML is let go of then): unknown, not waited
            # for; persistence mode on would keep the unbind waiting in the driver, which is bounded.
            with access.gate.use_if_up() as up:
                check_persistence_off(access.nvml if up is not None else None, bdf)
        if driver != NVIDIA_DRIVER:
            return  # unbound, or another driver: no /dev/nvidia<N> to hold
        # The agent's own NVML holds every GPU it has a handle of open: let go of before the unbind
        # (`_letting_go`), where the GPU is checked again, this process included.
        check_not_open(self.host.proc, self.host.dev, bdf, self._known_minor(bdf), but_self=True)

    def _known_minor(self, bdf: str) -> int:
        minor = self._gpu_minor(bdf)
        if minor is None:
            raise UsageUnknown(f"GPU {bdf} is bound to {NVIDIA_DRIVER} but its device minor is not known (not "
                               f"in NVML's GPUs, no {self.host.proc / 'driver' / 'nvidia' / 'gpus' / bdf}): "
                               "whether a process holds it open cannot be checked, so it is not unbound")
        return minor

    @contextlib.contextmanager
    def _letting_go(self, bindings: Sequence[DeviceBinding], *, check: bool) -> Iterator[None]:
        """Around moving the functions of `bindings` between drivers: where a GPU is among them, the agent's
        own NVML lets go of every GPU (`agent.inventory.nvmlgate`: its handles and event set hold them open,
        and the NVIDIA driver's unbind waits for every holder) and takes them up again afterwards, when NVML
        lists a GPU back on nvidia and no longer one on vfio-pci. `check`: a GPU still on nvidia is checked
        once more for holders, now without the agent's own, which must be gone."""
        gpus = [b.plan.target for b in bindings if self._is_gpu(b.device, b.plan.target)]
        access = nvml_of(self.inventory)() if gpus else None
        if access is None or access.gate is None:
            yield
            return
        with access.gate.released(f"GPU {', '.join(gpus)} changes drivers"):
            for bdf in gpus if check else ():
                if current_driver(self.host.sysfs, bdf) == NVIDIA_DRIVER:
                    check_not_open(self.host.proc, self.host.dev, bdf, self._known_minor(bdf))
            yield

    def _is_gpu(self, device: str, bdf: str) -> bool:
        dev = self.inventory.get(device)
        if dev is not None:
            return dev.gpu_function is not None
        return bdf in nvidia_display_functions(self.host.sysfs)

    def _gpu_minor(self, bdf: str) -> int | None:
        for d in self.inventory.devices():
            if d.kind is Kind.GPU and (gpu := d.gpu) is not None and gpu.pci_bus_id == bdf:
                return gpu.minor
        return driver_minors(self.host.proc).get(bdf)

    def apply(self, record: ClaimRecord, write: WriteRecord) -> ClaimRecord:
        """Apply the `binding` record's plans, writing "step k is next" before each step; returns the
        record as last written."""
        with self._letting_go(record.bindings, check=True):
            for i, b in enumerate(record.bindings):
                if b.sets_vf:
                    self._set_vf(b)
                record = self._run(record, i, b.plan.steps, write, "bind")
        return record

    def undo_intent(self, record: ClaimRecord) -> ClaimRecord:
        """Every binding at step 0 of its restore plan."""
        return dataclasses.replace(record, bindings=[dataclasses.replace(b, step=0) for b in record.bindings])

    def undo(self, record: ClaimRecord, write: WriteRecord | None) -> ClaimRecord:
        """Put every function of the record's bindings back on its original driver (override cleared, an
        operator's override put back). With `write` (a `restoring` record), from each binding's recorded
        step, recording each step first; without (rolling back a `binding` record, which recovery rolls
        back again from any state), all steps."""
        with self._letting_go(record.bindings, check=False):
            for i, b in enumerate(record.bindings):
                if b.previous is not None:  # back to what it had, while no host driver has the VF yet
                    failpoints.hit("vf-before-restore")
                    set_vf(self.host.sysfs, self.links, b.plan.target, b.previous, with_mac=bool(b.mac))
                    failpoints.hit("vf-after-restore")
                steps = b.plan.restore().steps
                if write is None:
                    for step in steps:
                        self._step(step, "restore")
                else:
                    record = self._run(record, i, steps, write, "restore")
        return record

    def _set_vf(self, b: DeviceBinding, if_lost: bool = False) -> None:
        """The claim's MAC and VLAN on the VF, over what it had before the claim (`if_lost`: unless set)."""
        now = read_vf(self.host.sysfs, self.links, b.plan.target) if if_lost or b.previous is None else b.previous
        if if_lost and now == now.changed(b.mac, b.vlan):
            return
        before = b.previous or now  # `now` for a record from before `previous`
        failpoints.hit("vf-before-set")
        set_vf(self.host.sysfs, self.links, b.plan.target, before.changed(b.mac, b.vlan), with_mac=bool(b.mac))
        failpoints.hit("vf-after-set")

    def _run(self, record: ClaimRecord, i: int, steps: Sequence[BindStep], write: WriteRecord,
             what: str) -> ClaimRecord:
        for k in range(record.bindings[i].step, len(steps)):
            record = with_step(record, i, k)
            write(record)
            self._step(steps[k], what)
        if record.bindings[i].step != len(steps):
            record = with_step(record, i, len(steps))  # done: written with the next step or the final record
        return record

    def _step(self, step: BindStep, what: str) -> None:
        failpoints.hit(f"{what}-before-step")
        try:
            apply_step(self.host.sysfs, step, timeout=self.timeout)
        except StepFailed as exc:
            if step.kind is not StepKind.UNBIND or step.driver != NVIDIA_DRIVER:
                raise
            raise type(exc)(f"{exc}; {self._who_holds(step.bdf)}") from exc
        failpoints.hit(f"{what}-after-step")

    def _who_holds(self, bdf: str) -> str:
        """Who has GPU `bdf` open, for an unbind that does not finish (the driver waits for them)."""
        minor = self._gpu_minor(bdf)
        holders = [] if minor is None else open_holders(
            self.host.proc, {f"/dev/nvidia{minor}", str(self.host.dev / f"nvidia{minor}")})
        if holders:
            return "the GPU is open in " + "; ".join(str(h) for h in holders[:5])
        return (f"no process in {self.host.proc} has the GPU open, so one this agent cannot see does (is its /proc "
                "the host's? docs/deployment.md: The host's processes)")

    def nodes(self, binding: DeviceBinding) -> tuple[DeviceNode, ...]:
        """The VFIO device nodes of a bound device (legacy: the container and its group; iommufd: the
        IOMMU and the function's cdev)."""
        return vfio_device_nodes(self.host.sysfs, self.host.dev, [binding.plan.target], IommuBackend(binding.iommu))

    def devices(self, allocated: Iterable[AllocatedDevice], record: ClaimRecord) -> list[AllocatedDevice]:
        """The allocation with each passthrough device's VFIO nodes and configured MAC filled in."""
        by_name = {b.device: b for b in record.bindings}
        out = []
        for a in allocated:
            b = by_name.get(a.device.name)
            if b is not None:
                a = dataclasses.replace(a, device=dataclasses.replace(a.device, device_nodes=self.nodes(b)), mac=b.mac)
            out.append(a)
        return out

    # -- recovery ----------------------------------------------------------------------------------

    def reassert(self, record: ClaimRecord, write: WriteRecord) -> ClaimRecord:
        """A prepared record's bindings made true again (after a reboot the kernel forgot them; a no-op
        when they hold); the record with the current boot ID. A function whose IOMMU group has another
        number now, with the same members, is bound in it (the new number recorded first: the claim's
        files are rewritten to name it, `agent.engine.recheck`). Raises when that fails."""
        boot = self.host.boot_id()
        for i in range(len(record.bindings)):
            b = record.bindings[i]
            group = iommu_group(self.host.sysfs, b.plan.target)
            if group != b.plan.group:
                record = self._regrouped(record, i, group, boot)
                write(record)
                b = record.bindings[i]
            if any(current_driver(self.host.sysfs, f.bdf) != b.plan.driver for f in b.plan.functions):
                log.warning("claim %s/%s: %s is not bound to %s as its record says (boot %s, recorded %s): "
                            "binding it again", record.namespace, record.name, b.device, b.plan.driver,
                            boot or "?", b.boot_id or "?")
                if self._is_gpu(b.device, b.plan.target):
                    self._check_gpu_free(b.plan.target)
                if b.sets_vf:
                    self._set_vf(b)
                with self._letting_go([b], check=True):
                    for step in b.plan.steps:
                        apply_step(self.host.sysfs, step, timeout=self.timeout)
            elif b.sets_vf:  # still bound: its PF may have forgotten the claim's MAC/VLAN (a reboot, a reload)
                self._set_vf(b, if_lost=True)
            self.nodes(b)  # the nodes its CDI spec names exist again
        if any(b.boot_id != boot for b in record.bindings):
            record = dataclasses.replace(record, bindings=[dataclasses.replace(b, boot_id=boot)
                                                           for b in record.bindings])
            write(record)
        return record

    def _regrouped(self, record: ClaimRecord, i: int, group: int | None, boot: str) -> ClaimRecord:
        """The record with binding i in IOMMU group `group`, when the group holds the same functions to move
        (group numbers are the kernel's order of discovery: a reboot with other hardware or firmware
        settings can renumber them); GroupChanged when it does not (the binding plan would move others)."""
        b = record.bindings[i]
        why = ""
        if group is None:
            why = "in no IOMMU group now (the IOMMU is off)"
        else:
            try:
                moving = {f.bdf for f in passthrough_set(self.host.sysfs, b.plan.target).moving}
            except VfioError as exc:
                moving, why = set(), str(exc)
            if not why and moving != {f.bdf for f in b.plan.functions}:
                why = (f"in IOMMU group {group} now, with other functions to move ({', '.join(sorted(moving))}, "
                       f"not {', '.join(f.bdf for f in b.plan.functions)})")
        if why:
            raise GroupChanged(f"{b.device}: PCI function {b.plan.target} is {why}; it was in group {b.plan.group} "
                               f"when the claim was prepared (boot {boot or '?'}, recorded {b.boot_id or '?'}); a "
                               "new prepare of the claim uses the group it has now")
        log.warning("claim %s/%s: PCI function %s is in IOMMU group %s now, not %d: its files are rewritten to "
                    "name /dev/vfio/%s", record.namespace, record.name, b.plan.target, group, b.plan.group, group)
        assert group is not None
        bindings = list(record.bindings)
        bindings[i] = dataclasses.replace(b, plan=dataclasses.replace(b.plan, group=group))
        return dataclasses.replace(record, bindings=bindings)


def with_step(record: ClaimRecord, i: int, step: int) -> ClaimRecord:
    bindings = list(record.bindings)
    bindings[i] = dataclasses.replace(bindings[i], step=step)
    return dataclasses.replace(record, bindings=bindings)

