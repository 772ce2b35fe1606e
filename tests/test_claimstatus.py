"""ResourceClaim status.devices (agent/health/claimstatus.py): the real prepare engine with a real inventory,
the claim status written by server-side apply to the Kubernetes API emulator over HTTP (which
enforces the API server's ownership and validation rules), and offline into a directory."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest
import yaml
from agentkit import DRIVER, NODE, Node, claim, make_node, nic, result, write_claim
from handshakes import metric, until
from kubeapi import RESOURCE_CLAIMS, KubeApi
from lightkube.core.exceptions import ApiError
from lightkube.resources.resource_v1 import ResourceClaimStatus
from lightkube.types import PatchType
from test_agent_cluster import NODE_UID, cluster_settings, eventually, start  # noqa: F401  (fixture)

from agent.claims.sources import ApiClaimSource
from agent.health.claimstatus import ClaimStatusWriter
from agent.health.conditions import Readiness
from agent.health.readytimes import ReadyTransitions
from agent.health.statussinks import ApiStatusSink, DirectoryStatusSink
from agent.kube import Backoff
from agent.kubelet import client as kc
from agent.metrics import Metrics
from agent.model import Device
from agent.names import ClaimRef

UID = "7a110000-0000-4000-8000-000000000001"
UID2 = "7a110000-0000-4000-8000-000000000002"
NIC = "nic-0000-3b-00-0"
OTHER = "other.example.com"
FAST = Backoff(initial=0.01, maximum=0.05)
STATUS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/c/status"
WAIT = 30.0  # a bound for background work, never an expected duration


class Links:
    """A readiness source a test sets: the devices in `down` are not ready (link down)."""

    def __init__(self) -> None:
        self.down: set[str] = set()

    def readiness(self, device: Device) -> Readiness:
        if device.name in self.down:
            return Readiness(False, "LinkDown", f"{device.node.interface} has no carrier")
        return Readiness()


class Gpus:
    """A readiness source a test sets: the GPUs in `lost` are not ready."""

    def __init__(self) -> None:
        self.lost: set[str] = set()

    def readiness(self, device: Device) -> Readiness:
        return Readiness(False, "GpuLost", "lost") if device.name in self.lost else Readiness()


@pytest.fixture
async def node(tmp_path: Path) -> Node:
    return await make_node(tmp_path)


@pytest.fixture
async def writers() -> AsyncIterator[list[ClaimStatusWriter]]:
    made: list[ClaimStatusWriter] = []
    yield made
    for w in made:
        await w.stop()


@pytest.fixture
def online(node: Node, kube_api: KubeApi, writers: list[ClaimStatusWriter]) -> Callable[..., ClaimStatusWriter]:
    def make(**kw: Any) -> ClaimStatusWriter:
        node.engine.claims = ApiClaimSource(kube_api.client())
        w = ClaimStatusWriter(DRIVER, ApiStatusSink(kube_api.client(), DRIVER), node.inventory, node.engine.book,
                              backoff=FAST, metrics=Metrics(process=False), **kw)
        node.engine.listeners.append(w)
        writers.append(w)
        return w
    return make


def devices_of(kube_api: KubeApi, name: str = "c") -> dict[tuple[str, str], dict[str, Any]]:
    obj = kube_api.get(RESOURCE_CLAIMS, name, "default")
    assert obj is not None
    return {(e["driver"], e["device"]): e for e in (obj.get("status") or {}).get("devices") or []}


def owners_of(kube_api: KubeApi, name: str = "c") -> dict[str, set[str]]:
    obj = kube_api.get(RESOURCE_CLAIMS, name, "default")
    assert obj is not None
    return {mf["manager"]: set(mf["fieldsV1"]["f:status"]["f:devices"])
            for mf in obj["metadata"].get("managedFields") or [] if mf.get("subresource") == "status"}


async def prepare(node: Node, uid: str = UID, name: str = "c") -> None:
    out = await asyncio.wait_for(node.engine.prepare([ClaimRef("default", name, uid)]), WAIT)
    assert out[uid].error == ""


async def unprepare(node: Node, uid: str = UID, name: str = "c") -> None:
    out = await asyncio.wait_for(node.engine.unprepare([ClaimRef("default", name, uid)]), WAIT)
    assert out[uid] == ""


async def settled(w: ClaimStatusWriter) -> None:
    await asyncio.wait_for(w.idle(), WAIT)


def writes(w: ClaimStatusWriter, result: str) -> float | None:
    return metric(w.metrics.registry, "dra_agent_claim_status_writes_total", {"result": result})


def queue(w: ClaimStatusWriter) -> float | None:
    return metric(w.metrics.registry, "dra_agent_claim_status_queue")


def ready(entry: dict[str, Any]) -> dict[str, Any]:
    (cond,) = entry["conditions"]
    assert cond["type"] == "Ready"
    return cond


async def apply_as(kube_api: KubeApi, manager: str, entries: list[dict[str, Any]], name: str = "c") -> Any:
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"}, "status": {"devices": entries}}
    return await kube_api.client().patch(ResourceClaimStatus, name, body, namespace="default",
                                         patch_type=PatchType.APPLY, field_manager=manager, force=True)


def other_entry(device: str = "dev-9") -> dict[str, Any]:
    return {"driver": OTHER, "pool": "pool-x", "device": device, "data": {"from": "the other driver"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "Fine", "message": "",
                            "lastTransitionTime": "2024-01-01T00:00:00Z"}]}


# -- online ----------------------------------------------------------------------------------------

async def test_prepare_writes_ready_entries_with_gpu_data_and_network_data(node, kube_api, online):
    writer = online()
    kube_api.add(claim("c", UID, [result("gpu-0", "gpu"), result(NIC, "net")]))
    await prepare(node)
    await settled(writer)
    found = devices_of(kube_api)
    assert set(found) == {(DRIVER, "gpu-0"), (DRIVER, NIC)}
    gpu, net = found[DRIVER, "gpu-0"], found[DRIVER, NIC]
    assert gpu["pool"] == NODE and "shareID" not in gpu
    assert ready(gpu)["status"] == "True" and ready(gpu)["reason"] == "Prepared"
    device = node.inventory.get("gpu-0")
    assert device is not None
    assert gpu["data"] == {"uuid": device.node.gpu.uuid, "productName": device.attributes["productName"]}
    assert "networkData" not in gpu
    assert net["networkData"] == {"interfaceName": "ens1f0", "ips": ["10.0.0.5/24"],
                                  "hardwareAddress": "02:00:00:00:00:01"}
    assert ready(net)["status"] == "True" and "data" not in net
    assert set(owners_of(kube_api)) == {DRIVER}  # applied under the driver's name as field manager
    assert writes(writer, "ok") == 1 and writer.queued == 0


async def test_other_drivers_entries_are_untouched_by_our_writes_and_by_unprepare(node, kube_api, online):
    writer = online()
    kube_api.add(claim("c", UID, [result("gpu-0", "gpu"), result("dev-9", "x", driver=OTHER, pool="pool-x")]))
    await apply_as(kube_api, OTHER, [other_entry()])
    theirs = devices_of(kube_api)[OTHER, "dev-9"]

    await prepare(node)
    await settled(writer)
    assert set(devices_of(kube_api)) == {(OTHER, "dev-9"), (DRIVER, "gpu-0")}
    assert devices_of(kube_api)[OTHER, "dev-9"] == theirs
    assert set(owners_of(kube_api)) == {OTHER, DRIVER}

    await unprepare(node)
    await settled(writer)
    assert devices_of(kube_api) == {(OTHER, "dev-9"): theirs}  # only ours went
    assert set(owners_of(kube_api)) == {OTHER}


async def test_a_failed_write_is_retried_and_prepare_does_not_wait_for_it(node, kube_api, online):
    writer = online()
    kube_api.add(claim("c", UID, [result("gpu-0", "gpu")]))
    fault = kube_api.fail("PATCH", STATUS, times=2, status=503)
    await prepare(node)
    await settled(writer)
    assert fault.hits == 2
    assert writes(writer, "retry") == 2 and writes(writer, "ok") == 1
    assert ready(devices_of(kube_api)[DRIVER, "gpu-0"])["status"] == "True"

    # The API server holds the write: unprepare answers all the same, and the removal lands later.
    gate = kube_api.hold("PATCH", STATUS)
    kube_api.mark()
    await unprepare(node)
    await until(lambda: [r for r in kube_api.since_mark() if r.method == "PATCH" and r.status is None],
                "the removal's write held at the API server")
    assert writer.queued == 1 and (DRIVER, "gpu-0") in devices_of(kube_api)
    assert queue(writer) == 1
    gate.set()
    await settled(writer)
    assert devices_of(kube_api) == {}
    assert queue(writer) == 0


async def test_a_claim_recreated_with_another_uid_is_never_written(node, kube_api, online):
    writer = online()
    kube_api.add(claim("c", UID, [result("gpu-0", "gpu")]))
    await prepare(node)
    await settled(writer)
    kube_api.remove(RESOURCE_CLAIMS, "c", "default")
    kube_api.add(claim("c", UID2, [result("gpu-0", "gpu")]))  # same name, another incarnation

    kube_api.mark()
    assert writer.devices_changed(["gpu-0"]) == 1
    await settled(writer)
    assert [w.status for w in kube_api.writes()] == [422]  # the UID in the apply body: refused
    assert devices_of(kube_api) == {}
    assert writes(writer, "gave_up") == 1 and writes(writer, "retry") == 0

    kube_api.mark()
    writer.devices_changed(["gpu-0"])
    await settled(writer)
    assert kube_api.writes() == []  # known gone: not tried again


async def test_a_deleted_claim_stops_the_writes_and_its_unprepare_counts_as_done(node, kube_api, online):
    writer = online()
    kube_api.add(claim("c", UID, [result("gpu-0", "gpu")]))
    gate = kube_api.hold("PATCH", STATUS)
    await prepare(node)
    kube_api.remove(RESOURCE_CLAIMS, "c", "default")
    gate.set()
    await settled(writer)
    assert writes(writer, "gave_up") == 1 and writes(writer, "ok") == 0
    await unprepare(node)
    await settled(writer)
    assert writes(writer, "ok") == 1  # a 404 on removal: nothing of ours is left anywhere


async def test_readiness_false_after_devices_changed_and_back(node, kube_api, online):
    links = Links()
    writer = online(readiness=links)
    kube_api.add(claim("c", UID, [result(NIC, "net"), result("gpu-0", "gpu")]))
    await prepare(node)
    await settled(writer)
    first = ready(devices_of(kube_api)[DRIVER, NIC])
    assert first["status"] == "True"

    links.down.add(NIC)
    assert writer.devices_changed([NIC]) == 1
    await settled(writer)
    down = ready(devices_of(kube_api)[DRIVER, NIC])
    assert (down["status"], down["reason"], down["message"]) == ("False", "LinkDown", "ens1f0 has no carrier")
    assert ready(devices_of(kube_api)[DRIVER, "gpu-0"])["status"] == "True"  # the other device is not affected

    links.down.clear()
    writer.devices_changed([NIC])
    await settled(writer)
    assert ready(devices_of(kube_api)[DRIVER, NIC])["status"] == "True"
    assert writer.devices_changed(["gpu-7"]) == 0  # no prepared claim holds it


async def test_new_addresses_are_applied_when_the_metadata_is_refreshed(node, kube_api, online):
    writer = online()
    kube_api.add(claim("c", UID, [result(NIC, "net")]))
    await prepare(node)
    await settled(writer)
    node.nic_source.devices = [nic(ips=("10.0.0.5/24", "fd00::5/64"))]
    await node.inventory.scan()
    assert await node.engine.refresh_devices([NIC]) == 1  # generation + 1: claim_refreshed
    await settled(writer)
    assert devices_of(kube_api)[DRIVER, NIC]["networkData"]["ips"] == ["10.0.0.5/24", "fd00::5/64"]


async def test_resync_writes_every_prepared_claim(node, kube_api, online):
    first = online()
    kube_api.add(claim("c", UID, [result("gpu-0", "gpu")]))
    await prepare(node)
    await settled(first)
    await first.stop()
    await apply_as(kube_api, DRIVER, [])  # the status was lost while no agent ran
    assert devices_of(kube_api) == {}

    again = online()
    assert again.resync(node.engine.records.values()) == 1
    await settled(again)
    assert ready(devices_of(kube_api)[DRIVER, "gpu-0"])["status"] == "True"


async def prepared_and_stopped(node, kube_api, writer, count: int) -> None:
    """`count` claims c0, c1... (a GPU each) prepared and their status written by `writer`, then stopped."""
    for i in range(count):
        uid = f"1e570000-0000-4000-8000-{i:012d}"
        kube_api.add(claim(f"c{i}", uid, [result(f"gpu-{i}", "gpu")]))
        await prepare(node, uid, f"c{i}")
    await settled(writer)
    await writer.stop()


CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"


async def test_a_restart_after_an_orderly_stop_reads_no_claim_and_writes_what_changed_alone(node, kube_api, online):
    # Before, a restarted agent read its claims' stored status back with one LIST per namespace, which needed
    # `list` on every namespace's claims (every tenant's, opaque configuration and all). Now the writer that
    # stopped says what it wrote, and the next one reads nothing: a claim whose entries are the same costs
    # no request, one whose entries changed while no agent ran is written without a read.
    gpus = Gpus()
    first = online(readiness=gpus)
    await prepared_and_stopped(node, kube_api, first, 3)
    known = first.written()
    assert sorted(known) == sorted(node.engine.records)
    gpus.lost.add("gpu-2")  # its Ready condition changes while no agent runs

    again = online(readiness=gpus)
    again.restore_written(known)
    kube_api.mark()
    assert again.resync(node.engine.records.values()) == 3
    await settled(again)
    sent = [(e.method, e.path) for e in kube_api.since_mark()]
    assert sent == [("PATCH", f"{CLAIMS}/c2/status")], sent
    assert writes(again, "unchanged") == 2 and writes(again, "ok") == 1
    assert ready(devices_of(kube_api, "c2")[DRIVER, "gpu-2"])["status"] == "False"


async def test_a_restart_that_was_told_nothing_reads_each_claim_by_itself_and_never_lists(node, kube_api, online):
    # After a crash nothing says what was written: each claim prepared here is read back, a GET of that claim
    # alone, never a LIST of the namespace. A claim whose stored entries were lost meanwhile is written again.
    await prepared_and_stopped(node, kube_api, online(), 3)
    await apply_as(kube_api, DRIVER, [], name="c2")  # lost while no agent ran

    again = online()
    kube_api.mark()
    assert again.resync(node.engine.records.values()) == 3
    await settled(again)
    sent = sorted((e.method, e.path) for e in kube_api.since_mark())
    assert sent == [("GET", f"{CLAIMS}/c{i}") for i in range(3)] + [("PATCH", f"{CLAIMS}/c2/status")], sent
    assert writes(again, "unchanged") == 2 and writes(again, "ok") == 1
    assert ready(devices_of(kube_api, "c2")[DRIVER, "gpu-2"])["status"] == "True"


async def test_what_was_written_is_kept_only_while_no_other_agent_can_write_after(node, kube_api, online):
    """`agent.health.statuswritten`: saved at an orderly stop and taken by the next start, unless another agent
    shares the state directory (a rolling update's: it writes after this one stops) or came and went between."""
    from agent.claims.writers import WRITERS_LOCK_FILE, RecordWriters
    from agent.health import statuswritten

    first = online()
    await prepared_and_stopped(node, kube_api, first, 2)
    known = first.written()
    path = statuswritten.path_of(node.settings.state_dir)
    opened: list[RecordWriters] = []

    def arrive() -> RecordWriters:
        """Another agent's registration as a writer of the state directory."""
        opened.append(RecordWriters(node.settings.state_dir / WRITERS_LOCK_FILE))
        opened[-1].open()
        return opened[-1]

    try:
        stopping = node.engine.writers  # the agent that stops in order, alone
        assert statuswritten.save(path, known, stopping) == 2
        stopping.close()
        nxt = arrive()
        assert statuswritten.take(path, nxt) == known and not path.exists()
        assert statuswritten.take(path, nxt) == {}  # taken once: a crash later leaves nothing to trust

        # A rolling update: another agent is there while this one stops, and writes after it.
        other = arrive()
        assert statuswritten.save(path, known, nxt) == 0 and not path.exists()
        nxt.close()

        # Kept by the last one, then an agent came and went (it may have written): the next reads back.
        assert statuswritten.save(path, known, other) == 2
        other.close()
        arrive().close()
        assert statuswritten.take(path, arrive()) == {} and not path.exists()
    finally:
        for w in opened:
            w.close()


async def test_a_restart_keeps_the_time_ready_last_changed_and_sends_what_is_stored_already(node, kube_api, online):
    # Each writer after the first is a restarted agent; each one's clock runs later than the last one's,
    # so that a time it dates cannot be mistaken for a stored one.
    links = Links()
    first = online(readiness=links, transitions=ReadyTransitions(clock=lambda: time.time() + 1800))
    kube_api.add(claim("c", UID, [result(NIC, "net"), result("gpu-0", "gpu")]))
    await prepare(node)
    await settled(first)
    prepared_at = ready(devices_of(kube_api)[DRIVER, NIC])["lastTransitionTime"]
    links.down.add(NIC)
    first.devices_changed([NIC])
    await settled(first)
    down = ready(devices_of(kube_api)[DRIVER, NIC])
    await first.stop()

    # Restarted while the link is still down: not ready since the same moment; nothing to send.
    again = online(readiness=links, transitions=ReadyTransitions(clock=lambda: time.time() + 3600))
    again.resync(node.engine.records.values())
    await settled(again)
    assert ready(devices_of(kube_api)[DRIVER, NIC]) == down
    assert writes(again, "unchanged") == 1 and writes(again, "ok") == 0
    links.down.clear()
    again.devices_changed([NIC])
    await settled(again)
    up = ready(devices_of(kube_api)[DRIVER, NIC])
    assert up["status"] == "True" and up["lastTransitionTime"] > down["lastTransitionTime"] > prepared_at
    await again.stop()

    # Restarted once it is up again: ready since it came up, not since the prepare.
    third = online(readiness=links, transitions=ReadyTransitions(clock=lambda: time.time() + 7200))
    third.resync(node.engine.records.values())
    await settled(third)
    assert ready(devices_of(kube_api)[DRIVER, NIC])["lastTransitionTime"] == up["lastTransitionTime"]
    assert ready(devices_of(kube_api)[DRIVER, "gpu-0"])["lastTransitionTime"] == prepared_at


async def test_what_the_api_would_refuse_is_clipped_before_sending(tmp_path, kube_api, writers, caplog):
    valid = [f"10.0.{i}.5/24" for i in range(20)]
    many = ("10.1.0.005/24", *valid)  # not canonical (and not even parsed by the API server), then 20
    node = await make_node(tmp_path, nics=[nic(ips=many)])
    node.engine.claims = ApiClaimSource(kube_api.client())
    writer = ClaimStatusWriter(DRIVER, ApiStatusSink(kube_api.client(), DRIVER), node.inventory, node.engine.book,
                               backoff=FAST)
    writers.append(writer)
    node.engine.listeners.append(writer)
    kube_api.add(claim("c", UID, [result(NIC, "net")]))
    with caplog.at_level(logging.WARNING, "agent.health.claimstatus"):
        await prepare(node)
        await settled(writer)
    assert devices_of(kube_api)[DRIVER, NIC]["networkData"]["ips"] == valid[:16]
    assert writes(writer, "ok") == 1
    assert "'10.1.0.005/24' must be an address in CIDR form" in caplog.text
    assert "beyond the first 16" in caplog.text


# -- the emulator is as strict as the API server ---------------------------------------------------

@pytest.mark.parametrize(("entry", "field", "says"), [
    ({"driver": DRIVER, "pool": NODE, "device": "gpu-3"}, "status.devices[0]", "must be an allocated device"),
    ({"driver": DRIVER, "pool": NODE, "device": "gpu-0",
      "networkData": {"ips": [f"10.0.0.{i}/24" for i in range(17)]}},
     "status.devices[0].networkData.ips", "Too many: 17"),
    ({"driver": DRIVER, "pool": NODE, "device": "gpu-0", "networkData": {"ips": ["10.0.0.1"]}},
     "status.devices[0].networkData.ips[0]", "CIDR"),
    ({"driver": DRIVER, "pool": NODE, "device": "gpu-0",
      "conditions": [{"type": f"C{i}", "status": "True", "reason": "R", "message": "",
                      "lastTransitionTime": "2024-01-01T00:00:00Z"} for i in range(9)]},
     "status.devices[0].conditions", "Too many: 9"),
    ({"driver": DRIVER, "pool": NODE, "device": "gpu-0", "data": {"x": "y" * 10240}},
     "status.devices[0].data", "Too long"),
])
async def test_the_emulator_refuses_what_the_api_server_refuses(kube_api, entry, field, says):
    kube_api.add(claim("c", UID, [result("gpu-0", "gpu")]))
    before = kube_api.get(RESOURCE_CLAIMS, "c", "default")
    with pytest.raises(ApiError) as caught:
        await apply_as(kube_api, DRIVER, [entry])
    status = caught.value.status
    assert status.code == 422 and status.reason == "Invalid"
    assert status.details is not None and status.details.causes
    assert any(c.field == field and says in (c.message or "") for c in status.details.causes)
    assert kube_api.get(RESOURCE_CLAIMS, "c", "default") == before


async def test_the_emulator_wants_a_field_manager_and_a_matching_uid(kube_api):
    kube_api.add(claim("c", UID, [result("gpu-0", "gpu")]))
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "c"}}
    async with httpx2.AsyncClient(base_url=kube_api.url) as http:
        answer = await http.patch(STATUS, content=yaml.safe_dump(body),
                                  headers={"Content-Type": "application/apply-patch+yaml"})
        assert answer.status_code == 422 and "fieldManager" in answer.json()["message"]
        body["metadata"]["uid"] = UID2
        answer = await http.patch(STATUS, content=yaml.safe_dump(body), params={"fieldManager": "m"},
                                  headers={"Content-Type": "application/apply-patch+yaml"})
        assert answer.status_code == 422
        assert answer.json()["details"]["causes"][0]["field"] == "metadata.uid"
        answer = await http.patch("/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/gone/status",
                                  content=yaml.safe_dump({**body, "metadata": {"name": "gone"}}),
                                  params={"fieldManager": "m"},
                                  headers={"Content-Type": "application/apply-patch+yaml"})
        assert answer.status_code == 404  # apply never creates through the status subresource


async def test_an_entry_another_manager_owns_conflicts_unless_forced(kube_api):
    kube_api.add(claim("c", UID, [result("dev-9", "x", driver=OTHER, pool="pool-x")]))
    await apply_as(kube_api, OTHER, [other_entry()])
    changed = {**other_entry(), "data": {"from": "someone else"}}
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "c"},
            "status": {"devices": [changed]}}
    with pytest.raises(ApiError) as caught:
        await kube_api.client().patch(ResourceClaimStatus, "c", body, namespace="default",
                                      patch_type=PatchType.APPLY, field_manager="intruder")
    assert caught.value.status.code == 409
    await kube_api.client().patch(ResourceClaimStatus, "c", body, namespace="default",
                                  patch_type=PatchType.APPLY, field_manager="intruder", force=True)
    assert devices_of(kube_api)[OTHER, "dev-9"]["data"] == {"from": "someone else"}
    assert owners_of(kube_api) == {"intruder": {'k:{"device":"dev-9","driver":"other.example.com","pool":"pool-x"}'}}


# -- offline ---------------------------------------------------------------------------------------

async def test_offline_the_status_file_is_written_and_removed(node, writers):
    assert node.settings.offline is not None
    writer = ClaimStatusWriter(DRIVER, DirectoryStatusSink(node.settings.offline), node.inventory,
                               node.engine.book, backoff=FAST)
    writers.append(writer)
    node.engine.listeners.append(writer)
    obj = claim("c", UID, [result("gpu-0", "gpu"), result("dev-9", "x", driver=OTHER, pool="pool-x")])
    obj["status"]["devices"] = [other_entry()]
    write_claim(node.claims_dir, obj)
    await prepare(node)
    await settled(writer)
    path = node.settings.offline / "resourceclaimstatus" / "default" / "c.yaml"
    written = yaml.safe_load(path.read_text())
    assert written["apiVersion"] == "resource.k8s.io/v1" and written["kind"] == "ResourceClaim"
    assert written["metadata"] == {"name": "c", "namespace": "default", "uid": UID}
    entries = {(e["driver"], e["device"]): e for e in written["status"]["devices"]}
    assert set(entries) == {(OTHER, "dev-9"), (DRIVER, "gpu-0")}
    assert ready(entries[DRIVER, "gpu-0"])["status"] == "True" and "uuid" in entries[DRIVER, "gpu-0"]["data"]
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp file left

    await unprepare(node)
    await settled(writer)
    assert not path.exists()


async def test_offline_a_status_file_in_block_style_is_removed_only_for_its_uid(tmp_path):
    """Status files are written as JSON now; one an older agent wrote in block-style YAML is still
    read back: removed at unprepare when it names the claim's UID, kept when it names another."""
    sink = DirectoryStatusSink(tmp_path)
    ref = ClaimRef("default", "c", UID)
    path = sink.path(ref)
    path.parent.mkdir(parents=True)
    for uid, kept in ((UID2, True), (UID, False)):
        path.write_text(yaml.safe_dump({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                        "metadata": {"name": "c", "namespace": "default", "uid": uid}},
                                       default_flow_style=False))
        await sink.write(ref, [])
        assert path.exists() is kept


async def test_offline_a_claim_file_with_another_uid_is_not_written(node, writers):
    assert node.settings.offline is not None
    writer = ClaimStatusWriter(DRIVER, DirectoryStatusSink(node.settings.offline), node.inventory,
                               node.engine.book, backoff=FAST)
    writers.append(writer)
    node.engine.listeners.append(writer)
    write_claim(node.claims_dir, claim("c", UID, [result("gpu-0", "gpu")]))
    gone = asyncio.Event()
    real_write = writer.sink.write

    async def after_recreate(target, entries):
        write_claim(node.claims_dir, claim("c", UID2, [result("gpu-0", "gpu")]))
        gone.set()
        await real_write(target, entries)

    writer.sink.write = after_recreate  # type: ignore[method-assign]
    await prepare(node)
    await settled(writer)
    assert gone.is_set() and writes(writer, "gave_up") == 1
    assert not (node.settings.offline / "resourceclaimstatus" / "default" / "c.yaml").exists()


class _CountingSink:
    """Takes every write, a little slowly, and remembers the most claims ever queued at once."""

    def __init__(self) -> None:
        self.written: list[str] = []
        self.writer: ClaimStatusWriter | None = None
        self.most_queued = 0

    async def write(self, claim: Any, entries: Any) -> None:
        assert self.writer is not None
        self.most_queued = max(self.most_queued, self.writer.queued)
        await asyncio.sleep(0.001)
        self.written.append(claim.uid)

    async def read(self, claim: Any) -> list[dict[str, Any]]:
        return []  # nothing written yet: each claim's status is written


async def test_a_resync_of_many_claims_is_fed_a_window_at_a_time(node, writers) -> None:
    from agent.health.claimstatus import RESYNC_WINDOW

    uids = [f"7a110000-0000-4000-8000-{i:012d}" for i in range(3 * RESYNC_WINDOW)]
    for i, uid in enumerate(uids):
        write_claim(node.claims_dir, claim(f"c{i}", uid, [result("gpu-0", "gpu")]))
        await prepare(node, uid, f"c{i}")
    sink = _CountingSink()
    writer = ClaimStatusWriter(DRIVER, sink, node.inventory, node.engine.book, backoff=FAST,
                               metrics=Metrics(process=False))
    sink.writer = writer
    writers.append(writer)
    assert writer.resync(node.engine.records.values()) == len(uids)
    await settled(writer)
    assert sorted(sink.written) == sorted(uids)
    assert 0 < sink.most_queued <= RESYNC_WINDOW


def test_an_update_keeps_every_raw_field_as_stored_and_replaces_only_our_entries() -> None:
    """The body of a status update (`agent.health.statusupdate`): the allocation's parameters and the kept
    entries' data are the stored bytes, byte for byte (spaces, key order); ours are replaced; the managed
    fields are left to the API server."""
    from agent.health.statusupdate import StoredRaw, update_body

    params = b'{"kind": "DeviceConfig", "apiVersion": "x/v1"}'
    theirs = b'{"b": 1,  "a": 2}'
    obj = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
           "metadata": {"name": "c", "namespace": "ns", "uid": "u", "resourceVersion": "7",
                        "managedFields": [{"manager": "kube-scheduler"}]},
           "status": {"allocation": {"devices": {"results": [], "config": [
               {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {"kind": "DeviceConfig"}}},
               {"source": "FromClass"}]}},
               "devices": [{"driver": DRIVER, "pool": NODE, "device": "gpu-0", "data": {"old": 1}},
                           {"driver": "other.example.com", "pool": "p", "device": "x", "data": {"a": 2, "b": 1}}]}}
    stored = StoredRaw("u", "7", (params, None), (b'{"old":1}', theirs))
    ours = [{"driver": DRIVER, "pool": NODE, "device": "gpu-1"}]
    body = update_body(obj, stored, DRIVER, ours)
    assert params in body and theirs in body and b"managedFields" not in body and b'"resourceVersion":"7"' in body
    assert b"gpu-0" not in body and b'"device":"gpu-1"' in body
    removed = update_body(obj, stored, DRIVER, [])
    assert b"gpu-" not in removed and theirs in removed
    # No entries left at all: no status.devices either.
    alone = {**obj, "status": {**obj["status"], "devices": obj["status"]["devices"][:1]}}
    assert b'"devices":[{' not in update_body(alone, StoredRaw("u", "7", (params, None), (None,)), DRIVER, [])
    with pytest.raises(ValueError, match="allocation config entries"):
        update_body(obj, StoredRaw("u", "7", (params,), ()), DRIVER, ours)


async def test_a_claim_found_gone_after_its_unprepare_is_not_remembered(node, writers) -> None:
    """The kubelet unprepares while the prepare's status write is in flight, then the claim is deleted: the
    write finds it gone. What the writer remembers of gone claims is for prepared ones (it skips their
    writes until the unprepare), and one whose unprepare came first is never forgotten: with claims coming
    and going the set only grew."""
    assert node.settings.offline is not None
    writer = ClaimStatusWriter(DRIVER, DirectoryStatusSink(node.settings.offline), node.inventory,
                               node.engine.book, backoff=FAST, metrics=Metrics(process=False))
    writers.append(writer)
    node.engine.listeners.append(writer)
    real_write, started, go = writer.sink.write, asyncio.Event(), asyncio.Event()

    async def held(target: ClaimRef, entries: Any) -> None:
        if entries:  # the prepare's write waits until the claim is unprepared and deleted
            started.set()
            await go.wait()
        await real_write(target, entries)

    writer.sink.write = held  # type: ignore[method-assign]
    for i in range(3):
        uid, name = f"7a110000-0000-4000-8000-{i + 100:012d}", f"gone-{i}"
        write_claim(node.claims_dir, claim(name, uid, [result("gpu-0", "gpu")]))
        started.clear()
        go.clear()
        await prepare(node, uid, name)
        await asyncio.wait_for(started.wait(), WAIT)
        await unprepare(node, uid, name)
        (node.claims_dir / "default" / f"{name}.yaml").unlink()
        go.set()
        await settled(writer)
    assert writes(writer, "gave_up") == 3
    assert writer._gone == set()


async def test_an_agent_restarted_in_order_asks_the_api_server_nothing_about_its_claims(
        kube_api, cluster_settings, agents) -> None:  # noqa: F811
    # The running agent, stopped and started again as a rolling restart's single agent is: its resync of the
    # claims' status sends no request for them (before: a LIST of every namespace holding them).
    kube_api.add_node(NODE, uid=NODE_UID)
    refs = [ClaimRef("team-a", f"c{i}", f"5e570000-0000-4000-8000-{i:012d}") for i in range(3)]
    for i, ref in enumerate(refs):
        kube_api.add(claim(ref.name, ref.uid, [result(f"gpu-{i}", "gpu")], namespace=ref.namespace))
    settings = cluster_settings()
    agent = await start(agents, settings)
    async with kc.DRAClient(settings.dra_socket) as client:
        assert all(c.error == "" for c in (await client.prepare(refs)).claims.values())

    def status_written() -> bool:
        return all((kube_api.get(RESOURCE_CLAIMS, r.name, r.namespace) or {}).get("status", {}).get("devices")
                   for r in refs)

    await eventually(status_written, "the claims' status written")
    await agent.stop()
    agents.remove(agent)
    agent.engine.close()  # as the process's exit does: its registration as a writer of records goes

    kube_api.mark()
    again = await start(agents, settings)
    await eventually(lambda: again.recovered.is_set(), "the start-up check done")
    await asyncio.wait_for(again.running.claim_status.idle(), WAIT)
    assert [(e.method, e.path) for e in kube_api.since_mark() if "/resourceclaims" in e.path] == []
    assert writes(again.running.claim_status, "unchanged") == 3
