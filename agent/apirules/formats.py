"""The value formats the API server checks in what the agent sends: DNS labels and subdomains,
qualified (attribute and capacity) names, label keys and values, semantic versions, quantities,
attribute values and pool names. The building blocks of the slice, device and status rules."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the value formats load without the device model (`dra-agent run` checks its
    from agent.model import AttrValue  # driver name before anything heavy is imported)

MAX_VALUE_LENGTH = 64
MAX_POOL_NAME = 253
MAX_DRIVER_NAME = 63
MAX_ID_LENGTH = 32
MAX_DOMAIN_LENGTH = 63

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]\Z")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?\Z")
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?\Z"
, re.ASCII)
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?\Z")


def dns_label_errors(value: str, max_len: int = 63) -> list[str]:
    errs = []
    if len(value) > max_len:
        errs.append(f"must be no more than {max_len} characters")
    if not _DNS_LABEL.match(value):
        errs.append("must be a DNS label (lower-case alphanumerics and '-', starting and ending "
                    "with an alphanumeric)")
    return errs


def dns_subdomain_errors(value: str, max_len: int = 253) -> list[str]:
    errs = []
    if len(value) > max_len:
        errs.append(f"must be no more than {max_len} characters")
    if not value or not all(_DNS_LABEL.match(part) for part in value.split(".")):
        errs.append("must be a DNS subdomain (lower-case alphanumerics, '-' and '.')")
    return errs


def semver_errors(value: str) -> list[str]:
    errs = []
    if len(value) > MAX_VALUE_LENGTH:
        errs.append(f"must be no more than {MAX_VALUE_LENGTH} characters")
    if not _SEMVER.match(value):
        errs.append("must be a semantic version (semver 2.0.0)")
    return errs


def normalize_version(text: str) -> str | None:
    """`570.124.06` -> `570.124.6`, `12.8` -> `12.8.0`; None when it is not numeric dotted."""
    parts = text.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    nums = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
    return ".".join(nums)


def qualified_name_errors(name: str) -> list[str]:
    """Attribute and capacity names: `<C identifier>` or `<DNS subdomain>/<C identifier>`."""
    domain, sep, ident = name.rpartition("/")
    errs = []
    if sep:
        if not domain:
            errs.append("has an empty domain")
        else:
            errs += [f"domain {e}" for e in dns_subdomain_errors(domain, MAX_DOMAIN_LENGTH)]
    if len(ident) > MAX_ID_LENGTH:
        errs.append(f"identifier must be no more than {MAX_ID_LENGTH} characters")
    if not _C_IDENTIFIER.match(ident):
        errs.append("identifier must be a C identifier")
    return errs


def label_key_errors(key: str) -> list[str]:
    """Taint keys follow the label key rules."""
    prefix, sep, name = key.rpartition("/")
    errs = []
    if sep:
        errs += [f"prefix {e}" for e in dns_subdomain_errors(prefix)]
    if len(name) > 63 or not _LABEL_NAME.match(name):
        errs.append("name must be 63 characters or less, alphanumerics, '-', '_' or '.'")
    return errs


def label_value_errors(value: str) -> list[str]:
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        return ["must be 63 characters or less, alphanumerics, '-', '_' or '.'"]
    return []


def attribute_value_errors(value: AttrValue) -> list[str]:
    from agent.model import IntList, Version

    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        if not -(2**63) <= value < 2**63:
            return ["int out of 64-bit range"]
        return []
    if isinstance(value, Version):
        return semver_errors(value.value)
    if isinstance(value, IntList):
        if not value.values:
            return ["ints must not be empty"]
        if not all(type(v) is int and -(2**63) <= v < 2**63 for v in value.values):
            return ["ints must be 64-bit integers"]
        return []
    if isinstance(value, str):
        if len(value) > MAX_VALUE_LENGTH:
            return [f"string must be no more than {MAX_VALUE_LENGTH} characters (is {len(value)})"]
        return []
    return [f"unsupported value type {type(value).__name__}"]


def quantity_errors(value: str) -> list[str]:
    return [] if _QUANTITY.match(value) else [f"{value!r} is not a quantity"]


def pool_name_errors(name: str) -> list[str]:
    errs = []
    if len(name) > MAX_POOL_NAME:
        errs.append(f"must be no more than {MAX_POOL_NAME} characters")
    for part in name.split("/"):
        if dns_subdomain_errors(part):
            errs.append("each '/'-separated part must be a DNS subdomain")
            break
    return errs
