"""The seam between the agent and the NVML behind it: what GPU discovery, the GPU event watcher, MIG
prepare and the passthrough's persistence check call (`Nvml`), what opens it (`NvmlOpener`, giving
`OpenNvml`), and what drives the GPUs from outside NVML while the agent runs (`GpuCommands`).

On a host the NVML is the `pynvml` module, its library loaded from the driver root, and nothing else
drives the GPUs (`agent.inventory.nvmlopen.open_real_nvml`, `NoCommands`); with `--nvml sim` it is the
simulated machine's. Which opener GPU discovery is given is chosen once, in `agent.app.assembly`.

`Nvml` names the calls the agent makes, positional-only as pynvml's own parameter names are not ours
to depend on. Handles, event sets and NVML's structs are ctypes objects of pynvml's (or the
simulation's stand-ins): opaque here, `Any`. Error classes and constants are read from `pynvml`
itself, which the simulated NVML answers with too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agent.config import Settings

NvmlHandle = Any  # a GPU, MIG device, GPU or compute instance handle, or an event set: opaque


class Nvml(Protocol):
    """The NVML calls the agent makes."""

    # Initialization (`agent.inventory.nvmlgate` shuts it down and initializes it again around a GPU
    # changing drivers).
    def nvmlInit(self) -> None: ...

    def nvmlShutdown(self) -> None: ...

    # The driver and the GPUs it lists (discovery).
    def nvmlSystemGetDriverVersion(self) -> str: ...

    def nvmlSystemGetCudaDriverVersion(self) -> int: ...

    def nvmlDeviceGetCount(self) -> int: ...

    def nvmlDeviceGetHandleByIndex(self, index: int, /) -> NvmlHandle: ...

    def nvmlDeviceGetHandleByUUID(self, uuid: str, /) -> NvmlHandle: ...

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str, /) -> NvmlHandle: ...

    def nvmlDeviceGetUUID(self, handle: NvmlHandle, /) -> str: ...

    def nvmlDeviceGetName(self, handle: NvmlHandle, /) -> str: ...

    def nvmlDeviceGetMinorNumber(self, handle: NvmlHandle, /) -> int: ...

    def nvmlDeviceGetPciInfo(self, handle: NvmlHandle, /) -> Any: ...

    def nvmlDeviceGetMemoryInfo(self, handle: NvmlHandle, /) -> Any: ...

    def nvmlDeviceGetBrand(self, handle: NvmlHandle, /) -> int: ...

    def nvmlDeviceGetArchitecture(self, handle: NvmlHandle, /) -> int: ...

    def nvmlDeviceGetCudaComputeCapability(self, handle: NvmlHandle, /) -> tuple[int, int]: ...

    def nvmlDeviceGetNumaNodeId(self, handle: NvmlHandle, /) -> int: ...

    def nvmlDeviceGetMigMode(self, handle: NvmlHandle, /) -> list[int]: ...

    def nvmlDeviceGetPersistenceMode(self, handle: NvmlHandle, /) -> int: ...

    # Health (the event watcher): events, and the recovery action as a field value.
    def nvmlDeviceGetFieldValues(self, handle: NvmlHandle, field_ids: list[int], /) -> Any: ...

    def nvmlEventSetCreate(self) -> NvmlHandle: ...

    def nvmlDeviceGetSupportedEventTypes(self, handle: NvmlHandle, /) -> int: ...

    def nvmlDeviceRegisterEvents(self, handle: NvmlHandle, event_types: int, event_set: NvmlHandle, /) -> None: ...

    def nvmlEventSetWait_v2(self, event_set: NvmlHandle, timeout_ms: int, /) -> Any: ...

    def nvmlEventSetFree(self, event_set: NvmlHandle, /) -> None: ...

    # MIG (discovery's placements; prepare's mode, GPU and compute instances).
    def nvmlDeviceSetMigMode(self, handle: NvmlHandle, mode: int, /) -> int: ...

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: NvmlHandle, profile: int, /) -> Any: ...

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, handle: NvmlHandle, profile_id: int, placements: Any,
                                                   count: Any, /) -> Any: ...

    def nvmlDeviceGetGpuInstances(self, handle: NvmlHandle, profile_id: int, instances: Any, count: Any, /) -> Any: ...

    def nvmlDeviceGetGpuInstanceById(self, handle: NvmlHandle, instance_id: int, /) -> NvmlHandle: ...

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: NvmlHandle, profile_id: int, placement: Any,
                                                 /) -> NvmlHandle: ...

    def nvmlGpuInstanceGetInfo(self, instance: NvmlHandle, /) -> Any: ...

    def nvmlGpuInstanceDestroy(self, instance: NvmlHandle, /) -> Any: ...

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, instance: NvmlHandle, profile: int, engine_profile: int,
                                                     /) -> Any: ...

    def nvmlGpuInstanceCreateComputeInstance(self, instance: NvmlHandle, profile_id: int, /) -> NvmlHandle: ...

    def nvmlGpuInstanceGetComputeInstances(self, instance: NvmlHandle, profile_id: int, instances: Any, count: Any,
                                           /) -> Any: ...

    def nvmlComputeInstanceGetInfo(self, instance: NvmlHandle, /) -> Any: ...

    def nvmlComputeInstanceDestroy(self, instance: NvmlHandle, /) -> Any: ...

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: NvmlHandle, /) -> int: ...

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: NvmlHandle, index: int, /) -> NvmlHandle: ...

    def nvmlDeviceGetGpuInstanceId(self, handle: NvmlHandle, /) -> int: ...

    def nvmlDeviceGetComputeInstanceId(self, handle: NvmlHandle, /) -> int: ...


class GpuCommands(Protocol):
    """What drives the GPUs from outside NVML while the event watcher runs, and what of it NVML does not
    show. Called on the watcher's thread."""

    def start(self) -> None:
        """Apply commands from now on: called once the first probe registered the GPUs for events, so an
        XID a command raises is delivered. Failing to watch for commands is logged here, never raised."""

    def stop(self) -> None: ...

    def resets(self, index: int) -> int:
        """How many resets the GPU at NVML index `index` has had: a reset that changed nothing NVML shows
        (after an application XID) is seen by its count changing."""

    def raised_at(self, data: Any) -> float | None:
        """When the command that raised this NVML event (its event data) was written, in Unix seconds: an
        XID is as old as its command, also when no agent ran then. None: not raised by a command."""


class NoCommands:
    """A host's: nothing but the hardware changes its GPUs, and NVML shows what does."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def resets(self, index: int) -> int:
        return 0

    def raised_at(self, data: Any) -> float | None:
        return None


@dataclass(frozen=True, slots=True)
class OpenNvml:
    """What GPU discovery reads GPUs through: the NVML, initialized (None: no GPUs), the sysfs and /dev the
    GPUs are in, what else drives them, and whether an empty file may stand in for a device node (where
    mknod is refused: the simulated machine run unprivileged)."""

    nvml: Nvml | None
    sysfs_root: Path
    dev_root: Path
    commands: GpuCommands = field(default_factory=NoCommands)
    node_placeholders: bool = False


class NvmlOpener(Protocol):
    """Opens NVML for these settings (DiscoveryError: it cannot be, and why)."""

    def __call__(self, settings: Settings, /) -> OpenNvml: ...
