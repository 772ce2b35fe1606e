"""The CDI specs of a prepared claim: one for its devices, one per request for the metadata mount."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from agent.claims.metadata import AllocatedDevice
from agent.model import PCI_BUS_ID
from cdi.atomic import TEMP_MARK, is_temp_name
from cdi.names import qualified_name
from cdi.spec import minimum_version
from cdi.store import check_filename, transient_spec_name

CLAIM_CLASS = "claim"
METADATA_CLASS = "metadata"
_UID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def claim_spec_name(vendor: str, uid: str) -> str:
    return transient_spec_name(vendor, CLAIM_CLASS, uid)


def metadata_spec_name(vendor: str, uid: str, base_request: str) -> str:
    # `<vendor>_metadata_<uid>_<request>.json`: the name the device metadata contract gives.
    name = f"{vendor}_{METADATA_CLASS}_{uid}_{base_request}.json"
    check_filename(name)
    return name


@functools.lru_cache(maxsize=8)
def _owned_spec_pattern(vendor: str) -> re.Pattern[str]:
    v = re.escape(vendor)
    return re.compile(rf"(?:{v}-{CLAIM_CLASS}_(?P<a>{_UID})\.json"
                      rf"|{v}_{METADATA_CLASS}_(?P<b>{_UID})_[a-z0-9-]+\.json)")


_METADATA_SPEC = re.compile(rf".+_{METADATA_CLASS}_{_UID}_(?P<request>[a-z0-9-]+)\.json")


def metadata_spec_request(name: str) -> str | None:
    """The base request in the name of a metadata spec (`metadata_spec_name`, whatever its vendor); None
    for any other name."""
    m = _METADATA_SPEC.fullmatch(name)
    return m.group("request") if m else None


def claim_uid_of_spec(name: str, vendor: str) -> str | None:
    """The claim UID in the file name of one of the agent's per-claim specs, or of a temp file of
    one (an interrupted write); None for any other file. Ownership is never a guess."""
    if is_temp_name(name):
        name = name[1: name.index(TEMP_MARK)]
    m = _owned_spec_pattern(vendor).fullmatch(name)
    return (m.group("a") or m.group("b")) if m else None


def claim_device_id(vendor: str, uid: str, device: str) -> str:
    return qualified_name(vendor, CLAIM_CLASS, f"{uid}-{device}")


def metadata_device_id(vendor: str, uid: str, base_request: str) -> str:
    return qualified_name(vendor, METADATA_CLASS, f"{uid}_{base_request}")


def env_prefix(device_name: str) -> str:
    """`gpu-3` -> `DRA_GPU_3`: one namespace of variables per device, so devices never collide."""
    return "DRA_" + device_name.upper().replace("-", "_")


def cpuset(cpus: Sequence[int]) -> str:
    """`[0, 1, 2, 5]` -> `0-2,5` (the kernel's list format)."""
    out: list[str] = []
    ids = sorted(set(cpus))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def device_env(alloc: AllocatedDevice) -> list[str]:
    dev = alloc.device
    prefix = env_prefix(dev.name)
    env = [f"{prefix}_NAME={dev.name}"]
    bus_id = dev.attributes.get(PCI_BUS_ID)
    if dev.kind in ("gpu", "mig"):  # a prepared MIG device carries its MIG-... UUID here (agent.hostprep.mig)
        env.append(f"{prefix}_UUID={dev.node.gpu_uuid}")
    elif dev.kind == "nic":
        env.append(f"{prefix}_INTERFACE={dev.node.interface}")
        if dev.node.mac:
            env.append(f"{prefix}_MAC={dev.node.mac}")
    elif dev.kind == "cpu":
        env.append(f"{prefix}_CPUS={cpuset(dev.node.cpus)}")
    if isinstance(bus_id, str):
        env.append(f"{prefix}_PCI_BUS_ID={bus_id}")
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
        nodes = [{"path": n.path, "hostPath": n.host_path} for n in alloc.device.node.device_nodes]
        if nodes:
            edits["deviceNodes"] = nodes
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
