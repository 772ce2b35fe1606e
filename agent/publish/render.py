"""Slices as API objects: what one slice carries (devices or counter sets, and what a device slice
says of its devices), its owner, its name (`generateName`, or one drawn here the same way) and the
rendered ResourceSlice. Pure.

A slice's name starts with its place in the pool (`<driver>-<node>-<NN>-`, `generate_name`): the
scheduler's allocator walks a pool's slices sorted by name and takes the first free device that
matches, so the names, not the random characters after them, must give the order the agent chose
(`slices.chunk_devices`), the same on every node."""

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


def place_label(place: int, count: int) -> str:
    """A slice's place in a pool of `count` slices, zero-padded so that the names sort as the places do
    (at least two digits; more only for a pool of over 100 slices, whose width then holds for all of it)."""
    return f"{place:0{max(2, len(str(max(count - 1, 0))))}d}"


def generate_name(driver: str, node: str, place: int = 0, count: int = 1) -> str:
    """`<driver>-<node>-<NN>-`: the slice at `place` of a pool of `count` slices. Within one pool every
    such prefix has the same length and differs only in NN, so any name that starts with it sorts
    after every slice before it and before every slice after it, whatever follows."""
    label = f"{place_label(place, count)}-"
    base = f"{driver}-{node}-"
    if len(base) + len(label) > MAX_GENERATE_NAME:
        # The server would cut it anyway, and cut the place off; cutting the node here keeps the place and
        # the name a valid DNS subdomain (a label may not end in "." or "-").
        base = base[: MAX_GENERATE_NAME - len(label) - 1].rstrip(".-") + "-"
    return base + label


def new_slice_name(generate: str) -> str:
    """A name as the API server would give one for `generate` (a `generate_name`), chosen here so that a
    retried create names the same object."""
    return generate + "".join(secrets.choice(NAME_ALPHABET) for _ in range(NAME_SUFFIX))


def owner_references(owner: NodeRef | None) -> list[dict[str, Any]]:
    if owner is None or not owner.uid:
        return []
    return [{"apiVersion": "v1", "kind": "Node", "name": owner.name, "uid": owner.uid, "controller": True}]


def render_slice(chunk: Chunk, *, driver: str, node: str, owner: NodeRef | None,
                 generation: int, count: int, place: int = 0) -> dict[str, Any]:
    """The ResourceSlice for `chunk`, the slice at `place` of the pool's `count`."""
    metadata: dict[str, Any] = {"generateName": generate_name(driver, node, place, count)}
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
