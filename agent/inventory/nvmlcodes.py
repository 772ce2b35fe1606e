"""NVML's numbers the agent keeps itself, where the bindings (nvidia-ml-py) name them only in some
versions: GPU discovery's event watcher reads them, and the simulated NVML answers with them."""

from __future__ import annotations

import enum


class NvmlRecoveryCode(enum.IntEnum):
    """nvmlGpuRecoveryAction_t's values, the ABI's numbers: nvidia-ml-py names them only from 13.580
    (BUS_RESET and SYSTEM_REBOOT later still), and a node may carry an older one beside a newer driver
    (the driver answers the field whatever the bindings know), so the agent keeps them itself.
    tests/test_gpu_events.py holds them to the installed pynvml's names."""

    NONE = 0
    GPU_RESET = 1
    NODE_REBOOT = 2
    DRAIN_P2P = 3
    DRAIN_AND_RESET = 4
    RECOVER_IMEX_DOMAIN = 5
    BUS_RESET = 6
    SYSTEM_REBOOT = 7


# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: the field id (nvml.h) the recovery action is read from; named by
# nvidia-ml-py from 13.580 only, for the reason above.
FI_DEV_GET_GPU_RECOVERY_ACTION = 230
