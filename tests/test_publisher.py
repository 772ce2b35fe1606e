"""Publishing ResourceSlices: to the API emulator over real HTTP, and to the offline directory."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest
import yaml
from kubeapi import RESOURCE_SLICES, Fault, KubeApi

from agent import kube
from agent.config import Settings
from agent.kinds import Kind
from agent.kube import Backoff, NodeInfo, NodeNotFound, connect, read_node, read_offline_node
from agent.model import Device, Taint
from agent.publish.apiserver import ApiPublisher, DirectoryPublisher, PublishError, PublishLoop
from agent.publish.slices import NodeRef, build_slices

DRIVER = "dra.example.com"
NODE = "node-a"
NODE_UID = "0d0c0b0a-1111-4222-8333-444455556666"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
FAST = Backoff(initial=0.01, maximum=0.05, attempts=4)


def nics(n: int, **attrs: Any) -> list[Device]:
    return [Device(name=f"nic-{i:03d}", kind=Kind.NIC,
                   attributes={"type": "nic", "ifName": f"ens{i}", "mtu": 1500, **attrs}) for i in range(n)]


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(driver_name=DRIVER, node_name=NODE, state_dir=tmp_path / "state")


@pytest.fixture
async def publisher(kube_api: KubeApi, settings: Settings) -> ApiPublisher:
    kube_api.add_node(NODE, uid=NODE_UID)
    node = await read_node(kube_api.client(), NODE)
    return ApiPublisher(kube_api.client(timeout=1.0), settings, node, backoff=FAST)


def ours(api: KubeApi) -> list[dict[str, Any]]:
    return [s for s in api.items(RESOURCE_SLICES) if s["spec"]["nodeName"] == NODE]


def generations(api: KubeApi) -> set[int]:
    return {s["spec"]["pool"]["generation"] for s in ours(api)}


def methods(api: KubeApi) -> list[str]:
    return [f"{r.method} {r.status}" for r in api.since_mark()]


async def eventually(check: Callable[[], bool], what: str) -> None:
    """Poll a condition the code under test reaches on its own (bounded, not timed)."""
    for _ in range(1000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


# -- API server ---------------------------------------------------------------------------------

async def test_first_publish_creates_the_pool(kube_api: KubeApi, publisher: ApiPublisher) -> None:
    kube_api.mark()
    result = await publisher.sync(nics(300))
    assert (result.generation, result.slices, result.devices) == (1, 3, 300)
    assert len(result.created) == 3 and result.updated == [] and result.deleted == []
    stored = ours(kube_api)
    assert sorted(s["metadata"]["name"] for s in stored) == sorted(result.created)
    for obj in stored:
        assert obj["metadata"]["name"].startswith(f"{DRIVER}-{NODE}-")
        assert obj["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE_UID, "controller": True}]
        assert obj["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 3}
    assert sorted(d["name"] for s in stored for d in s["spec"]["devices"]) == [d.name for d in nics(300)]
    listing = kube_api.since_mark()[0]
    assert (listing.method, listing.path) == ("GET", SLICES)
    assert sorted(listing.params["fieldSelector"].split(",")) == [
        f"spec.driver={DRIVER}", f"spec.nodeName={NODE}"]
    assert methods(kube_api) == ["GET 200", "POST 201", "POST 201", "POST 201"]


async def test_unchanged_inventory_writes_nothing(kube_api: KubeApi, publisher: ApiPublisher) -> None:
    await publisher.sync(nics(300))
    kube_api.mark()
    result = await publisher.sync(nics(300))
    assert not result.changed and result.generation == 1
    assert kube_api.writes() == []
    assert methods(kube_api) == ["GET 200"]


async def test_a_change_updates_only_the_slice_holding_it(kube_api: KubeApi, publisher: ApiPublisher) -> None:
    await publisher.sync(nics(300))
    devices = nics(300)
    devices[290].attributes["mtu"] = 9000  # in the last slice, of 44: still within 64 with a taint
    devices[290].taints = [Taint(key=f"{DRIVER}/link-down", effect="NoSchedule")]
    kube_api.mark()
    result = await publisher.sync(devices)
    assert result.generation == 1 and result.created == [] and result.deleted == []
    assert len(result.updated) == 1
    (put,) = kube_api.writes()
    assert put.method == "PUT" and put.path == f"{SLICES}/{result.updated[0]}"
    assert put.body["metadata"]["resourceVersion"]  # a conditional write
    changed = kube_api.get(RESOURCE_SLICES, result.updated[0])
    assert changed is not None
    dev = next(d for d in changed["spec"]["devices"] if d["name"] == "nic-290")
    assert dev["attributes"]["mtu"] == {"int": 9000} and dev["taints"][0]["key"] == f"{DRIVER}/link-down"
    assert dev["taints"][0]["timeAdded"]  # stamped by the server
    assert generations(kube_api) == {1}
    # The stamp is the server's, not a difference: the same inventory again writes nothing.
    kube_api.mark()
    assert not (await publisher.sync(devices)).changed
    assert kube_api.writes() == []


async def test_a_shrink_bumps_the_generation_and_deletes_after_writing(
        kube_api: KubeApi, publisher: ApiPublisher) -> None:
    await publisher.sync(nics(300))
    kube_api.mark()
    result = await publisher.sync(nics(100))
    assert result.generation == 2 and len(result.updated) == 1 and len(result.deleted) == 2
    assert [s["spec"]["pool"] for s in ours(kube_api)] == [
        {"name": NODE, "generation": 2, "resourceSliceCount": 1}]
    writes = [r.method for r in kube_api.writes()]
    assert writes == ["PUT", "DELETE", "DELETE"]


async def test_growth_reuses_and_creates(kube_api: KubeApi, publisher: ApiPublisher) -> None:
    await publisher.sync(nics(10))
    result = await publisher.sync(nics(200))
    assert result.generation == 2 and len(result.updated) == 1 and len(result.created) == 1
    assert generations(kube_api) == {2} and len(ours(kube_api)) == 2


async def test_conflict_is_re_read_and_retried(kube_api: KubeApi, publisher: ApiPublisher) -> None:
    await publisher.sync(nics(10))
    fault = kube_api.fail("PUT", f"{SLICES}/*", status=409)
    kube_api.mark()
    result = await publisher.sync(nics(10, mtu=9000))
    assert fault.hits == 1 and len(result.updated) == 1
    assert methods(kube_api) == ["GET 200", "PUT 409", "GET 200", "PUT 200"]
    assert all(d["attributes"]["mtu"] == {"int": 9000} for s in ours(kube_api) for d in s["spec"]["devices"])


async def test_a_stale_resource_version_is_a_real_conflict(
        kube_api: KubeApi, publisher: ApiPublisher) -> None:
    await publisher.sync(nics(10))
    # Someone else writes the slice between our read and our write: the LIST is answered, then the
    # other writer moves the resourceVersion on, and our PUT carries the old one.
    gate = kube_api.hold("PUT", f"{SLICES}/*")
    sync = asyncio.create_task(publisher.sync(nics(10, mtu=9000)))
    await eventually(lambda: kube_api.emulator.in_flight == 1, "the PUT reached the server")
    (name,) = [s["metadata"]["name"] for s in ours(kube_api)]
    other = kube_api.get(RESOURCE_SLICES, name)
    assert other is not None
    other["spec"]["devices"][0]["attributes"]["mtu"] = {"int": 1}
    kube_api.add(other)
    kube_api.emulator.faults.clear()
    gate.set()
    result = await sync
    assert len(result.updated) == 1
    statuses = [r.status for r in kube_api.requests if r.method == "PUT"]
    assert statuses == [409, 200]
    assert all(d["attributes"]["mtu"] == {"int": 9000} for s in ours(kube_api) for d in s["spec"]["devices"])


async def test_a_slice_deleted_between_the_read_and_the_write_is_re_read_and_created_again(
        kube_api: KubeApi, publisher: ApiPublisher, caplog: pytest.LogCaptureFixture) -> None:
    # A kubelet deletes every slice of its node when it starts: between our LIST and our PUT the slice
    # is gone. The PUT's 404 is a changed pool, read again and written again at once, not a failed
    # publish (an error in the log and a retry seconds later; seen through the real kubelet).
    await publisher.sync(nics(10))
    gate = kube_api.hold("PUT", f"{SLICES}/*")
    sync = asyncio.create_task(publisher.sync(nics(10, mtu=9000)))
    await eventually(lambda: kube_api.emulator.in_flight == 1, "the PUT reached the server")
    (name,) = [s["metadata"]["name"] for s in ours(kube_api)]
    kube_api.remove(RESOURCE_SLICES, name)
    kube_api.emulator.faults.clear()
    gate.set()
    caplog.set_level(logging.INFO, logger="agent.publish")
    result = await sync
    assert len(result.created) == 1 and not result.updated
    assert [r.status for r in kube_api.requests if r.method in ("PUT", "POST")][-2:] == [404, 201]
    assert all(d["attributes"]["mtu"] == {"int": 9000} for s in ours(kube_api) for d in s["spec"]["devices"])
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_server_errors_are_retried(kube_api: KubeApi, publisher: ApiPublisher) -> None:
    kube_api.fail("GET", SLICES, status=503)
    kube_api.fail("POST", SLICES, times=2, status=500)
    kube_api.fail("POST", SLICES, status=429, headers={"Retry-After": "0"})
    kube_api.mark()
    result = await publisher.sync(nics(10))
    assert len(result.created) == 1
    assert methods(kube_api) == ["GET 503", "GET 200", "POST 500", "POST 500", "POST 429", "POST 201"]
    assert len(ours(kube_api)) == 1


async def test_a_request_that_hangs_times_out_and_is_retried(
        kube_api: KubeApi, publisher: ApiPublisher) -> None:
    kube_api.hang("GET", SLICES, seconds=3.0)  # the client gives up after 1 s
    result = await publisher.sync(nics(10))
    assert len(result.created) == 1 and len(ours(kube_api)) == 1


def device_names(api: KubeApi) -> list[str]:
    """Every device of the pool, as often as it is published."""
    return sorted(d["name"] for s in ours(api) for d in s["spec"]["devices"])


@pytest.mark.parametrize("how", ["timeout", "dropped connection"])
async def test_a_create_whose_answer_is_lost_is_not_repeated(
        kube_api: KubeApi, publisher: ApiPublisher, how: str) -> None:
    # The server stores the slice, then the answer never arrives: the client (1 s timeout) gives up
    # and retries. With generateName that retry stored the same devices a second time.
    fault = kube_api.lose_answer("POST", SLICES, hang=1.5 if how == "timeout" else 0.0)
    kube_api.mark()
    result = await publisher.sync(nics(300))
    assert fault.hits == 1
    assert device_names(kube_api) == [d.name for d in nics(300)]  # each device exactly once
    assert len(ours(kube_api)) == 3 and generations(kube_api) == {1}
    assert sorted(result.created) == sorted(s["metadata"]["name"] for s in ours(kube_api))
    posts = [r for r in kube_api.since_mark() if r.method == "POST"]
    # The retry named the same object and was refused; the two other slices went through at once.
    assert [r.status for r in posts] == [None, 409, 201, 201]
    assert posts[0].body["metadata"]["name"] == posts[1].body["metadata"]["name"]
    for _ in range(10):
        kube_api.mark()
        assert not (await publisher.sync(nics(300))).changed
        assert kube_api.writes() == []


async def test_a_create_stored_after_its_retry_is_not_a_second_copy(
        kube_api: KubeApi, publisher: ApiPublisher) -> None:
    # Worse than a lost answer: the first try is still queued at the server when the client gives
    # up, so a LIST before the retry would not show it, and it is stored after the retry.
    gate = asyncio.Event()
    kube_api.emulator.faults.append(Fault("POST", SLICES, times=1, status=None, gate=gate))
    sync = asyncio.create_task(publisher.sync(nics(10)))
    await eventually(lambda: any(r.method == "POST" and r.status == 201 for r in kube_api.requests),
                     "the retry was stored")
    gate.set()
    await eventually(lambda: [r.status for r in kube_api.requests if r.method == "POST"] == [409, 201],
                     "the first try was answered")
    result = await sync
    assert len(result.created) == 1
    assert device_names(kube_api) == [d.name for d in nics(10)]


async def test_a_name_taken_by_someone_else_is_not_mistaken_for_ours(
        kube_api: KubeApi, publisher: ApiPublisher, monkeypatch: pytest.MonkeyPatch) -> None:
    # Not of this pool, though named like it: nothing but the name ties it to us.
    taken = build_slices(nics(1), driver=DRIVER, node="node-b")[0]
    taken["metadata"]["name"] = f"{DRIVER}-{NODE}-00-bbbbb"
    kube_api.add(taken)
    drawn = iter([f"{DRIVER}-{NODE}-00-bbbbb", f"{DRIVER}-{NODE}-00-bbbbb", f"{DRIVER}-{NODE}-00-ccccc"])
    monkeypatch.setattr("agent.publish.slices.new_slice_name", lambda generate: next(drawn))
    kube_api.fail("POST", SLICES, status=503)  # stored or not? The client cannot tell
    kube_api.mark()
    result = await publisher.sync(nics(3))
    assert result.created == [f"{DRIVER}-{NODE}-00-ccccc"]
    # A 409 after an unanswered try: the stored object is read, and it is not what we sent. A 409 on
    # a first try is a clash by itself. Either way another name is drawn.
    assert methods(kube_api) == ["GET 200", "POST 503", "POST 409", "GET 200", "POST 409", "POST 201"]
    assert generations(kube_api) == {1} and kube_api.get(RESOURCE_SLICES, taken["metadata"]["name"]) is not None
    stored = kube_api.get(RESOURCE_SLICES, f"{DRIVER}-{NODE}-00-ccccc")
    assert stored is not None and [d["name"] for d in stored["spec"]["devices"]] == [
        "nic-000", "nic-001", "nic-002"]


async def test_copies_of_a_slice_are_removed_by_the_next_sync(
        kube_api: KubeApi, publisher: ApiPublisher) -> None:
    await publisher.sync(nics(300))
    stored = ours(kube_api)
    # Two copies of one slice in the current generation (another agent, an older version): one
    # as published, one with a stale attribute.
    for suffix, mtu in (("copy1", None), ("copy2", 1)):
        extra = {k: v for k, v in stored[1].items() if k != "metadata"}
        extra["metadata"] = {"name": f"{DRIVER}-{NODE}-{suffix}",
                             "ownerReferences": stored[1]["metadata"]["ownerReferences"]}
        if mtu is not None:
            extra["spec"]["devices"][0]["attributes"]["mtu"] = {"int": mtu}
        kube_api.add(extra)
    assert len(device_names(kube_api)) == 300 + 2 * len(stored[1]["spec"]["devices"])
    kube_api.mark()
    result = await publisher.sync(nics(300))
    # Only the extra copies go; the pool keeps its generation and nothing else is rewritten.
    assert [r.method for r in kube_api.writes()] == ["DELETE", "DELETE"]
    assert result.generation == 1 and len(result.deleted) == 2 and not result.created + result.updated
    assert device_names(kube_api) == [d.name for d in nics(300)]
    # Of two identical copies either may stay; the one with the stale attribute never does.
    left = {s["metadata"]["name"] for s in ours(kube_api)}
    others = {s["metadata"]["name"] for s in stored} - {stored[1]["metadata"]["name"]}
    assert others < left and left - others in ({stored[1]["metadata"]["name"]}, {f"{DRIVER}-{NODE}-copy1"})
    kube_api.mark()
    assert not (await publisher.sync(nics(300))).changed
    assert kube_api.writes() == []


async def test_a_lasting_failure_is_a_clear_error(kube_api: KubeApi, publisher: ApiPublisher) -> None:
    kube_api.fail("POST", SLICES, times=100, status=500)
    with pytest.raises(PublishError, match=r"node node-a .*creating a ResourceSlice: HTTP 500.*4 tries"):
        await publisher.sync(nics(10))
    assert [r.status for r in kube_api.requests if r.method == "POST"] == [500] * FAST.attempts


async def test_a_refusal_is_not_retried(kube_api: KubeApi, publisher: ApiPublisher) -> None:
    kube_api.fail("POST", SLICES, times=100, status=403)
    with pytest.raises(PublishError, match="HTTP 403"):
        await publisher.sync(nics(10))
    assert [r.status for r in kube_api.requests if r.method == "POST"] == [403]


@pytest.mark.parametrize("server_filters", [True, False])
async def test_slices_of_other_nodes_and_drivers_are_left_alone(
        kube_api: KubeApi, publisher: ApiPublisher, server_filters: bool) -> None:
    kube_api.emulator.ignore_field_selectors = not server_filters
    for node, driver in (("node-b", DRIVER), (NODE, "other.example.com")):
        for obj in build_slices(nics(3), driver=driver, node=node):
            obj["metadata"]["name"] = f"{driver}-{node}-x"
            kube_api.add(obj)
    await publisher.sync(nics(5))
    await publisher.sync(nics(1))
    names = {s["metadata"]["name"] for s in kube_api.items(RESOURCE_SLICES)}
    assert {f"{DRIVER}-node-b-x", f"other.example.com-{NODE}-x"} <= names
    assert len(names) == 3


async def test_a_dropped_value_is_reported_once_not_on_every_sync(
        kube_api: KubeApi, publisher: ApiPublisher, caplog: pytest.LogCaptureFixture) -> None:
    devices = nics(3)
    devices[1].attributes["ifName"] = "x" * 65
    with caplog.at_level(logging.WARNING, logger="agent.publish.slices"):
        for _ in range(3):
            result = await publisher.sync(devices)
            assert len(result.dropped) == 1 and "nic-001" in result.dropped[0]
    assert [r.getMessage() for r in caplog.records if "nic-001" in r.getMessage()] == [
        f"not published: {result.dropped[0]}"]
    (obj,) = ours(kube_api)
    assert "ifName" not in obj["spec"]["devices"][1]["attributes"]


async def test_a_node_without_uid_gets_no_owner(kube_api: KubeApi, settings: Settings) -> None:
    publisher = ApiPublisher(kube_api.client(), settings, NodeInfo(NODE), backoff=FAST)
    await publisher.sync(nics(2))
    (obj,) = ours(kube_api)
    assert "ownerReferences" not in obj["metadata"]


# -- the keep-published loop --------------------------------------------------------------------

async def test_the_loop_survives_an_api_outage_and_catches_up(
        kube_api: KubeApi, publisher: ApiPublisher) -> None:
    await kube_api.stop()
    loop = PublishLoop(publisher, verify_interval=3600, backoff=Backoff(initial=0.01, maximum=0.05))
    loop.update(nics(20))
    task = asyncio.create_task(loop.run())
    try:
        await eventually(lambda: loop.failures >= 3, "failed syncs while the API is down")
        assert not task.done() and "ConnectError" in loop.last_error and not loop.up_to_date
        await kube_api.start()
        result = await asyncio.wait_for(loop.wait_published(), 30)
        assert len(result.created) == 1 and loop.failures == 0 and loop.last_error == ""
        assert len(ours(kube_api)) == 1

        loop.update(nics(300))
        result = await asyncio.wait_for(loop.wait_published(), 30)
        assert result.slices == 3 and generations(kube_api) == {2}
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_the_loop_puts_back_what_someone_deleted(kube_api: KubeApi, publisher: ApiPublisher) -> None:
    # The watch of the node's slices sees the deletion (as a kubelet's at its start): no timer is involved.
    from lightkube.resources.resource_v1 import ResourceSlice

    loop = PublishLoop(publisher, verify_interval=0.02, backoff=FAST)
    assert loop.verify_interval == 3600.0  # a watched pool: the timer is a backstop only
    loop.update(nics(5))
    task = asyncio.create_task(loop.run())
    try:
        await asyncio.wait_for(loop.wait_published(), 30)
        (obj,) = ours(kube_api)
        await until_watching(kube_api)
        await kube_api.client().delete(ResourceSlice, obj["metadata"]["name"])
        await eventually(lambda: len(ours(kube_api)) == 1, "the slice is back")
        assert ours(kube_api)[0]["metadata"]["name"] != obj["metadata"]["name"]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_watched_pool_is_not_listed_again_while_nothing_changes(kube_api: KubeApi,
                                                                      publisher: ApiPublisher) -> None:
    # Every agent of a cluster LISTed its slices once a minute; with the watch, an idle pool costs the
    # API server nothing but the watch, and the echo of our own writes starts no verification.
    loop = PublishLoop(publisher, verify_interval=0.02, backoff=FAST)
    loop.update(nics(300))
    task = asyncio.create_task(loop.run())
    try:
        await asyncio.wait_for(loop.wait_published(), 30)
        await until_watching(kube_api)
        loop.update(nics(300, mtu=9000))  # our own writes: their watch events are ours
        await asyncio.wait_for(loop.wait_published(), 30)
        kube_api.mark()
        await asyncio.sleep(1.0)  # fifty of the unwatched loop's verifications
        lists = [r for r in kube_api.since_mark() if r.method == "GET" and r.params.get("watch") != "true"]
        assert lists == []
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def until_watching(api: KubeApi) -> None:
    await eventually(lambda: any(r.path == SLICES and r.params.get("watch") == "true" for r in api.requests),
                     "the watch of the node's slices")


# -- the Node and the connection ----------------------------------------------------------------

async def test_read_node(kube_api: KubeApi) -> None:
    kube_api.add_node(NODE, uid=NODE_UID, declared_features=["DRANodeAllocatableResources", "Other"])
    info = await read_node(kube_api.client(), NODE)
    assert info == NodeInfo(NODE, NODE_UID, frozenset({"DRANodeAllocatableResources", "Other"}))
    assert info.node_allocatable
    with pytest.raises(NodeNotFound, match="node-z"):
        await read_node(kube_api.client(), "node-z")


async def test_errors_are_classified(kube_api: KubeApi) -> None:
    client = kube_api.client(timeout=0.5)
    kube_api.add_node(NODE)
    seen: dict[int | str, BaseException] = {}
    for status in (500, 429, 409, 403):
        kube_api.fail("GET", f"/api/v1/nodes/{NODE}", status=status)
        with pytest.raises(Exception) as info:
            await read_node(client, NODE)
        seen[status] = info.value
    with pytest.raises(NodeNotFound) as missing:
        await read_node(client, "nope")
    seen[404] = missing.value.__cause__  # type: ignore[assignment]
    await kube_api.stop()
    with pytest.raises(Exception) as down:
        await read_node(client, NODE)
    seen["down"] = down.value
    assert {k for k, e in seen.items() if kube.is_retryable(e)} == {500, 429, "down"}
    assert [k for k, e in seen.items() if kube.is_conflict(e)] == [409]
    assert [k for k, e in seen.items() if kube.is_not_found(e)] == [404]
    assert kube.describe(seen[500]) == "HTTP 500: injected fault"


async def test_connect_with_a_kubeconfig(kube_api: KubeApi, tmp_path: Path) -> None:
    kube_api.add_node(NODE, uid=NODE_UID)
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": {"server": kube_api.url}}],
        "users": [{"name": "emu", "user": {"token": "t"}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu"}}]}))
    settings = Settings(node_name=NODE, kubeconfig=config, state_dir=tmp_path, api_timeout=2.5)
    client, source = await connect(settings, service_account=tmp_path / "no-sa", home=tmp_path)
    assert client is not None and str(config) in source
    try:
        assert (await read_node(client, NODE)).uid == NODE_UID
    finally:
        await client.close()


async def test_connect_without_any_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    settings = Settings(node_name=NODE, state_dir=tmp_path)
    client, reason = await connect(settings, service_account=tmp_path / "no-sa", home=tmp_path)
    assert client is None and "no cluster configured" in reason
    # A kubeconfig that was asked for and is not there is a problem to report, not "no config".
    named = Settings(node_name=NODE, state_dir=tmp_path, kubeconfig=tmp_path / "missing")
    client, reason = await connect(named, service_account=tmp_path / "no-sa", home=tmp_path)
    assert client is None and "unusable" in reason and "missing" in reason


async def test_connect_prefers_the_service_account_over_home(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("tok")
    (sa / "namespace").write_text("dra-system")
    (sa / "ca.crt").write_text("not a certificate")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    (tmp_path / ".kube").mkdir()
    (tmp_path / ".kube" / "config").write_text("{}")
    settings = Settings(node_name=NODE, state_dir=tmp_path)
    config, source = kube.find_config(settings, service_account=sa, home=tmp_path)
    assert config is not None and "in-cluster" in source
    assert config.get().cluster.server == "https://10.96.0.1:443"
    # A CA that cannot be loaded makes the config unusable: a reason, not a crash.
    client, reason = await connect(settings, service_account=sa, home=tmp_path)
    assert client is None and "unusable" in reason


def test_read_offline_node(tmp_path: Path) -> None:
    assert read_offline_node(tmp_path, NODE) == NodeInfo(NODE)
    (tmp_path / "node.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "uid": NODE_UID},
        "status": {"declaredFeatures": ["DRANodeAllocatableResources"]}}))
    assert read_offline_node(tmp_path, NODE) == NodeInfo(NODE, NODE_UID,
                                                        frozenset({"DRANodeAllocatableResources"}))
    assert read_offline_node(tmp_path, "node-b") == NodeInfo("node-b")  # describes another node


# -- offline directory --------------------------------------------------------------------------

def slice_files(root: Path) -> dict[str, dict[str, Any]]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted((root / "resourceslices").glob("*.yaml"))}


def identities(root: Path) -> dict[str, tuple[int, int]]:
    """Inode and mtime of each file: a rewrite (atomic, so a new inode) changes both."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (root / "resourceslices").iterdir()}


async def test_directory_files_hold_exactly_what_would_be_posted(tmp_path: Path, settings: Settings) -> None:
    pub = DirectoryPublisher(tmp_path, settings, NodeInfo(NODE, NODE_UID))
    result = await pub.sync(nics(300))
    assert result.generation == 1 and len(result.created) == 3
    files = slice_files(tmp_path)
    assert list(files) == [f"{DRIVER}-{NODE}-{i}.yaml" for i in range(3)]
    assert list(files.values()) == build_slices(nics(300), driver=DRIVER, node=NODE,
                                                owner=NodeRef(NODE, NODE_UID))
    assert [n for n in os.listdir(tmp_path / "resourceslices") if n.startswith(".")] == []


async def test_directory_unchanged_is_not_rewritten(tmp_path: Path, settings: Settings) -> None:
    pub = DirectoryPublisher(tmp_path, settings, NodeInfo(NODE, NODE_UID))
    await pub.sync(nics(300))
    before = identities(tmp_path)
    result = await pub.sync(nics(300))
    assert not result.changed
    after = identities(tmp_path)
    assert after == before

    devices = nics(300)
    devices[0].attributes["mtu"] = 9000
    result = await pub.sync(devices)
    assert result.updated == [f"{DRIVER}-{NODE}-0"] and result.generation == 1
    changed = identities(tmp_path)
    assert {n for n in changed if changed[n] != before[n]} == {f"{DRIVER}-{NODE}-0.yaml"}


async def test_directory_check_of_an_unchanged_pool_reads_no_file(tmp_path: Path, settings: Settings,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # The publish loop checks the files every minute: with the devices and the files as the last sync
    # left them, nothing is built or parsed. Anything else (a file gone or rewritten by someone else, a
    # device changed, even in place) is seen and put right as before.
    from agent.publish import directory

    pub = DirectoryPublisher(tmp_path, settings, NodeInfo(NODE, NODE_UID))
    devices = nics(300)
    await pub.sync(devices)
    parsed: list[bytes] = []
    parse = directory._parse
    monkeypatch.setattr(directory, "_parse", lambda data: parsed.append(data) or parse(data))
    result = await pub.sync(nics(300))
    assert not result.changed and result.generation == 1 and result.devices == 300 and result.slices == 3
    assert parsed == []
    path = tmp_path / "resourceslices" / f"{DRIVER}-{NODE}-1.yaml"
    path.unlink()
    assert (await pub.sync(devices)).created == [f"{DRIVER}-{NODE}-1"] and len(parsed) == 2
    path.write_text(path.read_text().replace("ens1", "ens01"))  # rewritten in place
    assert (await pub.sync(devices)).updated == [f"{DRIVER}-{NODE}-1"]
    devices[0].attributes["mtu"] = 9000
    assert (await pub.sync(devices)).updated == [f"{DRIVER}-{NODE}-0"]
    parsed.clear()
    assert not (await pub.sync(devices)).changed and parsed == []


async def test_directory_stale_files_are_removed(tmp_path: Path, settings: Settings) -> None:
    pub = DirectoryPublisher(tmp_path, settings, NodeInfo(NODE))
    await pub.sync(nics(300))
    foreign = tmp_path / "resourceslices" / f"{DRIVER}-node-b-0.yaml"
    foreign.write_text("kept: true\n")
    result = await pub.sync(nics(5))
    assert result.generation == 2 and sorted(result.deleted) == [f"{DRIVER}-{NODE}-1", f"{DRIVER}-{NODE}-2"]
    files = slice_files(tmp_path)
    assert sorted(files) == [f"{DRIVER}-{NODE}-0.yaml", f"{DRIVER}-node-b-0.yaml"]
    assert files[f"{DRIVER}-{NODE}-0.yaml"]["spec"]["pool"] == {
        "name": NODE, "generation": 2, "resourceSliceCount": 1}
    result = await pub.sync([])
    assert result.deleted == [f"{DRIVER}-{NODE}-0"] and list(slice_files(tmp_path)) == [foreign.name]


async def test_directory_a_broken_file_is_rewritten(tmp_path: Path, settings: Settings) -> None:
    pub = DirectoryPublisher(tmp_path, settings, NodeInfo(NODE))
    await pub.sync(nics(300))
    path = tmp_path / "resourceslices" / f"{DRIVER}-{NODE}-1.yaml"
    path.write_text("{ not yaml")
    result = await pub.sync(nics(300))
    assert result.changed and result.generation == 2
    expected = build_slices(nics(300), driver=DRIVER, node=NODE, generation=2)
    assert list(slice_files(tmp_path).values()) == expected


async def test_emulator_rejects_a_slice_the_schema_rejects(kube_api: KubeApi) -> None:
    obj = build_slices(nics(1), driver=DRIVER, node=NODE)[0]
    obj["spec"]["devices"][0]["basic"] = {}  # the v1beta1 shape, gone in v1
    async with httpx2.AsyncClient(base_url=kube_api.url) as http:
        answer = await http.post(SLICES, json=obj)
    assert answer.status_code == 422 and "basic" in answer.json()["message"]
    assert kube_api.items(RESOURCE_SLICES) == []


async def test_a_pool_breaking_api_rules_is_not_published(tmp_path: Path, settings: Settings, kube_api: KubeApi,
                                                          publisher: ApiPublisher,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The split is checked against the pool-wide rules before anything is written: what the API
    server would refuse is not sent (nor written offline), and what is published stays."""
    pub = DirectoryPublisher(tmp_path, settings, NodeInfo(NODE, NODE_UID))
    await pub.sync(nics(3))
    await publisher.sync(nics(3))
    before, posted = identities(tmp_path), ours(kube_api)
    monkeypatch.setattr("agent.publish.slices.pool_rule_errors", lambda chunks: ["spec.devices has 65 entries"])
    with pytest.raises(PublishError, match=r"break API rules: spec\.devices has 65 entries"):
        await pub.sync(nics(4))
    with pytest.raises(PublishError, match="break API rules"):
        await publisher.sync(nics(4))
    assert identities(tmp_path) == before and ours(kube_api) == posted


# -- a field the API server drops ----------------------------------------------------------------

def mig_and_vgpu() -> list[Device]:
    """A MIG placement and a vGPU of one GPU, on its counter set (what `--compatibility-groups` keeps apart)."""
    from agent import counters
    from agent.facts import GpuFacts, GpuIdentity, MigPlacement, VgpuType
    from agent.kinds import Kind
    from agent.model import PCI_BUS_ID, CounterConsumption

    bus = "0000:18:00.0"
    gpu = GpuIdentity(uuid="GPU-0", index=0, minor=0, pci_bus_id=bus)
    cs = counters.gpu_counter_set(bus, 80 << 30)
    mig = Device(name="gpu-0-mig-1g10gb-0", kind=Kind.MIG, attributes={"type": "mig", PCI_BUS_ID: bus},
                 node=GpuFacts(gpu, MigPlacement("1g.10gb", 0, 1)),
                 consumes_counters=(CounterConsumption(cs, {"memory": "10Gi"}),))
    vgpu = Device(name="gpu-0-vgpu-nvidia-1021-0", kind=Kind.VGPU,
                  attributes={"type": "vgpu", PCI_BUS_ID: bus, "mdevType": "nvidia-1021", "vgpuType": "GRID H100-4C"},
                  node=GpuFacts(gpu, VgpuType("nvidia-1021", "GRID H100-4C", 4 << 30, 20)),
                  consumes_counters=(CounterConsumption(cs, {"memory": "4Gi"}),))
    return [mig, vgpu]


async def test_dropped_compatibility_groups_are_noticed_once_and_nothing_is_rewritten(
        kube_api: KubeApi, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The emulator, like an API server with DRADeviceCompatibilityGroups off, drops the groups.
    assert "DRADeviceCompatibilityGroups" not in kube_api.emulator.gates
    kube_api.add_node(NODE, uid=NODE_UID)
    node = await read_node(kube_api.client(), NODE)
    settings = Settings(driver_name=DRIVER, node_name=NODE, state_dir=tmp_path / "state", compatibility_groups=True)
    publisher = ApiPublisher(kube_api.client(timeout=1.0), settings, node, backoff=FAST)
    caplog.set_level(logging.WARNING, logger="agent.publish")

    await publisher.sync(mig_and_vgpu())
    stored = {d["name"]: d for s in ours(kube_api) for d in s["spec"].get("devices") or []}
    # Without groups the vGPU cannot be kept from the MIG placement: it is not published.
    assert set(stored) == {"gpu-0-mig-1g10gb-0"}
    # Found by a dry run: no slice ever held the vGPU.
    assert not [r for r in kube_api.requests if r.method == "POST" and "gpu-0-vgpu" in str(r.body)
                and r.params.get("dryRun") != "All"]
    said = [r.getMessage() for r in caplog.records if "compatibilityGroups" in r.getMessage()]
    assert len(said) == 1 and "DRADeviceCompatibilityGroups" in said[0]

    kube_api.mark()
    for _ in range(3):
        result = await publisher.sync(mig_and_vgpu())
        assert not result.changed
    assert [m for m in methods(kube_api) if not m.startswith("GET")] == []
    assert len([r for r in caplog.records if "compatibilityGroups" in r.getMessage()]) == 1


async def test_what_the_server_changes_in_a_slice_is_not_sent_again(
        kube_api: KubeApi, publisher: ApiPublisher, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # A server that stores a value other than the one sent (as a newer server might normalize one):
    # the agent cannot make the stored slice equal what it sends, and must not keep trying.
    default = type(kube_api.emulator)._default

    def normalizing(kind: Any, obj: dict[str, Any]) -> None:
        default(kind, obj)
        for dev in (obj.get("spec") or {}).get("devices") or []:
            if "ifName" in (dev.get("attributes") or {}):
                dev["attributes"]["ifName"]["string"] = dev["attributes"]["ifName"]["string"].upper()

    monkeypatch.setattr(type(kube_api.emulator), "_default", staticmethod(normalizing))
    caplog.set_level(logging.WARNING, logger="agent.publish")
    await publisher.sync(nics(3))
    kube_api.mark()
    for _ in range(3):
        assert not (await publisher.sync(nics(3))).changed
    assert [m for m in methods(kube_api) if not m.startswith("GET")] == []
    said = [r.getMessage() for r in caplog.records if "differently" in r.getMessage()]
    assert len(said) == 1 and "spec.devices[0].attributes.ifName.string" in said[0], said
    # A change of what is sent is sent.
    await publisher.sync(nics(3, mtu=9000))
    assert {d["attributes"]["mtu"]["int"] for s in ours(kube_api) for d in s["spec"]["devices"]} == {9000}
