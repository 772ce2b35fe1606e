"""The kubelet's view (docs/contract.md §1-3): a kubelet stand-in over the agent's real unix sockets."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pynvml
import pytest
from agentkit import DRIVER, NODE, StaticSource, claim, make_node, nic, result, roots, write_claim
from test_agent_cluster import published

from agent.app.daemon import Agent
from agent.config import build_settings
from agent.engine.prepare import CLAIM_WORKERS
from agent.kubelet import client as kc
from agent.kubelet.health import HealthTracker
from agent.kubelet.server import Servers
from agent.names import ClaimRef

UID1 = "4c2d8e00-0000-4000-8000-000000000001"
UID2 = "4c2d8e00-0000-4000-8000-000000000002"


@pytest.fixture
async def agent(short_tmp):
    settings = roots(short_tmp, rescan_interval=3600.0)
    a = Agent(settings)
    await a.start()
    yield a
    await a.stop()


def claims_dir(agent):
    return agent.settings.offline / "resourceclaims"


async def test_get_info_answers_like_the_kubelet_expects(agent):
    info = await kc.get_info(agent.settings.registration_socket)
    assert info.type == "DRAPlugin"
    assert info.name == DRIVER
    assert info.endpoint == str(agent.settings.dra_socket) and os.path.isabs(info.endpoint)
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth",
                                             "v1alpha1.DRAResourceHealth"]


async def call(socket, version):
    """One call to the service `version` names ("v1.DRAPlugin"), as the kubelet would make it."""
    api, _, service = version.partition(".")
    if service == "DRAPlugin":
        async with kc.DRAClient(socket, api) as client:
            response = await client.prepare([])
        assert dict(response.claims) == {}
    elif service == "DRAResourceHealth":
        stream = kc.watch_health(socket, api)
        try:
            first = await asyncio.wait_for(anext(stream), 10)
        finally:
            await stream.aclose()
        assert first.devices
    else:
        raise AssertionError(f"GetInfo lists {version}, a service this test does not know how to call")


async def test_every_service_get_info_lists_answers(agent):
    info = await kc.get_info(agent.settings.registration_socket)
    assert info.supported_versions
    for version in info.supported_versions:
        await call(agent.settings.dra_socket, version)


@pytest.mark.parametrize("health", [True, False], ids=["with-health", "without-health"])
async def test_get_info_lists_exactly_what_the_dra_socket_serves(short_tmp, health):
    """A listed health service that answered Unimplemented would make the kubelet stop watching for
    good; one served but not listed would never be watched."""
    node = await make_node(short_tmp)
    tracker = HealthTracker(pool=NODE)
    await tracker.update(node.inventory.snapshot())
    servers = Servers(node.settings, health=health)
    with pytest.raises(RuntimeError, match="health"):
        servers.attach(node.engine, None if health else tracker)
    servers.attach(node.engine, tracker if health else None)
    await servers.start_registration()
    await servers.start_dra()
    try:
        info = await kc.get_info(node.settings.registration_socket)
        listed = list(info.supported_versions)
        assert listed == ["v1.DRAPlugin", "v1beta1.DRAPlugin",
                          *(["v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"] if health else [])]
        for version in listed:
            await call(node.settings.dra_socket, version)
        for version in ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"):
            if version not in listed:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(node.settings.dra_socket, version)
                assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await servers.stop(grace=0)
        node.inventory.close()


async def test_sockets_are_0600_at_the_contract_paths(agent):
    s = agent.settings
    assert s.dra_socket == s.kubelet_dir / "plugins" / DRIVER / "dra.sock"
    assert s.registration_socket == s.kubelet_dir / "plugins_registry" / f"{DRIVER}-reg.sock"
    for path in (s.dra_socket, s.registration_socket):
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600


@pytest.mark.parametrize("api", ["v1", "v1beta1"])
async def test_prepare_and_unprepare_over_both_api_versions(agent, api):
    write_claim(claims_dir(agent), claim("c", UID1, [result("gpu-0", "gpu/fast", shareID="ab12")]))
    ref = ClaimRef("default", "c", UID1)
    async with kc.DRAClient(agent.settings.dra_socket, api) as client:
        response = await client.prepare([ref])
        entry = response.claims[UID1]
        assert entry.error == ""
        (dev,) = entry.devices
        assert list(dev.request_names) == ["gpu"]  # the base request name
        assert dev.pool_name == NODE and dev.device_name == "gpu-0"
        assert list(dev.cdi_device_ids) == [f"{DRIVER}/claim={UID1}-gpu-0", f"{DRIVER}/metadata={UID1}_gpu"]
        if api == "v1":
            assert dev.HasField("share_id") and dev.share_id == "ab12"
        assert (agent.settings.cdi_dir / f"{DRIVER}-claim_{UID1}.json").exists()
        un = await client.unprepare([ref])
        assert dict(un.claims) .keys() == {UID1} and un.claims[UID1].error == ""
        assert not (agent.settings.cdi_dir / f"{DRIVER}-claim_{UID1}.json").exists()


async def test_one_entry_per_claim_and_errors_are_per_claim(agent):
    write_claim(claims_dir(agent), claim("good", UID1, [result("gpu-1")]))
    async with kc.DRAClient(agent.settings.dra_socket) as client:
        response = await client.prepare([ClaimRef("default", "good", UID1), ClaimRef("default", "nope", UID2)])
    assert set(response.claims) == {UID1, UID2}
    assert response.claims[UID1].error == "" and len(response.claims[UID1].devices) == 1
    assert "not found" in response.claims[UID2].error and not response.claims[UID2].devices


async def test_get_info_answers_within_the_kubelets_1s_while_50_prepares_are_in_flight(agent):
    source = agent.engine.claims
    real_read = source.read
    reading = threading.Semaphore(0)
    go_on = threading.Event()

    def slow_read(namespace, name):  # a claim source that takes its time, in the worker threads
        reading.release()
        assert go_on.wait(60), "never let go"
        return real_read(namespace, name)

    source.read = slow_read
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=64))
    refs = []
    for i in range(50):
        uid = f"4c2d8e00-0000-4000-8000-{i:012d}"
        write_claim(claims_dir(agent), claim(f"c{i}", uid, [result(f"gpu-{i % 8}")]))
        refs.append(ClaimRef("default", f"c{i}", uid))
    async with kc.DRAClient(agent.settings.dra_socket) as client:
        calls = [asyncio.create_task(client.prepare([r])) for r in refs]
        try:
            # As many prepares as run at once are in the agent's worker threads, reading their claims; the
            # others wait for a thread.
            for _ in range(min(len(refs), CLAIM_WORKERS)):
                assert await asyncio.to_thread(reading.acquire, True, 60), "the prepares did not start"
            for _ in range(5):
                info = await kc.get_info(agent.settings.registration_socket, timeout=kc.GET_INFO_TIMEOUT)
                assert info.name == DRIVER
            assert not any(c.done() for c in calls)
        finally:
            go_on.set()
        responses = await asyncio.gather(*calls)
    assert all(r.claims[ref.uid].error == "" for r, ref in zip(responses, refs, strict=True))


@pytest.mark.parametrize("api", ["v1", "v1alpha1"])
async def test_health_stream_sends_the_full_list_then_changes(agent, api):
    stream = kc.watch_health(agent.settings.dra_socket, api)
    first = await anext(stream)
    devices = {d.device.device_name: d for d in first.devices}
    assert set(devices) == set(agent.inventory.snapshot().devices)
    assert {d.device.pool_name for d in first.devices} == {NODE}
    assert all(d.health == 1 and d.message == "" for d in first.devices)  # HEALTHY
    assert all(d.health_check_timeout_seconds > 0 and abs(d.last_updated_time - time.time()) < 60
               for d in first.devices)

    gpus = next(s for s in agent.inventory.sources if s.kind == "gpu")
    gpus.nvml.inject_error(2, "nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_GPU_IS_LOST)
    assert await agent.rescan(["gpu"])
    second = await asyncio.wait_for(anext(stream), 10)
    by_name = {d.device.device_name: d for d in second.devices}
    assert len(by_name) == len(devices)  # still the complete list
    assert by_name["gpu-2"].health == 2  # UNHEALTHY
    assert "lost" in by_name["gpu-2"].message.lower()
    assert by_name["gpu-3"].health == 1
    await stream.aclose()


async def test_health_stream_repeats_the_list_without_changes(agent):
    agent.tracker.interval = 0.3
    stream = kc.watch_health(agent.settings.dra_socket)
    a = await anext(stream)
    b = await asyncio.wait_for(anext(stream), 10)
    assert [d.device.device_name for d in a.devices] == [d.device.device_name for d in b.devices]
    await stream.aclose()


async def test_registration_rejection_is_recorded_and_logged_loudly(agent, caplog):
    await kc.notify_registration(agent.settings.registration_socket, False, "version mismatch")
    state = agent.servers.registration_state
    assert state.registered is False and state.error == "version mismatch"
    assert any(r.levelname == "ERROR" and "version mismatch" in r.getMessage() for r in caplog.records)
    await kc.notify_registration(agent.settings.registration_socket, True)
    assert state.registered is True


async def test_stale_socket_is_replaced_but_other_files_are_not(short_tmp):
    settings = roots(short_tmp)
    settings.dra_socket.parent.mkdir(parents=True)
    import socket as sk

    stale = sk.socket(sk.AF_UNIX)
    stale.bind(str(settings.dra_socket))
    stale.close()  # a socket file nobody listens on: left by a crashed agent
    a = Agent(settings)
    await a.start()
    try:
        info = await kc.get_info(settings.registration_socket)
        assert info.endpoint == str(settings.dra_socket)
        async with kc.DRAClient(settings.dra_socket) as client:
            assert (await client.unprepare([ClaimRef("default", "x", UID1)])).claims[UID1].error == ""
    finally:
        await a.stop()
    assert not settings.dra_socket.exists() and not settings.registration_socket.exists()

    settings.registration_socket.parent.mkdir(parents=True, exist_ok=True)
    settings.registration_socket.write_text("not a socket")
    b = Agent(settings)
    with pytest.raises(RuntimeError, match="not a socket"):
        await b.start()
    await b.stop()
    assert settings.registration_socket.read_text() == "not a socket"


def test_sigterm_stops_cleanly_and_removes_the_sockets(short_tmp):
    settings = roots(short_tmp)
    env = dict(os.environ, DRA_LOG_FORMAT="json")
    args = [sys.executable, "-m", "agent", "run", "--driver-name", DRIVER, "--node-name", NODE, "--nvml", "sim",
            "--kubelet-dir", str(settings.kubelet_dir), "--cdi-dir", str(settings.cdi_dir),
            "--state-dir", str(settings.state_dir), "--offline", str(settings.offline)]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not settings.registration_socket.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        info = asyncio.run(kc.get_info(settings.registration_socket))
        assert info.name == DRIVER
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert not settings.dra_socket.exists() and not settings.registration_socket.exists()
    assert "stopping" in err


def test_rolling_update_socket_names(short_tmp):
    uid = "8f3c6a1e-1b2c-4d5e-8f90-0123456789ab"
    s = build_settings({"kubelet_dir": short_tmp, "rolling_update_pod_uid": uid})
    assert s.dra_socket == short_tmp / "plugins" / "dra.example.com" / f"dra-{uid}.sock"
    assert s.registration_socket == short_tmp / "plugins_registry" / f"dra.example.com-{uid}-reg.sock"
    deep = short_tmp / ("d" * 24)
    s = build_settings({"kubelet_dir": deep, "rolling_update_pod_uid": uid})
    for path in (s.dra_socket, s.registration_socket):
        assert len(os.fsencode(str(path))) < 108
        assert uid not in path.name  # hashed to fit
    assert s.dra_socket != build_settings({"kubelet_dir": deep, "rolling_update_pod_uid": uid + "x"}).dra_socket


async def test_two_agents_of_a_rolling_update_serve_side_by_side(short_tmp):
    a = Agent(roots(short_tmp, rolling_update_pod_uid="11111111-aaaa-4aaa-8aaa-111111111111"))
    b = Agent(roots(short_tmp, rolling_update_pod_uid="22222222-bbbb-4bbb-8bbb-222222222222"))
    await a.start()
    await b.start()
    try:
        ia = await kc.get_info(a.settings.registration_socket)
        ib = await kc.get_info(b.settings.registration_socket)
        assert ia.endpoint == str(a.settings.dra_socket) != ib.endpoint == str(b.settings.dra_socket)
    finally:
        await b.stop()
        assert a.settings.dra_socket.exists()  # b removes only its own sockets
        await a.stop()


async def test_unreachable_socket_fails_fast_with_unavailable(tmp_path):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kc.get_info(tmp_path / "nothing.sock")
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class GatedPublisher:
    """The agent's publisher, held at the gate while `open` is clear (an API server that does not answer)."""

    def __init__(self, publisher):
        self.publisher = publisher
        self.open = asyncio.Event()
        self.open.set()

    async def sync(self, devices):
        await self.open.wait()
        return await self.publisher.sync(devices)

    async def close(self):
        await self.publisher.close()


async def test_a_device_gone_from_discovery_is_reported_until_the_published_pool_drops_it(
        short_tmp, agents, monkeypatch):
    a, b = nic("nic-a", "ens1f0", "02:00:00:00:00:01"), nic("nic-b", "ens1f1", "02:00:00:00:00:02")
    source = StaticSource("nic", [a, b])
    monkeypatch.setattr("agent.app.daemon.build_sources", lambda s: [source])
    agent = Agent(roots(short_tmp, rescan_interval=3600.0))
    agents.append(agent)
    await agent.start()
    await published(agent)
    gate = GatedPublisher(agent.publish.publisher)
    agent.publish.publisher = gate
    agent.tracker.interval = 0.2  # resent often, so the test sees many reports
    stream = kc.watch_health(agent.settings.dra_socket)

    async def report():
        response = await asyncio.wait_for(anext(stream), 10)
        return {d.device.device_name: (d.health, d.message) for d in response.devices}

    assert await report() == {"nic-a": (1, ""), "nic-b": (1, "")}
    gate.open.clear()
    source.devices = [a]  # nic-b unplugged; the pool without it is not published yet
    assert await agent.inventory.scan(["nic"])
    await agent._changed()
    for _ in range(5):
        assert await report() == {"nic-a": (1, ""), "nic-b": (2, "device is no longer found on this node")}
    gate.open.set()
    await asyncio.wait_for(agent.publish.wait_published(), 10)
    for _ in range(3):  # a report already on its way may still hold it
        if (latest := await report()) == {"nic-a": (1, "")}:
            break
    assert latest == {"nic-a": (1, "")}
    await stream.aclose()
