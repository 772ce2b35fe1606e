"""CDI names: vendor, class, device name, kind (`vendor/class`) and qualified device ID.

A qualified device ID is what a runtime is asked for (`--device vendor.com/class=name`).
The syntax is the one the CDI library enforces when it parses a spec. Its syntax for a
vendor or class has a distinct first and last character, and the library's check fails
on a one-character vendor or class (podman 4.3 panics on the device `a/thing=x`), so
both need at least two. A device name may be a single
letter or digit: the library accepts that case explicitly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_VENDOR_OR_CLASS = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*[A-Za-z0-9]")
_DEVICE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.:-]*[A-Za-z0-9])?")


class InvalidName(ValueError):
    pass


def _name_error(what: str, value: str, pattern: re.Pattern[str], rule: str) -> str | None:
    if not isinstance(value, str):
        return f"{what} must be a string, not {type(value).__name__}"
    if not value:
        return f"{what} is empty"
    if pattern.fullmatch(value) is None:
        return f"{what} {value!r} is invalid: {rule}"
    return None


_VENDOR_OR_CLASS_RULE = ("must be at least two characters, start with a letter, end with a letter or digit, "
                         "and hold only letters, digits, '_', '-' and '.'")


def vendor_error(vendor: str) -> str | None:
    return _name_error("vendor", vendor, _VENDOR_OR_CLASS, _VENDOR_OR_CLASS_RULE)


def class_error(cls: str) -> str | None:
    """The syntax only; a '.' in the class is valid but needs cdiVersion 0.6.0 (see spec.minimum_version)."""
    return _name_error("class", cls, _VENDOR_OR_CLASS, _VENDOR_OR_CLASS_RULE)


def device_name_error(name: str) -> str | None:
    """A leading digit is valid but needs cdiVersion 0.5.0 (see spec.minimum_version)."""
    return _name_error("device name", name, _DEVICE,
                       "must start and end with a letter or digit, and hold only letters, digits, "
                       "'_', '-', '.' and ':'")


def kind_error(kind: str) -> str | None:
    if not isinstance(kind, str):
        return f"kind must be a string, not {type(kind).__name__}"
    vendor, sep, cls = kind.partition("/")
    if not sep or not vendor or not cls:
        return f"kind {kind!r} is not of the form vendor/class"
    return vendor_error(vendor) or class_error(cls)


@dataclass(frozen=True, slots=True)
class QualifiedDevice:
    vendor: str
    cls: str
    name: str

    @property
    def kind(self) -> str:
        return f"{self.vendor}/{self.cls}"

    def __str__(self) -> str:
        return qualified_name(self.vendor, self.cls, self.name)


def parse_kind(kind: str) -> tuple[str, str]:
    """`vendor.com/class` -> (`vendor.com`, `class`); InvalidName when it is not a valid kind."""
    err = kind_error(kind)
    if err:
        raise InvalidName(err)
    vendor, _, cls = kind.partition("/")
    return vendor, cls


def parse_qualified(device_id: str) -> QualifiedDevice:
    """`vendor.com/class=name` -> its parts; InvalidName when any part is invalid."""
    if not isinstance(device_id, str):
        raise InvalidName(f"device ID must be a string, not {type(device_id).__name__}")
    kind, sep, name = device_id.partition("=")
    if not sep:
        raise InvalidName(f"device ID {device_id!r} is not of the form vendor/class=name")
    vendor, cls = parse_kind(kind)
    err = device_name_error(name)
    if err:
        raise InvalidName(f"device ID {device_id!r}: {err}")
    return QualifiedDevice(vendor, cls, name)


def qualified_name(vendor: str, cls: str, name: str) -> str:
    """The device ID a runtime is asked for; InvalidName when a part is invalid."""
    err = vendor_error(vendor) or class_error(cls) or device_name_error(name)
    if err:
        raise InvalidName(err)
    return f"{vendor}/{cls}={name}"


def is_qualified(device_id: str) -> bool:
    try:
        parse_qualified(device_id)
    except InvalidName:
        return False
    return True
