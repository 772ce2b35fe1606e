"""A simulated NVML: the `pynvml` calls discovery makes, answered for a described machine.

`SimulatedNvml` has the same function names, arguments and return shapes as the
`pynvml` module (strings where pynvml decodes them, the real ctypes structs for
PCI and memory info, `c_nvmlDevice_t` handles) and raises the real
`pynvml.NVMLError` subclasses, so discovery runs its one NVML code path whether
it holds the real module or this object. Constants and error classes are the
real module's.

A profile is a builtin name (`dgx-h100`) or the path of a JSON file:

    {
      "driverVersion": "570.124.06",        # nvmlSystemGetDriverVersion
      "cudaDriverVersion": 12080,           # nvmlSystemGetCudaDriverVersion
      "errors": {"<function>": <code>},     # faults for system calls (or a device call, on every GPU)
      "defaults": {<GPU fields>},           # merged under every entry of "gpus"
      "gpus": [{<GPU fields>}, ...]         # in NVML index order
    }

GPU fields (only `name`, `busId` and `memoryTotal` are required):

    name                "NVIDIA H100 80GB HBM3"
    busId               "0000:18:00.0" (any NVML or sysfs spelling)
    memoryTotal         bytes
    numaNode            sysfs numa_node of the function (default -1: no affinity)
    nvmlNumaNode        what nvmlDeviceGetNumaNodeId answers (default null: NOT_SUPPORTED)
    uuid, minor         default: derived from the profile name and index, and the index
    pcieRoot            "pci0000:17" (default: the bus just above the GPU's)
    brand, architecture int or constant name ("NVML_BRAND_NVIDIA", "NVML_DEVICE_ARCH_HOPPER")
    computeCapability   [major, minor] (default null: NOT_SUPPORTED)
    migMode             [current, pending] (default null: not MIG capable, NOT_SUPPORTED)
    pciDeviceId         (device << 16) | 0x10de, int or "0x233010de"; pciSubSystemId likewise
    inSysfs             false: `materialize` leaves the function out of sysfs (default true)
    lost                true: every call about this GPU fails with GPU_IS_LOST
    errors              {"nvmlDeviceGetMemoryInfo": "GPU_IS_LOST", ...}: that call fails on this GPU

Error codes are numbers or names, with or without the `NVML_ERROR_` prefix.
In-process tests inject the same faults with `inject_error` and `lose` (`agent.sim.nvmlhealth`).

MIG (`agent.sim.mig`): the pynvml MIG calls with real placement rules, for GPUs whose `migMode` is
set and whose `migProfiles` names a profile table (`h100-80gb` and the others in `agent.sim.migprofiles`).

Events and health (`agent.sim.nvmlhealth`, the event sets in `agent.sim.events`): the pynvml event
API (`nvmlEventSetCreate`, `nvmlDeviceGetSupportedEventTypes`, `nvmlDeviceRegisterEvents`, `nvmlEventSetWait_v2`,
`nvmlEventSetFree`) and `nvmlDeviceGetFieldValues` for `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`.
`raise_xid` delivers an XID to the event sets registered for it and sets the recovery action
(GPU_RESET, or NONE for the application XIDs 13, 31, 43, 45, 68, 109); `lose` makes the GPU fail
every call; `recover` is a GPU reset (answers again, recovery action NONE). The same three come
from outside the process as command files (`watch_control`, `agent.sim.control`).

What an initialized session lists and holds open (`agent.sim.nvmlview`): GPUs bound to nvidia when it
was initialized, numbered in order; a handle holds its GPU's node open until the last shutdown, an
event registration until its set is freed.

Persistence mode: `nvmlDeviceGetPersistenceMode` / `nvmlDeviceSetPersistenceMode`, off on every GPU
at start (passthrough refuses a GPU with it on); `inject_error` makes the get fail like a library
without it (`FUNCTION_NOT_FOUND`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml

from agent.host.pci import normalize_bus_id
from agent.inventory.nvmlcodes import NvmlRecoveryCode
from agent.sim.control import ControlWatcher
from agent.sim.driver import DriverState
from agent.sim.events import RECOVERY_ACTIONS, SimEvents
from agent.sim.hardware import machine_profile, materialize
from agent.sim.kernel.tree import SimTree
from agent.sim.mig import SimMig
from agent.sim.mighandles import gpu_handle, gpu_index
from agent.sim.migprofiles import MIG_FUNCTIONS, MIG_TABLES
from agent.sim.nvmlhealth import EVENT_DEVICE_FUNCTIONS, EVENT_SYSTEM_FUNCTIONS, SimHealth
from agent.sim.nvmlview import NvmlView
from agent.sim.profiles import (
    DEVICE_FUNCTIONS,
    SYSTEM_FUNCTIONS,
    ProfileError,
    SimGpu,
    SimProfile,
    error_code,
    load_profile,
)

__all__ = ["ProfileError", "SimulatedNvml", "load_profile", "materialize"]


_FORWARDED = re.compile(r"^(NVML|c_nvml|nvmlPciInfo_t$|nvmlExceptionClass$|nvmlEventType)")
# Persistence mode (off on every GPU at start, as after a boot without nvidia-persistenced).
PERSISTENCE_FUNCTIONS = frozenset({"nvmlDeviceGetPersistenceMode", "nvmlDeviceSetPersistenceMode"})


class SimulatedNvml(SimHealth):
    """Answers pynvml calls for one profile; faults can be injected while it runs."""

    def __init__(self, profile: SimProfile) -> None:
        self._use(profile)

    def _use(self, profile: SimProfile) -> None:
        self.profile = profile
        self._lock = threading.Lock()
        self._refcount = 0
        self._system_errors: dict[str, int] = dict(profile.errors)
        self._gpu_errors: list[dict[str, int]] = [dict(g.errors) for g in profile.gpus]
        self._lost: list[bool] = [g.lost for g in profile.gpus]
        self._resets: list[int] = [0] * len(profile.gpus)
        self._persistence: list[int] = [pynvml.NVML_FEATURE_DISABLED] * len(profile.gpus)
        self._events = SimEvents(len(profile.gpus))
        # Which GPUs an initialized session lists, and the files its handles hold open (agent.sim.nvmlview).
        self._view = NvmlView(profile.gpus)
        self._control: ControlWatcher | None = None
        # The NVIDIA driver of the machine on disk (None: no machine written, always loaded), and the load
        # this session was initialized under (agent.sim.driver).
        self._driver: DriverState | None = None
        self._session_load: int | None = None  # (None: not initialized yet)
        # MIG (nvml_sim_mig): profiles, placements, GPU and compute instances, MIG devices.
        self._mig = SimMig([MIG_TABLES.get(g.mig_profiles, ()) for g in profile.gpus],
                           [None if g.mig_mode is None else g.mig_mode[0] for g in profile.gpus],
                           self._mig_parent, lambda fn, i: self._checked(fn, i).uuid, gpu_handle)

    @classmethod
    def from_profile(cls, spec: str) -> SimulatedNvml:
        return cls(load_profile(spec))

    def __getattr__(self, name: str) -> Any:
        # Constants, error classes and structs are the real module's, so `except nvml.NVMLError`
        # and `nvml.NVML_ERROR_GPU_IS_LOST` mean the same on both.
        if _FORWARDED.match(name):
            return getattr(pynvml, name)
        if name.startswith("nvml") and hasattr(self._mig, name):
            return getattr(self._mig, name)
        raise AttributeError(f"the simulated NVML does not implement {name}")

    # Fault injection.
    def inject_error(self, index: int | None, function: str, code: int | str) -> None:
        """Make `function` fail with `code` on GPU `index` (None: a system call, or every GPU)."""
        allowed = DEVICE_FUNCTIONS | EVENT_DEVICE_FUNCTIONS | MIG_FUNCTIONS | PERSISTENCE_FUNCTIONS
        if index is None:
            allowed |= SYSTEM_FUNCTIONS | EVENT_SYSTEM_FUNCTIONS
        if function not in allowed:
            raise ValueError(f"{function!r} is not a function the simulated NVML answers")
        value = error_code(code, function)
        with self._lock:
            if index is None:
                self._system_errors[function] = value
            else:
                self._gpu_errors[self._checked_index(index)][function] = value

    def clear_errors(self) -> None:
        with self._lock:
            self._system_errors.clear()
            for errors in self._gpu_errors:
                errors.clear()
            self._lost = [False] * len(self._lost)
        for index in range(len(self.profile.gpus)):
            self._events.set_action(index, NvmlRecoveryCode.NONE)

    # Library lifetime.
    def nvmlInitWithFlags(self, flags: int) -> None:
        with self._lock:
            self._raise_system("nvmlInitWithFlags", initialized=False)
            self._raise_system("nvmlInit", initialized=False)
            driver = self._driver.current() if self._driver is not None else None
            if driver is not None and not driver.loaded:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
            reloaded = driver is not None and self._session_load is not None and driver.load != self._session_load
            if reloaded and self._refcount > 0:
                # The session was opened under an earlier load of the driver, which took its handles and
                # event sets with it: this initialization starts a new one.
                self._refcount = 0
                self._view.close_all()
                self._events.shutdown()
            if self._refcount <= 0:
                self._view.enumerate()
                if reloaded:  # the driver loaded since the last session initialized every GPU, as a reset does
                    for index in range(len(self.profile.gpus)):
                        self._events.set_action(index, NvmlRecoveryCode.NONE)
                self._session_load = driver.load if driver is not None else 0
            self._refcount += 1
        self._events.open()

    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    def nvmlShutdown(self) -> None:
        with self._lock:
            self._raise_system("nvmlShutdown", driver=False)
            self._refcount -= 1
            last = self._refcount <= 0
        if last:
            self._view.close_all()
            self._events.shutdown()

    @property
    def initialized(self) -> bool:
        return self._refcount > 0

    def materialize(self, root: Path) -> None:
        """Write this machine's sysfs and device nodes under `root` (see `nvml_hardware.materialize`); the
        MIG state and the recovery actions are kept there from now on, as hardware keeps them across an
        agent restart."""
        materialize(self.profile, root)
        booted = machine_profile(self.profile, root)
        if booted != self.profile:  # GPUs that did not come back in this boot: NVML does not list them
            self._use(booted)
        self._mig.attach(root, [g.minor for g in self.profile.gpus], [g.uuid for g in self.profile.gpus])
        self._events.keep_actions(root / RECOVERY_ACTIONS, SimTree(root).read_boot_id)
        self._view.attach(root)
        self._driver = DriverState(root)

    # System queries.
    def nvmlSystemGetDriverVersion(self) -> str:
        self._system("nvmlSystemGetDriverVersion")
        return self.profile.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._system("nvmlSystemGetCudaDriverVersion")
        return self.profile.cuda_driver_version

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._system("nvmlSystemGetCudaDriverVersion_v2")
        return self.profile.cuda_driver_version

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._system("nvmlSystemGetNVMLVersion")
        cuda_major = self.profile.cuda_driver_version // 1000
        return f"{cuda_major}.{self.profile.driver_version}"

    def nvmlDeviceGetCount(self) -> int:
        self._system("nvmlDeviceGetCount")
        return len(self._view.listed)

    # Handles.
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        with self._lock:
            self._raise_system("nvmlDeviceGetHandleByIndex")
            slot = self._view.slot(index) if isinstance(index, int) else None
            if slot is None:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            self._raise_device("nvmlDeviceGetHandleByIndex", slot)
        self._view.hold(slot)
        return gpu_handle(slot)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> Any:
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        return self._handle_where("nvmlDeviceGetHandleByUUID", lambda g: g.uuid == text)

    def nvmlDeviceGetHandleByPciBusId(self, pciBusId: str | bytes) -> Any:
        text = pciBusId.decode() if isinstance(pciBusId, bytes) else pciBusId
        try:
            wanted = normalize_bus_id(text)
        except ValueError:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT) from None
        return self._handle_where("nvmlDeviceGetHandleByPciBusId", lambda g: g.bus_id == wanted)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        index = self._view.index(self._device("nvmlDeviceGetIndex", handle)[0])
        assert index is not None  # _device checked that the session lists it
        return index

    # Per-GPU queries.
    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        if self._mig.is_mig_handle(handle):
            return self._mig.mig_uuid("nvmlDeviceGetUUID", handle)
        return self._device("nvmlDeviceGetUUID", handle)[1].uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._device("nvmlDeviceGetName", handle)[1].name

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        return self._device("nvmlDeviceGetMinorNumber", handle)[1].minor

    def nvmlDeviceGetPciInfo_v3(self, handle: Any) -> Any:
        return _pci_info(self._device("nvmlDeviceGetPciInfo_v3", handle)[1])

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        return _pci_info(self._device("nvmlDeviceGetPciInfo", handle)[1])

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        gpu = self._device("nvmlDeviceGetMemoryInfo", handle)[1]
        if not version:
            mem = pynvml.c_nvmlMemory_t()
        else:
            mem = pynvml.c_nvmlMemory_v2_t()
            mem.version = version
            mem.reserved = 0
        mem.total = gpu.memory_total
        mem.used = 0
        mem.free = gpu.memory_total
        return mem

    def nvmlDeviceGetBrand(self, handle: Any) -> int:
        return self._device("nvmlDeviceGetBrand", handle)[1].brand

    def nvmlDeviceGetArchitecture(self, device: Any) -> int:
        return self._device("nvmlDeviceGetArchitecture", device)[1].architecture

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        cc = self._device("nvmlDeviceGetCudaComputeCapability", handle)[1].compute_capability
        if cc is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return cc

    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        mode = self._mig.mode(self._device("nvmlDeviceGetMigMode", device)[0])
        if mode is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return mode

    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        node = self._device("nvmlDeviceGetNumaNodeId", handle)[1].nvml_numa_node
        if node is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return node

    def nvmlDeviceGetPersistenceMode(self, handle: Any) -> int:
        index = self._device("nvmlDeviceGetPersistenceMode", handle)[0]
        with self._lock:
            return self._persistence[index]

    def nvmlDeviceSetPersistenceMode(self, handle: Any, mode: int) -> None:
        """As `nvidia-smi -pm`: tests turn it on to see passthrough refuse the GPU."""
        index = self._device("nvmlDeviceSetPersistenceMode", handle)[0]
        if mode not in (pynvml.NVML_FEATURE_DISABLED, pynvml.NVML_FEATURE_ENABLED):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            self._persistence[index] = int(mode)

    # Internals.
    def _checked_index(self, index: int) -> int:
        if not 0 <= index < len(self.profile.gpus):
            raise IndexError(f"profile {self.profile.name} has no GPU {index}")
        return index

    def _raise_system(self, function: str, initialized: bool = True, *, driver: bool = True) -> None:
        if initialized and self._refcount <= 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if initialized and driver and self._driver is not None:
            now = self._driver.current()
            if not now.loaded:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
            if self._session_load is not None and now.load != self._session_load:  # loaded again: it is over
                raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if function in self._system_errors:
            raise pynvml.NVMLError(self._system_errors[function])

    def _raise_device(self, function: str, index: int) -> None:
        if self._lost[index]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if function in self._gpu_errors[index]:
            raise pynvml.NVMLError(self._gpu_errors[index][function])

    def _system(self, function: str) -> None:
        with self._lock:
            self._raise_system(function)

    def _device(self, function: str, handle: Any) -> tuple[int, SimGpu]:
        with self._lock:
            self._raise_system(function)
            index = gpu_index(handle, len(self.profile.gpus))
            if self._view.index(index) is None:  # a handle of a GPU this session does not list
                raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            self._raise_device(function, index)
        return index, self.profile.gpus[index]

    def _mig_parent(self, function: str, handle: Any) -> tuple[int, str]:
        index, gpu = self._device(function, handle)
        return index, gpu.uuid

    def _checked(self, function: str, index: int) -> SimGpu:
        """GPU `index` after the faults of `function` on it (calls on MIG instance handles)."""
        with self._lock:
            self._raise_system(function)
            self._raise_device(function, index)
        return self.profile.gpus[index]

    def _handle_where(self, function: str, match: Callable[[SimGpu], bool]) -> Any:
        with self._lock:
            self._raise_system(function)
            for index in self._view.listed:
                if match(self.profile.gpus[index]):
                    self._raise_device(function, index)
                    break
            else:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        self._view.hold(index)
        return gpu_handle(index)


def _pci_info(gpu: SimGpu) -> Any:
    info = pynvml.nvmlPciInfo_t()
    domain, bus, rest = gpu.bus_id.split(":")
    slot = rest.split(".")[0]
    info.domain = int(domain, 16)
    info.bus = int(bus, 16)
    info.device = int(slot, 16)
    info.pciDeviceId = gpu.pci_device_id
    info.pciSubSystemId = gpu.pci_subsystem_id
    info.busIdLegacy = f"{info.domain:04X}:{info.bus:02X}:{info.device:02X}.0".encode()
    info.busId = gpu.nvml_bus_id
    return info
