"""Metrics and probes over HTTP from a running in-process agent (`--metrics-address`)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import os
import platform
import socket
import stat
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import pytest
import yaml
from agentkit import DRIVER, REPO, claim, result, roots, write_claim
from prometheus_client.parser import text_string_to_metric_families

from agent import __version__
from agent.app import httpserver
from agent.app.daemon import Agent
from agent.config import DEFAULT_METRICS_ADDRESS, OPTIONS, ConfigError, build_settings, settings_from
from agent.inventory.netwatch import NetEvent
from agent.kubelet import client as kc
from agent.names import ClaimRef

UID1 = "6a1e0c00-0000-4000-8000-000000000001"
UID2 = "6a1e0c00-0000-4000-8000-000000000002"
ORPHAN = "6a1e0c00-0000-4000-8000-0000000000ff"
WAIT = 30.0


async def eventually(probe: Callable[[], Any], what: str, limit: float = WAIT) -> Any:
    deadline = time.monotonic() + limit
    while True:
        if value := await probe():
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {limit:g} s")
        await asyncio.sleep(0.05)


@pytest.fixture
async def started(short_tmp) -> AsyncIterator[Callable[..., Any]]:
    agents: list[Agent] = []

    async def start(**overrides: Any) -> Agent:
        values: dict[str, Any] = {"rescan_interval": 3600.0, "metrics_address": "127.0.0.1:0"}
        values.update(overrides)
        agent = Agent(roots(short_tmp, **values))
        agents.append(agent)
        await agent.start()
        return agent

    yield start
    for agent in agents:
        await agent.stop()


@pytest.fixture
async def http() -> AsyncIterator[httpx2.AsyncClient]:
    async with httpx2.AsyncClient(timeout=10, trust_env=False) as client:
        yield client


async def scrape(http: httpx2.AsyncClient, agent: Agent) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    assert agent.http is not None
    response = await http.get(f"{agent.http.url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[name, tuple(sorted(labels.items()))]


async def test_metrics_after_prepare_and_probes(started, http):
    agent = await started()
    assert agent.http is not None
    url = agent.http.url
    claims = agent.settings.offline / "resourceclaims"
    write_claim(claims, claim("one", UID1, [result("gpu-0")]))

    health = await http.get(f"{url}/healthz")
    assert health.status_code == 200, health.text
    assert "[+]registration-server ok" in health.text and "[+]dra-server ok" in health.text

    async def is_ready() -> httpx2.Response | None:
        r = await http.get(f"{url}/readyz")
        return r if r.status_code == 200 else None

    # Offline, no kubelet has registered the plugin yet: ready once the slices are written, and it says
    # so (in a cluster readiness waits for the kubelet: test_agent_cluster.py).
    ready = await eventually(is_ready, "/readyz answers 200")
    assert "[+]kubelet-registration ok: offline: no kubelet has registered the plugin" in ready.text
    assert "[+]slices ok: " in ready.text

    await kc.notify_registration(agent.settings.registration_socket, True)
    ready = await eventually(is_ready, "/readyz answers 200")
    assert "[+]kubelet-registration ok: the kubelet registered the plugin" in ready.text
    assert "[+]slices ok: " in ready.text
    await kc.notify_registration(agent.settings.registration_socket, False, "no such driver here")
    rejected = await http.get(f"{url}/readyz")  # a kubelet that says no is heard offline too
    assert rejected.status_code == 503
    assert "[-]kubelet-registration failed: the kubelet rejected the plugin: no such driver here" in rejected.text
    await kc.notify_registration(agent.settings.registration_socket, True)

    async with kc.DRAClient(agent.settings.dra_socket) as client:
        prepared = await client.prepare([ClaimRef("default", "one", UID1)])
        assert prepared.claims[UID1].error == ""
        missing = await client.prepare([ClaimRef("default", "missing", UID2)])
        assert missing.claims[UID2].error
        stream = kc.watch_health(agent.settings.dra_socket)
        await anext(stream)  # the kubelet holds one health stream open
        samples = await scrape(http, agent)
        await stream.aclose()

    assert value(samples, "dra_agent_claim_operations_total", operation="prepare", result="success") == 1
    assert value(samples, "dra_agent_claim_operations_total", operation="prepare", result="error") == 1
    assert value(samples, "dra_agent_claim_operations_total", operation="unprepare", result="success") == 0
    assert value(samples, "dra_agent_claim_operation_duration_seconds_count", operation="prepare") == 2
    assert value(samples, "dra_agent_claim_operations_in_flight", operation="prepare") == 0
    assert value(samples, "dra_agent_prepared_claims") == 1
    assert value(samples, "dra_agent_prepared_devices") == 1
    # The DRA socket's calls in go-grpc-prometheus's names: three prepare calls (/healthz's empty one, and two
    # claims': a claim's error is in the answer, the call is OK), the health stream open.
    dra = {"grpc_type": "unary", "grpc_service": "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
           "grpc_method": "NodePrepareResources"}
    assert value(samples, "grpc_server_started_total", **dra) == 3
    assert value(samples, "grpc_server_handled_total", **dra, grpc_code="OK") == 3
    assert value(samples, "grpc_server_handling_seconds_count", **dra) == 3
    stream = {"grpc_type": "server_stream", "grpc_service": "v1.DRAResourceHealth", "grpc_method": "NodeWatchResources"}
    assert value(samples, "grpc_server_started_total", **stream) == 1
    assert ("grpc_server_handled_total", tuple(sorted({**stream, "grpc_code": "Canceled"}.items()))) not in samples
    assert value(samples, "dra_agent_devices", kind="gpu", health="HEALTHY") == 8
    assert value(samples, "dra_agent_devices", kind="gpu", health="UNHEALTHY") == 0
    assert value(samples, "dra_agent_discovery_scans_total", kind="gpu", result="success") >= 1
    assert value(samples, "dra_agent_discovery_scan_duration_seconds_count", kind="gpu") >= 1
    assert value(samples, "dra_agent_publish_syncs_total", result="success") >= 1
    assert value(samples, "dra_agent_slice_writes_total", action="create") >= 1
    assert value(samples, "dra_agent_published_devices") == len(agent.inventory.devices())
    assert value(samples, "dra_agent_published_slices") >= 1
    assert value(samples, "dra_agent_publish_up_to_date") == 1
    assert value(samples, "dra_agent_publish_last_success_timestamp_seconds") > 0
    assert value(samples, "dra_agent_kubelet_registered") == 1
    assert value(samples, "dra_agent_health_watchers") == 1
    for action in ("repaired", "removed", "quarantined"):
        assert value(samples, "dra_agent_recovery_actions_total", action=action) == 0
    # The version an alert or a dashboard groups nodes by: the agent's one (`dra-agent --version`, the image's
    # org.opencontainers.image.version label, pyproject's version through importlib.metadata).
    assert value(samples, "dra_agent_build_info", version=__version__, python=platform.python_version()) == 1
    assert __version__ == importlib.metadata.version("dra-agent")
    assert value(samples, "process_resident_memory_bytes") > 0

    async with kc.DRAClient(agent.settings.dra_socket) as client:
        await client.unprepare([ClaimRef("default", "one", UID1)])
    samples = await scrape(http, agent)
    assert value(samples, "dra_agent_claim_operations_total", operation="unprepare", result="success") == 1
    assert value(samples, "dra_agent_prepared_claims") == 0 and value(samples, "dra_agent_prepared_devices") == 0
    assert value(samples, "dra_agent_health_watchers") == 0
    assert value(samples, "grpc_server_handled_total", **stream, grpc_code="Canceled") == 1  # the kubelet hung up
    assert value(samples, "grpc_server_handled_total", grpc_type="unary", grpc_code="OK",
                 grpc_service="k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin", grpc_method="NodeUnprepareResources") == 1


async def test_recovery_counts_what_the_start_removed(started, http, short_tmp):
    settings = roots(short_tmp)
    settings.cdi_dir.mkdir(parents=True)
    (settings.cdi_dir / f"{DRIVER}-claim_{ORPHAN}.json").write_text("{}")  # no record owns it
    agent = await started()
    # Orphans are removed in the background once every record is checked (the sockets open before).
    await asyncio.wait_for(agent.recovered.wait(), 30)
    samples = await scrape(http, agent)
    assert value(samples, "dra_agent_recovery_actions_total", action="removed") == 1
    assert value(samples, "dra_agent_recovery_actions_total", action="quarantined") == 0


async def test_healthz_fails_when_a_grpc_server_does_not_answer(started, http):
    agent = await started()
    assert agent.servers is not None and agent.http is not None
    await agent.servers.dra.stop(0)
    response = await http.get(f"{agent.http.url}/healthz")
    assert response.status_code == 503
    assert "[+]registration-server ok" in response.text
    assert "[-]dra-server failed: UNAVAILABLE" in response.text
    assert response.text.endswith("healthz check failed\n")


async def test_http_details(started, http):
    agent = await started()
    assert agent.http is not None
    url = agent.http.url
    assert (await http.get(f"{url}/nothing")).status_code == 404
    assert (await http.post(f"{url}/metrics")).status_code == 405
    head = await http.head(f"{url}/metrics")
    assert head.status_code == 200 and head.content == b""
    om = await http.get(f"{url}/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.endswith("# EOF\n")
    zipped = await http.get(f"{url}/metrics", headers={"Accept-Encoding": "gzip"})
    assert zipped.headers.get("content-encoding") == "gzip" and "dra_agent_prepared_claims" in zipped.text
    # A client that sends nothing useful is answered and dropped, and the server keeps serving.
    reader, writer = await asyncio.open_connection(*agent.http.addresses[0])
    writer.write(b"garbage\r\n\r\n")
    assert (await reader.read()).startswith(b"HTTP/1.1 400 ")
    writer.close()
    assert (await http.get(f"{url}/healthz")).status_code == 200


async def test_a_taken_port_does_not_stop_the_agent(started, http, monkeypatch):
    """During a rolling update the old agent holds the port until it exits: the new one starts anyway
    and takes the port when it is free."""
    monkeypatch.setattr(httpserver, "REBIND_INTERVAL", 0.05)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]
    agent = await started(metrics_address=f"127.0.0.1:{port}")
    assert agent.http is not None and not agent.http.bound.is_set()
    info = await kc.get_info(agent.settings.registration_socket)  # the agent serves the kubelet meanwhile
    assert info.name == DRIVER
    blocker.close()
    await asyncio.wait_for(agent.http.bound.wait(), WAIT)
    assert (await http.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200


class ScriptedNetlink:
    """The daemon's netlink watcher, delivering three events and then none."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    async def start(self) -> None:
        pass

    async def events(self) -> AsyncIterator[NetEvent]:
        for kind in ("link-changed", "link-changed", "address-added"):
            yield NetEvent(kind)
        await asyncio.Event().wait()

    async def close(self) -> None:
        pass


async def test_netlink_events_are_counted_by_kind(started, http, monkeypatch):
    monkeypatch.setattr("agent.inventory.netwatch.NetlinkWatcher", ScriptedNetlink)
    agent = await started()

    async def counted() -> Any:
        samples = await scrape(http, agent)
        return samples.get(("dra_agent_netlink_events_total", (("kind", "address-added"),)))

    await eventually(counted, "the address event counted")
    samples = await scrape(http, agent)
    assert samples[("dra_agent_netlink_events_total", (("kind", "link-changed"),))] == 2
    assert samples[("dra_agent_netlink_events_total", (("kind", "address-added"),))] == 1


def test_metrics_address_setting():
    (opt,) = [o for o in OPTIONS if o.dest == "metrics_address"]
    assert opt.default == DEFAULT_METRICS_ADDRESS == ":9477"
    assert settings_from(env={}).metrics_endpoint == (None, 9477)
    assert settings_from(env={"DRA_METRICS_ADDRESS": ""}).metrics_endpoint is None  # empty: off
    assert settings_from(env={"DRA_METRICS_ADDRESS": "127.0.0.1:0"}).metrics_endpoint == ("127.0.0.1", 0)
    assert build_settings({"metrics_address": "[::1]:9477"}).metrics_endpoint == ("::1", 9477)
    for bad in ("9477", "host:port", ":70000", "::1:9477"):
        with pytest.raises(ConfigError, match="--metrics-address"):
            build_settings({"metrics_address": bad})


async def two_claims_prepared_then_stopped(started, short_tmp: Path):  # type: ignore[no-untyped-def]
    """An agent that prepared claims one (gpu-0) and two (gpu-1), stopped: their records are on disk."""
    write_claim(roots(short_tmp).offline / "resourceclaims", claim("one", UID1, [result("gpu-0")]))
    write_claim(roots(short_tmp).offline / "resourceclaims", claim("two", UID2, [result("gpu-1")]))
    first = await started()
    async with kc.DRAClient(first.settings.dra_socket) as client:
        answer = await client.prepare([ClaimRef("default", "one", UID1), ClaimRef("default", "two", UID2)])
    assert not answer.claims[UID1].error and not answer.claims[UID2].error
    await first.stop()
    return first


async def test_an_unreadable_record_is_counted_and_shown_by_readyz_offline(started, http, short_tmp, caplog):
    """Set aside at start-up and while running: counted each time, named on /readyz (which stays ready),
    and offline the log says that no Event is posted (there is no API server to hold one)."""
    first = await two_claims_prepared_then_stopped(started, short_tmp)
    records = first.settings.claims_state_dir
    for uid in (UID1, UID2):
        path = records / f"{uid}.rec"
        path.write_bytes(path.read_bytes()[:-10])  # torn: the checksum no longer matches

    agent = await started()
    await asyncio.wait_for(agent.recovered.wait(), WAIT)
    assert agent.http is not None
    samples = await scrape(http, agent)
    assert value(samples, "dra_agent_records_quarantined_total") == 2
    assert value(samples, "dra_agent_recovery_actions_total", action="quarantined") == 2
    ready = await http.get(f"{agent.http.url}/readyz")
    line = next(x for x in ready.text.splitlines() if "claim-records" in x)
    assert line.startswith("[+]claim-records ok: 2 claim records set aside since the start, unreadable"), line
    assert f"{records / UID1}.rec.corrupt" in line and f"{records / UID2}.rec.corrupt" in line
    offline = [r.getMessage() for r in caplog.records if "no Event is posted" in r.getMessage()]
    assert len(offline) == 2 and all("offline" in m for m in offline), offline

    # While running: prepared again, its record torn, the next operation on it sets it aside.
    async with kc.DRAClient(agent.settings.dra_socket) as client:
        assert not (await client.prepare([ClaimRef("default", "one", UID1)])).claims[UID1].error
        path = records / f"{UID1}.rec"
        path.write_bytes(b"DRAREC 1 0 0\n")
        assert (await client.unprepare([ClaimRef("default", "one", UID1)])).claims[UID1].error == ""
    samples = await scrape(http, agent)
    assert value(samples, "dra_agent_records_quarantined_total") == 3
    assert value(samples, "dra_agent_recovery_actions_total", action="quarantined") == 2  # start-up only
    assert "3 claim records set aside" in (await http.get(f"{agent.http.url}/readyz")).text


async def test_a_record_whose_metadata_is_not_json_is_set_aside_and_named_while_the_start_up_goes_on(
        started, http, short_tmp, caplog):
    """Before, its check raised and the start-up task died ("background task recover died"): no later record
    was checked, orphans stayed, the claims' metadata was never refreshed, and /healthz and /readyz still
    answered 200 saying nothing of it. Now the record is set aside, named by /readyz, and the start goes on."""
    from agent.claims.records import FileRecord, FileRole, encode
    from agent.claims.store import ClaimStore

    first = await two_claims_prepared_then_stopped(started, short_tmp)
    records = first.settings.claims_state_dir
    found = ClaimStore(records).read(UID1)
    assert found is not None
    record = found[0]
    record.files = [FileRecord(f.path, b"{not json", f.mode, f.role, f.request) if f.role is FileRole.METADATA_FILE
                    else f for f in record.files]
    (records / f"{UID1}.rec").write_bytes(encode(record))  # framed as the agent frames it: checksum valid

    agent = await started()
    await asyncio.wait_for(agent.recovered.wait(), WAIT)
    await asyncio.wait_for(agent.refreshed.wait(), WAIT)
    assert not [r for r in caplog.records if "died" in r.getMessage()]
    assert agent.http is not None
    ready = await http.get(f"{agent.http.url}/readyz")
    line = next(x for x in ready.text.splitlines() if "claim-records" in x)
    assert line.startswith("[+]claim-records ok: 1 claim records set aside") and f"{records / UID1}.rec.corrupt" in line
    assert set(agent.engine.records) == {UID2}
    assert all(Path(f.path).read_bytes() == f.content for f in agent.engine.whole_record(UID2).files)  # type: ignore[union-attr]


# -- the probe listener and the metrics listener (docs/security.md) -----------------------------------

async def hold(address: tuple[str, int], count: int, partial: bool) -> list[asyncio.StreamWriter]:
    """`count` connections held open: idle, or sending half a request head (slowloris)."""
    writers = []
    for _ in range(count):
        try:
            _, writer = await asyncio.open_connection(*address)
        except OSError:
            continue  # the listener's backlog is full: as good as held
        if partial:
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        writers.append(writer)
    return writers


async def test_connections_held_on_the_metrics_listener_never_delay_a_probe(started, http):
    """Any pod that reaches the node's address may open connections to the metrics listener and hold them:
    200 idle and partial ones, and the probes still answer within the liveness probe's timeout, /metrics
    past the cap takes the place of a held connection rather than queue, and the agent prepares a claim
    meanwhile. (With one listener for both, as before, /healthz waited behind 48 such connections for 29.5 s.)"""
    agent = await started(probe_address="127.0.0.1:0")
    assert agent.http is not None and agent.metrics_http is not None
    held = await hold(agent.metrics_http.addresses[0], 100, partial=False)
    held += await hold(agent.metrics_http.addresses[0], 100, partial=True)
    try:
        async with asyncio.timeout(5.0):  # the DaemonSet's livenessProbe.timeoutSeconds
            for path in ("/healthz", "/readyz"):
                assert (await http.get(f"{agent.http.url}{path}")).status_code in (200, 503)
        # Past the cap: it takes the place of the oldest connection that has not sent its request, and is
        # answered; none is queued.
        assert await ask(agent.metrics_http.addresses[0], "/metrics") == 200
        assert agent.metrics_http.replaced > 0 and agent.metrics_http.refused == 0
        write_claim(agent.settings.offline / "resourceclaims",
                    claim("held", UID1, [result("gpu-0", "gpu", driver=agent.settings.driver_name)]))
        async with kc.DRAClient(agent.settings.dra_socket) as client:
            out = await client.prepare([ClaimRef("default", "held", UID1)])
        assert out.claims[UID1].error == ""
    finally:
        for writer in held:
            writer.close()
    # The held connections gone (closed, or timed out waiting for their heads), /metrics answers again.
    async def scraped() -> bool:
        with contextlib.suppress(httpx2.HTTPError):
            return (await http.get(f"{agent.metrics_http.url}/metrics")).status_code == 200
        return False
    await eventually(scraped, "/metrics answers once the held connections are gone")


async def ask(address: tuple[str, int], path: str, source: str = "127.0.0.1") -> int | None:
    """The status of `GET path` from the loopback address `source` (standing in for another host or pod),
    as a probe or a scrape would ask it; None: closed unanswered, or no answer within the DaemonSet's
    probe timeout."""
    try:
        reader, writer = await asyncio.open_connection(*address, local_addr=(source, 0))
    except OSError:
        return None
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: agent\r\n\r\n".encode())
        async with asyncio.timeout(5.0):  # livenessProbe.timeoutSeconds
            answer = await reader.read()
    except (OSError, TimeoutError):
        return None
    finally:
        writer.close()
    status = answer.split(b"\r\n", 1)[0].split(b" ")
    return int(status[1]) if len(status) > 1 and status[1].isdigit() else None


# The review's flood: 32 partial requests, each connection closed and opened again every 1.5 s, under the
# 2 s header timeout, so the listener never times one out.
FLOOD = 32
RENEW = 1.5
FLOOD_ROUNDS_MAX = 20  # a bound: the flood stops when the test is done, or after this many renewals


@dataclass(eq=False)
class Flood:
    """FLOOD partial requests to `address`, from `sources` in turn, each renewed every RENEW seconds until
    `stop`; `opened` counts the connections made."""

    address: tuple[str, int]
    sources: list[str]
    opened: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        await asyncio.gather(*(self._one(self.sources[i % len(self.sources)]) for i in range(FLOOD)))

    def stop(self) -> None:
        self.done.set()

    async def _one(self, source: str) -> None:
        for _ in range(FLOOD_ROUNDS_MAX):
            writer = None
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection(*self.address, local_addr=(source, 0))
                writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                self.opened += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.done.wait(), RENEW)
            if writer is not None:
                writer.close()
            if self.done.is_set():
                return


@contextlib.asynccontextmanager
async def flooded(*servers: httpserver.MetricsServer, sources: list[str]) -> AsyncIterator[list[Flood]]:
    """The flood on each of `servers`, in place (every connection made once) for the body, then stopped."""
    floods = [Flood(server.addresses[0], sources) for server in servers]
    tasks = [asyncio.create_task(f.run()) for f in floods]
    try:
        await eventually(lambda: asyncio.sleep(0, all(f.opened >= FLOOD for f in floods)), "the flood in place")
        yield floods
    finally:
        for f in floods:
            f.stop()
        await asyncio.gather(*tasks)


SCRAPES = 16


@pytest.mark.parametrize("sources", [1, FLOOD], ids=["one-source", "32-sources"])
async def test_a_slow_flood_never_holds_the_metrics_or_probe_listener(started, sources):
    """The review's repro: 32 partial requests renewed every 1.5 s, on the metrics listener (any pod that
    reaches the node's address) and on the loopback probe listener (any host-network pod), from one address
    or from 32. Every scrape from another address (Prometheus) and every /healthz (`dra-agent doctor`, a
    kubelet probing over TCP) is answered. (Before, the flood kept each connection cap full: 0 of 58 scrapes
    and 0 of 58 /healthz were answered.)"""
    agent = await started(probe_address="127.0.0.1:0")
    assert agent.http is not None and agent.metrics_http is not None
    servers = (agent.metrics_http, agent.http)
    answers = []
    async with flooded(*servers, sources=[f"127.0.0.{10 + i}" for i in range(sources)]) as floods:
        for _ in range(SCRAPES):  # the flood renews itself about every 7th round
            scrape = ask(agent.metrics_http.addresses[0], "/metrics", "127.0.0.200")
            answers.append((await scrape, await ask(agent.http.addresses[0], "/healthz", "127.0.0.201")))
            await asyncio.sleep(0.2)
    assert answers == [(200, 200)] * SCRAPES
    # The flood was there: its connections made room for the scrapes and for each other, none was refused.
    assert all(f.opened >= 2 * FLOOD for f in floods), [f.opened for f in floods]
    assert all(s.replaced > 0 and s.refused == 0 for s in servers), [(s.replaced, s.refused) for s in servers]


def daemonset_probe(which: str, path: Path) -> list[str]:
    """The DaemonSet's exec probe `which` as the kubelet runs it in the container: its `$(DRA_PROBE_SOCKET)`
    this test's socket, its `python3` this interpreter."""
    daemonset = yaml.safe_load((REPO / "deploy" / "base" / "daemonset.yaml").read_text())
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    return [sys.executable if part == "python3" else str(path) if part == "$(DRA_PROBE_SOCKET)" else part
            for part in container[which]["exec"]["command"]]


async def run_probe(command: list[str]) -> tuple[int, str]:
    """Exit status and output of a probe command, run from / as in the container."""
    proc = await asyncio.create_subprocess_exec(*command, cwd="/", stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    return proc.returncode if proc.returncode is not None else -1, out.decode()


async def test_the_kubelets_exec_probes_answer_on_the_probe_socket_under_a_flood(short_tmp):
    """The DaemonSet's probes ask the agent on a unix socket of the pod's own, 0600: the review's flood on
    both TCP listeners, from 32 addresses, never comes between them and the agent. Once the agent has
    stopped its socket is gone and the probe fails, naming it."""
    path = short_tmp / "run" / "probe.sock"
    agent = Agent(roots(short_tmp, rescan_interval=3600.0, metrics_address="127.0.0.1:0",
                        probe_address="127.0.0.1:0", probe_socket=path))
    await agent.start()
    try:
        assert agent.http is not None and agent.metrics_http is not None
        st = os.lstat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        async with flooded(agent.metrics_http, agent.http, sources=[f"127.0.0.{10 + i}" for i in range(FLOOD)]):
            for which in ("startupProbe", "livenessProbe"):
                status, out = await run_probe(daemonset_probe(which, path))
                assert status == 0 and "[+]dra-server ok" in out and "healthz check passed" in out, (which, out)

            async def ready() -> bool:
                status, out = await run_probe(daemonset_probe("readinessProbe", path))
                assert status in (0, 1) and "readyz check" in out, out
                return status == 0 and "[+]slices ok" in out
            await eventually(ready, "the readiness probe passes (offline: once the slices are written)")
    finally:
        await agent.stop()
    assert not path.exists()
    status, out = await run_probe(daemonset_probe("livenessProbe", path))
    assert status == 1 and f"no answer from the agent on {path}" in out, out


async def test_the_metrics_listener_serves_metrics_alone_and_names_nothing(started, http):
    agent = await started(probe_address="127.0.0.1:0")
    assert agent.http is not None and agent.metrics_http is not None
    metrics = await http.get(f"{agent.metrics_http.url}/metrics")
    assert metrics.status_code == 200 and "dra_agent_prepared_claims" in metrics.text
    answers = [metrics]
    for path in ("/healthz", "/readyz", "/livez"):
        answers.append(await http.get(f"{agent.metrics_http.url}{path}"))
        assert answers[-1].status_code == 404 and "[+]" not in answers[-1].text
    for answer in answers:
        assert not {k for k in answer.headers if k.lower().startswith("dra-agent-")}, answer.headers
    # The probe listener (the loopback in the DaemonSet) names the agent and gives the details.
    ready = await http.get(f"{agent.http.url}/readyz")
    assert ready.headers[httpserver.NODE_HEADER] == agent.settings.node_name and "[+]" in ready.text


@pytest.mark.parametrize(("method", "path", "query", "kind"), [
    ("GET", "/api/v1/nodes/node-a", {}, ("GET", "nodes")),
    ("GET", "/apis/resource.k8s.io/v1/resourceslices", {"fieldSelector": "spec.nodeName=a"},
     ("LIST", "resourceslices")),
    ("GET", "/apis/resource.k8s.io/v1/resourceslices", {"watch": "true"}, ("WATCH", "resourceslices")),
    ("GET", "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims", {"limit": "500"},
     ("LIST", "resourceclaims")),
    ("GET", "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/c", {}, ("GET", "resourceclaims")),
    ("PUT", "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/c/status", {},
     ("UPDATE", "resourceclaims/status")),
    ("PATCH", "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/c/status", {},
     ("PATCH", "resourceclaims/status")),
    ("POST", "/apis/resource.k8s.io/v1/resourceslices", {}, ("CREATE", "resourceslices")),
    ("DELETE", "/apis/resource.k8s.io/v1/resourceslices/s", {}, ("DELETE", "resourceslices")),
    ("POST", "/api/v1/namespaces/kube-system/events", {}, ("CREATE", "events")),
    ("GET", "/api/v1/namespaces/team-a", {}, ("GET", "namespaces")),
])
def test_api_requests_are_counted_as_the_api_server_names_them(method, path, query, kind) -> None:
    from agent.kube import request_kind

    assert request_kind(method, path, query) == kind
