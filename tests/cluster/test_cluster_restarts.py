"""What must hold across agent restarts and claim deletions, against the real API server and scheduler.

- A claim's `Ready` condition changes its `lastTransitionTime` only when its status changes: an XID
  that makes the GPU not ready, a restart while it is not ready, the GPU reset, a restart after it.
- Garbage collection: a prepared claim no pod on the node uses any more (the stand-in of the kubelet's pod
  resources service says) and that is deleted in the API is unprepared once `--gc-grace-period` is over;
  one deleted and re-created under the same name while the agent was down is unprepared, and the new
  claim of that name, prepared since, stays prepared; an idle agent whose claims pods use asks the API
  server nothing about them, and a restart after an orderly stop reads none of them back.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from .clusterkit import DRIVER, eventually
from .workloads import (
    BUS,
    Namespace,
    NodeAgent,
    allocated,
    claim_spec,
    our_status,
    prepared,
    published,
    ref_of,
    request,
    string,
)

pytestmark = pytest.mark.cluster

GPU = "gpu-5"


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def later_than(stamp: str) -> None:
    """Until the wall clock's second is past `stamp` (RFC 3339 times have whole seconds): so that a
    transition dated from now can be told from one dated `stamp`."""
    eventually(lambda: now() > stamp, f"a second after {stamp}")


def ready(ns: Namespace, name: str, status: str) -> dict[str, Any]:
    """The claim's one Ready condition of ours, once it has `status`."""
    def probe() -> dict[str, Any] | None:
        entries = our_status(ns.get("resourceclaims", name))
        conds = [c for e in entries for c in e.get("conditions") or [] if c["type"] == "Ready"]
        return conds[0] if len(conds) == 1 and conds[0]["status"] == status else None

    try:
        found: dict[str, Any] = eventually(probe, f"Ready={status} on claim {name}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {our_status(ns.get('resourceclaims', name))}") from None
    return found


def restarted(agent: NodeAgent) -> None:
    """The agent restarted, and its start-up write of the claims' status done (written or found current)."""
    proc = agent.restart()
    eventually(lambda: sum(proc.metric(f'dra_agent_claim_status_writes_total{{result="{r}"}}')
                           for r in ("ok", "unchanged", "gave_up")) >= 1, "the status written after the restart")


def gpu_claim(ns: Namespace, agent: NodeAgent, name: str, selectors: Sequence[str] = (),
              tolerations: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """A claim for one GPU, allocated by the scheduler for a pod on the agent's node."""
    ns.claim(name, claim_spec(request("gpu", "gpu", selectors=selectors, tolerations=tolerations)))
    ns.pod(name, agent.node, claims={"gpu": name})
    ns.scheduled(name)
    (claim,) = ns.claims_of(name).values()
    return claim


def prepare(agent: NodeAgent, claim: dict[str, Any]) -> str:
    """The claim prepared as allocated; its UID."""
    uid = str(claim["metadata"]["uid"])
    assert prepared(agent.prepare(claim)[uid]) == allocated(claim)
    return uid


def test_ready_changes_its_time_only_when_its_status_changes(scheduled: NodeAgent, ns: Namespace) -> None:
    bus = string(published(scheduled)[GPU], "resource.kubernetes.io/pciBusID")
    # Tolerating the XID taint: else the eviction controller deletes the pod and its claim is deallocated.
    tolerate = {"key": f"{DRIVER}/xid", "operator": "Exists", "effect": "NoExecute"}
    claim = gpu_claim(ns, scheduled, "ready", [f"{BUS} == '{bus}'"], [tolerate])
    prepare(scheduled, claim)
    prepared_at = ready(ns, "ready", "True")["lastTransitionTime"]

    later_than(prepared_at)
    scheduled.cli("sim", "xid", GPU, "79")  # off the bus: NoExecute, not ready
    lost = ready(ns, "ready", "False")
    assert lost["reason"] == "XidError" and lost["lastTransitionTime"] > prepared_at

    # A restart while the XID taint stands (it is saved): still not ready, since the same moment.
    later_than(lost["lastTransitionTime"])
    restarted(scheduled)
    assert ready(ns, "ready", "False")["lastTransitionTime"] == lost["lastTransitionTime"]

    later_than(lost["lastTransitionTime"])
    scheduled.cli("sim", "recover", GPU)  # a GPU reset clears the XID taint
    back = ready(ns, "ready", "True")
    assert back["lastTransitionTime"] > lost["lastTransitionTime"]

    # A restart now: ready since the reset, not since the prepare.
    later_than(back["lastTransitionTime"])
    restarted(scheduled)
    assert ready(ns, "ready", "True")["lastTransitionTime"] == back["lastTransitionTime"]
    assert not any(t for t in published(scheduled)[GPU].get("taints") or [])
    assert scheduled.unprepare(claim)[claim["metadata"]["uid"]].get("error", "") == ""


def test_claims_gone_from_the_api_are_unprepared_after_the_grace_period(scheduled: NodeAgent,
                                                                         ns: Namespace) -> None:
    old = gpu_claim(ns, scheduled, "renamed")
    old_uid = prepare(scheduled, old)

    # Deleted and re-created under the same name (and allocated again) while the agent is down; once it
    # runs again the kubelet prepares the new one.
    scheduled.stop()
    ns.remove_pod("renamed")
    ns.cluster.admin.delete(ns.path("resourceclaims", "renamed"))
    eventually(lambda: not ns.exists("resourceclaims", "renamed"), "the claim's deletion")
    new = gpu_claim(ns, scheduled, "renamed")
    assert ref_of(new).name == ref_of(old).name and ref_of(new).uid != old_uid
    assert old_uid in scheduled.prepared()
    scheduled.start()
    new_uid = prepare(scheduled, new)
    eventually(lambda: old_uid not in scheduled.prepared(), "the old claim's garbage collection")
    assert new_uid in scheduled.prepared()
    eventually(lambda: log_has(scheduled, f"garbage-collected claim {ns.name}/renamed ({old_uid})",
                               f"now has UID {new_uid}"), "the collection logged")

    # A claim deleted while the agent runs: unprepared once no pod has used it for the grace period. Meanwhile
    # the re-created claim, which no pod uses either (the stand-in kubelet runs none), is looked up, and stays.
    deleted = gpu_claim(ns, scheduled, "deleted")
    uid = prepare(scheduled, deleted)
    kubelet = scheduled.kubelet
    assert kubelet is not None
    asked = kubelet.calls  # the stand-in's count since the module's start: the sweeps before count too
    kubelet.use(ref_of(deleted), pod="deleted")
    # The second List from now was asked after the use (the first may have been answered before it): a sweep
    # that saw the pod use the claim, and so set its clock back.
    eventually(lambda: kubelet.calls >= asked + 2, "a sweep that sees the pod use the claim")
    ns.remove_pod("deleted")
    gone_at = time.monotonic()  # before the pod goes from the kubelet's list: the agent may see it at once
    kubelet.use(pod="deleted")
    ns.cluster.admin.delete(ns.path("resourceclaims", "deleted"))
    eventually(lambda: uid not in scheduled.prepared(), "the deleted claim's garbage collection")
    assert time.monotonic() - gone_at >= 1.0  # --gc-grace-period=1 (conftest)
    assert new_uid in scheduled.prepared()
    # Logged before the record goes, but the agent's log reaches its file when the line is flushed.
    eventually(lambda: log_has(scheduled, f"garbage-collected claim {ns.name}/deleted ({uid})"),
               "the collection logged")
    assert scheduled.unprepare(new)[new_uid].get("error", "") == ""


def test_what_an_idle_agent_asks_of_the_api_server_does_not_grow_with_its_claims(scheduled: NodeAgent,
                                                                                   ns: Namespace) -> None:
    # Read from the agent's own count of its requests (dra_agent_api_requests_total, named as the API
    # server's apiserver_request_total). Garbage collection sweeps every second here (--gc-grace-period=1):
    # each sweep asks the kubelet which claims its pods use, and reads no claim a pod uses (it was a LIST of
    # the namespace's claims a sweep, and four GETs before that); the node's slices are watched, not LISTed.
    # A restart after an orderly stop reads none of the claims' status back (it was a LIST too).
    claims = [gpu_claim(ns, scheduled, f"idle-{i}") for i in range(4)]
    for c in claims:
        prepare(scheduled, c)
    for c in claims:
        ready(ns, c["metadata"]["name"], "True")  # the status writes (a GET each) are done
    kubelet = scheduled.kubelet
    assert kubelet is not None
    kubelet.use(*(ref_of(c) for c in claims), pod="idle")
    assert scheduled.proc is not None
    proc = scheduled.proc

    def count(verb: str, resource: str) -> float:
        return proc.metric(f'dra_agent_api_requests_total{{resource="{resource}",verb="{verb}"}}')

    def sweeps() -> float:
        return proc.metric("dra_agent_gc_sweeps_total")

    before = {k: count(*k) for k in (("GET", "resourceclaims"), ("LIST", "resourceclaims"),
                                     ("LIST", "resourceslices"), ("WATCH", "resourceslices"))}
    first = sweeps()
    eventually(lambda: sweeps() >= first + 4, "four garbage collection sweeps")
    swept = sweeps() - first
    after = {k: count(*k) for k in before}
    delta = {k: after[k] - before[k] for k in before}
    assert delta[("GET", "resourceclaims")] == 0 and delta[("LIST", "resourceclaims")] == 0, delta
    assert kubelet.calls >= swept, swept  # each sweep asked the kubelet instead
    assert delta[("LIST", "resourceslices")] == 0, delta
    assert after[("WATCH", "resourceslices")] >= 1, after  # the watch that replaced them

    restarted(scheduled)
    assert scheduled.proc is not None and scheduled.proc is not proc
    eventually(lambda: scheduled.proc is not None and scheduled.proc.metric(
        'dra_agent_claim_status_writes_total{result="unchanged"}') == len(claims), "every claim's status found current")
    assert {k: scheduled.proc.metric(f'dra_agent_api_requests_total{{resource="resourceclaims",verb="{k}"}}')
            for k in ("GET", "LIST", "WATCH")} == {"GET": 0, "LIST": 0, "WATCH": 0}
    for c in claims:
        assert scheduled.unprepare(c)[c["metadata"]["uid"]].get("error", "") == ""


def log_has(agent: NodeAgent, *texts: str) -> bool:
    """Whether one line of the running agent's log holds every one of `texts`."""
    return agent.proc is not None and any(all(t in m for t in texts) for m in agent.proc.messages())
