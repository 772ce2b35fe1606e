"""Quantities in the canonical form the API server stores, and read exactly.

The API server rewrites quantities into a canonical string; emitting that form
ourselves means a slice read back compares equal to the one we would write, so
an unchanged inventory really writes nothing.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BINARY = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_DECIMAL = ("", "k", "M", "G", "T", "P", "E")


def binary(n: int) -> str:
    """Bytes as the API canonicalizes a BinarySI quantity: `85520809984` -> `81559Mi`."""
    if -1024 < n < 1024:
        return decimal(n)
    exp = 0
    while exp < len(_BINARY) - 1 and n % 1024 == 0 and n != 0:
        n //= 1024
        exp += 1
    return f"{n}{_BINARY[exp]}"


def decimal(n: int) -> str:
    """A count as the API canonicalizes a DecimalSI quantity: `96` -> `96`, `2000` -> `2k`."""
    exp = 0
    while exp < len(_DECIMAL) - 1 and n % 1000 == 0 and n != 0:
        n //= 1000
        exp += 1
    return f"{n}{_DECIMAL[exp]}"


_SUFFIX: dict[str, int] = ({s: 1024**i for i, s in enumerate(_BINARY) if s}
                            | {s: 1000**i for i, s in enumerate(_DECIMAL) if s})


def parse_int(text: str) -> int:
    """An integer quantity (`81559Mi`, `2k`, `96`) as an int; ValueError otherwise."""
    text = str(text).strip()
    for suffix in sorted(_SUFFIX, key=len, reverse=True):
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * _SUFFIX[suffix]
    return int(text)


# A quantity's grammar (the API's): a signed decimal number, then a binary or decimal suffix, or an exponent.
_QUANTITY = re.compile(r"^([+-]?)(\d+(?:\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?\Z")
_SMALL = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000)}


def exact(text: str) -> Fraction:
    """Any quantity (`50m`, `0.25`, `1.5Gi`, `1e3`) as an exact number; ValueError when it is not one."""
    m = _QUANTITY.match(str(text).strip())
    if m is None:
        raise ValueError(f"{text!r} is not a quantity")
    sign, number, suffix = m.groups()
    value = Fraction(number)
    if suffix:
        if suffix[0] in "eE":
            value *= Fraction(10) ** int(suffix[1:])
        else:
            value *= _SMALL[suffix] if suffix in _SMALL else _SUFFIX[suffix]
    return -value if sign == "-" else value


def milli(n: int) -> str:
    """Thousandths as the API canonicalizes a DecimalSI quantity: `250` -> `250m`, `1000` -> `1`."""
    return decimal(n // 1000) if n % 1000 == 0 else f"{n}m"
