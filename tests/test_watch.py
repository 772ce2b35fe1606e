"""The agent's watches of the API server (agent/kube/watch.py) against the API emulator over real HTTP: a
claim whose opaque parameters nest 1,500 levels deep (3 KB, what the API server 1.37.2 stores and sends) is
skipped, said once, and the claims after it are delivered by the same watch request; another node's such
claim is dropped unsaid, before its configuration is decoded; a watch that fails after delivering an event
backs off more at each failure and resumes from the version it saw (a 410 starts it over); the slices watch
skips what does not decode the same way. tests/cluster/test_cluster_watch.py shows the first against the
real API server and the agent's own count of its watches."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from agentkit import DRIVER, NODE, claim, result, roots
from hypothesis import given
from hypothesis import strategies as st
from kubeapi import RESOURCE_CLAIMS, WATCH_LINE, KubeApi
from lightkube.resources.resource_v1 import ResourceClaim

from agent.claims.watch import ClaimEvent, ClaimHead, watch_claims
from agent.kube import Backoff, NodeInfo
from agent.kube.watch import _flattened
from agent.publish.apiserver import ApiPublisher

CLAIMS = "/apis/resource.k8s.io/v1/resourceclaims"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
def depth() -> int:
    """Levels past what the decoder takes: 1,500 (the review's claim) where the recursion limit is Python's
    default; some test of the suite raises the limit in this process, and msgspec's bound follows it."""
    return max(1500, sys.getrecursionlimit() + 500)
FAST = Backoff(initial=0.01, maximum=0.02)


def deep_line(obj: dict[str, Any], kind: str = "ADDED") -> str:
    """The watch event of `obj` with a field nested depth() levels deep where it says "DEEP": written as text,
    as Python's own json could not."""
    return json.dumps({"type": kind, "object": obj}).replace('"DEEP"', "[" * depth() + "]" * depth())


def poisoned(name: str, uid: str, pool: str = NODE) -> dict[str, Any]:
    """A claim allocated a GPU in `pool` whose opaque parameters nest depth() levels deep."""
    obj = claim(name, uid, [result("gpu-0", "vm", pool=pool)])
    obj["metadata"]["resourceVersion"] = "7"
    obj["spec"]["devices"]["config"] = [{"opaque": {"driver": DRIVER, "parameters": {"a": "DEEP"}}}]
    return obj


def ours(head: ClaimHead) -> bool:
    return head.allocated_on(DRIVER, NODE)


def watches(api: KubeApi, path: str) -> list[dict[str, str]]:
    """The query of each watch request of `path`, in order."""
    return [r.params for r in api.requests if r.path == path and r.params.get("watch") == "true"]


async def next_claim(events: AsyncIterator[ClaimEvent]) -> tuple[str, str]:
    event = await asyncio.wait_for(anext(events), 10)
    return event.type, event.claim["metadata"]["name"]


def skipped(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and name in r.getMessage()]


async def test_a_claim_that_does_not_decode_is_said_once_and_the_claims_after_it_are_delivered(
        kube_api: KubeApi, caplog: pytest.LogCaptureFixture) -> None:
    line = deep_line(poisoned("b-poisoned", "uid-b"))
    assert 2 * depth() < len(line) < 2 * depth() + 1000  # small: 3 KB at the review's 1,500 levels
    kube_api.add(claim("a-first", "uid-a", [result("gpu-0", "vm")]))
    kube_api.add_line("resource.k8s.io/v1", "ResourceClaim", "b-poisoned", line, namespace="default")
    kube_api.add_line("resource.k8s.io/v1", "ResourceClaim", "c-elsewhere",
                      deep_line(poisoned("c-elsewhere", "uid-c", pool="node-b")), namespace="default")
    kube_api.add(claim("d-next", "uid-d", [result("gpu-1", "vm")]))
    client = kube_api.client()
    events = watch_claims(client, wanted=ours, backoff=FAST)
    try:
        assert await next_claim(events) == ("ADDED", "a-first")
        assert await next_claim(events) == ("ADDED", "d-next")
        # The poisoned claim changes (the scheduler's reservation): not said again. A claim made after it comes.
        await kube_api.emulator._buses[RESOURCE_CLAIMS].put(
            {"type": "MODIFIED", "object": {WATCH_LINE: deep_line(poisoned("b-poisoned", "uid-b"), "MODIFIED"),
                                            "metadata": {"namespace": "default", "name": "b-poisoned"}}})
        await client.create(ResourceClaim.from_dict(claim("e-last", "uid-e", [result("gpu-2", "vm")])))
        assert await next_claim(events) == ("ADDED", "e-last")
    finally:
        await events.aclose()
    # One watch request throughout: no claim of the cluster was sent twice.
    assert len(watches(kube_api, CLAIMS)) == 1
    (said,) = skipped(caplog, "b-poisoned")
    assert "default/b-poisoned (uid uid-b, resourceVersion 7)" in said and "RecursionError" in said
    # Another node's claim is dropped from its head, before its configuration is decoded: nothing to say.
    assert skipped(caplog, "c-elsewhere") == []


class Counted(Backoff):
    """Backoff that records which failure in a row each delay is for, and waits not at all."""

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "failures", [])

    def delay(self, failures: int, exc: BaseException | None = None) -> float:
        self.failures.append(failures)  # type: ignore[attr-defined]
        return 0.0


@pytest.mark.parametrize(("code", "resumed"), [(500, True), (410, False)])
async def test_a_watch_that_fails_after_an_event_backs_off_more_each_time(kube_api: KubeApi, code: int,
                                                                           resumed: bool) -> None:
    """Every watch request sends the one claim and then an ERROR: before, the claim reset the backoff, so the
    watch started again at the first delay (about a second) for ever, and without a resourceVersion."""
    version = kube_api.add(claim("a-good", "uid-a", [result("gpu-0", "vm")]))["metadata"]["resourceVersion"]
    status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "injected", "code": code}
    kube_api.add_line("resource.k8s.io/v1", "ResourceClaim", "z-error",
                      json.dumps({"type": "ERROR", "object": status}), namespace="default")
    backoff = Counted()
    events = watch_claims(kube_api.client(), wanted=ours, backoff=backoff)
    try:
        for _ in range(4):
            assert await next_claim(events) == ("ADDED", "a-good")
    finally:
        await events.aclose()
    assert backoff.failures[:3] == [1, 2, 3]  # type: ignore[attr-defined]
    first, *again = watches(kube_api, CLAIMS)[:4]
    assert "resourceVersion" not in first and len(again) == 3
    # A server error: resumed from the version seen. A 410 (that version is gone): every claim again.
    assert [w.get("resourceVersion") for w in again] == ([version] * 3 if resumed else [None] * 3)


async def test_the_slices_watch_skips_a_slice_that_does_not_decode(kube_api: KubeApi, tmp_path: Any,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    def made(name: str) -> dict[str, Any]:
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
                "spec": {"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE, "generation": 1,
                                                                      "resourceSliceCount": 1}, "devices": []}}

    first = kube_api.add(made("s-first"))["metadata"]["resourceVersion"]
    bad = made("s-poisoned")
    bad["metadata"] |= {"uid": "uid-s", "resourceVersion": "8"}
    bad["spec"]["devices"] = "DEEP"
    kube_api.add_line("resource.k8s.io/v1", "ResourceSlice", "s-poisoned", deep_line(bad))
    after = kube_api.add(made("s-next"))["metadata"]["resourceVersion"]
    publisher = ApiPublisher(kube_api.client(), roots(tmp_path), NodeInfo(NODE, "node-uid"), backoff=FAST)
    changes = publisher.changes()
    try:
        assert await asyncio.wait_for(anext(changes), 10) == ("s-first", first)
        assert await asyncio.wait_for(anext(changes), 10) == ("s-next", after)
    finally:
        await changes.aclose()  # type: ignore[attr-defined]
    assert len(watches(kube_api, SLICES)) == 1
    (said,) = skipped(caplog, "s-poisoned")
    assert "RecursionError" in said


# -- the head of an object too deep to decode -----------------------------------------------------------

TEXT = st.text(alphabet=st.sampled_from('ab"\\[]{},:\n\u00e9\U0001f600'), max_size=6)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                    max_leaves=40)


def cut_at(value: Any, depth: int, level: int = 1) -> Any:
    """`value` with every list or object nested deeper than `depth` replaced by None."""
    if isinstance(value, list | dict) and level > depth:
        return None
    if isinstance(value, list):
        return [cut_at(v, depth, level + 1) for v in value]
    if isinstance(value, dict):
        return {k: cut_at(v, depth, level + 1) for k, v in value.items()}
    return value


@given(JSON, st.integers(min_value=0, max_value=5), st.booleans())
def test_an_object_is_cut_at_a_depth_whatever_its_strings_hold(value: Any, depth: int, ascii_only: bool) -> None:
    # Brackets, quotes and escapes inside strings are text: only the structure is cut.
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert json.loads(_flattened(text, depth)) == cut_at(value, depth)
