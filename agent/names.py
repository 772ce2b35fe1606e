"""Validation of the names and UIDs that arrive from the kubelet and from claims.

Everything here runs before any of these strings becomes part of a path, so
a hostile or malformed claim can never make the agent write outside its roots.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.apirules import dns_label_errors, dns_subdomain_errors

_UID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")


class InvalidName(ValueError):
    pass


def _show(value: str) -> str:
    shown = value if len(value) <= 80 else value[:77] + "..."
    return repr(shown)


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A claim as the kubelet names it."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"claim {_plain(self.namespace)}/{_plain(self.name)} ({_plain(self.uid)})"


@dataclass(frozen=True, slots=True)
class ClaimName:
    """A claim by namespace and name alone: how the kubelet's pod resources service names the claims pods
    use (it gives no UID)."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"claim {_plain(self.namespace)}/{_plain(self.name)}"


def _plain(value: str) -> str:
    """The value as is when it is short and printable, else a clipped repr (logs stay one line)."""
    if len(value) <= 253 and value.isprintable():
        return value
    return _show(value)


def check_uid(uid: str) -> None:
    if not _UID.match(uid):
        raise InvalidName(f"claim UID {_show(uid)} is not a UID (lower-case 8-4-4-4-12 hex)")


def check_claim_ref(ref: ClaimRef) -> None:
    if errs := dns_label_errors(ref.namespace):
        raise InvalidName(f"claim namespace {_show(ref.namespace)} {errs[-1]}")
    if errs := dns_subdomain_errors(ref.name):
        raise InvalidName(f"claim name {_show(ref.name)} {errs[-1]}")
    check_uid(ref.uid)


def base_request(request: str) -> str:
    """`req/sub` -> `req` (the name the kubelet and the metadata paths use)."""
    return request.split("/", 1)[0]


def check_request(request: str) -> None:
    parts = request.split("/")
    if len(parts) > 2:
        raise InvalidName(f"request name {_show(request)} has more than one '/'")
    for part in parts:
        if errs := dns_label_errors(part):
            raise InvalidName(f"request name {_show(request)} {errs[-1]}")


def check_device_name(device: str) -> None:
    """A device name as published (`gpu-3`, `nic-...`): a DNS label."""
    if errs := dns_label_errors(device):
        raise InvalidName(f"device name {_show(device)} {errs[-1]}")


# An extended resource name: a domain-prefixed name (RFC 1123 subdomain, `/`, a qualified name's name part).
_EXTENDED_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_EXTENDED_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[-A-Za-z0-9_.]*$")


class ResourceNameError(ValueError):
    """A `--device-plugin-resources` entry that is not an extended resource name or a prefix of one."""


@dataclass(frozen=True, slots=True)
class PluginResources:
    """The extended resource names a device plugin serves GPUs under: exact names, and prefixes (`nvidia.com/mig-*`:
    the MIG names of the NVIDIA device plugin's mixed strategy, one per profile)."""

    exact: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> PluginResources:
        exact: set[str] = set()
        prefixes: list[str] = []
        for entry in (e.strip() for e in text.split(",")):
            if not entry:
                continue
            if entry.endswith("*") and _EXTENDED_PREFIX.match(entry[:-1]):
                prefixes.append(entry[:-1])
            elif _EXTENDED_NAME.match(entry) and len(entry) <= 253:
                exact.add(entry)
            else:
                raise ResourceNameError(
                    f"--device-plugin-resources: {entry!r} is not an extended resource name (nvidia.com/gpu) or a "
                    "prefix of one ending in * (nvidia.com/mig-*)")
        return cls(frozenset(exact), tuple(prefixes))

    def __bool__(self) -> bool:
        return bool(self.exact or self.prefixes)

    def matches(self, name: str) -> bool:
        return name in self.exact or any(name.startswith(p) for p in self.prefixes)

    def __str__(self) -> str:
        return ",".join([*sorted(self.exact), *(f"{p}*" for p in self.prefixes)])
