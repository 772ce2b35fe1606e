"""What a readable claim record may say: only what this agent derives from the claim's intent.

A record holds intent: the claim (namespace, name, UID), its devices (request, pool, device, share), its
host effects. Its files are what prepare derived from that intent (`agent.claims.plan`): their paths from
the agent's directories, the claim's UID and its requests; their mode the agent's (`FILE_MODE`); the
metadata CDI specs wholly from those paths and names; the claim's CDI spec one entry per device holding
its device nodes and variables, and nothing else (no mount, no hook). A record that says anything
else, checksum valid or not, was written by a bug or planted by someone with root on the node: it is
refused here (`RecordRefused`, a `RecordError`) and the engine sets it aside as it does an unreadable one
(`PrepareEngine.current_or_purge`): what the agent writes on the host never comes from a record it could
not have written (docs/security.md, "Claim records").

What the devices are now (their nodes, the variables that describe them, a NIC moved into the pod) is not
judged here: a reboot renumbers it. The check of the record against the host (`agent.engine.recheck`)
derives that part of the claim's CDI spec again from the devices, and repairs write only what it derived.

Run on every record the engine reads from disk (`ClaimBook`'s `check`): at start-up, and when another agent
or anyone else changed the file since; never on a record this engine wrote itself."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from agent.claims import cdispecs, filenames, metadata
from agent.claims.claimenv import MPS_LIMITS, reserved
from agent.claims.plan import CUDA_VISIBLE_DEVICES
from agent.claims.records import FILE_MODE, ClaimRecord, FileRecord, FileRole, RecordError
from agent.claims.respec import split_env
from agent.config import Settings
from agent.inventory.numa import parse_cpulist
from agent.names import ClaimRef, InvalidName, base_request, check_claim_ref, check_device_name, check_request
from cdi.spec import minimum_version
from cdi.store import encode_spec

# The NVIDIA Container Toolkit's CDI device of one GPU, by UUID or index (`agent.claims.toolkit`): the only
# CDI device of a prepared claim not of the agent's own vendor. Never `all`.
_TOOLKIT_ID = re.compile(r"nvidia\.com/gpu=(?:\d{1,4}|GPU-[0-9A-Za-z-]{1,64})\Z")
_EDITS = frozenset({"env", "deviceNodes", "netDevices"})  # what `cdispecs.claim_spec` gives a device
# CPU numbers a metadata file's `cpuset` may name: far above any machine's, and a bound on what reading
# it back costs (`agent.claims.cpuset.recorded_cpus` makes the set).
_MAX_CPU = 1 << 16
# Metadata generations: one more at each refresh, from 1; the files' JSON holds 64-bit integers.
_MAX_GENERATION = 1 << 53


class RecordRefused(RecordError):
    """A readable record that says what this agent never writes: set aside, nothing of it written."""


@dataclass(frozen=True, slots=True)
class RecordCheck:
    """The check of this agent's settings (its CDI vendor, driver, directories)."""

    vendor: str
    driver: str
    cdi_dir: str
    metadata_dir: str
    # The metadata directory below the kubelet's (`plugins/<driver>/dra-device-metadata`): a claim prepared
    # under another --kubelet-dir keeps its files in that kubelet directory's metadata directory
    # (`ClaimFiles.root_of_recorded`), never anywhere else.
    metadata_tail: tuple[str, ...]

    @classmethod
    def of(cls, s: Settings) -> RecordCheck:
        return cls(s.cdi_vendor, s.driver_name, str(s.cdi_dir), str(s.metadata_dir),
                   s.metadata_dir.relative_to(s.kubelet_dir).parts)

    def __call__(self, record: ClaimRecord) -> None:
        """RecordRefused naming the first thing the record says that this agent would not have written."""
        try:
            self._check(record)
        except (InvalidName, ValueError, TypeError, KeyError, AttributeError) as exc:
            if isinstance(exc, RecordRefused):
                raise
            raise RecordRefused(f"not a record this agent writes: {exc}"[:300]) from exc

    def _check(self, record: ClaimRecord) -> None:
        uid = record.uid
        check_claim_ref(ClaimRef(record.namespace, record.name, uid))
        if not 1 <= record.generation < _MAX_GENERATION:
            raise RecordRefused(f"generation {record.generation} is not one the agent counts to")
        if record.pod_claim_name:
            check_device_name(record.pod_claim_name)  # a DNS label, as allocation checks it
        bases: list[str] = []
        for d in record.devices:
            check_request(d.request)
            check_device_name(d.device)
            if (base := base_request(d.request)) not in bases:
                bases.append(base)
        names = {d.device for d in record.devices}
        for effect in [*(b.device for b in record.bindings), *(p.device for p in record.partitions)]:
            if effect not in names:
                raise RecordRefused(f"a host effect names device {effect!r}, which the claim does not hold")
        self._device_ids(record)
        self._files(record, bases)

    def _device_ids(self, record: ClaimRecord) -> None:
        """The kubelet's answer: each device's claim CDI device, the toolkit's for its GPU at most, and the
        metadata CDI device with the first device of each request (`plan_record`); none in an intent."""
        seen: set[str] = set()
        for d in record.devices:
            ids = list(d.cdi_device_ids)
            base = base_request(d.request)
            first = base not in seen
            seen.add(base)
            if not ids and not record.prepared:
                continue
            want_first = cdispecs.claim_device_id(self.vendor, record.uid, d.device)
            want_last = [cdispecs.metadata_device_id(self.vendor, record.uid, base)] if first else []
            if ids[:1] != [want_first] or (want_last and ids[-1:] != want_last):
                raise RecordRefused(f"device {d.device}: CDI devices {ids} are not the claim's own")
            middle = ids[1:len(ids) - len(want_last)]
            if len(middle) > 1 or not all(_TOOLKIT_ID.match(i) for i in middle):
                raise RecordRefused(f"device {d.device}: CDI devices {middle} are not one GPU's toolkit device")

    def _files(self, record: ClaimRecord, bases: list[str]) -> None:
        if not record.files and not record.dirs and not record.prepared:
            return  # an intent: no files yet, or none any more
        want = {(FileRole.CLAIM_SPEC, "")} | {(role, b) for b in bases
                                              for role in (FileRole.METADATA_FILE, FileRole.METADATA_SPEC)}
        have = [(f.role, f.request) for f in record.files]
        if len(set(have)) != len(have) or set(have) != want:
            raise RecordRefused(f"its files {sorted(have)} are not a claim's files for requests {bases}")
        meta = {f.request: f for f in record.files if f.role is FileRole.METADATA_FILE}
        roots = {self._metadata_root(record, f) for f in meta.values()}
        if record.dirs != [f"{r}{os.sep}{record.uid}" for r in roots]:
            raise RecordRefused(f"its directories {record.dirs} are not the claim's own")
        for f in record.files:
            if f.mode != FILE_MODE:
                raise RecordRefused(f"{f.path} has mode {f.mode:o}: the agent writes its files {FILE_MODE:o}")
            if f.role is FileRole.CLAIM_SPEC:
                self._at(f, self.cdi_dir, filenames.claim_spec_name(self.vendor, record.uid))
                self._claim_spec(record, f)
            elif f.role is FileRole.METADATA_SPEC:
                self._at(f, self.cdi_dir, filenames.metadata_spec_name(self.vendor, record.uid, f.request))
                spec = cdispecs.metadata_spec(
                    self.vendor, record.uid, f.request, meta[f.request].path,
                    metadata.container_file(self.driver, record.name, f.request, record.pod_claim_name))
                if f.content != encode_spec(spec):
                    raise RecordRefused(f"{f.path} is not the metadata CDI spec the agent writes for it")
            else:
                _metadata_content(record, f)

    @staticmethod
    def _at(f: FileRecord, directory: str, name: str) -> None:
        if f.path != f"{directory}{os.sep}{name}":
            raise RecordRefused(f"{f.path} is not where the agent writes the claim's {f.role} ({directory}/{name})")

    def _metadata_root(self, record: ClaimRecord, f: FileRecord) -> str:
        """The metadata directory a metadata file lies in: `<root>/<uid>/<request>/metadata.json`, the root
        today's or another kubelet directory's (`metadata_tail`); RecordRefused for any other path."""
        parts = f.path.split(os.sep)
        root = os.sep.join(parts[:-3])
        tail = tuple(parts[1:-3][-len(self.metadata_tail):])
        if (not f.path.startswith(os.sep) or os.path.normpath(f.path) != f.path
                or parts[-3:] != [record.uid, f.request, filenames.METADATA_FILE_NAME]
                or not (root == self.metadata_dir or tail == self.metadata_tail)):
            raise RecordRefused(f"{f.path} is not the claim's metadata file for request {f.request} (in "
                                f"{self.metadata_dir}/{record.uid}/{f.request}/ or another kubelet directory's)")
        return root

    def _claim_spec(self, record: ClaimRecord, f: FileRecord) -> None:
        """One entry per device (in the claim's order) holding nothing but its nodes, its variables and the
        interface it moves into the pod; its variables: those that describe it, then the claim's own, none
        of which a configuration may not set unless the agent sets it (`agent.claims.claimenv`)."""
        spec = orjson.loads(f.content)
        if not isinstance(spec, dict) or set(spec) != {"cdiVersion", "kind", "devices"} \
                or spec["kind"] != f"{self.vendor}/{filenames.CLAIM_CLASS}" or not isinstance(spec["devices"], list):
            raise RecordRefused(f"{f.path} is not a claim CDI spec of {self.vendor}")
        order = list(dict.fromkeys(d.device for d in record.devices))
        moved = {d.device: d.pod_interface for d in record.devices if d.pod_interface}
        entries = spec["devices"]
        if [e.get("name") if isinstance(e, dict) else None for e in entries] != [f"{record.uid}-{n}" for n in order]:
            raise RecordRefused(f"{f.path} does not hold one CDI device for each of the claim's devices")
        for name, entry in zip(order, entries, strict=True):
            edits = entry.get("containerEdits")
            if set(entry) != {"name", "containerEdits"} or not isinstance(edits, dict) or not set(edits) <= _EDITS:
                raise RecordRefused(f"{f.path}: device {name} has edits the agent never writes: "
                                    f"{sorted(set(edits) - _EDITS) if isinstance(edits, dict) else edits!r}")
            env = edits.get("env")
            if not isinstance(env, list) or not all(isinstance(e, str) and "=" in e for e in env):
                raise RecordRefused(f"{f.path}: device {name} has no list of variables")
            nodes = edits.get("deviceNodes", [])
            if not isinstance(nodes, list) or not all(_strings(n, ("path", "hostPath")) for n in nodes):
                raise RecordRefused(f"{f.path}: device {name} has device nodes the agent never writes")
            described, own = split_env(name, env)
            prefix = cdispecs.env_prefix(name)
            # A NIC moved into the pod: the interface the device's variables name, under the claim's name for it.
            if "netDevices" in edits and (name not in moved or edits["netDevices"] != [
                    {"hostInterfaceName": described.get(f"{prefix}_INTERFACE"), "name": moved[name]}]):
                raise RecordRefused(f"{f.path}: device {name} moves an interface its claim does not")
            # What describes the device is derived again from it (`agent.engine.recheck`); the rest is the
            # claim's configuration, where only the agent sets a reserved name.
            for item in own:
                key = item.partition("=")[0]
                if reserved(key) is not None and not _agents(key, prefix):
                    raise RecordRefused(f"{f.path}: device {name} sets {key}, which only the agent sets")
        if spec["cdiVersion"] != minimum_version(spec) or f.content != encode_spec(spec):
            raise RecordRefused(f"{f.path} is not written as the agent writes a claim CDI spec")


def _agents(key: str, prefix: str) -> bool:
    """Whether a reserved variable is one the agent sets in a device's entry: `CUDA_VISIBLE_DEVICES`, the MPS
    limits, and the device's own `DRA_<DEVICE>_*` (`agent.claims.plan.claim_env`)."""
    return key == CUDA_VISIBLE_DEVICES or key in MPS_LIMITS or key.startswith(f"{prefix}_")


def _strings(raw: object, keys: Iterable[str]) -> bool:
    return isinstance(raw, dict) and set(raw) == set(keys) and all(isinstance(v, str) for v in raw.values())


def _metadata_content(record: ClaimRecord, f: FileRecord) -> None:
    """A metadata file as `metadata.render` writes it: the claim's, a JSON object per API version, each naming
    this request's results; what a refresh reads back from it (a share's capacity, a CPU set) well formed."""
    try:
        objs = metadata.parse_stream(f.content)
    except orjson.JSONDecodeError as exc:
        raise RecordRefused(f"{f.path} is not JSON: {exc}") from exc
    if [o.get("apiVersion") if isinstance(o, dict) else None for o in objs] != list(metadata.API_VERSIONS):
        raise RecordRefused(f"{f.path} is not a device metadata file (one object per API version)")
    for obj in objs:
        meta = obj.get("metadata")
        if obj.get("kind") != "DeviceMetadata" or not isinstance(meta, dict) or \
                [meta.get(k) for k in ("name", "namespace", "uid")] != [record.name, record.namespace, record.uid]:
            raise RecordRefused(f"{f.path} is not this claim's device metadata")
        requests = obj.get("requests")
        if not isinstance(requests, list):
            raise RecordRefused(f"{f.path} has no list of requests")
        for req in requests:
            if not isinstance(req, dict) or not isinstance(req.get("name"), str) \
                    or base_request(req["name"]) != f.request or not isinstance(req.get("devices"), list):
                raise RecordRefused(f"{f.path} holds a request that is not {f.request}")
            for dev in req["devices"]:
                _metadata_device(f, dev)


def _metadata_device(f: FileRecord, dev: Any) -> None:
    if not isinstance(dev, dict) or not isinstance(dev.get("name"), str) \
            or not isinstance(dev.get("shareID", ""), str):
        raise RecordRefused(f"{f.path} holds a device entry that is not one")
    consumed = dev.get("consumedCapacity", {})
    if not isinstance(consumed, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in consumed.items()):
        raise RecordRefused(f"{f.path}: device {dev['name']} has a consumed capacity that is not names and quantities")
    cpus = dev.get("cpuset", "")
    if not isinstance(cpus, str) or (cpus and max(parse_cpulist(_bounded(cpus)), default=0) >= _MAX_CPU):
        raise RecordRefused(f"{f.path}: device {dev['name']} has a CPU set that is not one")


def _bounded(cpus: str) -> str:
    """The CPU list, refused before it is read when a number in it is beyond any machine's."""
    if any(int(n) >= _MAX_CPU for n in re.findall(r"\d+", cpus)):
        raise RecordRefused(f"CPU list {cpus[:80]!r} names CPUs beyond {_MAX_CPU}")
    return cpus
