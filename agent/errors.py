"""The base of every per-claim failure, so the response, the logs and the health stream can tell a
claim's own problem (its message goes to the kubelet for that claim alone) from a fault of the agent.
"""

from __future__ import annotations


class ClaimFailure(Exception):
    """Why one claim could not be prepared or unprepared; the message names the cause precisely."""


class ClaimError(ClaimFailure, ValueError):
    """Why a claim cannot be prepared here (the message goes to the kubelet)."""


class WholeGpuInMigMode(ClaimFailure):
    """The whole GPU (or a share of it) is asked for while the GPU is in MIG mode: CUDA cannot use the
    whole GPU then, only its MIG devices (a claim allocated before the operator turned the mode on)."""
