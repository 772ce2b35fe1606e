"""What the agent's token may read and write of the tenants' objects, on the real API server with the roles
deploy/ ships (every kustomization applied, as the session does): a node's agent reads a claim by its name,
and lists no namespace's claims, whose opaque configuration a tenant may put a secret in; it creates Events
in `default` alone, where its Node's Events live, never in a tenant's namespace.

Before (docs/security.md), the base ClusterRole granted `list` and `watch` on every namespace's claims and
`create` on Events everywhere: the token of any node's agent listed a tenant's claims, password and all,
and could post Events about a tenant's pods in the tenant's namespace. (The watch is the one grant of
deploy/overlays/binding-conditions, which the session applies too; tests/test_deploy.py holds the base to
`get` alone.)"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any

import pytest

from .clusterkit import DRIVER, NODE, ApiFailure, Cluster, Rest
from .workloads import Namespace

pytestmark = pytest.mark.cluster

EVENTS = "/apis/events.k8s.io/v1/namespaces/{}/events"


@pytest.fixture(scope="module")
def agent_token(cluster: Cluster) -> Iterator[Rest]:
    """The agent's ServiceAccount, its token bound to a pod on NODE (as the DaemonSet pod's is)."""
    rest = cluster.rest(cluster.token(pod=cluster.pod_on(NODE, "rbac-probe")))
    yield rest
    rest.close()


@pytest.fixture(scope="module")
def tenant(cluster: Cluster) -> Iterator[Namespace]:
    space = Namespace(cluster, "tenant-secrets").create()
    space.claim("trainer", {"devices": {
        "requests": [{"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}}],
        "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "gpu.example.com/v1", "kind": "GpuConfig", "env": {"DB_PASSWORD": "hunter2"}}}}]}})
    yield space
    space.clean()


def refused(call: Any, *args: Any) -> None:
    with pytest.raises(ApiFailure) as failure:
        call(*args)
    assert failure.value.status == 403, failure.value


def test_the_agents_token_reads_a_claim_by_name_and_lists_no_namespaces_claims(agent_token: Rest,
                                                                                  tenant: Namespace) -> None:
    claims = f"/apis/resource.k8s.io/v1/namespaces/{tenant.name}/resourceclaims"
    assert agent_token.get(f"{claims}/trainer")["metadata"]["name"] == "trainer"  # prepare reads the claim it is given
    refused(agent_token.get, claims)
    refused(agent_token.get, "/apis/resource.k8s.io/v1/resourceclaims")


def event(namespace: str, regarding: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"generateName": "rbac-probe-",
                                                                            "namespace": namespace},
            "eventTime": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "reportingController": f"{DRIVER}/dra-agent", "reportingInstance": f"dra-agent-{NODE}",
            "action": "Probe", "reason": "Probe", "type": "Normal", "note": "rbac probe", "regarding": regarding}


def test_the_agents_token_creates_events_in_default_alone(agent_token: Rest, tenant: Namespace) -> None:
    made = agent_token.post(EVENTS.format("default"), event("default", {"apiVersion": "v1", "kind": "Node",
                                                                        "name": NODE}))
    assert made["metadata"]["namespace"] == "default"
    refused(agent_token.post, EVENTS.format(tenant.name), event(tenant.name, {
        "apiVersion": "v1", "kind": "Pod", "namespace": tenant.name, "name": "trainer"}))
