"""Reading what NVML answers: an error by name (and a name as its code), a handle by address, a field
value as the integer it holds. NVML's facts, kept with NVML: the simulated NVML takes its error codes
from here too."""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml


def error_name(code: int) -> str:
    """`15` -> `NVML_ERROR_GPU_IS_LOST` (or the number when NVML has no name for it)."""
    for name in dir(pynvml):
        if name.startswith("NVML_ERROR_") and getattr(pynvml, name) == code:
            return name
    return str(code)


def error_code(value: object) -> int | None:
    """The NVML error code `15`, `"NVML_ERROR_GPU_IS_LOST"` or `"GPU_IS_LOST"` stand for; None when it is
    none that pynvml knows."""
    code: object = value
    if isinstance(value, str):
        name = value if value.startswith("NVML_ERROR_") else f"NVML_ERROR_{value}"
        code = getattr(pynvml, name, None)
    if isinstance(code, bool) or not isinstance(code, int) or code not in pynvml.NVMLError._valClassMapping:
        return None
    return code


def describe_error(exc: BaseException) -> str:
    """An NVML error with its name (`GPU_IS_LOST`), or any other exception with its type."""
    if isinstance(exc, pynvml.NVMLError):
        return f"{exc} ({error_name(exc.value)})"
    return f"{type(exc).__name__}: {exc}"


def handle_address(handle: Any) -> int:
    """The address a pynvml handle points at: what identifies a GPU in an event's data."""
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def field_int(value: Any) -> int:
    """The integer in a c_nvmlFieldValue_t, read as its valueType says."""
    kind = value.valueType
    if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return int(value.value.ulVal)
    if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
        return int(value.value.ullVal)
    if kind == pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return int(value.value.sllVal)
    if kind == pynvml.NVML_VALUE_TYPE_SIGNED_INT:
        return int(value.value.siVal)
    if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT:
        return int(value.value.usVal)
    return int(value.value.uiVal)
