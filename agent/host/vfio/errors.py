"""Why a PCI function cannot be passed through, or a binding step did not take: per-claim failures."""

from __future__ import annotations

from typing import ClassVar

from agent.errors import ClaimFailure


class VfioError(ClaimFailure):
    """A VFIO passthrough problem with one claim's device; the message names the function and cause."""

    retryable: ClassVar[bool] = False  # True: the same request may succeed later without a change here


class NoSuchFunction(VfioError):
    """sysfs does not know the PCI function (wrong address, or it fell off the bus)."""


class GroupNotViable(VfioError):
    """The function's IOMMU group holds another function the host uses: VFIO would refuse the group."""


class DeviceBusy(VfioError):
    """Something on the host still uses the device (an open handle, enabled SR-IOV VFs): unbinding it
    now would block in the driver or pull it from under a process. Retry once it is released."""

    retryable: ClassVar[bool] = True


class UsageUnknown(VfioError):
    """Whether the host uses a GPU cannot be told: it is on the NVIDIA driver but its device minor is
    unknown, so no `/dev/nvidia<N>` can be scanned for open handles. Refused rather than risk an unbind
    that blocks in the driver; retryable (the driver's GPU list may show it later)."""

    retryable: ClassVar[bool] = True


class StepFailed(VfioError):
    """A binding step's write was refused, or its effect did not show within the bound; the message
    says what the function is bound to now."""

    retryable: ClassVar[bool] = True


class WritePending(StepFailed):
    """An earlier write about the function (an unbind the driver is still waiting to finish) has not taken
    effect: nothing more is written about the function until it has."""
