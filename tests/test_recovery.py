"""Crash consistency and restart: a prepare interrupted at any side-effect step, then a restart,
leaves either a fully prepared claim or nothing; a restart repairs and cleans up."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from agentkit import DRIVER, claim, make_node, restarted, result, write_claim, written_files

from agent import failpoints
from agent.claims.records import ClaimRecord, FileRecord, FileRole, encode
from agent.claims.store import ClaimStore
from agent.engine.recovery import recover
from agent.names import ClaimRef
from cdi.store import encode_spec

UID = "3b1e9f00-0000-4000-8000-000000000001"
OTHER = "3b1e9f00-0000-4000-8000-000000000002"
STEPS_BEFORE_RECORD = ["after-claim-spec", "after-metadata-file", "after-metadata-spec"]
TESTS = Path(__file__).resolve().parent


@pytest.fixture
async def node(tmp_path):
    n = await make_node(tmp_path)
    write_claim(n.claims_dir, claim("c", UID, [result("gpu-0", "a"), result("gpu-1", "b")]))
    return n


@pytest.fixture(autouse=True)
def no_failpoints():
    yield
    failpoints.configure("")


@pytest.mark.parametrize("step", STEPS_BEFORE_RECORD)
async def test_raise_before_the_record_leaves_nothing(node, step):
    before = written_files(node.settings)
    failpoints.configure(f"{step}=raise")
    out = await node.engine.prepare([ClaimRef("default", "c", UID)])
    assert "internal error" in out[UID].error and step in out[UID].error
    assert written_files(node.settings) == before
    failpoints.configure("")
    out = await node.engine.prepare([ClaimRef("default", "c", UID)])
    assert out[UID].error == ""


async def test_raise_after_the_record_leaves_a_prepared_claim(node):
    failpoints.configure("after-record=raise")
    out = await node.engine.prepare([ClaimRef("default", "c", UID)])
    assert out[UID].error
    failpoints.configure("")
    report = recover(restarted(node))
    assert set(report.records) == {UID} and report.repaired == [] and report.removed == []


def _prepare_in_child(tmp: Path, step: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(f"""
        import asyncio, sys
        sys.path.insert(0, {str(TESTS)!r})
        import agentkit
        from agent.names import ClaimRef
        async def main():
            node = await agentkit.make_node(__import__('pathlib').Path({str(tmp)!r}))
            out = await node.engine.prepare([ClaimRef('default', 'c', {UID!r})])
            print(out)
        asyncio.run(main())
    """)
    env = dict(os.environ, DRA_AGENT_FAILPOINTS=f"{step}=kill")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("step", [*STEPS_BEFORE_RECORD, "after-record"])
async def test_killed_mid_prepare_then_restart_gives_all_or_nothing(node, tmp_path, step):
    before = written_files(node.settings)
    child = _prepare_in_child(tmp_path, step)
    assert child.returncode == -9, child.stderr  # SIGKILL at the failpoint
    assert written_files(node.settings) != before  # something was left behind
    engine = restarted(node)
    report = recover(engine)
    if step == "after-record":
        assert set(report.records) == {UID}
        rec = engine.whole_record(UID)
        assert rec is not None
        for f in rec.files:
            assert Path(f.path).read_bytes() == f.content
    else:
        assert report.records == {}
        assert written_files(node.settings) == before
        assert report.removed


async def test_restart_repairs_missing_and_damaged_files_from_the_record(node):
    await node.engine.prepare([ClaimRef("default", "c", UID)])
    rec = node.engine.whole_record(UID)
    assert rec is not None
    good = {f.path: f.content for f in rec.files}
    paths = list(good)
    os.unlink(paths[0])  # the claim's CDI spec
    Path(paths[1]).write_bytes(b"{broken")  # a metadata file
    os.unlink(paths[2])
    report = recover(restarted(node))
    assert sorted(report.repaired) == sorted(paths[:3])
    for path, content in good.items():
        assert Path(path).read_bytes() == content


async def test_restart_removes_agent_files_no_record_owns_and_keeps_everything_else(node):
    s = node.settings
    await node.engine.prepare([ClaimRef("default", "c", UID)])
    kept = written_files(s)
    s.cdi_dir.mkdir(parents=True, exist_ok=True)
    orphans = [s.cdi_dir / f"{DRIVER}-claim_{OTHER}.json", s.cdi_dir / f"{DRIVER}_metadata_{OTHER}_req.json",
               s.cdi_dir / f".{DRIVER}-claim_{OTHER}.json.tmp-1234"]
    for p in orphans:
        p.write_text("{}")
    foreign = [s.cdi_dir / "nvidia.yaml", s.cdi_dir / f"other.example.com-claim_{OTHER}.json",
               s.cdi_dir / f"{DRIVER}-claim_not-a-uid.json"]
    for p in foreign:
        p.write_text("{}")
    stray = s.metadata_dir / OTHER / "req"
    stray.mkdir(parents=True)
    (stray / "metadata.json").write_text("{}")
    old_layout = s.metadata_dir / "default_gone" / "req"  # an earlier agent's name-keyed layout
    old_layout.mkdir(parents=True)
    (old_layout / "metadata.json").write_text("{}")
    owned_tmp = s.metadata_dir / UID / "a" / ".metadata.json.tmp-beef"
    owned_tmp.write_text("half")
    report = recover(restarted(node))
    for p in orphans:
        assert not p.exists()
    for p in foreign:
        assert p.exists()
    assert not (s.metadata_dir / OTHER).exists() and not (s.metadata_dir / "default_gone").exists()
    assert not owned_tmp.exists()
    now = written_files(s)
    assert {k: v for k, v in now.items() if k in kept} == kept
    assert set(report.records) == {UID}


async def test_unreadable_record_is_set_aside_and_its_files_removed(node):
    s = node.settings
    await node.engine.prepare([ClaimRef("default", "c", UID)])
    rec_path = s.claims_state_dir / f"{UID}.rec"
    rec_path.write_bytes(rec_path.read_bytes()[:-10])
    report = recover(restarted(node))
    assert report.records == {} and len(report.quarantined) == 1
    assert Path(report.quarantined[0]).exists() and not rec_path.exists()
    assert not (s.cdi_dir / f"{DRIVER}-claim_{UID}.json").exists()
    assert not (s.metadata_dir / UID).exists()


async def test_record_in_a_state_this_agent_does_not_know_is_set_aside_and_touches_nothing_outside(
        node, tmp_path):
    import hashlib

    import orjson

    s = node.settings
    store = ClaimStore(s.claims_state_dir)
    left = tmp_path / "outside-the-roots.json"
    left.write_text("x")
    body = orjson.loads(ClaimRecord(uid=OTHER, namespace="default", name="x",
                                    files=[FileRecord(str(left), b"x")]).to_json())
    body["state"] = "binding-vfio"
    data = orjson.dumps(body)
    (s.claims_state_dir / f"{OTHER}.rec").write_bytes(
        b"DRAREC 1 %s %d\n" % (hashlib.sha256(data).hexdigest().encode(), len(data)) + data)
    report = recover(restarted(node))
    assert report.records == {} and len(report.quarantined) == 1
    assert left.read_text() == "x"
    assert store.read(OTHER) is None


# -- a record holds intent: what reaches the host is derived (docs/security.md) -----------------------------

def _plant(node: Any, uid: str, change: Callable[[ClaimRecord], ClaimRecord]) -> None:
    """The claim's record rewritten as `change` makes it, framed as the agent frames one (version,
    checksum, length): a record that reads cleanly and says what the agent never wrote."""
    found = ClaimStore(node.settings.claims_state_dir).read(uid)
    assert found is not None
    (node.settings.claims_state_dir / f"{uid}.rec").write_bytes(encode(change(found[0])))


def _with_file(record: ClaimRecord, role: FileRole, **fields: Any) -> ClaimRecord:
    """The record with the first file of `role` changed (path, content, mode)."""
    files = list(record.files)
    i = next(i for i, f in enumerate(files) if f.role is role)
    f = files[i]
    files[i] = FileRecord(fields.get("path", f.path), fields.get("content", f.content), fields.get("mode", f.mode),
                          f.role, f.request)
    return dataclasses.replace(record, files=files)


def _hooked(content: bytes) -> bytes:
    """The claim spec with a mount of the host's `/` and a createContainer hook on its first device."""
    spec = orjson.loads(content)
    spec["devices"][0]["containerEdits"]["mounts"] = [{"hostPath": "/", "containerPath": "/host",
                                                       "options": ["rbind", "rw"]}]
    spec["devices"][0]["containerEdits"]["hooks"] = [{"hookName": "createContainer", "path": "/bin/sh",
                                                      "args": ["sh", "-c", "touch /tmp/owned"]}]
    return orjson.dumps(spec)


@pytest.fixture
async def two(node):
    """UID prepared (the record the tests plant over) and OTHER, a good claim beside it."""
    write_claim(node.claims_dir, claim("d", OTHER, [result("gpu-2", "a")]))
    out = await node.engine.prepare([ClaimRef("default", "c", UID), ClaimRef("default", "d", OTHER)])
    assert out[UID].error == "" and out[OTHER].error == ""
    good = {f.path: f.content for f in node.engine.whole_record(OTHER).files}  # type: ignore[union-attr]
    for path in [*good, *(f.path for f in node.engine.whole_record(UID).files)]:  # type: ignore[union-attr]
        os.unlink(path)  # a reboot: the CDI specs and metadata files are gone (tmpfs), the records stay
    return good


def _set_aside(node: Any, engine: Any, report: Any, good: dict[str, bytes]) -> None:
    """UID's record is set aside with its files; OTHER recovered whole, every file as prepare wrote it."""
    s = node.settings
    assert set(report.records) == {OTHER}
    assert report.quarantined == [f"{s.claims_state_dir / UID}.rec.corrupt"]
    assert not (s.claims_state_dir / f"{UID}.rec").exists()
    assert not [p for p in written_files(s) if UID in p and not p.endswith(".corrupt")]
    for path, content in good.items():
        assert Path(path).read_bytes() == content
    assert [q.uid for q in engine.quarantines] == [UID] and engine.quarantines[0].reason


async def test_a_planted_record_whose_spec_mounts_the_host_root_with_a_hook_is_set_aside(node, two):
    """Before, recovery wrote the record's spec back as it was: the claim's containers got the host's `/`
    and a hook run as root by the runtime."""
    _plant(node, UID, lambda r: _with_file(r, FileRole.CLAIM_SPEC,
                                           content=_hooked(next(f.content for f in r.files
                                                                if f.role is FileRole.CLAIM_SPEC))))
    engine = restarted(node)
    report = recover(engine)
    for f in Path(node.settings.cdi_dir).iterdir():
        assert b"hooks" not in f.read_bytes() and b'"hostPath":"/"' not in f.read_bytes(), f
    _set_aside(node, engine, report, two)


async def test_a_planted_record_whose_files_say_mode_6777_is_set_aside(node, two):
    """Before, recovery wrote the claim's files back setuid, setgid and writable by all (0o6777)."""
    _plant(node, UID, lambda r: dataclasses.replace(r, files=[
        FileRecord(f.path, f.content, 0o6777, f.role, f.request) for f in r.files]))
    engine = restarted(node)
    report = recover(engine)
    for path in written_files(node.settings):
        assert os.stat(path).st_mode & 0o7777 in (0o644, 0o600), path
    _set_aside(node, engine, report, two)


@pytest.mark.parametrize("where", ["outside", "other-claim"])
async def test_a_planted_record_whose_metadata_path_leaves_its_claims_directory_is_set_aside(
        node, two, tmp_path, where):
    """Before, the start-up refresh rendered the metadata file and wrote it where the record said: over a file
    outside the metadata directory (a directory the record named as the claim's), or over another claim's."""
    s = node.settings
    if where == "outside":
        victim = tmp_path / "outside" / "precious"
        victim.parent.mkdir()
        dirs = [str(victim.parent)]
    else:
        victim = s.metadata_dir / OTHER / "a" / "metadata.json"
        dirs = [str(s.metadata_dir / UID)]
    victim.parent.mkdir(parents=True, exist_ok=True)
    victim.write_bytes(b"precious")
    # (A generation the file does not say: the refresh renders the file again, and writes it.)
    _plant(node, UID, lambda r: dataclasses.replace(_with_file(r, FileRole.METADATA_FILE, path=str(victim)),
                                                    dirs=dirs, generation=7))
    engine = restarted(node)
    report = recover(engine)
    await engine.refresh_claims(sorted(engine.records))  # the start-up refresh
    assert victim.read_bytes() == (b"precious" if where == "outside" else two[str(victim)])
    _set_aside(node, engine, report, two)


async def test_a_record_whose_metadata_is_not_json_is_set_aside_and_the_others_recover(node, two):
    """Before, recovery raised (orjson.JSONDecodeError reading what the record said each share consumed): in
    the daemon its task died, no later record was checked, and the probes still answered 200."""
    _plant(node, UID, lambda r: _with_file(r, FileRole.METADATA_FILE, content=b"{not json"))
    engine = restarted(node)
    report = recover(engine)
    _set_aside(node, engine, report, two)


def _device_nodes_and_visible(content: bytes) -> bytes:
    """The claim spec with the host's disk among its first device's nodes and CUDA given every GPU: edits
    of the kinds prepare writes, with values no device gives."""
    spec = orjson.loads(content)
    edits = spec["devices"][0]["containerEdits"]
    edits["deviceNodes"] = [*edits["deviceNodes"], {"path": "/dev/sda", "hostPath": "/dev/sda"}]
    edits["env"] = [e if not e.startswith("CUDA_VISIBLE_DEVICES=") else "CUDA_VISIBLE_DEVICES=all"
                    for e in edits["env"]]
    assert "CUDA_VISIBLE_DEVICES=all" in edits["env"]
    return encode_spec(spec)


def _planted_spec(record: ClaimRecord) -> ClaimRecord:
    spec = next(f.content for f in record.files if f.role is FileRole.CLAIM_SPEC)
    return _with_file(record, FileRole.CLAIM_SPEC, content=_device_nodes_and_visible(spec))


async def test_a_recorded_spec_is_derived_again_from_the_devices_at_recovery(node, two):
    """Device nodes and `CUDA_VISIBLE_DEVICES` are what the devices give, whatever the record says. Before,
    recovery compared only each device's nodes and describing variables: it wrote the devices' nodes back,
    and kept `CUDA_VISIBLE_DEVICES=all` (the claim's containers saw every GPU of the node)."""
    spec_path = node.settings.cdi_dir / f"{DRIVER}-claim_{UID}.json"
    prepared = next(f.content for f in node.engine.whole_record(UID).files  # type: ignore[union-attr]
                    if f.role is FileRole.CLAIM_SPEC)
    _plant(node, UID, _planted_spec)
    engine = restarted(node)
    report = recover(engine)
    assert set(report.records) == {UID, OTHER} and report.quarantined == []
    assert spec_path.read_bytes() == prepared  # as prepare wrote it, from the devices
    assert next(f.content for f in engine.whole_record(UID).files  # type: ignore[union-attr]
                if f.role is FileRole.CLAIM_SPEC) == prepared


async def test_self_healing_never_writes_a_spec_changed_on_disk_since_the_claims_check(node):
    """A record replaced while the agent runs (checksum valid, nothing but device nodes and variables in its
    spec) is not what the devices give: self-healing leaves the removed spec to the claim's next check, which
    derives it again. Before, it wrote the record's spec: the host's disk in the claim's containers."""
    from agent.engine.selfheal import SelfHealer

    await node.engine.prepare([ClaimRef("default", "c", UID)])
    spec_path = node.settings.cdi_dir / f"{DRIVER}-claim_{UID}.json"
    prepared = spec_path.read_bytes()
    _plant(node, UID, _planted_spec)
    spec_path.unlink()
    healer = SelfHealer(node.settings, node.engine, None)  # type: ignore[arg-type]  # (no sockets to watch)
    await asyncio.to_thread(healer._check_claim, UID)
    assert not spec_path.exists()
    # The kubelet's next prepare runs the claim's check: the spec derived again, and written.
    assert (await node.engine.prepare([ClaimRef("default", "c", UID)]))[UID].error == ""
    assert spec_path.read_bytes() == prepared
