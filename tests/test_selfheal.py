"""Self-healing (agent/engine/selfheal.py): a running agent's files and sockets removed or changed from
under it come back.

After each change a test makes, it awaits `SelfHealer.settled()`: every event the kernel queued has
been read and judged and every check it caused has finished. What the agent restores is there then,
and what it did not restore by then it never will (nothing is left to do it); each "not restored"
check has the same observation see a restore in the same test. No timing is asserted (the design
target of 1 s from the event is the agent's, not something a loaded test machine can show)."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat

import pytest
from agentkit import DRIVER, claim, result, roots, write_claim

from agent.app.daemon import Agent
from agent.kubelet import client as kc
from agent.names import ClaimRef

UID1 = "5e1f0000-0000-4000-8000-000000000001"
UID2 = "5e1f0000-0000-4000-8000-000000000002"


@pytest.fixture
async def agent(short_tmp):
    a = Agent(roots(short_tmp, rescan_interval=3600.0))
    await a.start()
    assert a.selfheal is not None
    yield a
    await a.stop()


async def prepared(agent, name: str, uid: str, device: str = "gpu-0") -> dict[str, bytes]:
    write_claim(agent.settings.offline / "resourceclaims", claim(name, uid, [result(device)]))
    results = await agent.engine.prepare([ClaimRef("default", name, uid)])
    assert results[uid].error == ""
    await settled(agent)  # the agent's own writes raised events: judged (as its own) by now
    record = agent.engine.whole_record(uid)
    assert record is not None
    return {f.path: f.content for f in record.files}


async def settled(agent) -> None:
    await asyncio.wait_for(agent.selfheal.settled(), 30)


def content(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def spec_path(agent, uid: str) -> str:
    return str(agent.settings.cdi_dir / f"{DRIVER}-claim_{uid}.json")


def metadata_path(files: dict[str, bytes]) -> str:
    (path,) = [p for p in files if p.endswith("metadata.json")]
    return path


async def test_a_deleted_cdi_spec_comes_back_identical(agent, caplog):
    files = await prepared(agent, "c", UID1)
    path = spec_path(agent, UID1)
    os.unlink(path)
    await settled(agent)
    assert content(path) == files[path]
    # logged right after the write, once the claim's lock is let go
    assert any(r.levelname == "WARNING" and path in r.getMessage() for r in caplog.records)


async def test_an_overwritten_metadata_file_is_restored(agent):
    files = await prepared(agent, "c", UID1)
    path = metadata_path(files)
    with open(path, "wb") as f:
        f.write(b"garbage")
    await settled(agent)
    assert content(path) == files[path]


async def test_a_removed_metadata_directory_is_restored(agent):
    files = await prepared(agent, "c", UID1)
    shutil.rmtree(agent.settings.metadata_dir / UID1)
    await settled(agent)
    assert all(content(p) == c for p, c in files.items())


async def test_files_of_an_unprepared_claim_are_not_recreated(agent):
    files = await prepared(agent, "c", UID1)
    path = spec_path(agent, UID1)
    os.unlink(path)  # while prepared: restored (the same observation, seeing a restore)
    await settled(agent)
    assert content(path) == files[path]
    assert await agent.engine.unprepare([ClaimRef("default", "c", UID1)]) == {UID1: ""}
    await settled(agent)
    assert all(content(p) is None for p in files)
    # Someone writes a file with the claim's name: not the agent's to restore (or remove).
    checks = agent.selfheal.claim_checks
    with open(path, "wb") as f:
        f.write(b"{}")
    os.unlink(path)
    await settled(agent)
    assert agent.selfheal.claim_checks > checks  # the removal was seen and judged
    assert content(path) is None and UID1 not in agent.engine.records


async def test_no_rewrite_loop_after_a_restore(agent):
    files = await prepared(agent, "c", UID1)
    path = spec_path(agent, UID1)
    restored = agent.selfheal.restored
    os.unlink(path)
    await settled(agent)  # a rewrite loop would never settle (the restore's own events are judged too)
    assert content(path) == files[path] and agent.selfheal.restored == restored + 1
    st = os.stat(path)
    await settled(agent)
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert agent.selfheal.restored == restored + 1


async def test_the_registration_socket_comes_back_and_answers(agent):
    path = agent.settings.registration_socket
    os.unlink(path)
    await settled(agent)
    assert stat.S_ISSOCK(os.stat(path).st_mode) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    info = await kc.get_info(path, timeout=kc.GET_INFO_TIMEOUT)
    assert info.name == DRIVER


async def test_a_removed_registry_directory_and_socket_come_back(agent):
    path = agent.settings.registration_socket
    shutil.rmtree(path.parent)
    await settled(agent)
    assert os.path.exists(path)
    assert (await kc.get_info(path, timeout=kc.GET_INFO_TIMEOUT)).name == DRIVER


async def test_the_dra_socket_comes_back_and_prepares(agent):
    path = agent.settings.dra_socket
    os.unlink(path)
    await settled(agent)
    assert os.path.exists(path)
    write_claim(agent.settings.offline / "resourceclaims", claim("c", UID2, [result("gpu-1")]))
    async with kc.DRAClient(path) as client:
        response = await client.prepare([ClaimRef("default", "c", UID2)])
    assert response.claims[UID2].error == ""


async def test_a_removed_plugin_directory_brings_back_socket_and_metadata(agent):
    files = await prepared(agent, "c", UID1)
    shutil.rmtree(agent.settings.plugin_dir)  # a kubelet restart cleaning its plugin directories
    await settled(agent)
    assert os.path.exists(agent.settings.dra_socket) and all(content(p) == c for p, c in files.items())
    async with kc.DRAClient(agent.settings.dra_socket) as client:
        response = await client.prepare([ClaimRef("default", "c", UID1)])
    assert response.claims[UID1].error == ""


async def test_a_removed_cdi_directory_is_recreated_with_the_specs(agent):
    files = await prepared(agent, "a", UID1, "gpu-0")
    files |= await prepared(agent, "b", UID2, "gpu-1")
    shutil.rmtree(agent.settings.cdi_dir)
    await settled(agent)
    assert all(content(p) == c for p, c in files.items())
    # ... and watched again: a spec deleted now comes back too.
    path = spec_path(agent, UID2)
    os.unlink(path)
    await settled(agent)
    assert content(path) == files[path]


async def test_a_removed_empty_cdi_directory_is_recreated(agent):
    shutil.rmtree(agent.settings.cdi_dir)
    await settled(agent)
    assert agent.settings.cdi_dir.is_dir()


async def test_stopping_does_not_bring_the_sockets_back(short_tmp):
    a = Agent(roots(short_tmp, rescan_interval=3600.0))
    await a.start()
    os.unlink(a.settings.registration_socket)  # while running: it comes back (the same observation)
    await settled(a)
    assert os.path.exists(a.settings.registration_socket)
    await a.stop()
    # Nothing of the agent runs any more that could bind them again: no task of it is left, and
    # self-healing has nothing queued or in flight.
    assert {t for t in asyncio.all_tasks() if t is not asyncio.current_task()} == set()
    await settled(a)
    assert not os.path.exists(a.settings.registration_socket)
    assert not os.path.exists(a.settings.dra_socket)


async def test_the_agents_own_writes_and_removals_cost_no_check_anyone_elses_do(agent):
    heal = agent.selfheal
    before = heal.claim_checks
    files = await prepared(agent, "c", UID1)  # waits for the events of the writes to be read
    assert await agent.engine.unprepare([ClaimRef("default", "c", UID1)]) == {UID1: ""}
    await settled(agent)
    assert heal.claim_checks == before and heal.own_skipped > 0
    # The same claim prepared again: a file replaced by someone else (another inode under the name)
    # and one removed by someone else are restored as ever.
    files = await prepared(agent, "c", UID1)
    path = spec_path(agent, UID1)
    with open(path + ".x", "wb") as f:
        f.write(b"{}")
    os.replace(path + ".x", path)
    await settled(agent)
    assert content(path) == files[path]
    meta = metadata_path(files)
    os.unlink(meta)
    await settled(agent)
    assert content(meta) == files[meta]
    assert heal.claim_checks > before


async def test_own_changes_faster_than_the_events_are_read_cost_no_check(agent):
    """Events are read in batches: the same claim prepared and unprepared many times within one
    batch (the path changed again before its events are judged) is still the agent's own."""
    heal = agent.selfheal
    write_claim(agent.settings.offline / "resourceclaims", claim("c", UID1, [result("gpu-0")]))
    ref = ClaimRef("default", "c", UID1)
    await settled(agent)
    before = heal.claim_checks
    for i in range(30):
        assert (await agent.engine.prepare([ref]))[UID1].error == ""
        if i < 29:
            assert await agent.engine.unprepare([ref]) == {UID1: ""}
    await settled(agent)
    assert heal.own_skipped > 0 and heal.claim_checks == before
    # Then someone else's change is still seen and undone.
    path = spec_path(agent, UID1)
    expected = content(path)
    os.unlink(path)
    await settled(agent)
    assert content(path) == expected and heal.claim_checks > before
