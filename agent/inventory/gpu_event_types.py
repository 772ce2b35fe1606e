"""What the GPU event watcher (`gpu_events`) reports: typed, frozen events and the recovery action.

Apart from the watcher so that consumers (taints, the health stream) depend on these types only.
`at` is when the watcher saw the event, in UTC.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime

from agent.inventory.nvmlcodes import NvmlRecoveryCode


class RecoveryAction(enum.Enum):
    """What the driver says a GPU needs before it is usable again (NVML_GPU_RECOVERY_ACTION_*)."""

    NONE = "none"
    GPU_RESET = "gpu-reset"
    NODE_REBOOT = "node-reboot"
    DRAIN_P2P = "drain-p2p"
    DRAIN_AND_RESET = "drain-and-reset"
    RECOVER_IMEX_DOMAIN = "recover-imex-domain"
    BUS_RESET = "bus-reset"
    SYSTEM_REBOOT = "system-reboot"
    UNKNOWN = "unknown"  # the driver does not say (field NOT_SUPPORTED) or says a code we have no name for

    @classmethod
    def from_nvml(cls, code: int) -> RecoveryAction:
        return _ACTIONS.get(code, cls.UNKNOWN)


_ACTIONS = {int(code): RecoveryAction[code.name] for code in NvmlRecoveryCode}


@dataclass(frozen=True)
class XidError:
    device: str
    xid: int
    recovery_action: RecoveryAction
    at: datetime


@dataclass(frozen=True)
class DoubleBitEcc:
    device: str
    recovery_action: RecoveryAction
    at: datetime


@dataclass(frozen=True)
class GpuLost:
    device: str
    reason: str
    at: datetime


@dataclass(frozen=True)
class GpuAnswering:
    """The GPU answers (again), and needs `recovery_action`: after it was lost, after a reset, or
    when its recovery action changed."""

    device: str
    recovery_action: RecoveryAction
    at: datetime


@dataclass(frozen=True)
class GpuBaseline:
    """The GPU's first answer to this watcher: which GPU it is (`uuid`, "" when it did not say) and
    what it needs. Only from a watcher asked for it (`GpuEventWatcher(baseline=True)`): whoever
    restored what an earlier process knew of the GPU checks it against this."""

    device: str
    uuid: str
    recovery_action: RecoveryAction
    at: datetime


@dataclass(frozen=True)
class NvmlLost:
    """NVML stopped answering as a whole (the NVIDIA driver unloaded, its library gone): no GPU can be read
    or watched until `NvmlBack`. Names no device: the consumer knows which GPUs were NVML's."""

    reason: str
    at: datetime


@dataclass(frozen=True)
class NvmlBack:
    """NVML answers again after `NvmlLost` (initialized again: a new session, the GPUs learnt afresh)."""

    at: datetime


GpuEvent = XidError | DoubleBitEcc | GpuLost | GpuAnswering | GpuBaseline | NvmlLost | NvmlBack
