"""Why a mediated device (vGPU) cannot be made or removed: per-claim failures naming the parent GPU,
the type and the cause."""

from __future__ import annotations

from typing import ClassVar

from agent.errors import ClaimFailure


class MdevError(ClaimFailure):
    """A mediated-device problem with one claim's device."""

    retryable: ClassVar[bool] = False  # True: the same request may succeed later without a change here


class TypeNotOffered(MdevError):
    """The parent's host driver does not offer the type (no `mdev_supported_types/<type>`)."""


class ParentUnavailable(MdevError):
    """The parent GPU is not on its host driver now (passed through to a VM, unbound, gone): it offers
    no types until it is back."""

    retryable: ClassVar[bool] = True


class NoInstanceAvailable(MdevError):
    """The type's `available_instances` is 0: its limit is reached, or the GPU hosts another type."""

    retryable: ClassVar[bool] = True


class MdevStepFailed(MdevError):
    """A write to `create` or `remove` was refused, or its effect did not show within the bound."""

    retryable: ClassVar[bool] = True
