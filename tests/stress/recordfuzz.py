"""The fuzzer's records (`make stress`): claim records that read cleanly (framed as the agent frames one: version,
checksum, length) and say what the agent never writes (docs/security.md, "Claim records").

A few claims are prepared (two GPUs with a variable of the claim's own and a pod claim name; the NIC; a share of a
shared GPU where the node has them); one of their records is rewritten with one to three drawn changes: a file's
path (outside the roots, another claim's, not normalized), its mode (setuid, writable by all), its content (not
JSON, another shape), an edit of the claim's CDI spec (the host's `/` mounted, a hook, a device node of the host's
disk, an interface moved), a reserved variable, the kubelet's CDI devices (`nvidia.com/gpu=all`), the claim's
directories, a field of its metadata file (a CPU set of every CPU there could be), anything spliced into the body.
Then, with or without a reboot (the files gone), the engine lists and checks every record again and refreshes every
claim, as the daemon's start does (the same engine: a new one would count its arrival in `<state>/writers.lock`,
outside the roots the fuzzer watches). Nothing may raise; the record is set aside (its files gone) or kept with
every file as it says; the other claims recover whole; every file below the CDI and metadata directories is the
agent's (a claim's UID in its name, mode 0644, a spec with nothing but device nodes the inventory gives and
variables no tenant may set, a metadata spec mounting the claim's own file); and a file outside the roots is
untouched."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from pathlib import Path
from typing import Any

import agentkit
import orjson

from agent.claims import filenames
from agent.claims.records import MAGIC, ClaimRecord, FileRole
from agent.claims.store import ClaimStore
from agent.engine.recovery import recover
from agent.fsutil import is_temp_name
from agent.kinds import Kind
from agent.names import ClaimRef
from cdi.store import encode_spec

SHARE_ID = "5e1ec7ed-0000-4000-8000-000000000001"
# Variables a planted spec sets that no claim's spec may carry (the agent never sets them).
HOSTILE_ENV = {"LD_PRELOAD": "/tmp/x.so", "NVIDIA_VISIBLE_DEVICES": "all", "LD_LIBRARY_PATH": "/tmp",
               "CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps", "GCONV_PATH": "/tmp", "NVIDIA_DRIVER_CAPABILITIES": "all"}
HOSTILE_EDITS: dict[str, Any] = {
    "mounts": [{"hostPath": "/", "containerPath": "/host", "options": ["rbind", "rw"]}],
    "hooks": [{"hookName": "createContainer", "path": "/bin/sh", "args": ["sh", "-c", "id"]}],
    "deviceNodes": [{"path": "/dev/sda", "hostPath": "/dev/sda"}],
    "netDevices": [{"hostInterfaceName": "eth0", "name": "eth0"}],
    "additionalGIDs": [0],
}
SPEC_EDITS = ("mounts", "hooks", "deviceNodes", "netDevices", "additionalGIDs", "env")


def uid(i: int) -> str:
    return f"ec0ec000-0000-4000-8000-{i:012d}"


def templates(node: Any) -> dict[str, dict[str, Any]]:
    """The claims whose records are rewritten, by UID: two GPUs with a variable of the claim's own and a pod
    claim name, the NIC, and a share of a shared GPU where the node publishes them."""
    devices = node.inventory.devices()
    nic = next(d.name for d in devices if d.kind is Kind.NIC)
    config = [{"opaque": {"driver": agentkit.DRIVER, "parameters": {
        "apiVersion": f"{agentkit.DRIVER}/v1alpha1", "kind": "DeviceConfig", "env": {"MODEL": "llama"}}}}]
    out = {
        uid(1): agentkit.claim("rec-gpus", uid(1), [agentkit.result("gpu-0", "a"), agentkit.result("gpu-1", "b")],
                               annotations={"resource.kubernetes.io/pod-claim-name": "pc"}, config=config),
        uid(2): agentkit.claim("rec-nic", uid(2), [agentkit.result(nic, "net")]),
    }
    if (shared := next((d.name for d in devices if d.kind.shared), None)) is not None:
        out[uid(3)] = agentkit.claim("rec-share", uid(3), [agentkit.result(
            shared, "gpu", shareID=SHARE_ID, consumedCapacity={"memory": "4Gi"})])
    return out


def strategies(st: Any, s: Any, outside: Path, json_value: Any, text: Any) -> Any:
    """One change to a record's body (see `mutate`)."""
    other = uid(2)
    paths = st.sampled_from([
        str(outside), "/", "relative/metadata.json", f"{s.cdi_dir}/../escaped.json",
        f"{s.metadata_dir}/{other}/net/metadata.json", f"{s.metadata_dir}/{uid(1)}/../{other}/net/metadata.json",
        f"{s.cdi_dir}/{filenames.claim_spec_name(s.cdi_vendor, other)}", f"{s.metadata_dir}/x/a/metadata.json",
        f"{s.claims_state_dir}/{other}.rec", f"{outside.parent}/plugins/{s.driver_name}/dra-device-metadata/"
                                             f"{uid(1)}/a/metadata.json"])
    index = st.integers(0, 5)
    return st.one_of(
        st.tuples(st.just("path"), index, paths),
        st.tuples(st.just("mode"), index, st.sampled_from([0o6777, 0o4755, 0o777, 0o666, 0o600, 0o644])),
        st.tuples(st.just("content"), index, st.one_of(
            text, st.sampled_from(["{not json", "[]", "", '{"apiVersion": 1}']), json_value.map(
                lambda v: orjson.dumps(v).decode()))),
        st.tuples(st.just("edit"), index, st.sampled_from(SPEC_EDITS),
                  st.one_of(st.sampled_from(list(HOSTILE_EDITS.values())), json_value)),
        st.tuples(st.just("env"), index, st.sampled_from([*HOSTILE_ENV, "CUDA_VISIBLE_DEVICES", "FOO"]),
                  st.sampled_from([*HOSTILE_ENV.values(), "0=999999M", "x"])),
        st.tuples(st.just("ids"), index, st.sampled_from(["nvidia.com/gpu=all", "other.example.com/x=y",
                                                          f"{s.cdi_vendor}/claim={other}-gpu-0", "nvidia.com/gpu=0"])),
        st.tuples(st.just("dirs"), st.lists(paths, max_size=2)),
        st.tuples(st.just("meta"), st.sampled_from(["cpuset", "consumedCapacity", "shareID", "name", "requests",
                                                     "metadata"]),
                  st.one_of(st.sampled_from(["0-4294967295", "0-99999999", "7", [], {"memory": 1}]), json_value)),
        st.tuples(st.just("splice"), st.lists(st.sampled_from(
            ["devices", "files", "dirs", "uid", "name", "namespace", "state", "generation", "podClaimName",
             "cdiDeviceIds", "device", "request", "path", "role", "request", 0, 1]), min_size=1, max_size=4),
            json_value),
    )


def mutate(body: dict[str, Any], change: tuple[Any, ...]) -> None:
    """Apply one drawn change to a record's body (its JSON object); a change an earlier one left nothing to
    apply to (a spec no longer JSON) is skipped."""
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError, IndexError):
        _mutate(body, change)


def _mutate(body: dict[str, Any], change: tuple[Any, ...]) -> None:
    kind = change[0]
    files = body.get("files") or []
    if kind in ("path", "mode", "content") and files:
        f = files[change[1] % len(files)]
        f[kind] = change[2]
    elif kind in ("edit", "env"):
        spec_file = next((f for f in files if f.get("role") == str(FileRole.CLAIM_SPEC)), None)
        if spec_file is None:
            return
        spec = orjson.loads(spec_file["content"])
        entry = spec["devices"][change[1] % len(spec["devices"])] if spec["devices"] else None
        if entry is None:
            return
        if kind == "edit":
            entry["containerEdits"][change[2]] = change[3]
        else:
            entry["containerEdits"]["env"].append(f"{change[2]}={change[3]}")
        spec_file["content"] = encode_spec(spec).decode()  # as the agent encodes a spec: only its sense is wrong
    elif kind == "ids" and body.get("devices"):
        body["devices"][change[1] % len(body["devices"])]["cdiDeviceIds"].insert(1, change[2])
    elif kind == "dirs":
        body["dirs"] = change[1]
    elif kind == "meta":
        meta = next((f for f in files if f.get("role") == str(FileRole.METADATA_FILE)), None)
        if meta is None:
            return
        objs = [orjson.loads(line) for line in meta["content"].splitlines() if line.strip()]
        for obj in objs:
            if change[1] in ("requests", "metadata"):
                obj[change[1]] = change[2]
            else:
                for req in obj.get("requests") or []:
                    for dev in req.get("devices") or []:
                        dev[change[1]] = change[2]
        meta["content"] = "".join(orjson.dumps(o).decode() + "\n" for o in objs)
    elif kind == "splice":
        target: Any = body
        keys = change[1]
        for key in keys[:-1]:
            into_dict = isinstance(target, dict) and isinstance(key, str) and isinstance(target.get(key), (dict, list))
            if not (into_dict or (isinstance(target, list) and isinstance(key, int) and key < len(target))):
                break
            target = target[key]
        if isinstance(target, dict) and isinstance(keys[-1], str):
            target[keys[-1]] = change[2]


def framed(body: bytes, version: int) -> bytes:
    """A record file as the agent frames a body (`agent.claims.records.encode`)."""
    return b"%s %d %s %d\n" % (MAGIC, version, hashlib.sha256(body).hexdigest().encode(), len(body)) + body


def judge(node: Any, target: str, good: dict[str, ClaimRecord], outside: Path) -> list[str]:
    """What is wrong with the disk after a restart over the rewritten record (see the module docstring)."""
    s = node.settings
    problems: list[str] = []
    if outside.read_bytes() != b"precious":
        problems.append(f"{outside}, outside the roots, was written")
    store = ClaimStore(s.claims_state_dir)
    for u, record in good.items():
        found = store.read(u) if (s.claims_state_dir / f"{u}.rec").exists() else None
        if u != target and found is None:
            problems.append(f"the good claim {u} is not prepared any more")
        if found is None:
            if u == target and not (s.claims_state_dir / f"{u}.rec.corrupt").exists():
                problems.append(f"the record of {u} is gone, not set aside")
            continue
        for f in found[0].files:
            try:
                ok = Path(f.path).read_bytes() == f.content
            except OSError:
                ok = False
            if not ok:
                problems.append(f"{f.path} is not what the record of {u} says")
        if u != target and found[0].to_json() != record.to_json():
            problems.append(f"the good claim {u}'s record changed")
    nodes = {n.host_path for d in node.inventory.devices() for n in d.device_nodes}
    moved = _moved(good)
    for root in (s.cdi_dir, s.metadata_dir):
        for parent, _dirs, names in os.walk(root):
            for name in names:
                path = os.path.join(parent, name)
                if is_temp_name(name):
                    problems.append(f"temp file left: {path}")
                    continue
                if not any(u in path for u in good):
                    problems.append(f"{path}: a file no claim of the agent's names")
                if (mode := os.stat(path).st_mode & 0o7777) != 0o644:
                    problems.append(f"{path} has mode {mode:o}")
                if root == s.cdi_dir:
                    problems += _spec_problems(s, path, nodes, moved)
    return problems


def _moved(good: dict[str, ClaimRecord]) -> dict[str, Any]:
    """CDI device name -> the interface its claim moves into the pod, as prepare wrote it."""
    out = {}
    for record in good.values():
        for f in record.files:
            if f.role is FileRole.CLAIM_SPEC:
                for dev in orjson.loads(f.content)["devices"]:
                    if "netDevices" in dev["containerEdits"]:
                        out[dev["name"]] = dev["containerEdits"]["netDevices"]
    return out


def _spec_problems(s: Any, path: str, nodes: set[str], moved: dict[str, Any]) -> list[str]:
    spec = orjson.loads(Path(path).read_bytes())
    problems = []
    for dev in spec.get("devices", []):
        edits = dev.get("containerEdits", {})
        if "_metadata_" in os.path.basename(path):
            owner = filenames.claim_uid_of_spec(os.path.basename(path), s.cdi_vendor)
            mounts = edits.get("mounts", [])
            if any(not str(m.get("hostPath")).startswith(f"{s.metadata_dir}/{owner}/") for m in mounts):
                problems.append(f"{path} mounts what is not its claim's metadata file: {edits.get('mounts')}")
            continue
        if extra := set(edits) - {"env", "deviceNodes", "netDevices"}:
            problems.append(f"{path} has edits the agent never writes: {sorted(extra)}")
        if bad := {n.get("hostPath") for n in edits.get("deviceNodes", [])} - nodes:
            problems.append(f"{path} names device nodes the inventory does not give: {bad}")
        env = {e.partition("=")[0]: e.partition("=")[2] for e in edits.get("env", [])}
        if hostile := sorted(set(env) & set(HOSTILE_ENV)):
            problems.append(f"{path} sets {hostile}")
        if env.get("CUDA_VISIBLE_DEVICES") in ("all", "x"):
            problems.append(f"{path} sets CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}")
        if "netDevices" in edits and edits["netDevices"] != moved.get(dev.get("name")):
            problems.append(f"{path} moves an interface prepare did not: {edits['netDevices']}")
    return problems


def fuzz_records(node: Any, source: Any, loop: asyncio.AbstractEventLoop, n: int, report: Any, work: Path) -> None:
    """`n` rewritten records, each recovered by a restarted engine; AssertionError on the first problem."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    s = node.settings
    claims = templates(node)
    for obj in claims.values():
        source.claims[("default", obj["metadata"]["name"])] = obj
    refs = {u: ClaimRef("default", obj["metadata"]["name"], u) for u, obj in claims.items()}
    # Outside the agent's roots (in the offline claims directory, which the fuzzer's claim source leaves
    # alone and the fuzzer's own check of the tree outside the roots skips).
    outside = (s.offline or work) / "outside-the-roots" / "victim"
    outside.parent.mkdir(parents=True, exist_ok=True)
    text = st.text(max_size=40)
    json_value = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | text,
                              lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                              max_leaves=6)
    change = strategies(st, s, outside, json_value, text)

    @settings(max_examples=n, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(sorted(claims)), st.lists(change, min_size=1, max_size=3), st.booleans())
    def one_record(target: str, changes: list[tuple[Any, ...]], reboot: bool) -> None:
        report.inputs += 1
        report.records += 1
        out = loop.run_until_complete(node.engine.prepare(list(refs.values())))
        assert all(not r.error for r in out.values()), out
        store = ClaimStore(s.claims_state_dir)
        good = {u: found[0] for u in refs if (found := store.read(u)) is not None}
        assert set(good) == set(refs)
        body = orjson.loads(good[target].to_json())
        for c in changes:
            mutate(body, c)
        (s.claims_state_dir / f"{target}.rec").write_bytes(framed(orjson.dumps(body), good[target].version))
        if reboot:  # the CDI specs and metadata files are on tmpfs: gone, the records stay
            for record in good.values():
                for f in record.files:
                    Path(f.path).unlink(missing_ok=True)
        outside.write_bytes(b"precious")
        engine = node.engine
        try:
            recover(engine)
            loop.run_until_complete(engine.refresh_claims(sorted(engine.records)))
            problems = judge(node, target, good, outside)
            assert not problems, (changes, problems)
        finally:  # back to the claims as prepare makes them
            loop.run_until_complete(engine.unprepare([refs[target]]))
            (s.claims_state_dir / f"{target}.rec.corrupt").unlink(missing_ok=True)

    one_record()
