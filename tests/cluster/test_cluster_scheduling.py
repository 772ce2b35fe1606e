"""The real scheduler allocates what the agent publishes, and the agent prepares exactly that.

Pods with claims for the classes deploy/ ships (a whole GPU, all eight, MIG devices side by side, a
share of a GPU with its capacity, a NIC, CPUs and memory, a VM's passthrough VF, and an unchanged pod
asking for `example.com/gpu`) are scheduled on the agent's node by kube-scheduler; each claim is then
prepared through the agent's DRA socket as the kubelet would (the agent reads the claim from the API
server), and the devices it prepares are the ones the scheduler allocated. What cannot fit (a MIG
device overlapping two others, a GPU passed through while its native form is taken) stays Pending with
the scheduler's reason. The claim status the agent writes with its own token is accepted, reads back,
and is gone after unprepare."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agent.claims.allocation import config_api_version

from .clusterkit import DRIVER, eventually
from .workloads import (
    BUS,
    Namespace,
    NodeAgent,
    allocated,
    attr,
    claim_spec,
    our_status,
    prepared,
    published,
    request,
    results_of,
    string,
)

pytestmark = pytest.mark.cluster

VF_MAC = "02:aa:bb:cc:dd:07"  # what a VM's SR-IOV network asks its VF to have
GAVE_UP = 'dra_agent_claim_status_writes_total{result="gave_up"}'


def metadata_device(agent: NodeAgent, uid: str) -> dict[str, Any]:
    """The one device of a claim's device metadata file (the newest version's object)."""
    (path,) = (agent.root / "kubelet").rglob(f"dra-device-metadata/{uid}/*/metadata.json")
    first = json.loads(path.read_text().splitlines()[0])
    (req,) = first["requests"]
    (dev,) = req["devices"]
    return dict(dev)


def statuses(ns: Namespace, claims: dict[str, dict[str, Any]], agent: NodeAgent,
             gave_up: float) -> dict[str, list[dict[str, Any]]]:
    """Each claim's status.devices entries of our driver, once every allocated device has one; no
    write given up since the agent's count was `gave_up`."""
    missing: dict[str, Any] = {}

    def probe() -> dict[str, list[dict[str, Any]]] | None:
        out = {}
        missing.clear()
        for key, c in claims.items():
            entries = our_status(ns.get("resourceclaims", c["metadata"]["name"]))
            keys = sorted((e["pool"], e["device"], e.get("shareID", "")) for e in entries)
            if keys != sorted((p, d, s) for _, p, d, s in allocated(c)):
                missing[key] = entries
            out[key] = entries
        return None if missing else out

    try:
        found: dict[str, list[dict[str, Any]]] = eventually(probe, "the agent's claim status, for every claim")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: not as allocated: {missing}") from None
    assert agent.proc is not None
    assert agent.proc.metric(GAVE_UP) == gave_up
    return found


def test_allocations_of_every_kind_are_prepared_as_allocated(scheduled: NodeAgent, ns: Namespace) -> None:
    node = scheduled.node
    devices = published(scheduled)
    assert scheduled.proc is not None
    gave_up = scheduled.proc.metric(GAVE_UP)
    bus = {n: string(d, "resource.kubernetes.io/pciBusID") for n, d in devices.items() if n in ("gpu-1", "gpu-2")}

    # First what is pinned to a GPU, so that no claim for "any GPU" takes one of those first.
    ns.claim("mig-left", claim_spec(request("mig", "mig", selectors=[
        f"{BUS} == '{bus['gpu-1']}'", f"{attr('profile')} == '3g.40gb'", f"{attr('placementStart')} == 0"])))
    ns.claim("mig-right", claim_spec(request("mig", "mig", selectors=[
        f"{BUS} == '{bus['gpu-1']}'", f"{attr('profile')} == '3g.40gb'", f"{attr('placementStart')} == 4"])))
    ns.claim("native", claim_spec(request("gpu", "gpu", selectors=[f"{BUS} == '{bus['gpu-2']}'"])))
    ns.pod("mig-left", node, claims={"mig": "mig-left"})
    ns.pod("mig-right", node, claims={"mig": "mig-right"})
    ns.pod("native", node, claims={"gpu": "native"})
    for pod in ("mig-left", "mig-right", "native"):
        ns.scheduled(pod)

    # What cannot fit beside them stays Pending, and the scheduler says why.
    ns.claim("mig-overlap", claim_spec(request("mig", "mig", selectors=[
        f"{BUS} == '{bus['gpu-1']}'", f"{attr('profile')} == '4g.40gb'"])))
    ns.claim("passthrough", claim_spec(request("vm", "gpu-passthrough", selectors=[f"{BUS} == '{bus['gpu-2']}'"])))
    ns.pod("mig-overlap", node, claims={"mig": "mig-overlap"})
    ns.pod("passthrough", node, claims={"vm": "passthrough"})

    # The rest, from templates, a claim and an unchanged pod.
    ns.template("gpu", claim_spec(request("gpu", "gpu")))
    ns.template("share", claim_spec(request("share", "gpu-shared", capacity={"memory": "4Gi"})))
    ns.template("nic", claim_spec(request("nic", "nic")))
    ns.template("cpu-memory", claim_spec(request("cpu", "cpu", capacity={"cpus": "1"}),
                                         request("memory", "memory", capacity={"memory": "1Gi"})))
    vfio = {"apiVersion": config_api_version(DRIVER), "kind": "VfioConfig", "mac": VF_MAC}
    ns.claim("vf", claim_spec(request("net", "nic-passthrough"),
                              config=[{"requests": ["net"], "opaque": {"driver": DRIVER, "parameters": vfio}}]))
    ns.pod("whole", node, templates={"gpu": "gpu"})
    ns.pod("share", node, templates={"share": "share"})
    ns.pod("nic", node, templates={"nic": "nic"})
    ns.pod("cpu-memory", node, templates={"res": "cpu-memory"})
    ns.pod("vf", node, claims={"net": "vf"})
    ns.pod("unchanged", node, limits={"example.com/gpu": "1"})
    for pod in ("whole", "share", "nic", "cpu-memory", "vf", "unchanged"):
        ns.scheduled(pod)
    for pod in ("mig-overlap", "passthrough"):
        cond = ns.unschedulable(pod)
        assert cond["reason"] == "Unschedulable" and "cannot allocate all claims" in cond["message"], cond

    claims = {pod: c for pod in ("mig-left", "mig-right", "native", "whole", "share", "nic", "cpu-memory", "vf")
              for c in ns.claims_of(pod).values()}
    claims["unchanged"] = ns.extended_claim("unchanged")
    assert claims["unchanged"]["metadata"]["annotations"]["resource.kubernetes.io/extended-resource-claim"] == "true"
    for key, c in claims.items():
        assert results_of(c) and all(r["pool"] == node for r in results_of(c)), (key, c.get("status"))
    kinds = {key: {string(devices[r["device"]], "type") for r in results_of(c)} for key, c in claims.items()}
    assert kinds == {"mig-left": {"mig"}, "mig-right": {"mig"}, "native": {"gpu"}, "whole": {"gpu"},
                     "share": {"shared"}, "nic": {"nic"}, "cpu-memory": {"cpu", "memory"}, "vf": {"vfio"},
                     "unchanged": {"gpu"}}
    (share,) = results_of(claims["share"])
    # Compute not named: the policy's default, a tenth of the GPU.
    assert share["shareID"] and share["consumedCapacity"] == {"memory": "4Gi", "compute": "100m"}

    # The kubelet's call: every claim at once, each answered with exactly what the scheduler allocated.
    answers = scheduled.prepare(*claims.values())
    for key, c in claims.items():
        assert prepared(answers[c["metadata"]["uid"]]) == allocated(c), key

    # The status the agent wrote with its own token: accepted by the API server, and what it said.
    found = statuses(ns, claims, scheduled, gave_up)
    for key, entries in found.items():
        for e in entries:
            (ready,) = e["conditions"]
            assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "True", "Prepared"), (key, e)
    for key in ("native", "whole", "unchanged"):
        (e,) = found[key]
        gpu = devices[e["device"]]
        assert e["data"] == {"uuid": string(gpu, "uuid"), "productName": string(gpu, "productName")}, key
    (e,) = found["share"]
    assert e["shareID"] == share["shareID"]
    (e,) = found["nic"]
    nic = devices[e["device"]]
    net = e["networkData"]
    assert net["interfaceName"] == string(nic, "ifName") and net["hardwareAddress"] == string(nic, "macAddress")
    assert net == metadata_device(scheduled, claims["nic"]["metadata"]["uid"])["networkData"]
    # A MIG device's UUID is its own, made at prepare (the one its metadata file gives), not its GPU's.
    for key in ("mig-left", "mig-right"):
        (e,) = found[key]
        own = metadata_device(scheduled, claims[key]["metadata"]["uid"])["attributes"]["uuid"]["string"]
        assert e["data"]["uuid"] == own and own.startswith("MIG-"), (key, e["data"])
        assert own != string(devices[e["device"]], "parentUUID")
    assert found["mig-left"][0]["data"]["uuid"] != found["mig-right"][0]["data"]["uuid"]
    # A VM's VF: the MAC its claim set, as its metadata file says.
    (e,) = found["vf"]
    assert e["networkData"] == {"hardwareAddress": VF_MAC}
    assert metadata_device(scheduled, claims["vf"]["metadata"]["uid"])["networkData"] == {"hardwareAddress": VF_MAC}

    # Unprepared: the agent's entries go, the claims stay.
    answers = scheduled.unprepare(*claims.values())
    assert all(a.get("error", "") == "" for a in answers.values()), answers
    eventually(lambda: not any(our_status(ns.get("resourceclaims", c["metadata"]["name"])) for c in claims.values()),
               "the agent removes its status entries")
    assert scheduled.prepared().isdisjoint(c["metadata"]["uid"] for c in claims.values())


def test_unchanged_pods_asking_for_the_device_plugins_mig_names_get_mig_devices_of_that_profile(
        scheduled: NodeAgent, ns: Namespace) -> None:
    """deploy/overlays/device-plugin-migration, which the session applied too (the base, applied last, leaves
    its MIG classes): a pod written for the NVIDIA device plugin's "mixed" strategy, on a node with no device
    plugin, gets a MIG device of the profile its resource names, through the scheduler's claim."""
    devices = published(scheduled)
    wanted = {"mig-3g": ("nvidia.com/mig-3g.40gb", "3g.40gb"), "mig-me": ("nvidia.com/mig-1g.10gb.me", "1g.10gb+me")}
    for pod, (resource, _) in wanted.items():
        ns.pod(pod, scheduled.node, limits={resource: "1"})
    for pod, (_, profile) in wanted.items():
        ns.scheduled(pod)
        claim = ns.extended_claim(pod)
        (result,) = results_of(claim)
        device = devices[result["device"]]
        assert (string(device, "type"), string(device, "profile")) == ("mig", profile), (pod, result)
        answer = scheduled.prepare(claim)[claim["metadata"]["uid"]]
        assert prepared(answer) == allocated(claim), pod
        assert scheduled.unprepare(claim)[claim["metadata"]["uid"]].get("error", "") == "", pod


def test_all_eight_gpus_in_one_claim(scheduled: NodeAgent, ns: Namespace) -> None:
    ns.template("eight", claim_spec(request("gpus", "gpu", count=8)))
    ns.pod("eight", scheduled.node, templates={"gpus": "eight"})
    ns.scheduled("eight")
    (claim,) = ns.claims_of("eight").values()
    assert sorted(r["device"] for r in results_of(claim)) == [f"gpu-{i}" for i in range(8)]
    answer = scheduled.prepare(claim)[claim["metadata"]["uid"]]
    assert prepared(answer) == allocated(claim)
    # A ninth GPU is not there to be had.
    ns.template("one-more", claim_spec(request("gpu", "gpu")))
    ns.pod("one-more", scheduled.node, templates={"gpu": "one-more"})
    assert "cannot allocate all claims" in ns.unschedulable("one-more")["message"]
    assert scheduled.unprepare(claim)[claim["metadata"]["uid"]].get("error", "") == ""


def test_fractions_of_one_gpu_as_compute_shares(scheduled: NodeAgent, ns: Namespace) -> None:
    """DRAFractionalCapacityRange: the scheduler hands out a quarter and a half of one GPU's compute, then
    finds no half left; each claim's MPS clients get the percentage of its share."""
    shared = published(scheduled)["gpu-5-shared"]
    assert shared["capacity"]["compute"] == {"value": "1", "requestPolicy": {
        "default": "100m", "validRange": {"min": "50m", "max": "1", "step": "50m"}}}
    on_gpu5 = f"{attr('uuid')} == '{string(shared, 'uuid')}'"
    for pod, compute in (("quarter", "0.25"), ("half", "0.5"), ("another-half", "500m")):
        ns.template(pod, claim_spec(request("share", "gpu-shared", selectors=[on_gpu5],
                                            capacity={"memory": "1Gi", "compute": compute})))
    ns.pod("quarter", scheduled.node, templates={"gpu": "quarter"})
    ns.pod("half", scheduled.node, templates={"gpu": "half"})
    ns.scheduled("quarter")
    ns.scheduled("half")
    claims = {pod: next(iter(ns.claims_of(pod).values())) for pod in ("quarter", "half")}
    got = {pod: [(r["device"], r["consumedCapacity"]) for r in results_of(c)] for pod, c in claims.items()}
    assert got == {"quarter": [("gpu-5-shared", {"memory": "1Gi", "compute": "250m"})],
                   "half": [("gpu-5-shared", {"memory": "1Gi", "compute": "500m"})]}
    ns.pod("another-half", scheduled.node, templates={"gpu": "another-half"})
    assert "cannot allocate all claims" in ns.unschedulable("another-half")["message"]

    answers = scheduled.prepare(*claims.values())
    for pod, percent in (("quarter", "25"), ("half", "50")):
        uid = claims[pod]["metadata"]["uid"]
        assert prepared(answers[uid]) == allocated(claims[pod])
        (cdev,) = json.loads((scheduled.root / "cdi" / f"{DRIVER}-claim_{uid}.json").read_text())["devices"]
        env = cdev["containerEdits"]["env"]
        assert f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={percent}" in env and \
            f"DRA_GPU_5_SHARED_COMPUTE_PERCENT={percent}" in env, env
    answers = scheduled.unprepare(*claims.values())
    assert all(a.get("error", "") == "" for a in answers.values()), answers


def test_a_claim_whose_parameters_the_server_encodes_otherwise_gets_its_status(scheduled: NodeAgent,
                                                                               ns: Namespace) -> None:
    # The API server 1.37.2 compares the opaque parameters the scheduler copied into the allocation byte for
    # byte after decoding a status apply, against its own encoding of them (keys sorted): parameters sent with
    # their keys in another order make every status apply of the claim fail (docs/tests.md).
    # The agent writes that claim's status by update instead (test_cluster_claim_status.py has the details).
    params = {"kind": "DeviceConfig", "apiVersion": config_api_version(DRIVER), "env": {"MODE": "fast"}}
    spec = claim_spec(request("cpu", "cpu", capacity={"cpus": "1"}),
                      config=[{"opaque": {"driver": DRIVER, "parameters": params}}])
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "unsorted"}, "spec": spec}
    ns.cluster.admin.post(ns.path("resourceclaims"), json.dumps(body, separators=(",", ":")))  # in this key order
    ns.pod("unsorted", scheduled.node, claims={"cpu": "unsorted"})
    ns.scheduled("unsorted")
    (claim,) = ns.claims_of("unsorted").values()
    assert scheduled.proc is not None
    gave_up = scheduled.proc.metric(GAVE_UP)
    assert prepared(scheduled.prepare(claim)[claim["metadata"]["uid"]]) == allocated(claim)
    (entry,) = eventually(lambda: our_status(ns.get("resourceclaims", "unsorted")), "the claim's status")
    assert [(c["type"], c["status"]) for c in entry["conditions"]] == [("Ready", "True")]
    assert any("refuses every server-side apply" in m for m in scheduled.proc.messages())
    assert scheduled.unprepare(claim)[claim["metadata"]["uid"]].get("error", "") == ""
    eventually(lambda: not our_status(ns.get("resourceclaims", "unsorted")), "the claim's status removed")
    assert scheduled.proc.metric(GAVE_UP) == gave_up
