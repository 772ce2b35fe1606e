"""The manifests of examples/workloads, applied with `kubectl apply` as docs/deployment.md "Workloads" applies them,
against the real scheduler on the shared agent's node (`scheduled`: a simulated DGX H100 with MIG
placements and shared GPUs, this host's NICs, CPUs and memory): each pod is scheduled (its claims
allocated, PodScheduled True), and every claim is then prepared through the agent's DRA socket as the
kubelet prepares it, giving what each example says its container gets.

One change is made to each manifest: its pods get a nodeSelector for that node, so that the scheduler
judges it alone (the other tests' nodes keep their slices published). The VirtualMachine needs KubeVirt,
which this cluster does not run: its ResourceClaimTemplates are applied with the pod KubeVirt 1.9 makes
for it (virt-launcher: the VM's resourceClaims as the pod's, and in its `compute` container a claim with
its request for each GPU and host device that names one), which must be scheduled and prepared, with
each device's metadata file where KubeVirt looks for it and saying what KubeVirt reads there.
tests/test_workload_examples.py checks the VirtualMachine itself against KubeVirt's API types."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from .clusterkit import DRIVER, REPO
from .podclaims import claim_env
from .workloads import Namespace, NodeAgent, allocated, condition, prepared, published, results_of, string

pytestmark = pytest.mark.cluster

EXAMPLES = REPO / "examples" / "workloads"
NUMA = "resource.kubernetes.io/numaNode"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
KUBEVIRT_METADATA = "metadata.resource.k8s.io/v1alpha1"  # the one version KubeVirt 1.9 reads
METADATA_DIR = "/var/run/kubernetes.io/dra-device-attributes"

# Applied in this order, each pod scheduled before the next is applied. The NUMA example first: this
# host's CPUs and memory are on NUMA node 0, with only four of the simulated GPUs, which the others
# would otherwise take first.
PODS = {"numa.yaml": "numa-pod", "gpu.yaml": "gpu-pod", "mig.yaml": "mig-pod", "gpu-share.yaml": "share-pod",
        "nic.yaml": "nic-pod", "extended-resource.yaml": "cuda-app"}
VM_FILE = "kubevirt-vm.yaml"


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def apply(ns: Namespace, docs: list[dict[str, Any]], node: str) -> None:
    """`kubectl apply` of the objects into the test's namespace, each pod pinned to `node`."""
    for doc in docs:
        if doc["kind"] == "Pod":
            doc["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    ns.cluster.kubectl("apply", "--validate=strict", f"--namespace={ns.name}", "-f", "-",
                       stdin=yaml.safe_dump_all(docs))


def virt_launcher(vm: dict[str, Any]) -> dict[str, Any]:
    """The claims of the pod KubeVirt 1.9's virt-controller makes for `vm` (its other parts do not matter to
    the scheduler here)."""
    spec = vm["spec"]["template"]["spec"]
    devices = spec["domain"]["devices"]
    uses = [{"name": d["claimName"], "request": d["requestName"]}
            for d in (*devices.get("gpus", ()), *devices.get("hostDevices", ())) if d.get("claimName")]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"virt-launcher-{vm['metadata']['name']}"},
            "spec": {"resourceClaims": [dict(c) for c in spec["resourceClaims"]],
                     "containers": [{"name": "compute", "image": "virt-launcher",
                                     "resources": {"claims": uses}}]}}


def scheduled_pod(ns: Namespace, pod: str) -> None:
    ns.scheduled(pod)
    cond = condition(ns.get("pods", pod), "PodScheduled")
    assert cond is not None and cond["status"] == "True", cond


def metadata_mount(root: Path, uid: str, request: str) -> tuple[str, list[dict[str, Any]]]:
    """Where the claim's metadata CDI spec mounts the request's file in the container, and the file's objects."""
    spec = json.loads((root / "cdi" / f"{DRIVER}_metadata_{uid}_{request}.json").read_text())
    ((mount,),) = [d["containerEdits"]["mounts"] for d in spec["devices"]]
    objects = [json.loads(line) for line in Path(mount["hostPath"]).read_text().splitlines() if line]
    return str(mount["containerPath"]), objects


def kubevirt_device(root: Path, uid: str, pod_claim: str, request: str) -> dict[str, Any]:
    """The device KubeVirt reads for a template claim's request: the file must be at
    `<base>/resourceclaimtemplates/<pod claim>/<request>/<driver>-metadata.json`, its first object in the
    version KubeVirt knows must list the request with exactly one device."""
    path, objects = metadata_mount(root, uid, request)
    assert path == f"{METADATA_DIR}/resourceclaimtemplates/{pod_claim}/{request}/{DRIVER}-metadata.json"
    first = next(o for o in objects if o["apiVersion"] == KUBEVIRT_METADATA)
    (device,) = next(r["devices"] for r in first["requests"] if r["name"] == request)
    return dict(device)


def test_every_workload_example_is_scheduled_and_prepared(scheduled: NodeAgent, ns: Namespace) -> None:
    node = scheduled.node
    proc = scheduled.proc
    assert proc is not None
    root = proc.root
    devices = published(scheduled)
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted([*PODS, VM_FILE])

    for name, pod in PODS.items():
        apply(ns, documents(name), node)
        scheduled_pod(ns, pod)
    vm_docs = documents(VM_FILE)
    (vm,) = [d for d in vm_docs if d["kind"] == "VirtualMachine"]
    launcher = virt_launcher(vm)
    apply(ns, [*(d for d in vm_docs if d["kind"] == "ResourceClaimTemplate"), launcher], node)
    scheduled_pod(ns, launcher["metadata"]["name"])

    # Pod -> pod claim name -> its claim (made from the template, or by the scheduler for `example.com/gpu`).
    claims = {pod: ns.claims_of(pod) for pod in PODS.values() if pod != "cuda-app"}
    claims["cuda-app"] = {"": ns.extended_claim("cuda-app")}
    claims["vm"] = ns.claims_of(launcher["metadata"]["name"])
    every = [c for by_name in claims.values() for c in by_name.values()]
    for c in every:
        assert results_of(c) and {r["pool"] for r in results_of(c)} == {node}, c.get("status")

    # The kubelet's call for all of them at once: each answered with exactly the devices allocated.
    answers = scheduled.prepare(*every)
    for c in every:
        assert prepared(answers[c["metadata"]["uid"]]) == allocated(c), c["metadata"]["name"]

    def got(pod: str, pod_claim: str) -> tuple[dict[str, dict[str, Any]], dict[str, str], dict[str, Any]]:
        """Request -> its published device, the container's environment, and the claim."""
        c = claims[pod][pod_claim]
        by_request = {r["request"]: devices[r["device"]] for r in results_of(c)}
        return by_request, claim_env(proc, c["metadata"]["uid"]), c

    def only(pod: str, pod_claim: str) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
        """The one device of a claim with one request, the environment and the claim."""
        by_request, env, c = got(pod, pod_claim)
        (device,) = by_request.values()
        return device, env, c

    def env_name(device: dict[str, Any]) -> str:
        return "DRA_" + device["name"].upper().replace("-", "_")

    # numa.yaml: a GPU, CPUs and memory of one NUMA node; the CPUs the container may use.
    by_request, env, _ = got("numa-pod", "local")
    assert {r: string(d, "type") for r, d in by_request.items()} == {"gpu": "gpu", "cpu": "cpu", "memory": "memory"}
    assert len({json.dumps(d["attributes"][NUMA]) for d in by_request.values()}) == 1, by_request
    assert env[f"{env_name(by_request['cpu'])}_CPUS"]

    # gpu.yaml: one whole GPU, its UUID in the container; the metadata file where the command reads it.
    gpu, env, c = only("gpu-pod", "gpu")
    assert string(gpu, "type") == "gpu" and env[f"{env_name(gpu)}_UUID"] == string(gpu, "uuid")
    path, _ = metadata_mount(root, c["metadata"]["uid"], "gpu")
    command = " ".join(ns.get("pods", "gpu-pod")["spec"]["containers"][0]["command"])
    assert path in command

    # mig.yaml: a 1g.10gb MIG device, its own UUID in the container.
    mig, env, _ = only("mig-pod", "mig")
    assert string(mig, "type") == "mig" and string(mig, "profile") == "1g.10gb"
    assert env[f"{env_name(mig)}_UUID"].startswith("MIG-")

    # gpu-share.yaml: 10Gi and half the compute of a shared GPU, and their limits in the container.
    share, env, c = only("share-pod", "share")
    (result,) = results_of(c)
    assert string(share, "type") == "shared" and result["shareID"]
    assert result["consumedCapacity"] == {"memory": "10Gi", "compute": "500m"}
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == env[f"{env_name(share)}_COMPUTE_PERCENT"] == "50"
    assert env[f"{env_name(share)}_MEMORY_LIMIT"] == str(10 << 30)
    assert env[f"{env_name(share)}_SHARE_ID"] == result["shareID"]
    assert env["CUDA_VISIBLE_DEVICES"] == string(share, "uuid")
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={10 << 10}M"  # keyed by CUDA's ordinal

    # nic.yaml: a NIC of the node, its interface in the container.
    nic, env, _ = only("nic-pod", "nic")
    assert string(nic, "type") == "nic" and env[f"{env_name(nic)}_INTERFACE"] == string(nic, "ifName")

    # extended-resource.yaml: the scheduler's claim for `example.com/gpu: 1`, one GPU.
    gpu, env, c = only("cuda-app", "")
    assert c["metadata"]["annotations"]["resource.kubernetes.io/extended-resource-claim"] == "true"
    assert string(gpu, "type") == "gpu" and env[f"{env_name(gpu)}_UUID"] == string(gpu, "uuid")

    # kubevirt-vm.yaml: a GPU and a VF passed through, each read by KubeVirt from its metadata file.
    templates = {d["metadata"]["name"]: d for d in vm_docs if d["kind"] == "ResourceClaimTemplate"}
    config = templates["passthrough-vf"]["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]
    wanted = {"gpu": ("gpu", "gpu"), "net": ("vf", "nic")}
    for pod_claim, (request, native) in wanted.items():
        by_request, _, c = got("vm", pod_claim)
        dev = by_request[request]
        assert (string(dev, "type"), string(dev, "nativeType")) == ("vfio", native)
        read = kubevirt_device(root, c["metadata"]["uid"], pod_claim, request)
        assert read["name"] == dev["name"] and read["attributes"][PCI_BUS_ID] == dev["attributes"][PCI_BUS_ID]
        if native == "nic":
            assert read["networkData"] == {"hardwareAddress": config["mac"]}

    answers = scheduled.unprepare(*every)
    assert all(a.get("error", "") == "" for a in answers.values()), answers
