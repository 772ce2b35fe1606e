"""From a ResourceClaim to the devices this node must prepare for it.

Strict by design: anything that does not match this driver and node, or opaque
configuration the agent does not understand, is a precise error for that claim,
found before anything is written.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.apirules import dns_label_errors
from agent.metadata import POD_CLAIM_NAME, AllocatedDevice
from agent.model import Device
from agent.names import ClaimRef, InvalidName, base_request, check_request

CONFIG_KIND = "DeviceConfig"
CONFIG_FIELDS = {"apiVersion", "kind", "env"}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
MAX_ENV_VALUE = 4096


class ClaimError(ValueError):
    """Why a claim cannot be prepared here (the message goes to the kubelet)."""


@dataclass(slots=True)
class Allocation:
    ref: ClaimRef
    pod_claim_name: str
    devices: list[AllocatedDevice] = field(default_factory=list)
    config_env: dict[str, dict[str, str]] = field(default_factory=dict)  # device name -> env


def config_api_version(driver: str) -> str:
    return f"{driver}/v1alpha1"


def parse_claim(claim: Mapping[str, Any], ref: ClaimRef, *, driver: str, pool: str,
                lookup: Callable[[str], Device | None]) -> Allocation:
    meta = claim.get("metadata") or {}
    if meta.get("namespace", ref.namespace) != ref.namespace or meta.get("name") != ref.name:
        raise ClaimError(f"the claim source returned {meta.get('namespace')}/{meta.get('name')}, "
                         f"not {ref.namespace}/{ref.name}")
    if meta.get("uid") != ref.uid:
        raise ClaimError(f"UID mismatch: the claim has UID {meta.get('uid')!r}, the kubelet asked for "
                         f"{ref.uid} (deleted and re-created?)")
    if meta.get("deletionTimestamp"):
        raise ClaimError("the claim is being deleted")
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError("the claim is not allocated")
    device_alloc = allocation.get("devices") or {}
    pod_claim_name = str((meta.get("annotations") or {}).get(POD_CLAIM_NAME, ""))
    if pod_claim_name:
        _check_name("pod claim name", pod_claim_name)
    out = Allocation(ref=ref, pod_claim_name=pod_claim_name)
    for i, result in enumerate(device_alloc.get("results") or []):
        if not isinstance(result, Mapping):
            raise ClaimError(f"allocation result #{i} is not an object")
        if result.get("driver") != driver:
            continue
        request = str(result.get("request", ""))
        name = str(result.get("device", ""))
        try:
            check_request(request)
        except InvalidName as exc:
            raise ClaimError(str(exc)) from None
        if result.get("pool") != pool:
            raise ClaimError(f"device {name} of pool {result.get('pool')!r} is not on this node "
                             f"(pool {pool!r})")
        device = lookup(name)
        if device is None:
            raise ClaimError(f"device {name} is not on this node")
        out.devices.append(AllocatedDevice(request=request, pool=pool, device=device,
                                           share_id=str(result.get("shareID") or "")))
    _apply_configs(out, device_alloc.get("config") or [], driver)
    return out


def _check_name(what: str, value: str) -> None:
    if dns_label_errors(value):
        raise ClaimError(f"{what} {value[:80]!r} is not a DNS label") from None


def _apply_configs(out: Allocation, configs: list[Any], driver: str) -> None:
    # Class configuration first, then the claim's own: later entries win.
    ordered = sorted(enumerate(configs), key=lambda ic: (0 if _source(ic[1]) == "FromClass" else 1, ic[0]))
    for i, config in ordered:
        opaque = (config or {}).get("opaque") if isinstance(config, Mapping) else None
        if not opaque or opaque.get("driver") != driver:
            continue
        env = decode_config(opaque.get("parameters"), driver, where=f"opaque configuration #{i}")
        requests = list(config.get("requests") or [])
        for alloc in out.devices:
            if not requests or alloc.request in requests or base_request(alloc.request) in requests:
                out.config_env.setdefault(alloc.device.name, {}).update(env)


def _source(config: Any) -> str:
    return str(config.get("source", "")) if isinstance(config, Mapping) else ""


def decode_config(params: Any, driver: str, where: str = "opaque configuration") -> dict[str, str]:
    """Strictly decode `{"apiVersion": "<driver>/v1alpha1", "kind": "DeviceConfig", "env": {...}}`."""
    if not isinstance(params, Mapping):
        raise ClaimError(f"{where}: parameters must be an object")
    unknown = sorted(set(params) - CONFIG_FIELDS)
    if unknown:
        raise ClaimError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}")
    if params.get("apiVersion") != config_api_version(driver):
        raise ClaimError(f"{where}: apiVersion must be {config_api_version(driver)!r}, "
                         f"not {params.get('apiVersion')!r}")
    if params.get("kind") != CONFIG_KIND:
        raise ClaimError(f"{where}: kind must be {CONFIG_KIND!r}, not {params.get('kind')!r}")
    env = params.get("env", {})
    if not isinstance(env, Mapping):
        raise ClaimError(f"{where}: env must be an object of strings")
    out: dict[str, str] = {}
    for key, value in env.items():
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise ClaimError(f"{where}: env name {str(key)[:80]!r} is not a valid variable name")
        if key.startswith("DRA_"):
            raise ClaimError(f"{where}: env name {key!r}: the DRA_ prefix is reserved for the driver")
        if not isinstance(value, str):
            raise ClaimError(f"{where}: env {key!r} must be a string")
        if len(value) > MAX_ENV_VALUE or "\x00" in value:
            raise ClaimError(f"{where}: env {key!r} is longer than {MAX_ENV_VALUE} characters or has NUL")
        out[key] = value
    return out
