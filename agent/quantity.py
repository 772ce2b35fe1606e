"""Integer quantities in the canonical form the API server stores.

The API server rewrites quantities into a canonical string; emitting that form
ourselves means a slice read back compares equal to the one we would write, so
an unchanged inventory really writes nothing.
"""

from __future__ import annotations

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
