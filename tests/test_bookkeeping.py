"""Claim bookkeeping as a real cluster stresses it: re-created claims, kubelet deadlines, two agents on
one node, restarts that find devices changed, and links planted under the agent's roots."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from agentkit import DRIVER, claim, make_node, nic, restarted, result, roots, write_claim, written_files
from handshakes import Workers, claim_lock_waiters, paused, until

from agent import failpoints
from agent.app.assembly import prepare_roots
from agent.app.connection import StartupError
from agent.app.daemon import Agent
from agent.claims import metadata
from agent.claims.store import ClaimStore
from agent.config import build_settings
from agent.engine.prepare import PrepareEngine
from agent.engine.recovery import recover
from agent.kubelet import client as kc
from agent.names import ClaimRef

OLD = "b0000000-0000-4000-8000-000000000001"
NEW = "b0000000-0000-4000-8000-000000000002"
NIC = "nic-0000-3b-00-0"


@pytest.fixture(autouse=True)
def no_failpoints():
    yield
    failpoints.configure("")


@pytest.fixture
async def workers():
    owned = Workers()
    yield owned
    owned.close()


@pytest.fixture
async def node(tmp_path, workers):
    return await make_node(tmp_path)


def ref(name: str, uid: str, namespace: str = "default") -> ClaimRef:
    return ClaimRef(namespace, name, uid)


def claim_files_exist(engine, uid: str) -> bool:
    record = engine.store.read(uid)
    assert record is not None, f"no record for {uid}"
    return all(Path(f.path).read_bytes() == f.content for f in record[0].files)


def nothing_of(settings, uid: str) -> bool:
    return not any(uid in path for path in written_files(settings))


# -- 1. a claim is its UID on disk ------------------------------------------------------------------

async def test_a_recreated_claim_never_shares_files_with_its_predecessor(node):
    node.nic_source.devices = [nic(ips=())]
    await node.inventory.scan(["nic"])
    write_claim(node.claims_dir, claim("c", OLD, [result(NIC, "req")]))
    assert (await node.engine.prepare([ref("c", OLD)]))[OLD].error == ""
    # Deleted and re-created under the same name while the old one is still prepared.
    write_claim(node.claims_dir, claim("c", NEW, [result("gpu-1", "req")]))
    assert (await node.engine.prepare([ref("c", NEW)]))[NEW].error == ""
    s = node.settings
    old_file, new_file = (metadata.host_file(s.metadata_dir, uid, "req") for uid in (OLD, NEW))
    assert old_file != new_file
    new_content = new_file.read_bytes()
    assert metadata.parse_stream(new_content)[0]["metadata"]["uid"] == NEW

    # The old claim's refresh touches only its own file ...
    node.nic_source.devices = [nic(ips=("10.1.1.1/24",))]
    await node.inventory.scan(["nic"])
    assert await node.engine.refresh_devices({NIC}) == 1
    assert new_file.read_bytes() == new_content
    assert metadata.parse_stream(old_file.read_bytes())[0]["metadata"]["generation"] == 2
    # ... and so does its unprepare, and a restart.
    assert await node.engine.unprepare([ref("c", OLD)]) == {OLD: ""}
    assert new_file.read_bytes() == new_content and claim_files_exist(node.engine, NEW)
    report = recover(restarted(node))
    assert set(report.records) == {NEW} and report.repaired == []
    assert new_file.read_bytes() == new_content


async def test_a_failed_prepare_under_a_reused_name_leaves_the_prepared_claim_alone(node):
    write_claim(node.claims_dir, claim("c", OLD, [result("gpu-0", "req")]))
    assert (await node.engine.prepare([ref("c", OLD)]))[OLD].error == ""
    before = written_files(node.settings)
    write_claim(node.claims_dir, claim("c", NEW, [result("gpu-1", "req")]))
    failpoints.configure("after-metadata-spec=raise")
    assert (await node.engine.prepare([ref("c", NEW)]))[NEW].error
    assert written_files(node.settings) == before


async def test_the_longest_valid_names_fit_on_disk(node):
    namespace = "n" * 63
    name = ".".join(["c" * 63] * 3 + ["d" * 61])  # 253 characters: too long for <name>.yaml
    assert len(name) == 253
    obj = claim(name, NEW, [result("gpu-2", "r" * 63)], namespace=namespace)
    (node.claims_dir / namespace).mkdir(parents=True)
    import yaml

    (node.claims_dir / namespace / "long-claim.yaml").write_text(yaml.safe_dump(obj))
    out = await node.engine.prepare([ClaimRef(namespace, name, NEW)])
    assert out[NEW].error == ""
    assert claim_files_exist(node.engine, NEW)
    assert await node.engine.unprepare([ClaimRef(namespace, name, NEW)]) == {NEW: ""}
    assert nothing_of(node.settings, NEW)


# -- 2. a kubelet deadline never leaks a claim --------------------------------------------------------

async def test_a_prepare_cancelled_at_its_deadline_is_undone_by_the_unprepare_that_follows(node, workers):
    write_claim(node.claims_dir, claim("c", OLD, [result("gpu-0", "req")]))
    failpoints.configure("after-claim-spec=pause")
    prepare = asyncio.create_task(node.engine.prepare([ref("c", OLD)]))
    await paused("after-claim-spec")  # the claim's CDI spec is written, nothing else
    assert not nothing_of(node.settings, OLD)
    with pytest.raises(TimeoutError):  # the kubelet's deadline passes now
        await asyncio.wait_for(prepare, 0.01)
    unprepare = asyncio.create_task(node.engine.unprepare([ref("c", OLD)]))
    failpoints.release("after-claim-spec")  # the cut-off prepare goes on in its thread
    assert await unprepare == {OLD: ""}
    await workers.drained()  # whatever was still running has ended
    assert nothing_of(node.settings, OLD) and OLD not in node.engine.records
    assert recover(restarted(node)).records == {}
    assert nothing_of(node.settings, OLD)


async def test_a_prepare_after_a_cancelled_unprepare_is_fully_prepared(node):
    write_claim(node.claims_dir, claim("c", OLD, [result("gpu-0", "a"), result("gpu-1", "b")]))
    assert (await node.engine.prepare([ref("c", OLD)]))[OLD].error == ""
    failpoints.configure("unprepare-after-file=pause")
    unprepare = asyncio.create_task(node.engine.unprepare([ref("c", OLD)]))
    await paused("unprepare-after-file")  # the record is gone, the first file too, not the rest
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(unprepare, 0.01)
    prepare = asyncio.create_task(node.engine.prepare([ref("c", OLD)]))
    failpoints.release("unprepare-after-file")
    out = await prepare
    assert out[OLD].error == "" and claim_files_exist(node.engine, OLD)


async def test_a_kubelet_call_past_its_deadline_over_the_socket_leaks_nothing(short_tmp, workers):
    settings = roots(short_tmp, rescan_interval=3600.0)
    agent = Agent(settings)
    await agent.start()
    try:
        assert settings.offline is not None
        write_claim(settings.offline / "resourceclaims", claim("c", OLD, [result("gpu-0", "req")]))
        failpoints.configure("after-metadata-file=pause")
        async with kc.DRAClient(settings.dra_socket) as client:
            call = asyncio.create_task(client.prepare([ref("c", OLD)], timeout=30))
            await paused("after-metadata-file")  # the agent is in the middle of the prepare
            assert not nothing_of(settings, OLD)
            call.cancel()  # the kubelet gives up: the call ends, the prepare goes on in the agent
            with pytest.raises(asyncio.CancelledError):
                await call
            unprepare = asyncio.create_task(client.unprepare([ref("c", OLD)]))
            failpoints.release("after-metadata-file")
            done = await unprepare
            assert done.claims[OLD].error == ""
        await workers.drained()
        assert nothing_of(settings, OLD)
    finally:
        await agent.stop()


# -- 3. two agents on one node ------------------------------------------------------------------------

async def test_a_starting_agent_never_removes_the_files_of_a_prepare_in_flight_in_the_other(node):
    write_claim(node.claims_dir, claim("c", OLD, [result("gpu-0", "a"), result("gpu-1", "b")]))
    failpoints.configure("after-metadata-file=pause")
    in_flight = asyncio.create_task(node.engine.prepare([ref("c", OLD)]))
    await paused("after-metadata-file")  # some of the claim's files are written, not its record
    half = written_files(node.settings)
    assert any(OLD in path for path in half) and node.engine.store.read(OLD) is None
    second = asyncio.create_task(asyncio.to_thread(recover, restarted(node)))  # the second agent starts
    # It finds files no record owns, and waits for the claim's lock before it judges them.
    await until(lambda: claim_lock_waiters(node.settings.state_dir, OLD) == 1, "the second agent waits for the claim")
    assert written_files(node.settings) == half
    failpoints.release("after-metadata-file")
    assert (await in_flight)[OLD].error == ""
    report = await second
    assert report.removed == []
    assert claim_files_exist(node.engine, OLD)


async def test_a_claim_prepared_by_one_agent_is_unprepared_by_the_other(node):
    other = restarted(node)  # started before the claim was prepared: it has never seen it
    write_claim(node.claims_dir, claim("c", OLD, [result("gpu-0", "req")]))
    assert (await node.engine.prepare([ref("c", OLD)]))[OLD].error == ""
    assert await other.unprepare([ref("c", OLD)]) == {OLD: ""}
    assert nothing_of(node.settings, OLD)
    # The first agent does not answer from its stale copy: a new prepare prepares again.
    out = await node.engine.prepare([ref("c", OLD)])
    assert out[OLD].error == "" and claim_files_exist(node.engine, OLD)
    assert await other.unprepare([ref("c", OLD)]) == {OLD: ""}
    assert nothing_of(node.settings, OLD)


async def test_an_agent_that_stops_leaves_the_sockets_of_its_successor(short_tmp):
    settings = roots(short_tmp, rescan_interval=3600.0)
    old, new = Agent(settings), Agent(settings)  # default socket names: a restart, overlapping
    await old.start()
    await new.start()
    await old.stop()
    for path in (settings.dra_socket, settings.registration_socket):
        assert path.is_socket(), path
    info = await kc.get_info(settings.registration_socket)
    assert info.name == DRIVER
    await new.stop()
    assert not settings.dra_socket.exists() and not settings.registration_socket.exists()


async def test_rolling_update_agents_prepare_and_unprepare_each_others_claims(short_tmp):
    a = Agent(roots(short_tmp, rescan_interval=3600.0, rolling_update_pod_uid="pod-a"))
    b = Agent(roots(short_tmp, rescan_interval=3600.0, rolling_update_pod_uid="pod-b"))
    await a.start()
    await b.start()
    try:
        assert a.settings.offline is not None
        write_claim(a.settings.offline / "resourceclaims", claim("c", OLD, [result("gpu-0", "req")]))
        async with kc.DRAClient(a.settings.dra_socket) as ca, kc.DRAClient(b.settings.dra_socket) as cb:
            assert (await ca.prepare([ref("c", OLD)])).claims[OLD].error == ""
            assert (await cb.prepare([ref("c", OLD)])).claims[OLD].error == ""  # already prepared
            assert (await cb.unprepare([ref("c", OLD)])).claims[OLD].error == ""
            assert nothing_of(a.settings, OLD)
    finally:
        await a.stop()
        assert b.settings.dra_socket.is_socket()
        await b.stop()


# -- 4. a restart brings prepared claims up to date ------------------------------------------------------

async def test_a_restart_rewrites_metadata_of_devices_that_changed_while_no_agent_ran(short_tmp, monkeypatch):
    from agentkit import StaticSource

    devices = [nic(ips=())]
    monkeypatch.setattr("agent.app.daemon.build_sources", lambda s: [StaticSource("nic", devices)])
    settings = roots(short_tmp, rescan_interval=3600.0)
    assert settings.offline is not None
    write_claim(settings.offline / "resourceclaims", claim("net", OLD, [result(NIC, "nic")]))
    first = Agent(settings)
    await first.start()
    assert first.engine is not None
    assert (await first.engine.prepare([ref("net", OLD)]))[OLD].error == ""
    await first.stop()
    devices[:] = [nic(ips=("10.7.7.7/24",))]  # the NIC got its address while no agent ran
    second = Agent(settings)
    await second.start()
    try:
        await asyncio.wait_for(second.refreshed.wait(), 10)
        host = metadata.host_file(settings.metadata_dir, OLD, "nic")
        for obj in metadata.parse_stream(host.read_bytes()):
            assert obj["metadata"]["generation"] == 2
            assert obj["requests"][0]["devices"][0]["networkData"]["ips"] == ["10.7.7.7/24"]
        record = ClaimStore(settings.claims_state_dir).read(OLD)
        assert record is not None and record[0].generation == 2
    finally:
        await second.stop()


async def test_a_refresh_killed_between_record_and_file_is_finished_by_the_restart(node):
    node.nic_source.devices = [nic(ips=())]
    await node.inventory.scan(["nic"])
    write_claim(node.claims_dir, claim("net", OLD, [result(NIC, "nic")]))
    assert (await node.engine.prepare([ref("net", OLD)]))[OLD].error == ""
    node.nic_source.devices = [nic(ips=("10.8.8.8/24",))]
    await node.inventory.scan(["nic"])
    failpoints.configure("refresh-after-record=raise")  # the process dies here: nothing after it runs
    assert await node.engine.refresh_devices({NIC}) == 0
    failpoints.configure("")
    host = metadata.host_file(node.settings.metadata_dir, OLD, "nic")
    assert metadata.parse_stream(host.read_bytes())[0]["metadata"]["generation"] == 1
    report = recover(restarted(node))
    assert report.repaired == [str(host)]
    assert metadata.parse_stream(host.read_bytes())[0]["metadata"]["generation"] == 2


async def test_a_refresh_after_a_restart_with_another_kubelet_dir_rewrites_the_files_where_the_record_says(
        node, tmp_path):
    node.nic_source.devices = [nic(ips=())]
    await node.inventory.scan(["nic"])
    write_claim(node.claims_dir, claim("net", OLD, [result(NIC, "nic")]))
    assert (await node.engine.prepare([ref("net", OLD)]))[OLD].error == ""
    # The running container mounts the metadata file its CDI spec names: below the old kubelet dir.
    host = metadata.host_file(node.settings.metadata_dir, OLD, "nic")
    spec = next(f for f in node.engine.whole_record(OLD).files if "_metadata_" in f.path)  # type: ignore[union-attr]
    assert str(host).encode() in spec.content

    # The agent restarts with another --kubelet-dir, and the NIC gets its address.
    moved = roots(tmp_path, kubelet_dir=tmp_path / "kubelet-moved")
    assert moved.metadata_dir != node.settings.metadata_dir and moved.claims_state_dir == node.settings.claims_state_dir
    engine = PrepareEngine(moved, node.inventory, node.engine.claims, ClaimStore(moved.claims_state_dir),
                           vf_links=node.engine.passthrough.links)
    recover(engine)
    node.nic_source.devices = [nic(ips=("10.9.9.9/24",))]
    await node.inventory.scan(["nic"])
    assert await engine.refresh_claims([OLD]) == 1

    # The file the record names is rewritten where it is, at the generation the record says.
    for obj in metadata.parse_stream(host.read_bytes()):
        assert obj["metadata"]["generation"] == 2
        assert obj["requests"][0]["devices"][0]["networkData"]["ips"] == ["10.9.9.9/24"]
    record = engine.whole_record(OLD)
    assert record is not None and record.generation == 2
    assert all(Path(f.path).read_bytes() == f.content for f in record.files)
    assert not moved.metadata_dir.exists()  # nothing written below the new kubelet dir
    # Nothing changed since: a second refresh writes nothing and keeps the generation.
    assert await engine.refresh_claims([OLD]) == 0
    assert engine.whole_record(OLD).generation == 2  # type: ignore[union-attr]

    # The old metadata directory removed: nothing to write to, the record stays, nothing is re-created.
    import shutil

    shutil.rmtree(node.settings.metadata_dir)
    node.nic_source.devices = [nic(ips=("10.9.9.10/24",))]
    await node.inventory.scan(["nic"])
    assert await engine.refresh_claims([OLD]) == 0
    assert engine.whole_record(OLD).generation == 2  # type: ignore[union-attr]
    assert not node.settings.metadata_dir.exists()


# -- 7. no link followed ----------------------------------------------------------------------------------

async def test_a_link_planted_where_the_metadata_directory_goes_is_refused(node, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    node.settings.metadata_dir.mkdir(parents=True, exist_ok=True)
    os.symlink(outside, node.settings.metadata_dir / OLD)
    write_claim(node.claims_dir, claim("c", OLD, [result("gpu-0", "req")]))
    before = written_files(node.settings)
    out = await node.engine.prepare([ref("c", OLD)])
    assert "symbolic link" in out[OLD].error
    assert list(outside.iterdir()) == []
    assert written_files(node.settings) == before


async def test_unprepare_removes_a_planted_link_and_never_what_it_points_to(node, tmp_path):
    write_claim(node.claims_dir, claim("c", OLD, [result("gpu-0", "req")]))
    assert (await node.engine.prepare([ref("c", OLD)]))[OLD].error == ""
    outside = tmp_path / "outside"
    (outside / "req").mkdir(parents=True)
    precious = outside / "req" / "metadata.json"
    precious.write_text("keep me")
    claim_dir = node.settings.metadata_dir / OLD
    import shutil

    shutil.rmtree(claim_dir)
    os.symlink(outside, claim_dir)
    assert await node.engine.unprepare([ref("c", OLD)]) == {OLD: ""}
    assert precious.read_text() == "keep me"
    assert not os.path.lexists(claim_dir)
    assert nothing_of(node.settings, OLD)


def test_the_agent_refuses_roots_that_others_can_write(tmp_path):
    settings = roots(tmp_path)
    prepare_roots(settings)
    os.chmod(settings.cdi_dir, 0o777)
    with pytest.raises(StartupError, match=r"CDI directory .* writable by group or others"):
        prepare_roots(settings)
    prepare_roots(build_settings({**{f: getattr(settings, f) for f in (
        "driver_name", "node_name", "kubelet_dir", "cdi_dir", "static_cdi_dir", "state_dir", "dev_root",
        "offline")}, "allow_unsafe_roots": True}))


async def test_a_record_write_that_fails_after_its_rename_leaves_no_record(node, monkeypatch):
    """The directory fsync after the rename can fail (EIO): the prepare is reported as failed, so
    the record that reached the disk must go as well, or the claim would read as prepared."""
    write_claim(node.claims_dir, claim("c", OLD, [result("gpu-0", "req")]))
    synced = []

    def fsync_fails():
        synced.append(os.listdir(node.settings.claims_state_dir))  # the record has been renamed
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(node.engine.store.dir_sync, "sync", fsync_fails)
    out = await node.engine.prepare([ref("c", OLD)])
    assert synced and f"{OLD}.rec" in synced[0]
    assert "Input/output error" in out[OLD].error
    assert node.engine.store.read(OLD) is None and nothing_of(node.settings, OLD)
