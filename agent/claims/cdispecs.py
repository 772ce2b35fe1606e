"""The CDI specs of a prepared claim: one for its devices, one per request for the metadata mount."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agent.claims.filenames import CLAIM_CLASS, METADATA_CLASS
from agent.claims.metadata import AllocatedDevice
from agent.facts import CpuFacts, NicFacts
from agent.inventory.numa import format_cpulist
from cdi.names import qualified_name
from cdi.spec import minimum_version


def claim_device_id(vendor: str, uid: str, device: str) -> str:
    return qualified_name(vendor, CLAIM_CLASS, f"{uid}-{device}")


def metadata_device_id(vendor: str, uid: str, base_request: str) -> str:
    return qualified_name(vendor, METADATA_CLASS, f"{uid}_{base_request}")


# The variables that describe a device (`device_env`, `<env_prefix>_<name>`): they come first in its CDI
# device, before the claim's own; `agent.claims.respec` tells the two apart by these names.
DEVICE_VARIABLES = ("NAME", "UUID", "INTERFACE", "MAC", "CPUS", "PCI_BUS_ID", "SHARE_ID")


def env_prefix(device_name: str) -> str:
    """`gpu-3` -> `DRA_GPU_3`: one namespace of variables per device, so devices never collide."""
    return "DRA_" + device_name.upper().replace("-", "_")


def device_env(alloc: AllocatedDevice) -> list[str]:
    dev = alloc.device
    prefix = env_prefix(dev.name)
    env = [f"{prefix}_NAME={dev.name}"]
    facts = dev.node
    if dev.kind.cuda_uuid:  # the GPU's, or the MIG device's that prepare made (agent.hostprep.mig)
        env.append(f"{prefix}_UUID={alloc.cuda_uuid}")
    elif isinstance(facts, NicFacts):
        env.append(f"{prefix}_INTERFACE={facts.interface}")
        if facts.mac:
            env.append(f"{prefix}_MAC={facts.mac}")
    elif isinstance(facts, CpuFacts):
        env.append(f"{prefix}_CPUS={format_cpulist(alloc.cpuset)}")
    if dev.pci_bus_id:
        env.append(f"{prefix}_PCI_BUS_ID={dev.pci_bus_id}")
    if alloc.share_id:
        env.append(f"{prefix}_SHARE_ID={alloc.share_id}")
    return env


def claim_spec(vendor: str, uid: str, allocated: Sequence[AllocatedDevice],
               config_env: Mapping[str, Mapping[str, str]]) -> dict[str, Any]:
    """`config_env`: device name -> extra variables from the claim's opaque configuration."""
    devices = []
    seen: set[str] = set()
    for alloc in allocated:
        name = alloc.device.name
        if name in seen:  # the same device for two requests (admin access): one CDI device
            continue
        seen.add(name)
        edits: dict[str, Any] = {
            "env": device_env(alloc) + [f"{k}={v}" for k, v in sorted(config_env.get(name, {}).items())]
        }
        nodes = [{"path": n.path, "hostPath": n.host_path} for n in alloc.device.device_nodes]
        if nodes:
            edits["deviceNodes"] = nodes
        if alloc.pod_interface and isinstance(alloc.device.node, NicFacts):
            # CDI 1.1 `netDevices` (OCI `linux.netDevices`): the runtime moves the interface into the
            # container's network namespace, with its addresses, under the pod's name for it.
            edits["netDevices"] = [{"hostInterfaceName": alloc.device.node.interface, "name": alloc.pod_interface}]
        devices.append({"name": f"{uid}-{name}", "containerEdits": edits})
    spec: dict[str, Any] = {"cdiVersion": "", "kind": f"{vendor}/{CLAIM_CLASS}", "devices": devices}
    spec["cdiVersion"] = minimum_version(spec)
    return spec


def metadata_spec(vendor: str, uid: str, base_request: str, host_path: str,
                  container_path: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "cdiVersion": "",
        "kind": f"{vendor}/{METADATA_CLASS}",
        "devices": [{
            "name": f"{uid}_{base_request}",
            "containerEdits": {
                "mounts": [{"hostPath": host_path, "containerPath": container_path,
                            "options": ["ro", "bind"]}],
            },
        }],
    }
    spec["cdiVersion"] = minimum_version(spec)
    return spec
