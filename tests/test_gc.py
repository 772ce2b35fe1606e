"""Garbage collection of prepared claims that no pod uses and whose ResourceClaim is gone (agent/engine/gc.py),
through the real engine and the real claim sources: the offline directory with an injected clock, the
kubelet's pod resources service as a stand-in on a real unix socket (tests/podresources.py), and a running
agent against the Kubernetes API emulator."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
from agentkit import claim, make_node, result, roots, write_claim, written_files
from handshakes import metric, until
from kubeapi import RESOURCE_CLAIMS, KubeApi
from podresources import Pod, PodResourcesStandIn, socket_of
from test_agent_cluster import NODE_UID, cluster_settings, eventually, start, write_kubeconfig  # noqa: F401  (fixture)

from agent.app import doctor
from agent.claims.sources import ClaimSourceError
from agent.config import ConfigError, build_settings
from agent.engine.gc import SWEEP_WINDOW, ClaimCollector, gc_interval
from agent.kube.podresources import PodResourcesClient
from agent.kubelet import client as kc
from agent.metrics import Metrics
from agent.names import ClaimName, ClaimRef

OLD = "9c000000-0000-4000-8000-000000000001"
NEW = "9c000000-0000-4000-8000-000000000002"
KEEP = "9c000000-0000-4000-8000-000000000003"
NIC = "nic-0000-3b-00-0"
GRACE = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def node(tmp_path):
    return await make_node(tmp_path)


def nothing_of(settings, uid: str) -> bool:
    return not any(uid in path for path in written_files(settings))


async def prepared(node, name: str, uid: str, device: str = NIC) -> Path:
    path = write_claim(node.claims_dir, claim(name, uid, [result(device, "req")]))
    assert (await node.engine.prepare([ClaimRef("default", name, uid)]))[uid].error == ""
    return path


def collectors() -> int:
    """Garbage collectors running in this process (the agent's background task named `gc`)."""
    return sum(1 for t in asyncio.all_tasks() if t.get_name() == "gc" and not t.done())


def collector(node, clock: Clock, **kw: Any) -> ClaimCollector:
    return ClaimCollector(node.engine, GRACE, clock=clock, **kw)


async def test_a_removed_claim_file_is_collected_after_the_grace_period_not_before(node):
    path = await prepared(node, "c", OLD)
    metrics = Metrics(process=False)
    clock = Clock()
    gc = collector(node, clock, metrics=metrics)
    assert await gc.sweep() == []  # present: nothing starts
    assert gc.gone_since == {}

    path.unlink()
    assert await gc.sweep() == []  # first seen gone: the clock starts
    clock.now += GRACE
    assert await gc.sweep() == []  # exactly the grace period: not yet
    assert OLD in node.engine.records and not nothing_of(node.settings, OLD)

    clock.now += 0.5
    assert await gc.sweep() == [OLD]
    assert OLD not in node.engine.records and nothing_of(node.settings, OLD)
    assert metric(metrics.registry, "dra_agent_claims_garbage_collected_total") == 1
    assert metric(metrics.registry, "dra_agent_gc_sweeps_total") == 4
    assert await gc.sweep() == [] and gc.gone_since == {}


async def test_a_claim_that_comes_back_starts_the_grace_period_over(node):
    path = await prepared(node, "c", OLD)
    text = path.read_text()
    clock = Clock()
    gc = collector(node, clock)
    path.unlink()
    await gc.sweep()
    clock.now += GRACE - 1
    path.write_text(text)  # back, same UID
    assert await gc.sweep() == [] and gc.gone_since == {}
    path.unlink()
    clock.now += 2  # past the first observation's grace, but it restarted
    assert await gc.sweep() == []
    assert OLD in node.engine.records


async def test_a_claim_recreated_with_a_new_uid_has_the_old_uid_collected(node):
    await prepared(node, "c", OLD)
    clock = Clock()
    gc = collector(node, clock)
    write_claim(node.claims_dir, claim("c", NEW, [result(NIC, "req")]))  # deleted and re-created
    assert await gc.sweep() == []
    clock.now += GRACE + 1
    assert await gc.sweep() == [OLD]
    assert nothing_of(node.settings, OLD)
    # The new claim prepares, and is never collected: it exists with its UID.
    assert (await node.engine.prepare([ClaimRef("default", "c", NEW)]))[NEW].error == ""
    clock.now += 10 * GRACE
    assert await gc.sweep() == [] and await gc.sweep() == []
    assert NEW in node.engine.records


async def test_a_claim_that_still_exists_is_never_collected(node):
    await prepared(node, "keep", KEEP)
    before = written_files(node.settings)
    clock = Clock()
    gc = collector(node, clock)
    for _ in range(5):
        clock.now += 10 * GRACE
        assert await gc.sweep() == []
    assert KEEP in node.engine.records and written_files(node.settings) == before


class Failing:
    """A claim source whose reads fail (the API server is down)."""

    def __init__(self) -> None:
        self.calls = 0

    async def get(self, namespace: str, name: str) -> Mapping[str, Any]:
        self.calls += 1
        raise ClaimSourceError(f"reading ResourceClaim {namespace}/{name} failed: connection refused")


async def test_a_claim_source_error_is_never_taken_for_gone(node):
    path = await prepared(node, "c", OLD)
    before = written_files(node.settings)
    source = Failing()
    clock = Clock()
    gc = collector(node, clock, source=source)
    for _ in range(5):
        clock.now += 10 * GRACE
        assert await gc.sweep() == []
    assert source.calls == 5 and gc.gone_since == {}
    assert written_files(node.settings) == before

    # An error neither collects nor resets: the clock runs only on observations of "gone".
    path.unlink()
    real = node.engine.claims
    gc.source = real
    await gc.sweep()
    started = gc.gone_since[OLD]
    gc.source = source
    clock.now += 10 * GRACE
    assert await gc.sweep() == [] and gc.gone_since == {OLD: started}
    gc.source = real
    assert await gc.sweep() == [OLD]


async def test_an_unreadable_claim_file_is_not_gone(node):
    path = await prepared(node, "c", OLD)
    path.write_text("{not yaml: [")
    clock = Clock()
    gc = collector(node, clock)
    for _ in range(3):
        clock.now += 10 * GRACE
        assert await gc.sweep() == []
    assert OLD in node.engine.records


async def test_a_claim_unprepared_by_the_kubelet_meanwhile_is_forgotten(node):
    path = await prepared(node, "c", OLD)
    clock = Clock()
    gc = collector(node, clock)
    path.unlink()
    await gc.sweep()
    assert await node.engine.unprepare_claim(ClaimRef("default", "c", OLD)) == ""
    await gc.sweep()
    assert gc.gone_since == {}


class Counting:
    """The real claim source, counting the lookups in flight at once."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = self.in_flight = self.most = 0

    async def get(self, namespace: str, name: str) -> Mapping[str, Any]:
        self.calls += 1
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(0)  # as a read that takes time would: the others start meanwhile
            return await self.inner.get(namespace, name)
        finally:
            self.in_flight -= 1


async def test_a_sweep_looks_claims_up_a_window_at_a_time(node):
    # All at once, a sweep over 10,000 prepared claims queued 10,000 reads ahead of the kubelet's
    # prepares in the worker threads, and held them all in memory.
    uids = [f"9c000000-0000-4000-8000-{i:012d}" for i in range(100, 100 + 3 * SWEEP_WINDOW + 2)]
    for i, uid in enumerate(uids):
        await prepared(node, f"c{i}", uid)
    source = Counting(node.engine.claims)
    gc = collector(node, Clock(), source=source)
    assert await gc.sweep() == []
    assert source.calls == len(uids) and source.most == SWEEP_WINDOW
    assert set(uids) <= set(node.engine.records)


def test_the_grace_period_setting_and_the_interval(tmp_path):
    assert build_settings({"state_dir": tmp_path}).gc_grace_period == 600.0
    with pytest.raises(ConfigError, match="--gc-grace-period"):
        build_settings({"state_dir": tmp_path, "gc_grace_period": -1.0})
    assert gc_interval(600) == 600 and gc_interval(40) == 40 and gc_interval(0) == 0.1


# -- in a cluster: the kubelet's pod resources service says which claims pods use -----------------------

@pytest.fixture
def kubelet(short_tmp: Path) -> Iterator[PodResourcesStandIn]:
    with PodResourcesStandIn(socket_of(short_tmp / "kubelet")) as standin:
        yield standin


async def test_a_claim_a_pod_uses_costs_no_lookup_and_one_no_pod_uses_is_looked_up_once_grace_is_over(node, kubelet):
    # Before, every sweep read every prepared claim's namespace from the API server (a LIST each, which
    # needed `list` on every namespace's claims); now only a claim no pod on the node uses is read, by itself.
    path = await prepared(node, "c", OLD)
    await prepared(node, "keep", KEEP)
    kubelet.use(("default", "keep"))
    source = Counting(node.engine.claims)
    clock = Clock()
    pods = PodResourcesClient(kubelet.socket)
    gc = collector(node, clock, source=source, pods=pods)
    try:
        assert await gc.sweep() == [] and source.calls == 0 and set(gc.gone_since) == {OLD}
        clock.now += GRACE
        assert await gc.sweep() == [] and source.calls == 0  # exactly the grace period: not yet
        clock.now += 0.5
        assert await gc.sweep() == [] and source.calls == 1  # looked up: it exists, so it stays
        assert gc.gone_since == {} and OLD in node.engine.records

        path.unlink()  # the claim deleted behind the kubelet's back
        assert await gc.sweep() == [] and source.calls == 1  # unused again: its clock starts over
        clock.now += GRACE + 1
        assert await gc.sweep() == [OLD] and source.calls == 2
        assert nothing_of(node.settings, OLD)
        for _ in range(3):
            clock.now += 10 * GRACE
            assert await gc.sweep() == []
        assert source.calls == 2 and KEEP in node.engine.records  # the claim a pod uses: never read
        assert kubelet.calls == 8  # one List a sweep
    finally:
        await pods.close()


async def test_a_claim_a_pod_uses_again_is_not_collected(node, kubelet):
    path = await prepared(node, "c", OLD)
    clock = Clock()
    pods = PodResourcesClient(kubelet.socket)
    gc = collector(node, clock, pods=pods)
    try:
        path.unlink()
        await gc.sweep()
        kubelet.use(("default", "c"))  # a pod names it again (the kubelet's cache caught up)
        clock.now += 10 * GRACE
        assert await gc.sweep() == [] and gc.gone_since == {} and OLD in node.engine.records
    finally:
        await pods.close()


async def test_without_the_kubelets_socket_nothing_is_collected_and_the_log_says_why(node, short_tmp, caplog):
    caplog.set_level(logging.INFO, logger="agent.engine.gc")
    path = await prepared(node, "c", OLD)
    path.unlink()
    socket = socket_of(short_tmp / "kubelet")
    metrics = Metrics(process=False)
    source = Counting(node.engine.claims)
    clock = Clock()
    pods = PodResourcesClient(socket)
    gc = collector(node, clock, source=source, pods=pods, metrics=metrics)
    try:
        for _ in range(4):
            clock.now += 10 * GRACE
            assert await gc.sweep() == []
        assert OLD in node.engine.records and not nothing_of(node.settings, OLD)
        assert source.calls == 0 and gc.gone_since == {}  # nothing guessed, nothing started
        assert metric(metrics.registry, "dra_agent_gc_skipped_total") == 4
        assert metric(metrics.registry, "dra_agent_gc_sweeps_total") == 0
        said = [r.getMessage() for r in caplog.records if "cannot tell which claims" in r.getMessage()]
        assert len(said) == 1, said  # once a streak
        assert f"the kubelet's pod resources socket {socket} does not exist: mount the host's " in said[0]

        with PodResourcesStandIn(socket):  # the kubelet is there now, and no pod uses the claim
            await gc.sweep()
            clock.now += GRACE + 1
            assert await gc.sweep() == [OLD]
        assert any("reads which claims the pods on this node use again" in r.getMessage() for r in caplog.records)
    finally:
        await pods.close()


async def test_a_kubelet_that_answers_an_error_is_no_answer(node, kubelet):
    path = await prepared(node, "c", OLD)
    path.unlink()
    kubelet.failure = grpc.StatusCode.INTERNAL
    clock = Clock()
    pods = PodResourcesClient(kubelet.socket)
    gc = collector(node, clock, pods=pods)
    try:
        for _ in range(3):
            clock.now += 10 * GRACE
            assert await gc.sweep() == []
        assert "did not answer List: INTERNAL" in (gc.blind or "") and OLD in node.engine.records
        kubelet.failure = None
        await gc.sweep()
        clock.now += GRACE + 1
        assert await gc.sweep() == [OLD]
    finally:
        await pods.close()


async def test_the_client_reads_what_each_pods_containers_hold(kubelet):
    # The records the device-plugin migration reads too: device-plugin IDs by resource, claims by name.
    kubelet.set_pods([Pod("team-a", "trainer", claims=(("team-a", "gpus"), ("team-a", "nic"))),
                      Pod("team-b", "legacy", plugin_devices=(("example.com/gpu", ("gpu-1", "gpu-3")),))])
    pods = PodResourcesClient(kubelet.socket)
    try:
        found = await pods.list()
    finally:
        await pods.close()
    assert [(p.namespace, p.name) for p in found.pods] == [("team-a", "trainer"), ("team-b", "legacy")]
    assert found.claims_in_use() == {ClaimName("team-a", "gpus"), ClaimName("team-a", "nic")}
    assert found.device_ids("example.com/gpu") == {"gpu-1", "gpu-3"} and found.device_ids("other/x") == set()


async def test_doctor_says_whether_the_kubelets_pod_resources_answer(short_tmp):
    settings = roots(short_tmp, offline=None)
    (line,) = await doctor.Doctor(settings).pod_resources()
    assert not line.ok and not line.blocking
    assert line.detail.startswith(f"the kubelet's pod resources socket {settings.pod_resources_socket} does not exist")
    assert "garbage collection collects nothing" in line.fix
    with PodResourcesStandIn(settings.pod_resources_socket) as standin:
        standin.use(("default", "c"))
        (line,) = await doctor.Doctor(settings).pod_resources()
    assert line.ok and line.detail == f"{settings.pod_resources_socket} answers: 1 pods, 1 claims in use " \
                                      "(what garbage collection reads)"


# -- the running agent against the API emulator --------------------------------------------------------

CLAIMS = "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims"


async def test_a_claim_deleted_from_the_api_server_is_unprepared_by_the_running_agent(
        kube_api: KubeApi, cluster_settings, agents, caplog) -> None:  # noqa: F811
    caplog.set_level(logging.INFO, logger="agent.engine.gc")
    grace = 1.0
    kube_api.add_node("node-a", uid=NODE_UID)
    kube_api.add(claim("trainer", OLD, [result("gpu-0", "gpu")], namespace="team-a"))
    kube_api.add(claim("other", KEEP, [result("gpu-1", "gpu")], namespace="team-a"))
    settings = cluster_settings(gc_grace_period=grace)
    with PodResourcesStandIn(settings.pod_resources_socket) as kubelet:
        kubelet.use(("team-a", "other"))  # a pod on the node uses it; none uses the trainer's claim any more
        agent = await start(agents, settings)
        s = agent.settings
        async with kc.DRAClient(s.dra_socket) as client:
            response = await client.prepare([ClaimRef("team-a", "trainer", OLD), ClaimRef("team-a", "other", KEEP)])
        assert all(c.error == "" for c in response.claims.values())
        assert not nothing_of(s, OLD)
        # The prepares' status writes are the claim status writer's, in the background: done before the mark,
        # so that what follows it is collection's alone (on a loaded machine they came after it).
        await eventually(lambda: metric(agent.metrics.registry, "dra_agent_claim_status_writes_total",
                                        {"result": "ok"}) == 2
                         and metric(agent.metrics.registry, "dra_agent_claim_status_queue") == 0,
                         "the prepared claims' status written")
        kube_api.mark()

        kube_api.remove(RESOURCE_CLAIMS, "trainer", "team-a")
        deleted = time.monotonic()
        await eventually(lambda: OLD not in agent.engine.records if agent.engine else None,
                         "the deleted claim is garbage-collected")
        assert time.monotonic() - deleted > grace
        # Logged once the unprepare has finished, a moment after the record left the book (the
        # record goes first, then the files): only then must nothing of the claim be left.
        await eventually(lambda: any("garbage-collected" in r.getMessage() and OLD in r.getMessage()
                                     for r in caplog.records), "the collection logged")
        assert nothing_of(s, OLD)
        assert metric(agent.metrics.registry, "dra_agent_claims_garbage_collected_total") == 1
        # The claim a pod uses stays prepared: two whole sweeps later (the one under way may have looked
        # before now) it is, whereas those sweeps found the other unused and gone, and collected it.
        sweeps = metric(agent.metrics.registry, "dra_agent_gc_sweeps_total")
        assert sweeps is not None
        await until(lambda: metric(agent.metrics.registry, "dra_agent_gc_sweeps_total") >= sweeps + 2,
                    "two more sweeps")
        assert KEEP in agent.engine.records and not nothing_of(s, KEEP)
        assert metric(agent.metrics.registry, "dra_agent_claims_garbage_collected_total") == 1
        assert kubelet.calls >= sweeps + 2
    # What collection asked of the API server: the deleted claim by itself (the first lookup found it gone,
    # the last look before the unprepare too; its status write), never a list of a namespace's claims, never
    # the claim a pod uses.
    reads = [(e.method, e.path) for e in kube_api.since_mark() if e.path.startswith(CLAIMS)]
    assert ("GET", CLAIMS) not in reads, reads
    assert {p for _, p in reads} <= {f"{CLAIMS}/trainer", f"{CLAIMS}/trainer/status"}, reads


async def test_a_lookup_that_fails_is_no_answer_and_collection_waits_for_one(
        kube_api: KubeApi, cluster_settings, agents) -> None:  # noqa: F811
    # The one GET of a claim no pod uses, refused (403, no retry): no answer, however long it lasts.
    grace = 0.3
    kube_api.add_node("node-a", uid=NODE_UID)
    kube_api.add(claim("trainer", OLD, [result("gpu-0", "gpu")], namespace="team-a"))
    settings = cluster_settings(gc_grace_period=grace)
    with PodResourcesStandIn(settings.pod_resources_socket):
        agent = await start(agents, settings)
        async with kc.DRAClient(agent.settings.dra_socket) as client:
            response = await client.prepare([ClaimRef("team-a", "trainer", OLD)])
        assert all(c.error == "" for c in response.claims.values())
        refused = kube_api.fail("GET", f"{CLAIMS}/trainer", times=1 << 30, status=403)
        kube_api.remove(RESOURCE_CLAIMS, "trainer", "team-a")
        await until(lambda: refused.hits >= 3, "three lookups refused")
        assert agent.engine is not None and OLD in agent.engine.records
        assert not nothing_of(agent.settings, OLD)

        kube_api.emulator.faults.remove(refused)  # the claim can be read again: now it is gone
        await eventually(lambda: OLD not in agent.engine.records if agent.engine else None,
                         "the deleted claim is garbage-collected")
        # Counted once the unprepare has finished, a moment after the record left the book.
        await eventually(lambda: metric(agent.metrics.registry, "dra_agent_claims_garbage_collected_total") == 1,
                         "the collection counted")


async def test_an_agent_fallen_back_offline_collects_no_claim_prepared_online(
        kube_api: KubeApi, cluster_settings, agents, short_tmp: Path, caplog) -> None:  # noqa: F811
    # `--offline-fallback` (what `make run` uses): a claim prepared while the API server answered is
    # not in the offline directory, and the agent cannot tell where a record's claim came from. When
    # the API server is away at the next start, not finding it there must not collect it.
    caplog.set_level(logging.INFO, logger="agent")
    grace = 0.0
    fallback = short_tmp / "fallback"
    kube_api.add_node("node-a", uid=NODE_UID)
    kube_api.add(claim("trainer", OLD, [result("gpu-0", "gpu")], namespace="team-a"))
    online = await start(agents, cluster_settings(gc_grace_period=grace, offline_fallback=fallback))
    assert online.conn is not None and online.conn.offline is None
    assert collectors() == 1  # online, claims are collected (the observation below sees a collector)
    async with kc.DRAClient(online.settings.dra_socket) as client:
        response = await client.prepare([ClaimRef("team-a", "trainer", OLD)])
    assert all(c.error == "" for c in response.claims.values())
    await online.stop()
    agents.remove(online)

    dead = write_kubeconfig(short_tmp / "dead-kubeconfig", "http://127.0.0.1:1")  # nothing listens there
    offline = await start(agents, cluster_settings(gc_grace_period=grace, offline_fallback=fallback,
                                                   kubeconfig=dead))
    assert offline.conn is not None and offline.conn.offline == fallback
    await eventually(lambda: offline.recovered.is_set(), "the start-up check done")
    # The start decided: no collector runs in this agent, so none will ever collect the claim.
    assert collectors() == 0
    assert any("garbage collection is off" in r.getMessage() for r in caplog.records)
    assert offline.engine is not None and OLD in offline.engine.records
    assert not nothing_of(offline.settings, OLD)
    assert metric(offline.metrics.registry, "dra_agent_claims_garbage_collected_total") == 0
    assert metric(offline.metrics.registry, "dra_agent_gc_sweeps_total") == 0
