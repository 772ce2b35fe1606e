"""The whole agent in cluster mode, against the Kubernetes API emulator over real HTTP.

The agent is `Agent(settings)` in-process with a kubeconfig naming the emulator, exactly
as a DaemonSet pod would be configured, and the kubelet stand-in calls its real sockets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx2
import kubernetes_validate
import pytest
import yaml
from agentkit import DRIVER, NODE, claim, result, roots
from kubeapi import RESOURCE_SLICES, KubeApi

from agent.app.connection import StartupError
from agent.app.daemon import Agent
from agent.config import Settings
from agent.kube import NODE_ALLOCATABLE_FEATURE
from agent.kubelet import client as kc
from agent.names import ClaimRef

NODE_UID = "0b5c4a7e-0000-4000-8000-0000000000aa"
UID_GPU = "5d1e9c00-0000-4000-8000-000000000001"
UID_TWO = "5d1e9c00-0000-4000-8000-000000000002"
UID_MISSING = "5d1e9c00-0000-4000-8000-0000000000ff"
WAIT = 30.0  # a bound for things that happen in the background, never an expected duration

T = TypeVar("T")


def claim_path(namespace: str, name: str) -> str:
    return f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"


def write_kubeconfig(path: Path, server: str) -> Path:
    # A token user: lightkube refuses a context without one, and the emulator accepts any.
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "emulator", "user": {"token": "emulator"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator"}}],
    }))
    return path


async def eventually(probe: Callable[[], T | None], what: str, limit: float = WAIT) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` if it never does."""
    deadline = time.monotonic() + limit
    while True:
        if value := probe():
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {limit:g} s")
        await asyncio.sleep(0.05)


@pytest.fixture
def cluster_settings(short_tmp: Path, kube_api: KubeApi) -> Callable[..., Settings]:
    kubeconfig = write_kubeconfig(short_tmp / "kubeconfig", kube_api.url)

    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {"offline": None, "kubeconfig": kubeconfig, "rescan_interval": 3600.0,
                                  "api_timeout": 2.0}
        values.update(overrides)
        return roots(short_tmp, **values)

    return make



async def start(agents: list[Agent], settings: Settings) -> Agent:
    agent = Agent(settings)
    agents.append(agent)
    await agent.start()
    return agent


async def published(agent: Agent) -> None:
    await eventually(lambda: agent.publish, "the agent starts publishing")
    assert agent.publish is not None
    async with asyncio.timeout(WAIT):
        await agent.publish.wait_published()


def our_slices(api: KubeApi) -> list[dict[str, Any]]:
    return [s for s in api.items(RESOURCE_SLICES) if s["spec"].get("nodeName") == NODE]


def devices_of(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices for d in s["spec"].get("devices", [])}  # counter slices have none


# -- publishing -------------------------------------------------------------------------------------

async def test_slices_are_owned_by_the_node_and_valid(kube_api: KubeApi, cluster_settings, agents) -> None:
    kube_api.add_node(NODE, uid=NODE_UID)
    agent = await start(agents, cluster_settings())
    assert agent.conn is not None and agent.conn.mode == "cluster"
    await published(agent)

    stored = our_slices(kube_api)
    assert stored and len(stored) == len(kube_api.items(RESOURCE_SLICES))
    for obj in stored:
        kubernetes_validate.validate(obj, "1.37.0", strict=True)
        assert obj["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE_UID, "controller": True}]
        assert obj["metadata"]["name"].startswith(f"{DRIVER}-{NODE}-")
        spec = obj["spec"]
        assert spec["nodeName"] == NODE and spec["driver"] == DRIVER
        assert spec["pool"]["name"] == NODE
        assert spec["pool"]["resourceSliceCount"] == len(stored)
    names = devices_of(stored)
    assert {f"gpu-{i}" for i in range(8)} <= set(names)
    assert "cpu-numa0" in names and "memory-numa0" in names


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "not-declared"])
async def test_node_allocatable_fields_follow_the_nodes_declared_features(
        kube_api: KubeApi, cluster_settings, agents, declared: bool) -> None:
    kube_api.add_node(NODE, uid=NODE_UID, declared_features=[NODE_ALLOCATABLE_FEATURE] if declared else [])
    agent = await start(agents, cluster_settings())
    await published(agent)

    devices = devices_of(our_slices(kube_api))
    numa = {n: d for n, d in devices.items() if n.startswith(("cpu-numa", "memory-numa"))}
    assert {"cpu-numa0", "memory-numa0"} <= set(numa)
    for name, dev in numa.items():
        policies = [c.get("requestPolicy") for c in dev["capacity"].values()]
        if declared:
            assert dev.get("allowMultipleAllocations") is True, name
            assert all(policies), name
            key = "cpu" if name.startswith("cpu") else "memory"
            assert dev["nodeAllocatableResources"][key]["mapping"]["capacityKey"] in dev["capacity"]
        else:
            assert "allowMultipleAllocations" not in dev, name
            assert "nodeAllocatableResources" not in dev, name
            assert not any(policies), name
    # Only the NUMA devices are shared that way: a GPU stays one per claim.
    assert "allowMultipleAllocations" not in devices["gpu-0"]


async def test_ready_only_once_the_kubelet_registered_the_plugin(kube_api: KubeApi, cluster_settings,
                                                                 agents) -> None:
    """In a cluster, /readyz waits for the kubelet's registration as well as the slices (offline it does
    not: test_metrics.py)."""
    kube_api.add_node(NODE, uid=NODE_UID)
    agent = await start(agents, cluster_settings(metrics_address="127.0.0.1:0"))
    await published(agent)
    assert agent.http is not None
    async with httpx2.AsyncClient(timeout=10, trust_env=False) as http:
        ready = await http.get(f"{agent.http.url}/readyz")
        assert ready.status_code == 503 and "[+]slices ok: " in ready.text
        assert "[-]kubelet-registration failed: the kubelet has not registered the plugin yet" in ready.text
        await kc.notify_registration(agent.settings.registration_socket, True)
        ready = await http.get(f"{agent.http.url}/readyz")
        assert ready.status_code == 200 and "[+]kubelet-registration ok: the kubelet registered" in ready.text


# -- claims from the API server ------------------------------------------------------------------------

async def test_prepare_reads_claims_from_the_api_server(kube_api: KubeApi, cluster_settings, agents) -> None:
    kube_api.add_node(NODE, uid=NODE_UID)
    kube_api.add(claim("trainer", UID_GPU, [result("gpu-0", "gpu")], namespace="team-a"))
    kube_api.add(claim("pair", UID_TWO, [result("gpu-1", "gpu"), result("gpu-2", "gpu")], namespace="team-a"))
    agent = await start(agents, cluster_settings())
    s = agent.settings

    refs = [ClaimRef("team-a", "trainer", UID_GPU), ClaimRef("team-a", "pair", UID_TWO),
            ClaimRef("team-a", "absent", UID_MISSING)]
    async with kc.DRAClient(s.dra_socket) as client:
        response = await client.prepare(refs)

    claims = response.claims
    assert set(claims) == {UID_GPU, UID_TWO, UID_MISSING}
    assert claims[UID_GPU].error == "" and [d.device_name for d in claims[UID_GPU].devices] == ["gpu-0"]
    assert claims[UID_TWO].error == "" and [d.device_name for d in claims[UID_TWO].devices] == ["gpu-1", "gpu-2"]
    missing = claims[UID_MISSING]
    assert not missing.devices
    assert "team-a/absent" in missing.error and "not found" in missing.error
    assert (s.cdi_dir / f"{DRIVER}-claim_{UID_GPU}.json").is_file()
    assert not list(s.cdi_dir.glob(f"*{UID_MISSING}*"))
    gets = [r for r in kube_api.requests if r.method == "GET" and "/resourceclaims/" in r.path]
    assert {r.path for r in gets} == {claim_path("team-a", n) for n in ("trainer", "pair", "absent")}


async def test_prepare_retries_claim_reads_through_server_errors(kube_api: KubeApi, cluster_settings,
                                                                  agents) -> None:
    kube_api.add_node(NODE, uid=NODE_UID)
    kube_api.add(claim("flaky", UID_GPU, [result("gpu-3", "gpu")], namespace="team-a"))
    fault = kube_api.fail("GET", claim_path("team-a", "flaky"), times=3, status=500)
    agent = await start(agents, cluster_settings())

    async with kc.DRAClient(agent.settings.dra_socket) as client:
        response = await client.prepare([ClaimRef("team-a", "flaky", UID_GPU)])

    entry = response.claims[UID_GPU]
    assert entry.error == "" and [d.device_name for d in entry.devices] == ["gpu-3"]
    assert fault.hits == 3
    answers = [r.status for r in kube_api.requests if r.path == claim_path("team-a", "flaky")]
    assert answers == [500, 500, 500, 200]


# -- the API server away -------------------------------------------------------------------------------

async def test_agent_starts_without_the_api_server_and_publishes_when_it_is_back(
        kube_api: KubeApi, cluster_settings, agents) -> None:
    kube_api.add_node(NODE, uid=NODE_UID, declared_features=[NODE_ALLOCATABLE_FEATURE])
    await kube_api.stop()
    agent = await start(agents, cluster_settings())

    # The kubelet is served while the API server is away: registration, and the DRA socket.
    assert agent.conn is not None and agent.conn.mode == "cluster" and agent.conn.node is None
    info = await kc.get_info(agent.settings.registration_socket)
    assert info.name == DRIVER and info.endpoint == str(agent.settings.dra_socket)
    assert agent.publish is None  # no Node read yet, so nothing can be owned by it

    await kube_api.start()
    stored = await eventually(lambda: our_slices(kube_api), "slices published once the API server is back")
    assert all(s["metadata"]["ownerReferences"][0]["uid"] == NODE_UID for s in stored)
    await published(agent)
    devices = devices_of(our_slices(kube_api))
    assert {f"gpu-{i}" for i in range(8)} <= set(devices)
    # What the Node declares is learnt late too: the CPUs are published as node-allocatable.
    assert devices["cpu-numa0"].get("allowMultipleAllocations") is True
    assert "cpu" in devices["cpu-numa0"]["nodeAllocatableResources"]


# -- no Node ---------------------------------------------------------------------------------------------

async def test_missing_node_with_fallback_goes_offline_and_says_why(
        kube_api: KubeApi, cluster_settings, agents, short_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agent")
    fallback = short_tmp / "fallback"
    agent = await start(agents, cluster_settings(offline_fallback=fallback))

    assert agent.conn is not None and agent.conn.offline == fallback
    (mode,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mode: ")]
    assert f"offline ({fallback})" in mode
    assert f"Node {NODE!r} does not exist in the cluster" in mode
    await published(agent)
    files = list((fallback / "resourceslices").glob("*.yaml"))
    assert files
    assert kube_api.items(RESOURCE_SLICES) == []
    assert not [r for r in kube_api.requests if r.method != "GET"]  # nothing was written to the cluster


async def test_missing_node_without_fallback_refuses_to_start(kube_api: KubeApi, cluster_settings,
                                                              agents) -> None:
    settings = cluster_settings()
    with pytest.raises(StartupError, match=rf"Node {NODE!r} does not exist in the cluster.*--node-name"):
        await start(agents, settings)
    assert not settings.dra_socket.exists() and not settings.registration_socket.exists()
    assert kube_api.items(RESOURCE_SLICES) == []
