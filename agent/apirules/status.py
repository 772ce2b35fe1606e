"""The API server's rules for the `status.devices` entries of a ResourceClaim (resource.k8s.io/v1,
1.37): what a driver may report about each device allocated to the claim. Checked before sending,
so an offending part is dropped and logged instead of the whole write refused."""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Collection, Mapping
from typing import Any

from agent.apirules.formats import (
    MAX_DRIVER_NAME,
    dns_label_errors,
    dns_subdomain_errors,
    label_key_errors,
    pool_name_errors,
)

MAX_STATUS_CONDITIONS = 8
MAX_STATUS_DATA = 10 * 1024  # bytes of the JSON `data` object
MAX_NETWORK_IPS = 16
MAX_INTERFACE_NAME = 256
MAX_HARDWARE_ADDRESS = 128
MAX_CONDITION_TYPE = 316  # a qualified name: 253-character prefix, '/', 63-character name
MAX_CONDITION_REASON = 1024
MAX_CONDITION_MESSAGE = 32768
CONDITION_STATUSES = ("True", "False", "Unknown")
_CONDITION_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?\Z")
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})\Z")

# (driver, pool, device, shareID or ""): the key of a status.devices entry, and of an allocation result.
DeviceKey = tuple[str, str, str, str]


def device_key(entry: Mapping[str, Any]) -> DeviceKey:
    return (str(entry.get("driver", "")), str(entry.get("pool", "")), str(entry.get("device", "")),
            str(entry.get("shareID") or ""))


def interface_address_errors(value: str) -> list[str]:
    """An IP in CIDR form, written canonically (`10.9.8.7/24`, `2001:db8::1/64`), as the API wants."""
    try:
        if "/" not in value:
            raise ValueError("no prefix length")
        iface = ipaddress.ip_interface(value)
    except ValueError:
        return [f"{value!r} must be an address in CIDR form (e.g. 10.9.8.7/24 or 2001:db8::1/64)"]
    canonical = f"{iface.ip.compressed}/{iface.network.prefixlen}"
    if value != canonical:
        return [f"{value!r} must be in canonical form ({canonical!r})"]
    return []


def condition_errors(cond: Mapping[str, Any]) -> list[str]:
    """metav1.Condition as the API server validates it."""
    errs = []
    ctype = str(cond.get("type") or "")
    if not ctype or len(ctype) > MAX_CONDITION_TYPE or label_key_errors(ctype):
        errs.append(f"type {ctype!r} must be a qualified name")
    if cond.get("status") not in CONDITION_STATUSES:
        errs.append(f"status must be one of {', '.join(CONDITION_STATUSES)}")
    reason = str(cond.get("reason") or "")
    if len(reason) > MAX_CONDITION_REASON or not _CONDITION_REASON.match(reason):
        errs.append(f"reason {reason[:80]!r} must be CamelCase letters, digits, '_', ',' or ':'")
    if len(str(cond.get("message") or "")) > MAX_CONDITION_MESSAGE:
        errs.append(f"message must be no more than {MAX_CONDITION_MESSAGE} characters")
    if not _RFC3339.match(str(cond.get("lastTransitionTime") or "")):
        errs.append("lastTransitionTime must be an RFC 3339 time")
    generation = cond.get("observedGeneration")
    if generation is not None and (not isinstance(generation, int) or generation < 0):
        errs.append("observedGeneration must be a non-negative int")
    return errs


def clip_device_status(entry: Mapping[str, Any],
                       allocated: Collection[DeviceKey]) -> tuple[dict[str, Any] | None, list[str]]:
    """The entry cut down to what the API server accepts, and what was cut (one line each).

    None: the whole entry must go (not an allocated device of the claim, or a name the API
    rejects). Otherwise each offending part goes alone: a condition beyond the eighth or an
    invalid one, `data` over 10 KiB, an invalid or surplus IP, an over-long interface name or
    hardware address.
    """
    key = device_key(entry)
    driver, pool, device, share = key
    errs = [f"driver {e}" for e in dns_subdomain_errors(driver, MAX_DRIVER_NAME)]
    errs += [f"pool {e}" for e in pool_name_errors(pool)]
    errs += [f"device {e}" for e in dns_label_errors(device)]
    if key not in allocated:
        errs.append(f"{driver}/{pool}/{device}" + (f" (share {share})" if share else "")
                    + " is not an allocated device of the claim")
    if errs:
        return None, errs
    out = dict(entry)
    dropped: list[str] = []
    conditions: list[Mapping[str, Any]] = []
    for cond in entry.get("conditions") or []:
        if problems := condition_errors(cond):
            dropped.append(f"condition {cond.get('type')!r}: {'; '.join(problems)}")
        elif len(conditions) == MAX_STATUS_CONDITIONS:
            dropped.append(f"condition {cond.get('type')!r}: more than {MAX_STATUS_CONDITIONS} conditions")
        else:
            conditions.append(cond)
    if "conditions" in out:
        out["conditions"] = conditions
    if "data" in out:
        data = out["data"]
        size = len(json.dumps(data, separators=(",", ":")).encode()) if isinstance(data, Mapping) else 0
        if not isinstance(data, Mapping):
            dropped.append("data must be a JSON object")
            del out["data"]
        elif size > MAX_STATUS_DATA:
            dropped.append(f"data is {size} bytes of JSON, more than {MAX_STATUS_DATA}")
            del out["data"]
    net = out.get("networkData")
    if isinstance(net, Mapping):
        out["networkData"], cut = clip_network_data(net)
        dropped += cut
    return out, dropped


def clip_network_data(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A device's `networkData` (NetworkDeviceData: in a claim's status, and in the device metadata file)
    cut down to what the API type allows, and what was cut (one line each): an over-long interface name
    or hardware address, an invalid, duplicated or surplus IP."""
    net = dict(data)
    dropped: list[str] = []
    if len(str(net.get("interfaceName", ""))) > MAX_INTERFACE_NAME:
        dropped.append(f"networkData.interfaceName is longer than {MAX_INTERFACE_NAME} characters")
        del net["interfaceName"]
    if len(str(net.get("hardwareAddress", ""))) > MAX_HARDWARE_ADDRESS:
        dropped.append(f"networkData.hardwareAddress is longer than {MAX_HARDWARE_ADDRESS} characters")
        del net["hardwareAddress"]
    if "ips" in net:
        ips: list[str] = []
        for ip in net["ips"]:
            if problems := interface_address_errors(str(ip)):
                dropped.append(f"networkData.ips: {problems[0]}")
            elif ip in ips:
                dropped.append(f"networkData.ips: {ip!r} is duplicated")
            elif len(ips) == MAX_NETWORK_IPS:
                dropped.append(f"networkData.ips: {ip!r} is beyond the first {MAX_NETWORK_IPS}")
            else:
                ips.append(str(ip))
        net["ips"] = ips
    return net, dropped
