"""The book's summaries kept for the next start (agent/claims/summaries.py): a restarted agent knows which
claim holds which device from them, so its first forms check reads no other claim's record; it takes a
summary only while its record is the file summarized, so a record changed since, or a file it cannot
trust, is read as before and the forms checks refuse exactly what they refused without it."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
from agentkit import Node, claim, make_node, restarted, result, roots, write_claim

from agent.app.daemon import Agent
from agent.claims import summaries
from agent.claims.book import ClaimSummary, DeviceSummary
from agent.claims.records import RecordState
from agent.engine.prepare import PrepareEngine
from agent.engine.recovery import begin_recovery
from agent.kubelet import client as kc
from agent.names import ClaimRef

GPU0_BUS = "0000:18:00.0"
GPU2_BUS = "0000:3a:00.0"
MIG = "gpu-0-mig-1g10gb-4"
UID_A = "5c000000-0000-4000-8000-00000000000a"
UID_B = "5c000000-0000-4000-8000-00000000000b"
UID_C = "5c000000-0000-4000-8000-00000000000c"
UID_D = "5c000000-0000-4000-8000-00000000000d"


@pytest.fixture
async def node(tmp_path: Path) -> Node:
    return await make_node(tmp_path, gpu_sharing=True)


def share_of(gpu: int, share_id: str = "7c9e6679-7425-40de-944b-e07fc1f90ae7") -> dict[str, Any]:
    return result(f"gpu-{gpu}-shared", "gpu", shareID=share_id, consumedCapacity={"memory": "4Gi"})


async def prepare(engine: PrepareEngine, node: Node, name: str, uid: str, results: list[dict[str, Any]]) -> str:
    write_claim(node.claims_dir, claim(name, uid, results))
    return (await engine.prepare([ClaimRef("default", name, uid)]))[uid].error


def started_again(node: Node, monkeypatch: pytest.MonkeyPatch) -> tuple[PrepareEngine, list[str]]:
    """The agent stopped and started: a new engine with its records listed and none checked yet (the
    background check has not begun), and the records its store reads from here on."""
    node.engine.close()
    engine = restarted(node)
    reads: list[str] = []
    real = engine.store.read

    def read(uid: str) -> Any:
        reads.append(uid)
        return real(uid)

    monkeypatch.setattr(engine.store, "read", read)
    begin_recovery(engine)
    return engine, reads


def summaries_file(node: Node) -> Path:
    return summaries.path_of(node.settings.state_dir)


async def test_the_first_forms_check_after_a_start_reads_no_other_claims_record(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    assert await prepare(node.engine, node, "mig", UID_A, [result(MIG, "part")]) == ""
    assert await prepare(node.engine, node, "whole", UID_B, [result("gpu-1", "gpu")]) == ""
    assert summaries.save(summaries_file(node), node.engine.book) == 2
    engine, reads = started_again(node, monkeypatch)
    assert engine.unverified() == [UID_A, UID_B]
    # The GPU a listed, unchecked record holds a MIG device of is refused whole, from its summary ...
    error = await prepare(engine, node, "whole-0", UID_C, [result("gpu-0", "gpu")])
    assert f"GPU {GPU0_BUS} is prepared as {MIG} for claim default/mig ({UID_A})" in error, error
    # ... another GPU is prepared ...
    assert await prepare(engine, node, "whole-2", UID_D, [result("gpu-2", "gpu")]) == ""
    # ... and neither forms check read the other claims' records, nor checked them: nothing is answered
    # from a record before its check, which still comes, in the background or at an operation on it.
    assert not set(reads) & {UID_A, UID_B}, reads
    assert engine.unverified() == [UID_A, UID_B]


async def test_a_record_changed_since_the_save_is_read_and_its_old_summary_left(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    assert await prepare(node.engine, node, "whole", UID_B, [result("gpu-1", "gpu")]) == ""
    summaries.save(summaries_file(node), node.engine.book)
    # After the save the claim is unprepared and allocated again, another GPU (another agent in a
    # rolling update, or this one before it was killed): its record is a new file.
    assert await node.engine.unprepare([ClaimRef("default", "whole", UID_B)]) == {UID_B: ""}
    assert await prepare(node.engine, node, "whole", UID_B, [result("gpu-2", "gpu")]) == ""
    engine, reads = started_again(node, monkeypatch)
    assert engine.book.record_of(UID_B) is None  # the summary of a file that is no longer there: not taken
    assert await prepare(engine, node, "share-1", UID_C, [share_of(1)]) == ""
    error = await prepare(engine, node, "share-2", UID_D, [share_of(2)])
    assert f"GPU {GPU2_BUS} is prepared as gpu-2 for claim default/whole ({UID_B})" in error, error
    assert UID_B in reads


@pytest.mark.parametrize("damage", ["truncated", "flipped", "version", "directory"])
async def test_a_file_that_cannot_be_trusted_is_ignored_whole(node: Node, monkeypatch: pytest.MonkeyPatch,
                                                              damage: str) -> None:
    assert await prepare(node.engine, node, "whole", UID_B, [result("gpu-2", "gpu")]) == ""
    path = summaries_file(node)
    summaries.save(path, node.engine.book)
    data = path.read_bytes()
    header, body = data.split(b"\n", 1)
    if damage == "truncated":
        path.write_bytes(data[:-10])
    elif damage == "flipped":
        path.write_bytes(header + b"\n" + body.replace(b"gpu-2", b"gpu-3"))
    elif damage == "version":
        path.write_bytes(header.replace(b"DRASUMS 1 ", b"DRASUMS 2 ") + b"\n" + body)
    else:
        path.unlink()
        path.mkdir()
    leftover = path.parent / ".claim-summaries.tmp-0badcafe"  # a save cut short
    leftover.write_bytes(b"half")
    engine, reads = started_again(node, monkeypatch)
    assert engine.book.record_of(UID_B) is None
    assert not leftover.exists()
    error = await prepare(engine, node, "share-2", UID_D, [share_of(2)])
    assert f"GPU {GPU2_BUS} is prepared as gpu-2 for claim default/whole ({UID_B})" in error, error
    assert UID_B in reads


def test_a_summary_comes_back_whole() -> None:
    """Every field of a summary is kept. A field added to either class fails here until the wire form
    has it and `summaries.VERSION` is raised (a file of the old version is then ignored whole)."""
    assert [f.name for f in dataclasses.fields(ClaimSummary)] == [
        "uid", "namespace", "name", "pod_claim_name", "devices", "dirs", "prepared_at", "generation", "state", "ahead"]
    assert [f.name for f in dataclasses.fields(DeviceSummary)] == [
        "pool", "device", "share_id", "made", "mac", "admin_access", "pod_interface"]
    summary = ClaimSummary(
        UID_A, "ns", "c", "pod-claim",
        (DeviceSummary("node", MIG, "", (("uuid", "MIG-1"),)),
         DeviceSummary("node", "nic-0000-3b-00-0-vfio", "", (), "02:00:00:00:00:01", False, "net1"),
         DeviceSummary("node", "gpu-1-shared", "7c9e6679-7425-40de-944b-e07fc1f90ae7", admin_access=True)),
        ("/m/a", "/m/b"), 1.5, 3, RecordState.BINDING, ahead=True)
    import orjson

    assert ClaimSummary.from_wire(UID_A, orjson.loads(orjson.dumps(summary.wire()))) == summary


async def test_the_agent_keeps_its_summaries_once_recovered_and_when_it_stops(short_tmp: Path) -> None:
    settings = roots(short_tmp, rescan_interval=3600.0, gpu_sharing=True)
    path = summaries.path_of(settings.state_dir)
    agent = Agent(settings)
    await agent.start()
    try:
        await asyncio.wait_for(agent.recovered.wait(), 30)
        assert summaries._load(path) == []  # saved with what the book knew then: nothing
        assert settings.offline is not None
        write_claim(settings.offline / "resourceclaims", claim("c", UID_B, [result("gpu-1", "gpu")]))
        async with kc.DRAClient(settings.dra_socket) as client:
            assert (await client.prepare([ClaimRef("default", "c", UID_B)])).claims[UID_B].error == ""
    finally:
        await agent.stop()
    (entry,) = summaries._load(path)
    st = os.stat(settings.claims_state_dir / f"{UID_B}.rec")
    assert entry[:4] == [UID_B, st.st_ino, st.st_mtime_ns, st.st_size]
    assert entry[4][3][0][:2] == [settings.node_name, "gpu-1"]
