"""Reading ResourceClaims for prepare: from the API emulator over real HTTP, and from a directory."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx2
import pytest
import yaml
from handshakes import until
from kubeapi import RESOURCE_CLAIMS, KubeApi

from agent.claims.sources import ApiClaimSource, ClaimNotFound, ClaimSourceError, DirectoryClaimSource
from agent.kube import Backoff

FAST = Backoff(initial=0.01, maximum=0.05)


def claim(namespace: str = "team-a", name: str = "gpu-claim") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace,
                     "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"}},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}},
        "status": {"allocation": {"devices": {
            "results": [{"request": "gpu", "driver": "dra.example.com", "pool": "node-a", "device": "gpu-0",
                         "consumedCapacity": {"memory": "40Gi"},
                         "shareID": "7c0a1a52-0000-4000-8000-00000000000a"}],
            "config": [{"source": "FromClaim", "requests": ["gpu"],
                        "opaque": {"driver": "dra.example.com",
                                   "parameters": {"mode": "exclusive", "n": [1, 2]}}}]}},
            "reservedFor": [{"resource": "pods", "name": "p", "uid": "u-1"}]},
    }


def path(namespace: str, name: str) -> str:
    return f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"


def statuses(api: KubeApi) -> list[int | None]:
    return [r.status for r in api.requests]


# -- API server ---------------------------------------------------------------------------------

async def test_a_claim_comes_back_as_the_api_sent_it(kube_api: KubeApi) -> None:
    stored = kube_api.add(claim())
    source = ApiClaimSource(kube_api.client(), concurrency=4, deadline=10, backoff=FAST)
    got = await source.get("team-a", "gpu-claim")
    assert got == stored == kube_api.get(RESOURCE_CLAIMS, "gpu-claim", "team-a")
    assert got["metadata"]["uid"] and got["status"]["allocation"]["devices"]["results"][0]["shareID"]


async def test_a_missing_claim_is_not_found(kube_api: KubeApi) -> None:
    kube_api.add(claim())
    source = ApiClaimSource(kube_api.client(), deadline=10, backoff=FAST)
    with pytest.raises(ClaimNotFound, match="team-b/gpu-claim"):
        await source.get("team-b", "gpu-claim")
    assert statuses(kube_api) == [404]


async def test_server_errors_are_retried(kube_api: KubeApi) -> None:
    kube_api.add(claim())
    kube_api.fail("GET", path("team-a", "gpu-claim"), times=2, status=500)
    kube_api.fail("GET", path("team-a", "gpu-claim"), status=429)
    source = ApiClaimSource(kube_api.client(), deadline=10, backoff=FAST)
    got = await source.get("team-a", "gpu-claim")
    assert got["metadata"]["name"] == "gpu-claim"
    assert statuses(kube_api) == [500, 500, 429, 200]


async def test_a_hanging_request_times_out_and_is_retried(kube_api: KubeApi) -> None:
    kube_api.add(claim())
    kube_api.hang("GET", path("team-a", "gpu-claim"), seconds=3.0)
    source = ApiClaimSource(kube_api.client(timeout=0.3), deadline=10, backoff=FAST)
    got = await source.get("team-a", "gpu-claim")
    assert got["metadata"]["name"] == "gpu-claim" and len(kube_api.requests) == 2


async def test_the_deadline_ends_the_retries(kube_api: KubeApi) -> None:
    kube_api.add(claim())
    kube_api.fail("GET", path("team-a", "gpu-claim"), times=10**6, status=503)
    source = ApiClaimSource(kube_api.client(), deadline=0.3, backoff=FAST)
    with pytest.raises(ClaimSourceError, match=r"team-a/gpu-claim did not succeed within 0\.3s.*HTTP 503"):
        await source.get("team-a", "gpu-claim")
    assert len(kube_api.requests) > 1 and set(statuses(kube_api)) <= {503, None}


async def test_the_deadline_covers_a_request_that_never_answers(kube_api: KubeApi) -> None:
    kube_api.add(claim())
    gate = kube_api.hold("GET", path("team-a", "gpu-claim"))
    source = ApiClaimSource(kube_api.client(timeout=30), deadline=0.3, backoff=FAST)
    try:
        with pytest.raises(ClaimSourceError, match=r"within 0\.3s"):
            await source.get("team-a", "gpu-claim")
    finally:
        gate.set()


async def test_forbidden_is_not_retried(kube_api: KubeApi) -> None:
    kube_api.add(claim())
    kube_api.fail("GET", path("team-a", "gpu-claim"), times=10, status=403)
    source = ApiClaimSource(kube_api.client(), deadline=10, backoff=FAST)
    with pytest.raises(ClaimSourceError, match="HTTP 403"):
        await source.get("team-a", "gpu-claim")
    assert statuses(kube_api) == [403]


class CallCounting:
    """The API client, counting the requests the claim source hands it."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.calls = 0

    async def get(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return await self.client.get(*args, **kwargs)


@pytest.mark.parametrize("limit", [2, 5])
async def test_concurrency_is_bounded(kube_api: KubeApi, limit: int) -> None:
    for i in range(8):
        kube_api.add(claim(name=f"c{i}"))
    gate = kube_api.hold("GET", "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/*")
    client = CallCounting(kube_api.client())
    source = ApiClaimSource(client, concurrency=limit, deadline=20, backoff=FAST)  # type: ignore[arg-type]
    gets = [asyncio.create_task(source.get("team-a", f"c{i}")) for i in range(8)]
    await until(lambda: kube_api.emulator.in_flight >= limit, "the first requests at the API server")
    # Every get has run as far as it can by now (each was started before the first request went out,
    # and a get not held back would have called the client at once): the rest wait for a slot.
    assert client.calls == limit and kube_api.emulator.in_flight == limit
    assert not any(get.done() for get in gets)
    gate.set()
    got = await asyncio.gather(*gets)
    assert [c["metadata"]["name"] for c in got] == [f"c{i}" for i in range(8)]
    assert kube_api.emulator.max_in_flight == limit


# -- offline directory --------------------------------------------------------------------------

def write_claim(root: Path, namespace: str, name: str, text: str) -> Path:
    directory = root / "resourceclaims" / namespace
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{name}.yaml"
    target.write_text(text)
    return target


async def test_directory_claim_in_yaml_and_in_json(tmp_path: Path) -> None:
    write_claim(tmp_path, "team-a", "gpu-claim", yaml.safe_dump(claim()))
    write_claim(tmp_path, "team-a", "as-json", json.dumps(claim(name="as-json"), indent=1))
    source = DirectoryClaimSource(tmp_path)
    assert await source.get("team-a", "gpu-claim") == claim()
    assert await source.get("team-a", "as-json") == claim(name="as-json")


async def test_directory_missing_claim_is_not_found(tmp_path: Path) -> None:
    source = DirectoryClaimSource(tmp_path)
    with pytest.raises(ClaimNotFound, match="team-a/nope"):
        await source.get("team-a", "nope")


@pytest.mark.parametrize("text", ["{ broken: [", "- just\n- a list\n", "42\n", ""])
async def test_directory_unusable_content_is_an_error(tmp_path: Path, text: str) -> None:
    write_claim(tmp_path, "team-a", "bad", text)
    with pytest.raises(ClaimSourceError, match="team-a/bad"):
        await DirectoryClaimSource(tmp_path).get("team-a", "bad")


async def test_directory_unreadable_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "resourceclaims" / "team-a" / "dir.yaml").mkdir(parents=True)
    with pytest.raises(ClaimSourceError, match="cannot read"):
        await DirectoryClaimSource(tmp_path).get("team-a", "dir")


@pytest.mark.parametrize(("namespace", "name"), [
    ("..", "secret"), ("team-a", "../../secret"), ("team-a/x", "y"), (".", "secret"), ("", "x"), ("a", ""),
    ("team-a", "x\0y"),
])
async def test_directory_refuses_paths_that_leave_it(tmp_path: Path, namespace: str, name: str) -> None:
    (tmp_path / "secret.yaml").write_text(yaml.safe_dump(claim()))
    (tmp_path / "resourceclaims").mkdir()
    (tmp_path / "resourceclaims" / "secret.yaml").write_text(yaml.safe_dump(claim()))
    with pytest.raises(ClaimSourceError):
        await DirectoryClaimSource(tmp_path).get(namespace, name)


async def test_directory_refuses_a_symlink_out(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.yaml"
    outside.write_text(yaml.safe_dump(claim()))
    (tmp_path / "resourceclaims" / "team-a").mkdir(parents=True)
    os.symlink(outside, tmp_path / "resourceclaims" / "team-a" / "sneaky.yaml")
    write_claim(tmp_path, "team-a", "fine", yaml.safe_dump(claim(name="fine")))
    source = DirectoryClaimSource(tmp_path)
    with pytest.raises(ClaimSourceError, match="outside"):
        await source.get("team-a", "sneaky")
    assert (await source.get("team-a", "fine"))["metadata"]["name"] == "fine"


# -- the emulator's claim semantics, which status writers will rely on ----------------------------

async def test_emulator_status_subresource_and_main_resource_stay_apart(kube_api: KubeApi) -> None:
    stored = kube_api.add(claim())
    base = path("team-a", "gpu-claim")
    async with httpx2.AsyncClient(base_url=kube_api.url) as http:
        # A write to the main resource cannot change status ...
        body = {**stored, "status": {"devices": []}, "spec": {"devices": {"requests": []}}}
        put = await http.put(base, json=body)
        assert put.status_code == 200
        after = put.json()
        assert after["status"] == stored["status"] and after["spec"] == {"devices": {"requests": []}}
        assert int(after["metadata"]["resourceVersion"]) > int(stored["metadata"]["resourceVersion"])
        # ... and one to status cannot change anything else.
        devices = [{"driver": "dra.example.com", "pool": "node-a", "device": "gpu-0",
                    "shareID": "7c0a1a52-0000-4000-8000-00000000000a",
                    "conditions": [{"type": "Ready", "status": "True", "reason": "Prepared", "message": "",
                                    "lastTransitionTime": "2024-01-01T00:00:00Z"}]}]
        patch = await http.patch(f"{base}/status", json={"spec": {"x": 1}, "status": {"devices": devices}},
                                 headers={"Content-Type": "application/merge-patch+json"})
        assert patch.status_code == 200
        patched = patch.json()
        assert patched["status"]["devices"] == devices and patched["spec"] == after["spec"]
        assert patched["status"]["allocation"] == stored["status"]["allocation"]
        # A write carrying an old resourceVersion is refused.
        stale = await http.put(f"{base}/status", json={**patched, "metadata": after["metadata"]})
        assert stale.status_code == 409 and stale.json()["reason"] == "Conflict"
        # Deleted is gone.
        assert (await http.delete(base)).status_code == 200
        assert (await http.get(base)).status_code == 404


async def test_emulator_selectors_on_list(kube_api: KubeApi) -> None:
    for i, team in enumerate(("team-a", "team-a", "team-b")):
        obj = claim(namespace=team, name=f"c{i}")
        obj["metadata"]["labels"] = {"app": "train" if i else "serve", "tier": str(i)}
        kube_api.add(obj)
    async with httpx2.AsyncClient(base_url=kube_api.url) as http:
        async def names(url: str, **params: str) -> list[str]:
            answer = await http.get(url, params=params)
            assert answer.status_code == 200, answer.text
            return [o["metadata"]["name"] for o in answer.json()["items"]]

        every = "/apis/resource.k8s.io/v1/resourceclaims"
        assert await names(every) == ["c0", "c1", "c2"]
        assert await names("/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims") == ["c0", "c1"]
        assert await names(every, labelSelector="app=train") == ["c1", "c2"]
        assert await names(every, labelSelector="app!=train,tier") == ["c0"]
        assert await names(every, labelSelector="tier in (0, 2)") == ["c0", "c2"]
        assert await names(every, labelSelector="!nolabel,tier notin (1)") == ["c0", "c2"]
        assert await names(every, fieldSelector="metadata.namespace=team-b") == ["c2"]
        refused = await http.get(every, params={"fieldSelector": "spec.devices=x"})
        assert refused.status_code == 400 and "field label not supported" in refused.json()["message"]


async def test_emulator_generated_names_are_unique_and_watch_sees_changes(kube_api: KubeApi) -> None:
    async with httpx2.AsyncClient(base_url=kube_api.url) as http:
        url = "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims"
        events: list[dict[str, Any]] = []

        async def watch() -> None:
            async with http.stream("GET", url, params={"watch": "true"}) as stream:
                async for line in stream.aiter_lines():
                    if line.strip():
                        events.append(json.loads(line))

        watcher = asyncio.create_task(watch())
        made = []
        for _ in range(5):
            body = claim()
            del body["metadata"]["name"]
            body["metadata"]["generateName"] = "gpu-claim-"
            answer = await http.post(url, json=body)
            assert answer.status_code == 201
            made.append(answer.json()["metadata"])
        assert len({m["name"] for m in made}) == 5 and len({m["uid"] for m in made}) == 5
        assert all(m["name"].startswith("gpu-claim-") and len(m["name"]) == len("gpu-claim-") + 5
                   for m in made)
        for _ in range(1000):
            if len(events) >= 5:
                break
            await asyncio.sleep(0.01)
        watcher.cancel()
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
            ("ADDED", m["name"]) for m in made]
