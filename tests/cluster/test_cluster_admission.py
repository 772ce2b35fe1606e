"""The ValidatingAdmissionPolicy deploy/base ships, enforced by the real API server: the agent's
ServiceAccount, with a token bound to a pod on its node, may create, update and delete that node's
slices of our driver and nothing else; with a token bound to no node, nothing at all."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from .clusterkit import DRIVER, NODE, OTHER_NODE, SLICES, ApiFailure, Cluster, Rest

pytestmark = pytest.mark.cluster

POLICY = "dra-agent-resourceslices"


def slice_of(name: str, *, node: str | None = NODE, pool: str = NODE, driver: str = DRIVER,
             **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"driver": driver, "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
                            "devices": [{"name": "dev-0"}]}
    if node is not None:
        body["nodeName"] = node
    body.update(spec)
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name}, "spec": body}


@pytest.fixture(scope="module")
def bound(cluster: Cluster) -> Iterator[Rest]:
    """The agent's ServiceAccount, token bound to a pod on NODE."""
    rest = cluster.rest(cluster.token(pod=cluster.pod_on(NODE, "admission-probe")))
    yield rest
    rest.close()


@pytest.fixture(scope="module")
def unbound(cluster: Cluster) -> Iterator[Rest]:
    """The same ServiceAccount, a token bound to nothing (no node)."""
    rest = cluster.rest(cluster.token())
    yield rest
    rest.close()


def refused_by_policy(call: Any, *args: Any) -> str:
    with pytest.raises(ApiFailure) as failure:
        call(*args)
    assert failure.value.status == 403, failure.value
    assert f"ValidatingAdmissionPolicy '{POLICY}'" in failure.value.message, failure.value.message
    return failure.value.message


def test_tokens_say_who_they_are(cluster: Cluster) -> None:
    # What the policy reads: the node-name extra is there exactly when the token is bound to a pod on a node.
    pod = cluster.pod_on(NODE, "whoami-probe")
    bound_user = cluster.whoami(cluster.token(pod=pod))
    assert bound_user["username"] == "system:serviceaccount:dra-agent:dra-agent"
    assert bound_user["extra"]["authentication.kubernetes.io/node-name"] == [NODE]
    unbound_user = cluster.whoami(cluster.token())
    assert "authentication.kubernetes.io/node-name" not in (unbound_user.get("extra") or {})


def test_the_agent_writes_its_own_nodes_slices(bound: Rest) -> None:
    created = bound.post(SLICES, slice_of("own-node-slice"))
    changed = copy.deepcopy(created)
    changed["spec"]["devices"].append({"name": "dev-1"})
    bound.put(f"{SLICES}/own-node-slice", changed)
    # A pool named after the node with a further segment is still the node's (docs/devices.md).
    bound.post(SLICES, slice_of("own-node-subpool", pool=f"{NODE}/extra"))
    bound.delete(f"{SLICES}/own-node-slice")
    bound.delete(f"{SLICES}/own-node-subpool")


@pytest.mark.parametrize(("case", "body"), [
    ("another node's nodeName", slice_of("x-other-node", node=OTHER_NODE, pool=OTHER_NODE)),
    ("another node's pool", slice_of("x-other-pool", pool=OTHER_NODE)),
    ("a pool that merely starts with the node's name", slice_of("x-prefix-pool", pool=f"{NODE}x")),
    ("another driver", slice_of("x-other-driver", driver="gpu.other.example.com")),
    ("allNodes", slice_of("x-all-nodes", node=None, allNodes=True)),
    ("perDeviceNodeSelection", slice_of("x-per-device", node=None, perDeviceNodeSelection=True,
                                        devices=[{"name": "dev-0", "nodeName": NODE}])),
])
def test_the_agent_may_not_write_other_slices(cluster: Cluster, bound: Rest, case: str,
                                              body: dict[str, Any]) -> None:
    cluster.admin.post(SLICES, body, dryRun="All")  # a valid slice: only the policy refuses it
    refused_by_policy(bound.post, SLICES, body)


@pytest.mark.parametrize("version", ["v1beta1", "v1beta2"])
def test_the_policy_holds_through_every_served_version(bound: Rest, version: str) -> None:
    # The policy names v1 (so that it is type-checked); a write through another version is converted
    # and still judged.
    body = slice_of(f"x-other-node-{version}", node=OTHER_NODE, pool=OTHER_NODE)
    body["apiVersion"] = f"resource.k8s.io/{version}"
    if version == "v1beta1":
        body["spec"]["devices"] = [{"name": "dev-0", "basic": {}}]
    refused_by_policy(bound.post, f"/apis/resource.k8s.io/{version}/resourceslices", body)


def test_the_agent_may_not_change_or_remove_another_nodes_slice(cluster: Cluster, bound: Rest) -> None:
    theirs = cluster.admin.post(SLICES, slice_of("their-slice", node=OTHER_NODE, pool=OTHER_NODE))
    try:
        changed = copy.deepcopy(theirs)
        changed["spec"]["devices"].append({"name": "dev-1"})
        refused_by_policy(bound.put, f"{SLICES}/their-slice", changed)
        # (Moving it to this node is refused before admission: nodeName, driver and pool name are
        # immutable.)
        moved = copy.deepcopy(theirs)
        moved["spec"]["nodeName"] = NODE
        with pytest.raises(ApiFailure) as immutable:
            bound.put(f"{SLICES}/their-slice", moved)
        assert immutable.value.status == 422 and "field is immutable" in immutable.value.message
        refused_by_policy(bound.delete, f"{SLICES}/their-slice")
    finally:
        cluster.admin.delete(f"{SLICES}/their-slice")


def test_a_token_bound_to_no_node_may_write_nothing(cluster: Cluster, unbound: Rest) -> None:
    message = refused_by_policy(unbound.post, SLICES, slice_of("unbound-create"))
    assert "names no node" in message
    mine = cluster.admin.post(SLICES, slice_of("unbound-target"))
    try:
        refused_by_policy(unbound.put, f"{SLICES}/unbound-target", mine)
        refused_by_policy(unbound.delete, f"{SLICES}/unbound-target")
    finally:
        cluster.admin.delete(f"{SLICES}/unbound-target")
