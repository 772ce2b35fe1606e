"""Device taints acting in the real cluster.

The agent's own: `dra-agent sim xid gpu-N 79` (the GPU fell off the bus) puts a NoExecute taint on
gpu-N and every form of it in the real slices; kube-controller-manager's device taint eviction
controller deletes the pods whose claims hold those devices without tolerating the taint, leaves
the ones that do, and deletes one that tolerates it for a second a second later; `dra-agent sim
recover` (a GPU reset) takes the taint away. An administrator's: a DeviceTaintRule that selects our
devices is listed by `dra-agent taints` as such, and the agent does not clear it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from .clusterkit import DRIVER, ApiFailure, Cluster, eventually
from .workloads import BUS, Namespace, NodeAgent, attr, claim_spec, published, request, results_of, string

pytestmark = pytest.mark.cluster

GPU = "gpu-6"
XID = f"{DRIVER}/xid"
RULES = "/apis/resource.k8s.io/v1/devicetaintrules"


def taints(agent: NodeAgent) -> list[dict[str, Any]]:
    """`dra-agent taints -o json` at the agent's node, with its credentials."""
    return list(json.loads(agent.cli("taints", "-o", "json").stdout))


def evicted(ns: Namespace, pod: str) -> bool:
    """Whether the pod was deleted (at once, or gracefully: no kubelet confirms it here)."""
    try:
        return bool(ns.get("pods", pod)["metadata"].get("deletionTimestamp"))
    except ApiFailure as exc:
        if exc.status == 404:
            return True
        raise


def test_an_xid_taint_evicts_the_pods_that_do_not_tolerate_it(scheduled: NodeAgent, ns: Namespace) -> None:
    bus = string(published(scheduled)[GPU], "resource.kubernetes.io/pciBusID")
    tolerate = {"key": XID, "operator": "Exists", "effect": "NoExecute"}
    # Three MIG devices of the GPU side by side: one taint reaches all three claims at once.
    for pod, start, tolerations in (("untolerating", 0, []), ("tolerating", 1, [tolerate]),
                                    ("for-a-second", 2, [{**tolerate, "tolerationSeconds": 1}])):
        ns.claim(pod, claim_spec(request("mig", "mig", tolerations=tolerations, selectors=[
            f"{BUS} == '{bus}'", f"{attr('profile')} == '1g.10gb'", f"{attr('placementStart')} == {start}"])))
        ns.pod(pod, scheduled.node, claims={"mig": pod})
    held = {}
    for pod in ("untolerating", "tolerating", "for-a-second"):
        ns.scheduled(pod)
        (claim,) = ns.claims_of(pod).values()
        (result,) = results_of(claim)
        held[pod] = result["device"]

    scheduled.cli("sim", "xid", GPU, "79")
    (taint,) = eventually(lambda: published(scheduled)[GPU].get("taints"), f"the XID taint on {GPU}")
    assert (taint["key"], taint["value"], taint["effect"]) == (XID, "79", "NoExecute")
    # A GPU's forms are in different slices (whole GPUs first, MIG placements last: the order the scheduler
    # walks), written one after another by the same publish: the MIG slices may land a moment after.
    eventually(lambda: all(published(scheduled)[d].get("taints") == [taint] for d in held.values()),
               "every form of the GPU tainted")
    ours = [t for t in taints(scheduled) if t["device"] == GPU]
    assert [(t["key"], t["value"], t["effect"], t["source"]) for t in ours] == [(XID, "79", "NoExecute", "agent")]

    eventually(lambda: evicted(ns, "untolerating"), "the eviction of the pod that does not tolerate the taint")
    eventually(lambda: evicted(ns, "for-a-second"), "the eviction of the pod that tolerates it for a second")
    # Judged by the same controller at the same time as the two, and later: still there.
    assert not evicted(ns, "tolerating")

    scheduled.cli("sim", "recover", GPU)
    eventually(lambda: not published(scheduled)[GPU].get("taints"), f"the taint on {GPU} removed")
    eventually(lambda: not any(published(scheduled)[d].get("taints") for d in held.values()),
               "the taint on every form of the GPU removed")
    assert [t for t in taints(scheduled) if t["device"] == GPU] == []


@pytest.fixture
def rules(cluster: Cluster) -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for name in made:
        cluster.admin.delete(f"{RULES}/{name}")


def rule(name: str, taint: dict[str, str], **selector: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "metadata": {"name": name},
            "spec": {"deviceSelector": selector, "taint": taint}}


def test_an_administrators_taint_rule_is_listed_as_theirs(scheduled: NodeAgent, cluster: Cluster,
                                                          rules: list[str]) -> None:
    node = scheduled.node
    maintenance = {"key": "example.com/maintenance", "value": "planned", "effect": "NoSchedule"}
    note = {"key": "example.com/audit", "effect": "None"}
    for body in (rule("gpu-7-maintenance", maintenance, driver=DRIVER, pool=node, device="gpu-7"),
                 rule("pool-audit", note, driver=DRIVER, pool=node),
                 rule("other-pool", maintenance, driver=DRIVER, pool="dra-node-2", device="gpu-7"),
                 rule("other-driver", maintenance, driver="other.example.com", pool=node)):
        cluster.admin.post(RULES, body)
        rules.append(body["metadata"]["name"])

    listed = {t["rule"]: t for t in taints(scheduled) if t["source"] == "DeviceTaintRule"}
    assert set(listed) == {"gpu-7-maintenance", "pool-audit"}
    gpu7 = listed["gpu-7-maintenance"]
    assert (gpu7["device"], gpu7["key"], gpu7["value"], gpu7["effect"]) == ("gpu-7", *maintenance.values())
    assert gpu7["since"] is not None  # the server's timeAdded
    assert (listed["pool-audit"]["device"], listed["pool-audit"]["effect"]) == ("*", "None")
    table = scheduled.cli("taints").stdout
    assert "DeviceTaintRule gpu-7-maintenance (an administrator's: the agent does not clear it)" in table

    # Not the agent's to clear: asking leaves the rule, and nothing of the agent's was there.
    said = scheduled.cli("taints", "clear", "gpu-7").stdout.strip()
    assert said == ("gpu-7 had no XID taint: nothing cleared; still tainted by: DeviceTaintRule pool-audit "
                    "(an administrator's: the agent does not clear it); DeviceTaintRule gpu-7-maintenance (an "
                    "administrator's: the agent does not clear it)")
    assert cluster.admin.get(f"{RULES}/gpu-7-maintenance")["spec"]["taint"]["key"] == maintenance["key"]
