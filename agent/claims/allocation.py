"""From a ResourceClaim to the devices this node must prepare for it.

Strict by design: anything that does not match this driver and node, or opaque
configuration the agent does not understand, is a precise error for that claim,
found before anything is written. The claim may come from a file anyone on the
node can edit, so its shape is checked field by field as it is read: a list
where an object belongs, a number where a name belongs or a null anywhere is a
`ClaimError` naming the field's path, never an exception from deep inside.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent import quantity
from agent.apirules import dns_label_errors, quantity_errors
from agent.claims.claimenv import MPS_LIMITS, RESERVED_ENV_TEXT, ConfiguredLimits, MpsLimits, is_share, reserved
from agent.claims.metadata import POD_CLAIM_NAME, AllocatedDevice
from agent.computeshare import COMPUTE, COMPUTE_PERCENT, thread_percentage
from agent.errors import ClaimError
from agent.facts import NicFacts, PassthroughFacts
from agent.inventory import Withheld
from agent.kinds import Kind
from agent.model import Device
from agent.names import ClaimRef, InvalidName, base_request, check_request

CONFIG_KIND = "DeviceConfig"
CONFIG_FIELDS = {"apiVersion", "kind", "env"}
VFIO_KIND = "VfioConfig"  # passthrough (VFIO) devices: the VFIO interface, a VF's MAC and VLAN
VFIO_FIELDS = {"apiVersion", "kind", "iommu", "mac", "vlan"}
# NICs: the name the interface takes in the pod, or `move: false` to leave it in the host's namespace
# (a host-network pod, a runtime that reads no CDI 1.1 `netDevices`).
NETWORK_KIND = "NetworkConfig"
NETWORK_FIELDS = {"apiVersion", "kind", "interfaceName", "move"}
IFNAMSIZ = 16  # the kernel's limit on an interface name, its NUL included
IOMMU_BACKENDS = ("legacy", "iommufd")
_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}\Z")
MAX_VLAN = 4094
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
MAX_ENV_VALUE = 4096
_RESULTS = "status.allocation.devices.results"
_CONFIG = "status.allocation.devices.config"


@dataclass(frozen=True, slots=True)
class VfioSettings:
    """What a claim's `VfioConfig` asks for one passthrough device. `where` is the claim field of the
    last entry that set something, for errors found when the device is bound."""

    iommu: str = "legacy"  # legacy (/dev/vfio/vfio + /dev/vfio/<group>) | iommufd (/dev/iommu + cdev)
    mac: str = ""  # set on a VF through its PF before binding ("" leaves it)
    vlan: int | None = None  # likewise (0 clears it; None, not asked for, leaves it)
    where: str = ""


@dataclass(slots=True)
class Allocation:
    ref: ClaimRef
    pod_claim_name: str
    devices: list[AllocatedDevice] = field(default_factory=list)
    config_env: dict[str, dict[str, str]] = field(default_factory=dict)  # device name -> env, but the MPS limits
    # The MPS limits each configuration sets, in the order they apply: the claim's clients get the lowest of
    # them and the agent's (`agent.claims.plan.client_limits`); each entry applies to shares only.
    mps_limits: list[ConfiguredLimits] = field(default_factory=list)
    vfio: dict[str, VfioSettings] = field(default_factory=dict)  # passthrough device name -> its config
    network: dict[str, NetworkSettings] = field(default_factory=dict)  # NIC device name -> its config


@dataclass(frozen=True, slots=True)
class NetworkSettings:
    """What a claim's `NetworkConfig` asks for one NIC: the interface's name in the pod ("" keeps the
    host's) and whether it moves there at all."""

    interface: str = ""
    move: bool = True


def config_api_version(driver: str) -> str:
    return f"{driver}/v1alpha1"


# -- typed access to a decoded JSON/YAML document ---------------------------------------------------

def _kind(value: object) -> str:
    """A value's type in the words of the document it came from (YAML/JSON), for messages."""
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__  # `true` reads as bool, not as the int it subclasses


def _key(key: object) -> str:
    """A map key (annotation, env name) as it appears in a field path: quoted, clipped."""
    text = key if isinstance(key, str) else str(key)
    return repr(text if len(text) <= 80 else text[:77] + "...")


def _value(value: object) -> str:
    """A value the claim holds, for a message: its repr, clipped (it may be megabytes)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _object(value: object, path: str) -> Mapping[Any, Any]:
    """An optional object: absent or null is empty (as the API server treats null)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ClaimError(f"{path} must be an object, not {_kind(value)}")
    return value


def _list(value: object, path: str) -> list[Any]:
    """An optional list: absent or null is empty."""
    if value is None:
        return []
    # A string is iterable too: without this check `requests: gpu` would mean ["g", "p", "u"].
    if not isinstance(value, list):
        raise ClaimError(f"{path} must be a list, not {_kind(value)}")
    return value


def _string(obj: Mapping[Any, Any], key: str, path: str, *, default: str | None = None) -> str:
    """A string field; `default` is used when it is absent or null, else it is required."""
    value = obj.get(key)
    if value is None and default is not None:
        return default
    if not isinstance(value, str):
        raise ClaimError(f"{path}.{key} must be a string, not {_kind(value)}")
    return value


# -- the claim ---------------------------------------------------------------------------------------

def parse_claim(claim: Mapping[str, Any], ref: ClaimRef, *, driver: str, pool: str,
                lookup: Callable[[str], Device | None],
                withheld: Callable[[str], Withheld | None] = lambda _: None) -> Allocation:
    """The claim's allocation on this node; `withheld` says why a device discovery read is not published
    now (its typed failure is raised for a claim allocated it before)."""
    if not isinstance(claim, Mapping):
        raise ClaimError(f"the claim must be an object, not {_kind(claim)}")
    meta = _object(claim.get("metadata"), "metadata")
    namespace = _string(meta, "namespace", "metadata", default=ref.namespace)
    name = meta.get("name")
    if name is not None and not isinstance(name, str):
        raise ClaimError(f"metadata.name must be a string, not {_kind(name)}")
    if namespace != ref.namespace or name != ref.name:
        raise ClaimError(f"the claim source returned {namespace}/{name}, not {ref.namespace}/{ref.name}")
    uid = meta.get("uid")
    if uid is not None and not isinstance(uid, str):
        raise ClaimError(f"metadata.uid must be a string, not {_kind(uid)}")
    if uid != ref.uid:
        raise ClaimError(f"UID mismatch: the claim has UID {_value(uid)}, the kubelet asked for "
                         f"{ref.uid} (deleted and re-created?)")
    if meta.get("deletionTimestamp"):
        raise ClaimError("the claim is being deleted")
    annotations = _object(meta.get("annotations"), "metadata.annotations")
    annotated = annotations.get(POD_CLAIM_NAME)
    if annotated is not None and not isinstance(annotated, str):
        raise ClaimError(f"metadata.annotations[{_key(POD_CLAIM_NAME)}] must be a string, "
                         f"not {_kind(annotated)}")
    pod_claim_name: str = annotated or ""
    if pod_claim_name:
        _check_name("pod claim name", pod_claim_name)

    status = _object(claim.get("status"), "status")
    allocation = _object(status.get("allocation"), "status.allocation")
    if not allocation:
        raise ClaimError("the claim is not allocated")
    device_alloc = _object(allocation.get("devices"), "status.allocation.devices")
    out = Allocation(ref=ref, pod_claim_name=pod_claim_name)
    for i, result in enumerate(_list(device_alloc.get("results"), _RESULTS)):
        path = f"{_RESULTS}[{i}]"
        if not isinstance(result, Mapping):
            raise ClaimError(f"{path} must be an object, not {_kind(result)}")
        if _string(result, "driver", path) != driver:
            continue
        request = _string(result, "request", path)
        device_name = _string(result, "device", path)
        result_pool = _string(result, "pool", path)
        share_id = _string(result, "shareID", path, default="")
        consumed = _consumed(result.get("consumedCapacity"), f"{path}.consumedCapacity")
        admin_access = result.get("adminAccess")
        if admin_access is not None and not isinstance(admin_access, bool):
            raise ClaimError(f"{path}.adminAccess must be a bool, not {_kind(admin_access)}")
        try:
            check_request(request)
        except InvalidName as exc:
            raise ClaimError(str(exc)) from None
        if result_pool != pool:
            raise ClaimError(f"device {device_name} of pool {result_pool!r} is not on this node "
                             f"(pool {pool!r})")
        device = lookup(device_name)
        if device is None and (held := withheld(device_name)) is not None:
            raise held.failure()
        if device is None:
            raise ClaimError(f"device {device_name} is not on this node")
        if admin_access:
            pass  # the device as it is, beside whoever holds it: what it consumes is not checked, nor given
        elif device.kind.shared:
            _check_share(device, share_id, consumed, path)
        elif device.kind is Kind.CPU and share_id:
            _check_cpu_share(device, consumed, path)
        out.devices.append(AllocatedDevice(request=request, pool=pool, device=device, share_id=share_id,
                                           consumed=consumed, admin_access=bool(admin_access)))
    _apply_configs(out, _list(device_alloc.get("config"), _CONFIG), driver)
    out.devices = [_placed(alloc, out.network.get(alloc.device.name)) for alloc in out.devices]
    return out


def _placed(alloc: AllocatedDevice, config: NetworkSettings | None) -> AllocatedDevice:
    """A NIC allocated for a pod moves into the pod's network namespace (CDI `netDevices`), under the
    name its `NetworkConfig` gives or its host name; not one allocated with admin access (the device as
    it is), nor one whose configuration says `move: false`. The node's uplink never moves: prepare refuses
    it, from the links as they are then (`agent.engine.claimops`, `agent.inventory.uplinks`)."""
    facts = alloc.device.node
    if not isinstance(facts, NicFacts) or alloc.admin_access or (config is not None and not config.move):
        return alloc
    return dataclasses.replace(alloc, pod_interface=(config.interface if config else "") or facts.interface)


def _consumed(value: object, path: str) -> dict[str, str]:
    """`consumedCapacity`: capacity name -> quantity (absent: nothing consumed)."""
    out: dict[str, str] = {}
    for name, amount in _object(value, path).items():
        if not isinstance(name, str) or not isinstance(amount, str) or quantity_errors(amount):
            raise ClaimError(f"{path}[{_key(name)}] must be a quantity, not {_value(amount)}")
        out[name] = amount
    return out


def _check_share(device: Device, share_id: str, consumed: dict[str, str], path: str) -> None:
    """A shared GPU is given out only as a share: the result must say which one and how much memory
    (the scheduler always sets both for a device that allows multiple allocations), within the GPU."""
    if not share_id:
        raise ClaimError(f"{path}: device {device.name} is a shared device, but the result has no shareID")
    amount = consumed.get("memory")
    if amount is None:
        raise ClaimError(f"{path}: device {device.name} is a shared device, but the result has no "
                         "consumedCapacity.memory")
    capacity = device.capacity.get("memory")
    try:
        ok = 0 < quantity.parse_int(amount) <= (quantity.parse_int(capacity.value) if capacity else 0)
    except ValueError:
        ok = False
    if not ok:
        raise ClaimError(f"{path}.consumedCapacity.memory {amount!r} is not a share of device {device.name} "
                         f"(whole bytes, more than 0, at most {capacity.value if capacity else 0})")
    # Compute (`agent.computeshare`): absent where the device was published without it.
    if COMPUTE in consumed and COMPUTE_PERCENT in consumed:
        raise ClaimError(f"{path}.consumedCapacity names both {COMPUTE} and {COMPUTE_PERCENT}")
    try:
        thread_percentage(consumed)
    except ValueError as exc:
        name = COMPUTE if COMPUTE in consumed else COMPUTE_PERCENT
        raise ClaimError(f"{path}.consumedCapacity[{name}] {consumed[name]!r} is not a compute share of device "
                         f"{device.name}: {exc}") from None


def _check_cpu_share(device: Device, consumed: dict[str, str], path: str) -> None:
    """A share of a CPU device: a whole number of its CPUs, at least one, under its one capacity's name."""
    if len(device.capacity) != 1:
        raise ClaimError(f"{path}: device {device.name} publishes no capacity to take a share of")
    (name, capacity), = device.capacity.items()
    amount = consumed.get(name)
    try:
        ok = amount is not None and 0 < quantity.parse_int(amount) <= quantity.parse_int(capacity.value)
    except ValueError:
        ok = False
    if not ok:
        raise ClaimError(f"{path}.consumedCapacity[{_key(name)}] {amount!r} is not a share of device {device.name} "
                         f"(whole CPUs, at least 1, at most {capacity.value})")


def _check_name(what: str, value: str) -> None:
    if dns_label_errors(value):
        raise ClaimError(f"{what} {value[:80]!r} is not a DNS label") from None


@dataclass(frozen=True, slots=True)
class _Config:
    index: int
    from_class: bool
    requests: list[str]
    parameters: object


def _apply_configs(out: Allocation, configs: list[Any], driver: str) -> None:
    # Every entry is checked before any is applied, so a malformed entry is reported whatever
    # its position, and the order below cannot hide it.
    ours: list[_Config] = []
    for i, config in enumerate(configs):
        path = f"{_CONFIG}[{i}]"
        if not isinstance(config, Mapping):
            raise ClaimError(f"{path} must be an object, not {_kind(config)}")
        source = _string(config, "source", path, default="")
        requests = _list(config.get("requests"), f"{path}.requests")
        for j, request in enumerate(requests):
            if not isinstance(request, str):
                raise ClaimError(f"{path}.requests[{j}] must be a string, not {_kind(request)}")
        # A config entry without `opaque` is one this agent has no use for (the API may add kinds).
        opaque = _object(config.get("opaque"), f"{path}.opaque")
        if not opaque or _string(opaque, "driver", f"{path}.opaque") != driver:
            continue
        ours.append(_Config(i, source == "FromClass", requests, opaque.get("parameters")))
    # Class configuration first, then the claim's own: later entries win.
    ours.sort(key=lambda c: (not c.from_class, c.index))
    for c in ours:
        where = f"{_CONFIG}[{c.index}].opaque.parameters"
        decoded = decode_config(c.parameters, driver, where=where)
        applied = False
        for alloc in out.devices:
            if c.requests and alloc.request not in c.requests and base_request(alloc.request) not in c.requests:
                continue
            applied = True
            if isinstance(decoded, NetworkSettings):
                if alloc.device.kind is not Kind.NIC:
                    raise ClaimError(f"{where}: a {NETWORK_KIND} applies to NICs only; device "
                                     f"{alloc.device.name} of request {alloc.request!r} is a {alloc.device.kind} "
                                     "device")
                out.network[alloc.device.name] = decoded
                continue
            if isinstance(decoded, _EnvEntry):
                # The MPS limits are a share's: on any other device they would be a variable of its CDI
                # device that no share's value overrides (docs/security.md).
                if (named := sorted(decoded.limits.env())) and not is_share(alloc):
                    what = "allocated with adminAccess" if alloc.admin_access else f"a {alloc.device.kind} device"
                    raise ClaimError(f"{where}.env: {', '.join(named)}: the MPS limits are a GPU share's; device "
                                     f"{alloc.device.name} of request {alloc.request!r} is {what}, not a share (name "
                                     "only the shares' requests in the configuration's requests)")
                # Other variables of a later entry win.
                out.config_env.setdefault(alloc.device.name, {}).update(decoded.env)
                continue
            dev = alloc.device
            if not dev.kind.passthrough:
                raise ClaimError(f"{where}: a {VFIO_KIND} applies to passthrough (VFIO) devices only; "
                                 f"device {dev.name} of request {alloc.request!r} is a {dev.kind} device")
            if alloc.admin_access:
                raise ClaimError(f"{where}: a {VFIO_KIND} configures the device it binds to vfio-pci; device "
                                 f"{dev.name} of request {alloc.request!r} is allocated with adminAccess, which "
                                 "gets a device as it is, never reconfigured (leave this request out of the config)")
            if decoded.fields & {"mac", "vlan"} and not (isinstance(dev.node, PassthroughFacts)
                                                         and dev.node.native is Kind.NIC):
                raise ClaimError(f"{where}.{'mac' if 'mac' in decoded.fields else 'vlan'}: only a NIC "
                                 f"function (an SR-IOV VF) takes a MAC or VLAN; {dev.name} is not one")
            old = out.vfio.get(dev.name, VfioSettings())
            out.vfio[dev.name] = VfioSettings(
                iommu=decoded.settings.iommu if "iommu" in decoded.fields else old.iommu,
                mac=decoded.settings.mac if "mac" in decoded.fields else old.mac,
                vlan=decoded.settings.vlan if "vlan" in decoded.fields else old.vlan, where=where)
        if applied and isinstance(decoded, _EnvEntry) and decoded.limits.env():
            out.mps_limits.append(ConfiguredLimits(where, decoded.limits))


@dataclass(frozen=True, slots=True)
class _EnvEntry:
    env: dict[str, str]  # the variables a DeviceConfig sets, but the MPS limits
    limits: MpsLimits  # the MPS limits it sets


@dataclass(frozen=True, slots=True)
class _VfioEntry:
    settings: VfioSettings
    fields: frozenset[str]  # the fields the entry sets (later entries override only those)


def decode_config(params: Any, driver: str,
                  where: str = "parameters") -> _EnvEntry | _VfioEntry | NetworkSettings:
    """Strictly decode `{"apiVersion": "<driver>/v1alpha1", "kind": "DeviceConfig", "env": {...}}`
    (its variables) or `{..., "kind": "VfioConfig", "iommu", "mac", "vlan"}`; `where` is the path of
    `params` in the claim, for messages."""
    if not isinstance(params, Mapping):
        raise ClaimError(f"{where} must be an object, not {_kind(params)}")
    vfio = params.get("kind") == VFIO_KIND
    network = params.get("kind") == NETWORK_KIND
    allowed = VFIO_FIELDS if vfio else NETWORK_FIELDS if network else CONFIG_FIELDS
    # Keys of a YAML document need not be strings: compare and sort them as text.
    unknown = sorted(str(k) for k in params if k not in allowed)
    if unknown:
        shown = ", ".join(_key(k) for k in unknown[:10]) + (", ..." if len(unknown) > 10 else "")
        raise ClaimError(f"{where}: unknown field(s) {shown}")
    if params.get("apiVersion") != config_api_version(driver):
        raise ClaimError(f"{where}.apiVersion must be {config_api_version(driver)!r}, "
                         f"not {_value(params.get('apiVersion'))}")
    if vfio:
        return _decode_vfio(params, where)
    if network:
        return _decode_network(params, where)
    if params.get("kind") != CONFIG_KIND:
        raise ClaimError(f"{where}.kind must be {CONFIG_KIND!r}, {NETWORK_KIND!r} or {VFIO_KIND!r}, "
                         f"not {_value(params.get('kind'))}")
    env = params.get("env")
    if env is None:
        return _EnvEntry({}, MpsLimits())
    if not isinstance(env, Mapping):
        raise ClaimError(f"{where}.env must be an object of strings, not {_kind(env)}")
    out: dict[str, str] = {}
    limits: dict[str, str] = {}
    for key, value in env.items():
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise ClaimError(f"{where}.env: name {_key(key)} is not a valid variable name")
        if (family := reserved(key)) is not None and key not in MPS_LIMITS:
            raise ClaimError(f"{where}.env: {key!r} is reserved: {family.why} (reserved: {RESERVED_ENV_TEXT}; a "
                             f"configuration may only lower a share's MPS limits {', '.join(MPS_LIMITS)})")
        if not isinstance(value, str):
            raise ClaimError(f"{where}.env[{_key(key)}] must be a string, not {_kind(value)}")
        if len(value) > MAX_ENV_VALUE or "\x00" in value:
            raise ClaimError(f"{where}.env[{_key(key)}] is longer than {MAX_ENV_VALUE} characters or has NUL")
        (limits if key in MPS_LIMITS else out)[key] = value
    return _EnvEntry(out, MpsLimits.decode(limits, f"{where}.env"))


def _decode_vfio(params: Mapping[Any, Any], where: str) -> _VfioEntry:
    iommu, mac, vlan = params.get("iommu", "legacy"), params.get("mac", ""), params.get("vlan")
    if iommu not in IOMMU_BACKENDS:
        raise ClaimError(f"{where}.iommu must be 'legacy' or 'iommufd', not {_value(iommu)}")
    if not isinstance(mac, str) or (mac and not _MAC.match(mac.lower())):
        raise ClaimError(f"{where}.mac must be a MAC address like '02:00:00:00:00:01', not {_value(mac)}")
    mac = mac.lower()
    if mac and int(mac[:2], 16) & 1:
        raise ClaimError(f"{where}.mac {mac!r} is a multicast address: a VF needs a unicast one")
    if "vlan" in params and (type(vlan) is not int or not 0 <= vlan <= MAX_VLAN):
        raise ClaimError(f"{where}.vlan must be a VLAN ID from 0 (none) to {MAX_VLAN}, not {_value(vlan)}")
    fields = frozenset(k for k in ("iommu", "mac", "vlan") if k in params)
    return _VfioEntry(VfioSettings(iommu=str(iommu), mac=mac, vlan=vlan, where=where), fields)


def _decode_network(params: Mapping[Any, Any], where: str) -> NetworkSettings:
    name, move = params.get("interfaceName", ""), params.get("move", True)
    if not isinstance(name, str):
        raise ClaimError(f"{where}.interfaceName must be a string, not {_kind(name)}")
    if name and (problem := interface_name_errors(name)):
        raise ClaimError(f"{where}.interfaceName must be a network interface name: {problem}")
    if not isinstance(move, bool):
        raise ClaimError(f"{where}.move must be true or false, not {_value(move)}")
    return NetworkSettings(interface=name, move=move)


def interface_name_errors(name: str) -> str:
    """Why the kernel would refuse `name` for an interface ("" when it takes it): 1 to 15 bytes, not
    `.` or `..`, no `/`, `:` or white space."""
    if not 0 < len(name.encode()) < IFNAMSIZ:
        return f"{name[:40]!r} is not 1 to {IFNAMSIZ - 1} bytes long"
    if name in (".", "..") or any(c in "/:" or c.isspace() or not c.isprintable() for c in name):
        return f"{name!r} has '/', ':', white space or an unprintable character, or is '.' or '..'"
    return ""
