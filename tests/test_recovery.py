"""Crash consistency and restart: a prepare interrupted at any side-effect step, then a restart,
leaves either a fully prepared claim or nothing; a restart repairs and cleans up."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from agentkit import DRIVER, claim, make_node, restarted, result, write_claim, written_files

from agent import failpoints
from agent.claims.records import ClaimRecord, FileRecord
from agent.claims.store import ClaimStore
from agent.engine.recovery import recover
from agent.names import ClaimRef

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
