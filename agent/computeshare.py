"""Compute shares of a shared GPU: the fraction of its streaming multiprocessors a claim's MPS clients may
use, as a capacity the scheduler hands out beside memory (`--gpu-compute-shares`).

A shared GPU (`agent.inventory.gpushare`) offers `compute`, the whole GPU being `1`, with a request policy
whose range is fractional (default 0.1, from 0.05 to 1 in steps of 0.05). Kubernetes 1.37 keeps such a range
only with `DRAFractionalCapacityRange` on (beta, off by default): the API server and the scheduler then
count the range in thousandths. With the gate off, both read every bound rounded up to a whole number
(`Quantity.Value()`): a range of 0.05 to 1 becomes 1 to 1, and every claim that names an amount would
consume the whole GPU. The API server keeps the fields either way, so nothing is seen dropped; the
publisher asks the server which arithmetic it uses (`agent.publish.apiserver`) and, on a server that
counts in whole units, publishes `computePercent` instead: the same policy in percent (100 the whole
GPU), whole numbers only.

Prepare turns what a share consumed into `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` (a whole percentage, which
is why every value of the policy is a whole percentage: the consumed amount, a whole number of steps
above min, always is one, and the percentage is exact, never rounded).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from agent import quantity

COMPUTE = "compute"  # the capacity's name: a fraction of the GPU, 1 the whole
COMPUTE_PERCENT = "computePercent"  # its whole-number form, for servers without fractional ranges
DEFAULT_POLICY = "0.1/0.05/1/0.05"


@dataclass(frozen=True, slots=True)
class ComputeShares:
    """The request policy of a shared GPU's compute, in hundredths of the GPU (percent)."""

    default: int
    min: int
    max: int
    step: int

    @classmethod
    def parse(cls, text: str) -> ComputeShares | None:
        """`DEFAULT/MIN/MAX/STEP` as fractions of a GPU (`0.1/0.05/1/0.05`), or `off` (None); ValueError
        naming what is wrong."""
        if text.strip() == "off":
            return None
        parts = text.split("/")
        if len(parts) != 4:
            raise ValueError(f"--gpu-compute-shares must be DEFAULT/MIN/MAX/STEP (fractions of a GPU, e.g. "
                             f"{DEFAULT_POLICY}) or off, not {text!r}")
        values: list[int] = []
        for name, part in zip(("DEFAULT", "MIN", "MAX", "STEP"), parts, strict=True):
            try:
                amount = quantity.exact(part)
            except ValueError:
                raise ValueError(f"--gpu-compute-shares: {name} {part!r} is not a number") from None
            if (amount * 100).denominator != 1:
                raise ValueError(f"--gpu-compute-shares: {name} {part} is not a whole percentage of a GPU (MPS "
                                 "takes its thread percentage in whole numbers)")
            values.append(int(amount * 100))
        shares = cls(*values)
        if errors := shares.errors():
            raise ValueError(f"--gpu-compute-shares {text}: {'; '.join(errors)}")
        return shares

    def errors(self) -> list[str]:
        errs = []
        if not 0 < self.min <= self.default <= self.max <= 100:
            errs.append("0 < MIN <= DEFAULT <= MAX <= 1 is needed")
        if self.step <= 0 or self.min + self.step > 100:
            errs.append("STEP must be above 0, and MIN + STEP at most 1")
        elif (self.default - self.min) % self.step or (self.max - self.min) % self.step:
            errs.append("DEFAULT and MAX must be a whole number of STEPs above MIN")
        return errs

    def fraction_capacity(self) -> tuple[str, dict[str, Any]]:
        """The `compute` capacity's value and request policy: fractions of the GPU, in the API's canonical
        form (`100m`, `1`)."""
        def q(percent: int) -> str:
            return quantity.milli(percent * 10)

        return "1", {"default": q(self.default),
                     "validRange": {"min": q(self.min), "max": q(self.max), "step": q(self.step)}}

    def percent_capacity(self) -> tuple[str, dict[str, Any]]:
        """The `computePercent` capacity's value and request policy: whole percentages."""
        return "100", {"default": str(self.default),
                       "validRange": {"min": str(self.min), "max": str(self.max), "step": str(self.step)}}


def thread_percentage(consumed: Mapping[str, str]) -> int | None:
    """The MPS thread percentage a share's `consumedCapacity` gives (None: it names no compute); ValueError
    when the amount is not a whole percentage from 1 to 100 of the GPU."""
    if COMPUTE in consumed:
        percent = quantity.exact(consumed[COMPUTE]) * 100
    elif COMPUTE_PERCENT in consumed:
        percent = quantity.exact(consumed[COMPUTE_PERCENT])
    else:
        return None
    if percent.denominator != 1 or not 1 <= percent <= 100:
        raise ValueError("not a whole percentage from 1 to 100 of the GPU")
    return int(percent)


def has_fractions(policy: Mapping[str, Any] | None) -> bool:
    """Whether a request policy's range holds a fraction (what `DRAFractionalCapacityRange` decides on)."""
    rng = (policy or {}).get("validRange") or {}
    values = [rng.get(k) for k in ("min", "max", "step")] + [(policy or {}).get("default")]
    return any(v is not None and _fraction(v).denominator != 1 for v in values)


def _fraction(text: object) -> Fraction:
    try:
        return quantity.exact(str(text))
    except ValueError:
        return Fraction(0)
