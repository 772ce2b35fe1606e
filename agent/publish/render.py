"""Slices as API objects: what one slice carries (devices or counter sets, and what a device slice
says of its devices), its owner, its name (`generateName`, or one drawn here the same way) and the
rendered ResourceSlice. Pure."""

from __future__ import annotations

import copy
import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"
# The API server appends 5 random characters to generateName and caps the result at 63.
MAX_GENERATE_NAME = 58
# What the API server draws those characters from; names chosen here look the same.
NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
NAME_SUFFIX = 5


@dataclass(frozen=True, slots=True)
class NodeRef:
    """The Node that owns the slices; without a UID no owner reference can be written."""

    name: str
    uid: str = ""


@dataclass(frozen=True, slots=True)
class CounterChunk:
    """One slice's worth of shared counter sets (API form): a slice carries `spec.sharedCounters` or
    `spec.devices`, never both."""

    sets: tuple[dict[str, Any], ...]


@dataclass(frozen=True, slots=True)
class DeviceChunk(Sequence[Mapping[str, Any]]):
    """One slice's worth of devices (API form) with what the slice says of all of them: the attribute
    that names their partition type (`spec.partitionTypeAttribute`), and the kubelet calls their claims
    do without (`spec.skipNodeOperations`). A plain sequence of devices is a chunk that says neither."""

    devices: tuple[Mapping[str, Any], ...]
    partition_type_attribute: str = ""
    skip_node_operations: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.devices)

    @overload
    def __getitem__(self, i: int) -> Mapping[str, Any]: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[Mapping[str, Any]]: ...

    def __getitem__(self, i: int | slice) -> Mapping[str, Any] | Sequence[Mapping[str, Any]]:
        return self.devices[i]

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        return iter(self.devices)


# What one slice carries: devices (API form), or counter sets.
Chunk = Sequence[Mapping[str, Any]] | CounterChunk


def generate_name(driver: str, node: str) -> str:
    base = f"{driver}-{node}-"
    if len(base) <= MAX_GENERATE_NAME:
        return base
    # The server would cut it anyway; cutting here keeps the name a valid DNS subdomain.
    return base[: MAX_GENERATE_NAME - 1].rstrip(".-") + "-"


def new_slice_name(driver: str, node: str) -> str:
    """A name as generateName would give it, chosen here so that a retried create names the same object."""
    return generate_name(driver, node) + "".join(secrets.choice(NAME_ALPHABET) for _ in range(NAME_SUFFIX))


def owner_references(owner: NodeRef | None) -> list[dict[str, Any]]:
    if owner is None or not owner.uid:
        return []
    return [{"apiVersion": "v1", "kind": "Node", "name": owner.name, "uid": owner.uid, "controller": True}]


def render_slice(chunk: Chunk, *, driver: str, node: str, owner: NodeRef | None,
                 generation: int, count: int) -> dict[str, Any]:
    metadata: dict[str, Any] = {"generateName": generate_name(driver, node)}
    if refs := owner_references(owner):
        metadata["ownerReferences"] = refs
    spec: dict[str, Any] = {
        "driver": driver,
        "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
        "nodeName": node,
    }
    if isinstance(chunk, CounterChunk):
        spec["sharedCounters"] = copy.deepcopy(list(chunk.sets))
    else:
        spec["devices"] = copy.deepcopy(list(chunk))
        if isinstance(chunk, DeviceChunk) and chunk.partition_type_attribute:
            spec["partitionTypeAttribute"] = chunk.partition_type_attribute
        if isinstance(chunk, DeviceChunk) and chunk.skip_node_operations:
            spec["skipNodeOperations"] = list(chunk.skip_node_operations)
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec}
