"""The API server's validation rules for what the agent sends (resource.k8s.io/v1, 1.37), one role a
module, every public name re-exported here (callers use `agent.apirules`):

- `formats`: the value formats (DNS labels and subdomains, qualified names, label keys and values,
  semantic versions, quantities, attribute values, pool names)
- `devices`: one device of a slice (attributes, capacities and their request policies, taints,
  node-allocatable resources)
- `countersets`: shared counter sets and a device's counter consumption, compatibility groups
- `resourceslice`: a whole ResourceSlice and the rules spanning a pool's slices
- `status`: the `status.devices` entries of ResourceClaims

Each check returns a list of human-readable problems (empty = valid), so the
slice builder can drop exactly the offending value and say why, instead of
having the whole slice rejected by the API server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Each name is imported from its module when first used: a caller of the value formats alone (the
# settings check the driver name before `dra-agent run` opens its first socket) does not load the
# device, slice and status rules and the device model behind them. The imports below are for the
# type checker; at run time `__getattr__` does them.
if TYPE_CHECKING:
    from agent.apirules.countersets import (
        MAX_COMPATIBILITY_GROUPS,
        MAX_CONSUMPTIONS_PER_DEVICE,
        MAX_COUNTER_SETS_PER_SLICE,
        MAX_COUNTERS_PER_CONSUMPTION,
        MAX_COUNTERS_PER_SET,
        compatibility_groups_errors,
        consumption_errors,
        counter_set_errors,
        shared_counters_errors,
    )
    from agent.apirules.devices import (
        MAX_ATTRIBUTE_VALUES,
        MAX_ATTRIBUTES_AND_CAPACITIES,
        MAX_BINDING_CONDITIONS,
        MAX_TAINTS,
        MAX_VALID_VALUES,
        NODE_ALLOCATABLE_KEYS,
        TAINT_EFFECTS,
        binding_condition_errors,
        device_wire_errors,
        node_allocatable_errors,
        request_policy_errors,
        taint_errors,
    )
    from agent.apirules.formats import (
        MAX_DOMAIN_LENGTH,
        MAX_DRIVER_NAME,
        MAX_ID_LENGTH,
        MAX_POOL_NAME,
        MAX_VALUE_LENGTH,
        attribute_value_errors,
        dns_label_errors,
        dns_subdomain_errors,
        label_key_errors,
        label_value_errors,
        normalize_version,
        pool_name_errors,
        qualified_name_errors,
        quantity_errors,
        semver_errors,
    )
    from agent.apirules.resourceslice import (
        MAX_DEVICES_PER_SLICE,
        MAX_DEVICES_PER_SLICE_RESTRICTED,
        device_limit,
        pool_errors,
        slice_errors,
    )
    from agent.apirules.status import (
        CONDITION_STATUSES,
        MAX_CONDITION_MESSAGE,
        MAX_CONDITION_REASON,
        MAX_CONDITION_TYPE,
        MAX_HARDWARE_ADDRESS,
        MAX_INTERFACE_NAME,
        MAX_NETWORK_IPS,
        MAX_STATUS_CONDITIONS,
        MAX_STATUS_DATA,
        DeviceKey,
        clip_device_status,
        clip_network_data,
        condition_errors,
        device_key,
        interface_address_errors,
    )

_NAMES = {
    "countersets": ("MAX_COMPATIBILITY_GROUPS", "MAX_CONSUMPTIONS_PER_DEVICE", "MAX_COUNTER_SETS_PER_SLICE",
        "MAX_COUNTERS_PER_CONSUMPTION", "MAX_COUNTERS_PER_SET", "compatibility_groups_errors",
        "consumption_errors", "counter_set_errors", "shared_counters_errors"),
    "devices": ("MAX_ATTRIBUTE_VALUES", "MAX_ATTRIBUTES_AND_CAPACITIES", "MAX_BINDING_CONDITIONS", "MAX_TAINTS",
        "MAX_VALID_VALUES", "NODE_ALLOCATABLE_KEYS", "TAINT_EFFECTS", "binding_condition_errors",
        "device_wire_errors", "node_allocatable_errors",
        "request_policy_errors", "taint_errors"),
    "formats": ("MAX_DOMAIN_LENGTH", "MAX_DRIVER_NAME", "MAX_ID_LENGTH", "MAX_POOL_NAME", "MAX_VALUE_LENGTH",
        "attribute_value_errors", "dns_label_errors", "dns_subdomain_errors", "label_key_errors",
        "label_value_errors", "normalize_version", "pool_name_errors", "qualified_name_errors",
        "quantity_errors", "semver_errors"),
    "resourceslice": ("MAX_DEVICES_PER_SLICE", "MAX_DEVICES_PER_SLICE_RESTRICTED", "device_limit",
        "pool_errors", "slice_errors"),
    "status": ("CONDITION_STATUSES", "MAX_CONDITION_MESSAGE", "MAX_CONDITION_REASON", "MAX_CONDITION_TYPE",
        "MAX_HARDWARE_ADDRESS", "MAX_INTERFACE_NAME", "MAX_NETWORK_IPS", "MAX_STATUS_CONDITIONS",
        "MAX_STATUS_DATA", "DeviceKey", "clip_device_status", "clip_network_data", "condition_errors",
        "device_key", "interface_address_errors"),
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "CONDITION_STATUSES", "MAX_ATTRIBUTES_AND_CAPACITIES", "MAX_ATTRIBUTE_VALUES", "MAX_BINDING_CONDITIONS",
    "MAX_COMPATIBILITY_GROUPS",
    "MAX_CONDITION_MESSAGE", "MAX_CONDITION_REASON", "MAX_CONDITION_TYPE", "MAX_CONSUMPTIONS_PER_DEVICE",
    "MAX_COUNTERS_PER_CONSUMPTION", "MAX_COUNTERS_PER_SET", "MAX_COUNTER_SETS_PER_SLICE",
    "MAX_DEVICES_PER_SLICE", "MAX_DEVICES_PER_SLICE_RESTRICTED", "MAX_DOMAIN_LENGTH", "MAX_DRIVER_NAME",
    "MAX_HARDWARE_ADDRESS", "MAX_ID_LENGTH", "MAX_INTERFACE_NAME", "MAX_NETWORK_IPS", "MAX_POOL_NAME",
    "MAX_STATUS_CONDITIONS", "MAX_STATUS_DATA", "MAX_TAINTS", "MAX_VALID_VALUES", "MAX_VALUE_LENGTH",
    "NODE_ALLOCATABLE_KEYS", "TAINT_EFFECTS", "DeviceKey", "attribute_value_errors", "binding_condition_errors",
    "clip_device_status",
    "clip_network_data",
    "compatibility_groups_errors", "condition_errors", "consumption_errors", "counter_set_errors",
    "device_key", "device_limit", "device_wire_errors", "dns_label_errors", "dns_subdomain_errors",
    "interface_address_errors", "label_key_errors", "label_value_errors", "node_allocatable_errors",
    "normalize_version", "pool_errors", "pool_name_errors", "qualified_name_errors", "quantity_errors",
    "request_policy_errors", "semver_errors", "shared_counters_errors", "slice_errors", "taint_errors",
]
