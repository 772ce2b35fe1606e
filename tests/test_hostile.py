"""Hostile and malformed names never reach a path: every one is a clear error and nothing is
written, inside the configured roots or outside them."""

from __future__ import annotations

import pytest
from agentkit import DRIVER, claim, make_node, result, tree, write_claim

from agent.names import ClaimRef

GOOD_UID = "2a7f0c11-0000-4000-8000-000000000001"

HOSTILE = [
    "../../../../etc/passwd", "..", ".", "a/b", "/abs", "x\x00y", "\x00", "", "ns\n", "Upper",
    "a" * 254, "ünïcödé", "名前", "a..b", "-lead", "trail-", "a b", "a;rm -rf", "%2e%2e", "\\..\\x",
]
HOSTILE_UIDS = [
    "../" + GOOD_UID, GOOD_UID + "/..", GOOD_UID.upper(), GOOD_UID[:-1], GOOD_UID + "0", "", "\x00" * 36,
    "2a7f0c11-0000-4000-8000-00000000000\u0661", "2a7f0c11_0000_4000_8000_000000000001",
]


@pytest.fixture
async def node(tmp_path):
    n = await make_node(tmp_path / "roots")
    # A real claim the hostile refs will try to reach around.
    write_claim(n.claims_dir, claim("victim", GOOD_UID, [result("gpu-0")]))
    return n


def snapshot(tmp_path):
    return tree(tmp_path)


@pytest.mark.parametrize("field", ["namespace", "name"])
@pytest.mark.parametrize("value", HOSTILE)
async def test_hostile_names_are_refused_by_prepare_and_unprepare(node, tmp_path, field, value):
    fields = {"namespace": "default", "name": "victim", "uid": GOOD_UID}
    fields[field] = value
    bad = ClaimRef(**fields)
    before = snapshot(tmp_path)
    out = await node.engine.prepare([bad])
    assert out[GOOD_UID].error and f"claim {field}" in out[GOOD_UID].error, out
    assert out[GOOD_UID].devices == []
    uout = await node.engine.unprepare([bad])
    assert f"claim {field}" in uout[GOOD_UID]
    assert snapshot(tmp_path) == before
    assert node.engine.records == {}


@pytest.mark.parametrize("uid", HOSTILE_UIDS)
async def test_hostile_uids_are_refused(node, tmp_path, uid):
    bad = ClaimRef("default", "victim", uid)
    before = snapshot(tmp_path)
    out = await node.engine.prepare([bad])
    assert "is not a UID" in out[uid].error
    assert "is not a UID" in (await node.engine.unprepare([bad]))[uid]
    assert snapshot(tmp_path) == before


async def test_error_messages_stay_short_for_huge_names(node):
    out = await node.engine.prepare([ClaimRef("a" * 100_000, "x", GOOD_UID)])
    assert len(out[GOOD_UID].error) < 600


@pytest.mark.parametrize("where,value", [
    ("request", "../../x"), ("request", "a/b/c"), ("request", "Req"), ("request", "a\x00"),
    ("pod-claim-name", "../../../tmp/x"), ("pod-claim-name", "a/b"),
    ("device", "../../../../etc/shadow"),
])
async def test_hostile_content_inside_the_claim_is_refused(node, tmp_path, where, value):
    res = result("gpu-0")
    annotations = None
    if where == "request":
        res["request"] = value
    elif where == "device":
        res["device"] = value
    else:
        annotations = {"resource.kubernetes.io/pod-claim-name": value}
    obj = claim("victim", GOOD_UID, [res], annotations=annotations)
    obj["spec"]["devices"]["requests"] = [{"name": "x"}]
    write_claim(node.claims_dir, obj)
    before = snapshot(tmp_path)
    out = await node.engine.prepare([ClaimRef("default", "victim", GOOD_UID)])
    assert out[GOOD_UID].error, out
    assert snapshot(tmp_path) == before


async def test_the_good_claim_still_prepares_next_to_hostile_ones(node):
    refs = [ClaimRef("default", "victim", GOOD_UID)] + [
        ClaimRef("default", v, f"2a7f0c11-0000-4000-8000-{i:012d}") for i, v in enumerate(HOSTILE[:5], 10)]
    out = await node.engine.prepare(refs)
    assert out[GOOD_UID].error == "" and out[GOOD_UID].devices
    assert all(out[r.uid].error for r in refs[1:])
    assert (node.settings.cdi_dir / f"{DRIVER}-claim_{GOOD_UID}.json").exists()
