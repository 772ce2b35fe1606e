"""GPU health end to end: `dra-agent sim` commands reach the running agent's simulated NVML, its
event watcher turns them into device conditions, and the taints reach the ResourceSlices in the
API emulator (over HTTP) while the kubelet's health stream says the same; a reset clears both.

The agent runs in-process in cluster mode (`Agent(settings)` with a kubeconfig naming the
emulator), the commands go through the same control directory the CLI writes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from agentkit import DRIVER, NODE, claim, result, roots
from kubeapi import RESOURCE_CLAIMS, KubeApi
from test_agent_cluster import devices_of, eventually, our_slices, published, start, write_kubeconfig

from agent.app import simctl
from agent.app.daemon import Agent
from agent.config import Settings
from agent.health.requests import submit_clear
from agent.kubelet import client as kc
from agent.names import ClaimRef
from agent.sim.hardware import materialize
from agent.sim.nvml import SimulatedNvml
from agent.sim.profiles import load_profile

NODE_UID = "0b5c4a7e-0000-4000-8000-0000000000ab"
CLAIM_UID = "6a0e0000-0000-4000-8000-000000000005"


@pytest.fixture
def settings(short_tmp: Path, kube_api: KubeApi) -> Settings:
    kubeconfig = write_kubeconfig(short_tmp / "kubeconfig", kube_api.url)
    return roots(short_tmp, offline=None, kubeconfig=kubeconfig, rescan_interval=3600.0, api_timeout=2.0,
                 gpu_probe_interval=0.2, gpu_sharing=True)


class HealthFeed:
    """The latest list the health stream sent, kept current by a background reader."""

    def __init__(self) -> None:
        self.latest: dict[str, dict[str, Any]] = {}

    async def follow(self, agent: Agent) -> None:
        async for response in kc.watch_health(agent.settings.dra_socket):
            self.latest = {d["device"]["device_name"]: d for d in kc.to_dict(response)["devices"]}


@contextlib.asynccontextmanager
async def health_feed(agent: Agent) -> AsyncIterator[HealthFeed]:
    feed = HealthFeed()
    task = asyncio.create_task(feed.follow(agent))
    try:
        yield feed
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


def taints(api: KubeApi, device: str) -> dict[str, dict[str, Any]]:
    return {t["key"]: t for t in devices_of(our_slices(api)).get(device, {}).get("taints") or []}


def claim_ready(api: KubeApi) -> dict[str, Any] | None:
    """The Ready condition of this driver's entry in the claim `default/holder`."""
    obj = api.get(RESOURCE_CLAIMS, "holder", "default") or {}
    for entry in (obj.get("status") or {}).get("devices") or []:
        if entry["driver"] == DRIVER:
            return next((c for c in entry.get("conditions") or [] if c["type"] == "Ready"), None)
    return None


def sim(agent: Agent, action: str, device: str, xid: int | None = None) -> None:
    simctl.submit(agent.settings, simctl.make_command(agent.settings, action, device, xid))


async def test_an_xid_taints_the_gpu_and_a_reset_clears_it(kube_api: KubeApi, settings: Settings, agents) -> None:
    kube_api.add_node(NODE, uid=NODE_UID)
    agent = await start(agents, settings)
    await published(agent)
    assert taints(kube_api, "gpu-3") == {}
    async with health_feed(agent) as feed:
        await eventually(lambda: feed.latest.get("gpu-3", {}).get("health") == "HEALTHY", "gpu-3 HEALTHY")

        sim(agent, "xid", "gpu-3", 48)
        xid = await eventually(lambda: taints(kube_api, "gpu-3").get(f"{DRIVER}/xid"), "the XID taint published")
        assert (xid["value"], xid["effect"]) == ("48", "NoSchedule") and xid["timeAdded"].endswith("Z")
        health = await eventually(lambda: (h := feed.latest["gpu-3"]) and h["health"] == "UNHEALTHY" and h,
                                  "gpu-3 UNHEALTHY on the health stream")
        assert "XID 48 (double-bit ECC error)" in health["message"]
        assert "recovery action gpu-reset" in health["message"]
        assert taints(kube_api, "gpu-2") == {} and feed.latest["gpu-2"]["health"] == "HEALTHY"
        assert agent.metrics_state().taints == {("xid", "NoSchedule"): 1}
        # Its passthrough variant is the same GPU: the same taint keeps VMs off it.
        bus = devices_of(our_slices(kube_api))["gpu-3"]["attributes"]["resource.kubernetes.io/pciBusID"]
        (variant,) = [d for d in devices_of(our_slices(kube_api)).values() if d["name"].endswith("-vfio")
                      and d["attributes"]["resource.kubernetes.io/pciBusID"] == bus]
        assert [t["key"] for t in variant["taints"]] == [f"{DRIVER}/xid"]
        # So is its shared form (`--gpu-sharing`).
        assert [t["key"] for t in taints(kube_api, "gpu-3-shared").values()] == [f"{DRIVER}/xid"]
        assert feed.latest["gpu-3-shared"]["health"] == "UNHEALTHY"

        sim(agent, "recover", "gpu-3")
        await eventually(lambda: not taints(kube_api, "gpu-3"), "the XID taint gone after the reset")
        await eventually(lambda: feed.latest["gpu-3"]["health"] == "HEALTHY", "gpu-3 HEALTHY again")


async def test_a_lost_gpu_stays_published_with_a_noexecute_taint(kube_api: KubeApi, settings: Settings,
                                                                agents) -> None:
    kube_api.add_node(NODE, uid=NODE_UID)
    agent = await start(agents, settings)
    await published(agent)
    before = devices_of(our_slices(kube_api))["gpu-5"]
    kube_api.add(claim("holder", CLAIM_UID, [result("gpu-5", "gpu")]))
    async with kc.DRAClient(agent.settings.dra_socket) as client:
        response = await client.prepare([ClaimRef("default", "holder", CLAIM_UID)])
    assert all(c.error == "" for c in response.claims.values())
    await eventually(lambda: (r := claim_ready(kube_api)) and r["status"] == "True", "the claim's Ready True")
    async with health_feed(agent) as feed:
        sim(agent, "lose", "gpu-5")
        lost = await eventually(lambda: taints(kube_api, "gpu-5").get(f"{DRIVER}/gpu-lost"), "the gpu-lost taint")
        assert lost["effect"] == "NoExecute"
        # Still the same device as last seen (attributes, capacity), only tainted.
        now = devices_of(our_slices(kube_api))["gpu-5"]
        assert {k: v for k, v in now.items() if k != "taints"} == before
        await eventually(lambda: feed.latest.get("gpu-5", {}).get("health") == "UNHEALTHY", "gpu-5 UNHEALTHY")
        assert "GPU lost" in feed.latest["gpu-5"]["message"]
        # Its passthrough variant is the same GPU: UNHEALTHY too, saying whose loss it is.
        variant = next(n for n, d in devices_of(our_slices(kube_api)).items() if n.endswith("-vfio") and
                       d["attributes"]["resource.kubernetes.io/pciBusID"] == before["attributes"][
                           "resource.kubernetes.io/pciBusID"])
        await eventually(lambda: feed.latest.get(variant, {}).get("health") == "UNHEALTHY", "the variant UNHEALTHY")
        assert feed.latest[variant]["message"].startswith("gpu-5: ")
        # The claim holding it says why it is not ready: lost, not missing.
        ready = await eventually(lambda: (r := claim_ready(kube_api)) and r["status"] == "False" and r,
                                 "the claim's Ready condition False")
        assert ready["reason"] == "GpuLost" and "GPU lost" in ready["message"]

        # A rescan while it is lost (discovery fails it) keeps it published.
        await agent.rescan(["gpu"])
        assert taints(kube_api, "gpu-5").get(f"{DRIVER}/gpu-lost")

        sim(agent, "recover", "gpu-5")
        await eventually(lambda: not taints(kube_api, "gpu-5"), "the gpu-lost taint gone")
        await eventually(lambda: feed.latest["gpu-5"]["health"] == "HEALTHY", "gpu-5 HEALTHY again")
        await eventually(lambda: (r := claim_ready(kube_api)) and r["status"] == "True", "the claim Ready again")


async def test_an_application_xid_is_informational_and_an_operator_can_clear_it(
        kube_api: KubeApi, settings: Settings, agents) -> None:
    kube_api.add_node(NODE, uid=NODE_UID)
    agent = await start(agents, settings)
    await published(agent)
    async with health_feed(agent) as feed:
        sim(agent, "xid", "gpu-1", 13)
        xid = await eventually(lambda: taints(kube_api, "gpu-1").get(f"{DRIVER}/xid"), "the XID 13 taint")
        assert (xid["value"], xid["effect"]) == ("13", "None")
        await eventually(lambda: "XID 13" in feed.latest.get("gpu-1", {}).get("message", ""), "the message")
        assert feed.latest["gpu-1"]["health"] == "HEALTHY"

        submit_clear(agent.settings, "gpu-1")
        await eventually(lambda: not taints(kube_api, "gpu-1"), "the taint cleared by hand")
        await eventually(lambda: feed.latest["gpu-1"].get("message", "") == "", "the message gone")


async def test_xid_taints_survive_a_restart_of_the_agent_until_the_gpu_was_reset(
        kube_api: KubeApi, settings: Settings, agents) -> None:
    kube_api.add_node(NODE, uid=NODE_UID)
    agent = await start(agents, settings)
    await published(agent)
    sim(agent, "xid", "gpu-6", 48)
    first = await eventually(lambda: taints(kube_api, "gpu-6").get(f"{DRIVER}/xid"), "the XID 48 taint")

    async def restart(before: Agent) -> Agent:
        await before.stop()
        agents.remove(before)
        after = await start(agents, settings)
        await published(after)
        return after

    # The same GPU in the same boot, still needing its reset: kept, also once it has answered.
    agent = await restart(agent)
    assert taints(kube_api, "gpu-6")[f"{DRIVER}/xid"] == first  # same taint, same time added
    sim(agent, "xid", "gpu-2", 13)  # the watcher reports in order: gpu-6's first answer came before
    await eventually(lambda: taints(kube_api, "gpu-2").get(f"{DRIVER}/xid"), "gpu-2's XID 13 taint")
    assert taints(kube_api, "gpu-6")[f"{DRIVER}/xid"] == first

    # Reset while no agent ran (by an operator, on the same machine): cleared at the GPU's first answer.
    await agent.stop()
    agents.remove(agent)
    operator = SimulatedNvml.from_profile(settings.nvml.profile)
    operator.materialize(settings.sim_root)
    operator.nvmlInit()
    operator.recover(next(i for i, g in enumerate(operator.profile.gpus) if g.minor == 6))
    operator.nvmlShutdown()
    agent = await start(agents, settings)
    await published(agent)
    await eventually(lambda: not taints(kube_api, "gpu-6"), "the XID taint of a GPU reset meanwhile cleared")

    # A reboot resets every GPU: not even restored.
    sim(agent, "xid", "gpu-6", 48)
    await eventually(lambda: taints(kube_api, "gpu-6").get(f"{DRIVER}/xid"), "the XID 48 taint again")
    await agent.stop()
    agents.remove(agent)
    materialize(load_profile(settings.nvml.profile), settings.sim_root, boot=True)
    agent = await start(agents, settings)
    assert agent.health.conditions.causes("gpu-6") == []
    await published(agent)
    assert taints(kube_api, "gpu-6") == {}
