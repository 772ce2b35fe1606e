"""NVIDIA GPUs through NVML: one device per GPU, named by its minor number, consuming the GPU's
counter set; a passthrough variant per GPU that can go to a VM whole (`agent.inventory.passthrough`);
and, for MIG-capable GPUs unless dynamic MIG is off, one device per MIG placement on the same counter
set (`agent.inventory.mig`); then the shared form of each GPU and the host-memory overhead of every GPU
device (`agent.inventory.gpushare`).

The source calls NVML through the seam `agent.inventory.nvmlapi.Nvml` and is given what opens it
(`NvmlOpener`): on a host the real `pynvml` module, its library loaded from the driver root
(`agent.inventory.nvmlopen`, which says why when a node with NVIDIA hardware has no usable NVML);
`agent.app.assembly` chooses.

One GPU's failure costs that GPU only, whatever it raises. A GPU that fails is
reported under its device name (`gpu-<minor>`): the minor it said in an earlier
scan, or, for one that never said it, the minor the kernel driver lists for the
one GPU left over (`<proc>/driver/nvidia/gpus/<bus id>/information`, where
`<proc>` is the `proc` directory beside the sysfs root; `agent.inventory.gpuminors`).
Only when neither names it is it a `SourceProblem` ("GPU at NVML index N").

Brand and architecture are NVML codes (named in `agent.inventory.gpunames`); a
code this agent has no name for is published as `unknown-<code>` (logged once),
never dropped. NVML's own "unknown" codes are omitted.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import pynvml

from agent import quantity
from agent.apirules import normalize_version
from agent.config import Settings
from agent.errors import WholeGpuInMigMode
from agent.facts import GpuFacts, GpuIdentity, GpuShare, MigChoice
from agent.host.pci import normalize_bus_id, pci_function
from agent.inventory import DeviceFailure, ScanError, ScanResult, Withheld
from agent.inventory.gpumemory import GpuMemory
from agent.inventory.gpuminors import DRIVER_GPUS as DRIVER_GPUS  # re-exported, as driver_minors: vfioprep
from agent.inventory.gpuminors import driver_minors as driver_minors
from agent.inventory.gpuminors import name_the_rest
from agent.inventory.gpunames import ARCHITECTURES, BRANDS, NO_ARCHITECTURE, NO_BRAND
from agent.inventory.gpushare import GpuExtras
from agent.inventory.mig import MigDevices
from agent.inventory.nvmlapi import GpuCommands, NoCommands, Nvml, NvmlHandle, NvmlOpener
from agent.inventory.nvmlgate import NvmlGate
from agent.inventory.nvmlopen import probe as probe  # python -m agent.inventory.gpus --probe
from agent.inventory.nvmlvalues import describe_error
from agent.inventory.passthrough import GpuVariants
from agent.inventory.published import MIG_CAPABLE, MIG_ENABLED, attributes, with_partition_type
from agent.inventory.vgpu import VgpuDevices
from agent.kinds import Kind
from agent.model import NUMA_NODE, PCI_BUS_ID, AttrValue, Capacity, Device, DeviceNode, Version
from agent.vgpupolicy import VgpuPolicy

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_A = TypeVar("_A")

SHARED_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")

# Answers that mean "this GPU or driver has no such thing", not "this GPU is broken".
_ABSENT = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)


class _GpuFailed(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class GpuSource:
    kind = "gpu"

    def __init__(self, settings: Settings, dynamic_mig: bool | None = None, *, opener: NvmlOpener,
                 sharing: bool | None = None, host_memory_overhead: int | None = None) -> None:
        """`opener`: opens the NVML the GPUs are read through (`agent.app.assembly.nvml_opener` chooses)."""
        self.settings = settings
        self.opener = opener
        # Publish MIG placements (`--dynamic-mig`); the argument overrides the setting (tests).
        self.dynamic_mig = dynamic_mig if dynamic_mig is not None else settings.dynamic_mig
        self._mig = MigDevices(MigChoice.parse(settings.mig_profiles))
        # vGPU types the host driver offers (`--vgpu-types`, checked by Settings).
        self._vgpu = VgpuDevices(VgpuPolicy.of(settings.vgpu_types, settings.compatibility_groups))
        # Shared forms (`--gpu-sharing`) and the host-memory overhead (`--gpu-host-memory-overhead`).
        # The arguments override the settings (tests).
        self._extras = GpuExtras(settings.gpu_sharing if sharing is None else sharing,
                                 settings.gpu_host_memory_overhead if host_memory_overhead is None
                                 else host_memory_overhead, settings.compute_shares)
        # Set by the daemon when the Node declares DRANodeAllocatableResources (as for CPU and memory).
        self.node_allocatable: bool = False
        self.nvml: Nvml | None = None  # None: not open, or no GPUs
        self.sysfs_root: Path = settings.sysfs_root
        self.dev_root: Path = settings.dev_root
        # What drives the GPUs besides NVML (the event watcher's), and whether an empty file may stand in
        # for a device node (MIG prepare's): as the opener says.
        self.commands: GpuCommands = NoCommands()
        self.node_placeholders = False
        self._initialized = False
        self._minors: dict[int, int] = {}  # NVML index -> minor, to name a GPU that stops answering
        self._reported: dict[str, str] = {}  # problems already logged, logged again only when they change
        self._tracebacks: dict[int, str] = {}  # NVML index -> unexpected exception whose traceback was logged
        # Each GPU's counter set, and its passthrough variant (agent.inventory.passthrough).
        self._variants = GpuVariants()
        # Who uses NVML, and letting go of it while a GPU changes drivers (agent.inventory.nvmlgate).
        self.gate: NvmlGate | None = None
        self._generation = 0  # the gate's, as of the NVML indexes in _minors and _tracebacks
        # The GPUs NVML described this boot, for those passed through to a VM (agent.inventory.gpumemory).
        self._memory = GpuMemory(settings.state_dir, self._boot_id)

    @property
    def proc_root(self) -> Path:
        """Where the kernel driver's GPU list is read: the `proc` directory beside the sysfs root."""
        return self.sysfs_root.parent / "proc"

    def open(self) -> None:
        opened = self.opener(self.settings)
        self.nvml, self.sysfs_root, self.dev_root = opened.nvml, opened.sysfs_root, opened.dev_root
        self.commands, self.node_placeholders = opened.commands, opened.node_placeholders
        self._initialized = self.nvml is not None
        if self.nvml is not None:
            self.gate = NvmlGate(self.nvml)
            self._memory.load()

    def _boot_id(self) -> str:
        try:
            return (self.proc_root / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
        except OSError:
            return ""

    def device_name(self, index: int) -> str | None:
        """The published name of the GPU at NVML index `index`, once a scan learned its minor."""
        return None if (minor := self._minors.get(index)) is None else f"gpu-{minor}"

    def close(self) -> None:
        if not self._initialized or self.nvml is None:
            return
        self._initialized = False
        try:
            self.nvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.warning("nvmlShutdown failed: %s", describe_error(exc))

    def scan(self) -> ScanResult:
        nvml = self.nvml
        if nvml is None:
            return ScanResult()
        if self.gate is None:
            self.gate = NvmlGate(nvml)
        with self.gate.use() as generation:
            if generation != self._generation:
                # NVML was initialized again (a GPU changed drivers): its indexes mean other GPUs now.
                self._generation = generation
                self._minors.clear()
                self._tracebacks.clear()
            result, mig_on = self._scan_nvml(nvml)
        natives = list(result.devices)
        self._memory.learn(natives, self._mig.layouts)
        for away in self._memory.away(self.sysfs_root, {d.pci_bus_id for d in natives}):
            # Passed through to a VM: published as NVML last described it, with its counter set.
            result.devices.append(away.device)
            if away.layout is not None:
                self._mig.layouts.setdefault(away.device.pci_bus_id, away.layout)
        result.devices = self._variants.apply(self.sysfs_root, result.devices)
        if self.dynamic_mig:
            result.devices = self._mig.apply(result.devices)
        # After MIG, which extends the counter set the vGPU devices consume from.
        result.devices = self._vgpu.apply(self.sysfs_root, result.devices)
        # Last: a shared form takes its GPU's counter set as it is by now.
        result.devices = self._extras.apply(result.devices, node_allocatable=self.node_allocatable)
        if self.settings.partition_type_attribute:
            result.devices = [with_partition_type(d) for d in result.devices]
        # Last: every form of the GPU was made from the whole GPU (counter set, MIG placements, variant).
        result.devices, result.withheld = withhold_in_mig_mode(result.devices, mig_on)
        return result

    def mig_parents(self) -> dict[str, str]:
        """MIG device UUID -> its GPU's UUID, for every MIG device NVML lists now: a device plugin names the
        MIG devices it gives out by these (`agent.health.pluginholds`). Blocking."""
        nvml, gate, out = self.nvml, self.gate, dict[str, str]()
        if nvml is None or gate is None:
            return out
        with gate.use():
            try:
                count = nvml.nvmlDeviceGetCount()
            except pynvml.NVMLError:
                return out
            for index in range(count):
                try:
                    handle = nvml.nvmlDeviceGetHandleByIndex(index)
                    uuid = nvml.nvmlDeviceGetUUID(handle)
                    slots = nvml.nvmlDeviceGetMaxMigDeviceCount(handle)
                except pynvml.NVMLError:
                    continue
                for slot in range(slots):
                    try:
                        out[nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot))] = uuid
                    except pynvml.NVMLError:
                        continue  # no MIG device in this slot
        return out

    def _scan_nvml(self, nvml: Nvml) -> tuple[ScanResult, set[str]]:
        """The GPUs NVML lists now, as native devices, and the ones that fail; the bus IDs of those in MIG
        mode now."""
        common = self._driver_attributes(nvml)
        try:
            count = nvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            # Not a statement about any GPU: the inventory keeps the ones it has and retries.
            raise ScanError(f"nvmlDeviceGetCount failed: {describe_error(exc)}") from exc
        result = ScanResult()
        mig_on: set[str] = set()
        unnamed: dict[int, str] = {}  # NVML index -> why, for failing GPUs that never said their minor
        for index in range(count):
            try:
                result.devices.append(self._describe(nvml, index, common, mig_on))
                self._tracebacks.pop(index, None)
                continue
            except _GpuFailed as failure:
                reason = failure.message
            except Exception as exc:  # whatever one GPU's calls raise costs that GPU only
                reason = f"unexpected {type(exc).__name__}: {exc}"
                if self._tracebacks.get(index) != reason:
                    self._tracebacks[index] = reason
                    log.warning("GPU at NVML index %d: %s", index, reason, exc_info=exc)
            minor = self._minors.get(index)
            if minor is not None:
                result.failed_devices.append(DeviceFailure(f"gpu-{minor}", reason))
            else:
                unnamed[index] = reason
        if unnamed:
            known = {self._minors[i] for i in range(count) if i not in unnamed and i in self._minors}
            name_the_rest(self.proc_root, count, known, unnamed, self._minors, result)
        self._log_failures(result)
        return result, mig_on

    def _log_failures(self, result: ScanResult) -> None:
        failed = {f.device: f.reason for f in result.failed_devices} | {p.what: p.reason for p in result.problems}
        for key, why in sorted(failed.items()):
            if self._reported.get(key) != why:
                log.warning("%s is not published: %s", key, why)
        for key in sorted(set(self._reported) - set(failed)):
            if not key.startswith("<"):
                log.info("%s answers again", key)
        self._reported = {**{k: v for k, v in self._reported.items() if k.startswith("<")}, **failed}

    def _driver_attributes(self, nvml: Nvml) -> dict[str, AttrValue]:
        attrs: dict[str, AttrValue] = {}
        driver = self._system_call(nvml.nvmlSystemGetDriverVersion)
        if driver is not None:
            self._put_version(attrs, "driverVersion", str(driver))
        cuda = self._system_call(nvml.nvmlSystemGetCudaDriverVersion)
        if cuda is not None:
            # NVML packs the CUDA version as major * 1000 + minor * 10.
            self._put_version(attrs, "cudaDriverVersion", f"{int(cuda) // 1000}.{int(cuda) % 1000 // 10}")
        return attrs

    def _put_version(self, attrs: dict[str, AttrValue], name: str, text: str) -> None:
        version = normalize_version(text)
        if version is None:
            self._note(f"<{name}>", f"{name} {text!r} is not a dotted numeric version; attribute omitted")
        else:
            attrs[name] = Version(version)

    def _system_call(self, call: Callable[[], _T]) -> _T | None:
        function = call.__name__
        try:
            value = call()
        except pynvml.NVMLError as exc:
            self._note(f"<{function}>", f"{function} failed: {describe_error(exc)}; attribute omitted")
            return None
        except Exception as exc:  # a driver-wide attribute is not worth the scan
            self._note(f"<{function}>", f"{function} raised {type(exc).__name__}: {exc}; attribute omitted")
            return None
        self._reported.pop(f"<{function}>", None)
        return value

    def _note(self, key: str, message: str) -> None:
        if self._reported.get(key) != message:
            log.warning("%s", message)
            self._reported[key] = message

    @staticmethod
    def _call(call: Callable[[_A], _T], arg: _A) -> _T:
        """One GPU's NVML call; an NVMLError fails that GPU, named by the call."""
        try:
            return call(arg)
        except pynvml.NVMLError as exc:
            raise _GpuFailed(f"{call.__name__} failed: {describe_error(exc)}") from exc

    @staticmethod
    def _optional(call: Callable[[NvmlHandle], _T], handle: NvmlHandle) -> _T | None:
        """As `_call`, where a GPU or driver without the feature answers None."""
        try:
            return call(handle)
        except pynvml.NVMLError as exc:
            if exc.value in _ABSENT:
                return None
            raise _GpuFailed(f"{call.__name__} failed: {describe_error(exc)}") from exc

    def _describe(self, nvml: Nvml, index: int, common: dict[str, AttrValue], mig_on: set[str]) -> Device:
        handle = self._call(nvml.nvmlDeviceGetHandleByIndex, index)
        minor = int(self._call(nvml.nvmlDeviceGetMinorNumber, handle))
        self._minors[index] = minor
        uuid = str(self._call(nvml.nvmlDeviceGetUUID, handle))
        product = str(self._call(nvml.nvmlDeviceGetName, handle))
        pci_info = self._call(nvml.nvmlDeviceGetPciInfo, handle)
        raw_bus = pci_info.busId.decode(errors="replace") if isinstance(pci_info.busId, bytes) \
            else str(pci_info.busId)
        try:
            bus_id = normalize_bus_id(raw_bus)
        except ValueError as exc:
            raise _GpuFailed(f"nvmlDeviceGetPciInfo gave an unusable bus ID: {exc}") from exc
        memory = int(self._call(nvml.nvmlDeviceGetMemoryInfo, handle).total)

        facts = GpuFacts(GpuIdentity(uuid, index, minor, bus_id))
        attrs = attributes(facts) | {"productName": product}
        for attr, call, names, unknown in (("brand", nvml.nvmlDeviceGetBrand, BRANDS, NO_BRAND),
                                           ("architecture", nvml.nvmlDeviceGetArchitecture, ARCHITECTURES,
                                            NO_ARCHITECTURE)):
            code = self._optional(call, handle)
            if code is None or int(code) == unknown:
                continue
            name = names.get(int(code))
            if name is None:
                name = f"unknown-{int(code)}"
                self._note(f"<{attr} {int(code)}>", f"gpu-{minor}: NVML {attr} code {int(code)} has no name in "
                           f"this agent; published as {attr}={name}")
            attrs[attr] = name
        cc = self._optional(nvml.nvmlDeviceGetCudaComputeCapability, handle)
        if cc is not None:
            attrs["cudaComputeCapability"] = Version(f"{int(cc[0])}.{int(cc[1])}.0")
        attrs.update(common)
        mig = self._optional(nvml.nvmlDeviceGetMigMode, handle)
        attrs[MIG_CAPABLE] = mig is not None
        attrs[MIG_ENABLED] = mig is not None and mig[0] == pynvml.NVML_DEVICE_MIG_ENABLE
        if attrs[MIG_ENABLED]:
            # The current mode, not the pending one: CUDA sees the GPU as the mode is now (a change waiting
            # for a GPU reset has not happened yet).
            mig_on.add(bus_id)
        if mig is not None and self.dynamic_mig:
            self._mig.learn(nvml, handle, bus_id)

        function = pci_function(self.sysfs_root, bus_id)
        if function is not None:
            attrs.update(function.standard_attributes())
        else:
            attrs[PCI_BUS_ID] = bus_id
            numa = self._optional(nvml.nvmlDeviceGetNumaNodeId, handle)
            if numa is not None and int(numa) >= 0:
                attrs[NUMA_NODE] = int(numa)

        nodes = [DeviceNode(f"/dev/nvidia{minor}", str(self.dev_root / f"nvidia{minor}"))]
        nodes += [DeviceNode(f"/dev/{name}", str(self.dev_root / name)) for name in SHARED_NODES]
        return Device(
            name=f"gpu-{minor}",
            kind=Kind.GPU,
            attributes=attrs,
            capacity={"memory": Capacity(quantity.binary(memory))},
            node=facts,
            device_nodes=tuple(nodes),
        )


def withhold_in_mig_mode(devices: Sequence[Device], mig_on: set[str]) -> tuple[list[Device], list[Withheld]]:
    """The devices without the whole GPU and its shared form of each GPU in MIG mode (`mig_on`: bus IDs),
    and those as withheld. CUDA cannot use the whole GPU in MIG mode, only its MIG devices, which stay
    published, as does its passthrough variant: a VM gets the whole PCI function, and its own driver
    finds the MIG mode the GPU holds and may use or change it."""
    kept: list[Device] = []
    withheld: list[Withheld] = []
    for d in devices:
        facts = d.node
        if (isinstance(facts, GpuFacts) and facts.pci_bus_id in mig_on
                and (facts.target is None or isinstance(facts.target, GpuShare))):
            withheld.append(Withheld(d.name, f"GPU {facts.pci_bus_id} ({facts.gpu.uuid}) is in MIG mode: CUDA cannot "
                                     "use the whole GPU then, only its MIG devices; not published until MIG mode "
                                     "is off", WholeGpuInMigMode))
        else:
            kept.append(d)
    return kept, withheld


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.inventory.gpus",
                                     description="NVIDIA GPU discovery helpers")
    parser.add_argument("--probe", action="store_true", required=True,
                        help="print `real` if the NVML library loads and initializes, else `sim`")
    parser.add_argument("--driver-root", type=Path, default=Path("/"),
                        help="where the NVIDIA driver is installed (default /)")
    args = parser.parse_args(argv)
    print(probe(args.driver_root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
