"""A GPU's other forms (its MIG placements, its shared form, its passthrough variant) are the same
hardware: the claims holding them, their taints and their health follow the GPU's conditions, and
a lost GPU's forms stay published, tainted, as they were last seen. A device that disappears from
discovery makes the claims holding it say so at once (not at the next resync).

The agent runs in-process in cluster mode against the API emulator (over HTTP); GPU events come
through the same control directory `dra-agent sim` writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from agentkit import DRIVER, NODE, StaticSource, claim, nic, result, roots
from kubeapi import RESOURCE_CLAIMS, KubeApi
from test_agent_cluster import devices_of, eventually, our_slices, published, start, write_kubeconfig
from test_gpu_health import NODE_UID, health_feed, settings, sim, taints

from agent.app.daemon import Agent
from agent.kubelet import client as kc
from agent.names import ClaimRef

__all__ = ["settings"]  # the fixture, shared with test_gpu_health

SHARE_ID = "3f2a1b4c-0000-4000-8000-00000000aaaa"
SHARED_UID = "6a0e0000-0000-4000-8000-0000000000f1"
NIC_UID = "6a0e0000-0000-4000-8000-0000000000f2"


def ready_of(api: KubeApi, name: str) -> dict[str, Any] | None:
    """The Ready condition of this driver's first entry in the claim `default/NAME`."""
    obj = api.get(RESOURCE_CLAIMS, name, "default") or {}
    for entry in (obj.get("status") or {}).get("devices") or []:
        if entry["driver"] == DRIVER:
            return next((c for c in entry.get("conditions") or [] if c["type"] == "Ready"), None)
    return None


def is_ready(api: KubeApi, name: str, status: str, reason: str | None = None) -> dict[str, Any] | None:
    r = ready_of(api, name)
    return r if r and r["status"] == status and (reason is None or r["reason"] == reason) else None


async def prepare_shared(agent: Agent, api: KubeApi, gpu: str) -> None:
    api.add(claim("shared", SHARED_UID, [result(f"{gpu}-shared", "gpu", shareID=SHARE_ID,
                                                consumedCapacity={"memory": "4Gi"})]))
    async with kc.DRAClient(agent.settings.dra_socket) as client:
        response = await client.prepare([ClaimRef("default", "shared", SHARED_UID)])
    assert all(c.error == "" for c in response.claims.values()), response
    await eventually(lambda: is_ready(api, "shared", "True"), "the shared claim Ready")


async def test_a_claim_on_a_shared_gpu_follows_the_gpus_xid_and_reset(kube_api: KubeApi, settings, agents) -> None:
    kube_api.add_node(NODE, uid=NODE_UID)
    agent = await start(agents, settings)
    await published(agent)
    await prepare_shared(agent, kube_api, "gpu-3")

    sim(agent, "xid", "gpu-3", 79)  # fallen off the bus: NoExecute
    ready = await eventually(lambda: is_ready(kube_api, "shared", "False"), "the shared claim not Ready")
    assert ready["reason"] == "XidError" and "XID 79" in ready["message"]

    sim(agent, "recover", "gpu-3")
    await eventually(lambda: is_ready(kube_api, "shared", "True"), "the shared claim Ready after the reset")


async def test_a_lost_gpus_forms_stay_published_tainted_and_unhealthy(kube_api: KubeApi, settings, agents) -> None:
    kube_api.add_node(NODE, uid=NODE_UID)
    agent = await start(agents, settings)
    await published(agent)
    before = devices_of(our_slices(kube_api))
    forms = [*sorted(n for n in before if n.startswith("gpu-5-mig-")), "gpu-5-shared"]
    assert len(forms) > 1, sorted(before)
    await prepare_shared(agent, kube_api, "gpu-5")
    lost_key = f"{DRIVER}/gpu-lost"
    async with health_feed(agent) as feed:
        sim(agent, "lose", "gpu-5")
        await eventually(lambda: all(lost_key in taints(kube_api, n) for n in ["gpu-5", *forms]),
                         "gpu-5 and its MIG and shared forms published with the gpu-lost taint")
        now = devices_of(our_slices(kube_api))
        for name in forms:  # as last seen, only tainted
            assert {k: v for k, v in now[name].items() if k != "taints"} == before[name]
            assert now[name]["taints"][0]["effect"] == "NoExecute"
        await eventually(lambda: all(feed.latest.get(n, {}).get("health") == "UNHEALTHY" for n in forms),
                         "the forms UNHEALTHY")
        for name in forms:  # the cause, not "no longer found"
            assert feed.latest[name]["message"].startswith("gpu-5: ") and "GPU lost" in feed.latest[name]["message"]
        ready = await eventually(lambda: is_ready(kube_api, "shared", "False", "GpuLost"),
                                 "the shared claim not Ready: GPU lost")
        assert "GPU lost" in ready["message"]

        sim(agent, "recover", "gpu-5")
        await eventually(lambda: not any(taints(kube_api, n) for n in ["gpu-5", *forms]), "the taints gone")
        await eventually(lambda: all(feed.latest.get(n, {}).get("health") == "HEALTHY" for n in forms),
                         "the forms HEALTHY again")
        await eventually(lambda: is_ready(kube_api, "shared", "True"), "the shared claim Ready again")


def on_the_host(driver: str) -> dict[str, Any]:
    """A NetworkConfig that leaves the NIC in the host's namespace (its absence there is then a loss)."""
    return {"source": "FromClaim", "requests": ["nic"], "opaque": {"driver": driver, "parameters": {
        "apiVersion": f"{driver}/v1alpha1", "kind": "NetworkConfig", "move": False}}}


async def nic_claim_ready(kube_api: KubeApi, short_tmp: Path, agents: Any, monkeypatch: pytest.MonkeyPatch,
                          config: list[dict[str, Any]]) -> tuple[Agent, StaticSource, Any]:
    """An agent whose only device is a NIC, and the claim `net` for it prepared and Ready: the agent, the
    NIC's discovery source and the NIC."""
    device = nic()
    source = StaticSource("nic", [device])
    monkeypatch.setattr("agent.app.daemon.build_sources", lambda s: [source])
    kubeconfig = write_kubeconfig(short_tmp / "kubeconfig", kube_api.url)
    settings = roots(short_tmp, offline=None, kubeconfig=kubeconfig, rescan_interval=3600.0, api_timeout=2.0)
    kube_api.add_node(NODE, uid=NODE_UID)
    agent = await start(agents, settings)
    await published(agent)
    kube_api.add(claim("net", NIC_UID, [result(device.name, "nic")], config=config))
    async with kc.DRAClient(agent.settings.dra_socket) as client:
        response = await client.prepare([ClaimRef("default", "net", NIC_UID)])
    assert all(c.error == "" for c in response.claims.values()), response
    await eventually(lambda: is_ready(kube_api, "net", "True"), "the NIC claim Ready")
    return agent, source, device


async def test_a_device_gone_from_discovery_makes_its_claims_not_ready(
        kube_api: KubeApi, short_tmp: Path, agents, monkeypatch) -> None:
    agent, source, device = await nic_claim_ready(kube_api, short_tmp, agents, monkeypatch, [on_the_host(DRIVER)])

    source.devices = []  # the NIC is gone (unplugged, its driver unbound)
    assert await agent.rescan(["nic"])
    ready = await eventually(lambda: is_ready(kube_api, "net", "False"), "the NIC claim not Ready")
    assert ready["reason"] == "DeviceMissing"

    source.devices = [device]  # back
    assert await agent.rescan(["nic"])
    await eventually(lambda: is_ready(kube_api, "net", "True"), "the NIC claim Ready again")


async def test_a_nic_moved_into_its_pod_is_ready_while_the_host_does_not_see_it(
        kube_api: KubeApi, short_tmp: Path, agents, monkeypatch) -> None:
    # The runtime moved the NIC into the pod's network namespace: the host's discovery no longer sees it,
    # which is where it should be. The claim stays Ready (MovedIntoPod) with its networkData.
    agent, source, _ = await nic_claim_ready(kube_api, short_tmp, agents, monkeypatch, [])

    source.devices = []  # moved into the pod
    assert await agent.rescan(["nic"])
    ready = await eventually(lambda: is_ready(kube_api, "net", "True", "MovedIntoPod"), "the NIC claim Ready, moved")
    assert "ens1f0" in ready["message"]
    (entry,) = kube_api.get(RESOURCE_CLAIMS, "net", "default")["status"]["devices"]
    assert entry["networkData"]["interfaceName"] == "ens1f0" and entry["networkData"]["ips"] == ["10.0.0.5/24"]
