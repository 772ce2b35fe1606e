"""The whole chain on a real node: the kubelet (1.37), containerd, runc and a CNI pod network, built by
`make kubelet-components`, on a control plane of its own whose node lifecycle controller treats the
node as any cluster does. The Node becomes Ready by itself (nothing patches it or tolerates
`not-ready`), pods get their own network namespace and address, the scheduler allocates a pod's claims
from the slices the agent published, the kubelet finds the agent through its plugin registration
socket and calls NodePrepareResources on its DRA socket, containerd applies the CDI specs the agent
wrote, and the container reads its device metadata at the contract's paths; when the pod is deleted
the kubelet unprepares and the agent's files go.

One node, one control plane and one agent serve the tests of this module (starting them takes
some 20 s); each test works in a namespace of its own. Every wait is on a condition with a bound
(`eventually`); a failing test's report has the cluster's Events, the kubelet's and containerd's logs
and the agent's (conftest.py).

Marker `kubelet` (docs/tests.md, "A real kubelet"): `make test-kubelet` runs these alone."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import subprocess
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from agent.kubelet import client as kc
from agent.names import ClaimRef

from .clusterkit import (
    DRIVER,
    REPO,
    VENV_BIN,
    AgentProcess,
    AgentRuns,
    Cluster,
    devices_of,
    eventually,
    slices_of,
)
from .clusterkit import NAMESPACE as AGENT_NAMESPACE
from .nodekit import IMAGE, POD_SUBNET, Node, NodeReport
from .realnode import AGENT_ROOT, NODE_NAME, SLEEPER, node_object, ready
from .workloads import Namespace, results_of, string

pytestmark = [pytest.mark.cluster, pytest.mark.kubelet]

NAMESPACE = "kubelet-e2e"
ATTRIBUTES = "/var/run/kubernetes.io/dra-device-attributes"
# What every test container prints, in sections the test splits on: each metadata file the kubelet's CDI
# mounts gave it, its environment, and the device nodes CDI made (type, hex major:minor).
SCRIPT = f"""
for f in {ATTRIBUTES}/*/*/*/*; do [ -e "$f" ] && {{ echo "=== file $f"; cat "$f"; }}; done
echo "=== env"; env
echo "=== dev"; for d in /dev/nvidia* /dev/vfio/*; do [ -e "$d" ] && stat -c '%n %F %t:%T' "$d"; done
echo "=== net"; for i in /sys/class/net/*; do echo "${{i##*/}} $(cat $i/address)"; done
echo "=== end"
trap 'exit 0' TERM
sleep 2147483647 & wait
"""
# The agent as the workload examples need it (tests/cluster/conftest.py's SCHEDULED_FLAGS say why), and
# collecting claims after a second's grace: a claim whose pods the kubelet still runs must never be.
# NICs the tests make in the host's namespace (`host_nic`): veth links, software ones, published only when
# named.
NIC_PREFIX = "dranic"
AGENT_FLAGS = ("--dynamic-mig=true", "--gpu-sharing=true", "--gpu-host-memory-overhead=0", "--gc-grace-period=1",
               f"--nic-include={NIC_PREFIX}*")


@pytest.fixture(scope="module", autouse=True)
def _reported(node_report: NodeReport) -> None:
    """Every test of the module has the node's report (conftest.py, realnode.py)."""


@pytest.fixture(scope="module")
def node_agent(node_cluster: Cluster, real_node: Node, node_runs: AgentRuns) -> Iterator[AgentProcess]:
    """The agent of the node, with a token bound to its own pod, which the kubelet runs (a sleeper in
    place of the DaemonSet's image); registered with the kubelet."""
    kubeconfig = node_cluster.agent_kubeconfig(NODE_NAME, container=SLEEPER)
    with node_runs.run(AGENT_ROOT, kubeconfig, *AGENT_FLAGS, node=NODE_NAME, own_kubelet=False) as agent:
        agent.wait_published()
        # The kubelet's plugin watcher found the registration socket and told the agent it took it.
        eventually(lambda: agent.metric("dra_agent_kubelet_registered") == 1.0, "the kubelet registers the plugin")
        yield agent


class HostNic:
    """A veth link in the host's namespace (this machine's kernel has no dummy links), as a NIC for a pod
    to claim: the agent publishes it (`--nic-include`; its peer's name is not included), runc moves it
    into the pod, and the kernel destroys it and its peer with the pod's namespace (a physical function
    would come back to the host instead)."""

    def __init__(self, index: int) -> None:
        tag = uuid.uuid4().hex[:6]
        self.name, self.peer = f"{NIC_PREFIX}{tag}", f"drapeer{tag}"
        self.mac = f"02:d7:00:00:00:{index:02x}"
        self.cidr = f"10.218.{index}.2/24"
        subprocess.run(["ip", "link", "add", self.name, "address", self.mac, "type", "veth", "peer", "name",
                        self.peer], check=True)
        subprocess.run(["ip", "addr", "add", self.cidr, "dev", self.name], check=True)
        for link in (self.name, self.peer):
            subprocess.run(["ip", "link", "set", link, "up"], check=True)

    def on_the_host(self) -> bool:
        return subprocess.run(["ip", "link", "show", self.name], capture_output=True).returncode == 0

    def remove(self) -> None:
        if self.on_the_host():
            subprocess.run(["ip", "link", "del", self.name], check=False)


@pytest.fixture
def host_nic() -> Iterator[Callable[[], HostNic]]:
    made: list[HostNic] = []

    def make() -> HostNic:
        made.append(HostNic(len(made) + 1))
        return made[-1]

    yield make
    for nic in made:
        nic.remove()


def published_nic(cluster: Cluster, nic: HostNic) -> str:
    """The device name the agent publishes `nic` under, once it does."""
    def find() -> str | None:
        return next((name for name, d in devices_of(slices_of(cluster.admin, NODE_NAME)).items()
                     if string(d, "type") == "nic" and string(d, "ifName") == nic.name), None)
    found: str = eventually(find, f"the agent publishes {nic.name}")
    return found


def _sections(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    current = ""
    for line in text.splitlines(keepends=True):
        if line.startswith("=== "):
            current = line[4:].strip()
            out[current] = ""
        elif current:
            out[current] += line
    return out


def _first(stream: str) -> dict[str, Any]:
    """The newest object of a metadata file's JSON stream (one object per version, newest first)."""
    obj, _ = json.JSONDecoder().raw_decode(stream.lstrip())
    assert isinstance(obj, dict)
    return obj


def _phase(cluster: Cluster, namespace: str, name: str, wanted: str) -> dict[str, Any] | None:
    """The pod once in phase `wanted`; a pod that ended otherwise fails at once."""
    pod: dict[str, Any] = cluster.admin.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
    phase = pod["status"].get("phase")
    if phase == wanted:
        return pod
    assert phase in ("Pending", "Running"), json.dumps(pod["status"], indent=1)
    return None


def test_the_node_is_ready_and_its_pods_have_a_network_of_their_own(node_cluster: Cluster, real_node: Node,
                                                                     node_agent: AgentProcess) -> None:
    node = node_object(node_cluster)
    assert node is not None and ready(node), node
    # The kubelet registered the Node with the not-ready taint; the node lifecycle controller took it
    # away. No test wrote the Node: every manager of its fields is the kubelet or a controller.
    managers = {m["manager"] for m in node["metadata"].get("managedFields") or []}
    assert managers <= {"kubelet", "kube-controller-manager"}, managers
    # The agent's own pod (what its token is bound to) runs in a network namespace of its own, with an
    # address of the node's pod network.
    pod = eventually(lambda: _phase(node_cluster, AGENT_NAMESPACE, f"dra-agent-{NODE_NAME}", "Running"),
                     "the agent's pod runs")
    assert not pod["spec"].get("hostNetwork")
    assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(POD_SUBNET), pod["status"]


def _objects(cluster: Cluster) -> dict[str, Any]:
    """The namespace, a claim by name (returned), a claim template, and the pod using both."""
    api = cluster.admin
    api.post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    # Pod admission looks the pod's service account up; the controller-manager makes `default`.
    eventually(lambda: any(a["metadata"]["name"] == "default"
                           for a in api.get(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts")["items"]),
               "the namespace's default service account")
    one_gpu = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}}]}}
    claims = f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}"
    named = api.post(f"{claims}/resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "trainer-gpu", "namespace": NAMESPACE}, "spec": one_gpu})
    api.post(f"{claims}/resourceclaimtemplates", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "spare-gpu", "namespace": NAMESPACE}, "spec": {"spec": one_gpu}})
    api.post(f"/api/v1/namespaces/{NAMESPACE}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "reader", "namespace": NAMESPACE},
        "spec": {
            # Placed by the scheduler, not named: only this node's slices can satisfy it.
            "nodeSelector": {"kubernetes.io/hostname": NODE_NAME},
            "automountServiceAccountToken": False, "restartPolicy": "Never",
            "resourceClaims": [{"name": "gpu", "resourceClaimName": "trainer-gpu"},
                               {"name": "spare", "resourceClaimTemplateName": "spare-gpu"}],
            "containers": [{"name": "reader", "image": IMAGE, "imagePullPolicy": "Never",
                            "command": ["/bin/sh", "-c", SCRIPT],
                            "resources": {"claims": [{"name": "gpu"}, {"name": "spare"}]}}]}})
    return named


def test_a_scheduled_pod_reads_its_device_metadata_through_kubelet_containerd_and_cdi(
        node_cluster: Cluster, real_node: Node, node_agent: AgentProcess) -> None:
    api = node_cluster.admin
    agent = node_agent
    published = devices_of(slices_of(api, NODE_NAME))
    named = _objects(node_cluster)
    pods = f"/api/v1/namespaces/{NAMESPACE}/pods"

    def printed() -> tuple[dict[str, Any], dict[str, str]] | None:
        # Running, and through its script: its claims stay allocated to it while it waits.
        p = _phase(node_cluster, NAMESPACE, "reader", "Running")
        if p is None:
            return None
        sections = _sections(real_node.container_log(p, "reader"))
        return (p, sections) if "end" in sections else None

    running_pod, out = eventually(printed, "the container prints its devices")
    assert running_pod["spec"]["nodeName"] == NODE_NAME
    assert ipaddress.ip_address(running_pod["status"]["podIP"]) in ipaddress.ip_network(POD_SUBNET)
    generated = {s["name"]: s["resourceClaimName"] for s in running_pod["status"]["resourceClaimStatuses"]}
    claims = {"gpu": api.get(f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/trainer-gpu"),
              "spare": api.get(f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/"
                               f"{generated['spare']}")}
    assert claims["gpu"]["metadata"]["uid"] == named["metadata"]["uid"]
    paths = {"gpu": f"{ATTRIBUTES}/resourceclaims/trainer-gpu/gpu/{DRIVER}-metadata.json",
             "spare": f"{ATTRIBUTES}/resourceclaimtemplates/spare/gpu/{DRIVER}-metadata.json"}
    assert sorted(k for k in out if k.startswith("file ")) == sorted(f"file {p}" for p in paths.values()), out
    minors = []
    for pod_claim, claim in claims.items():
        result, = claim["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"]) == (DRIVER, NODE_NAME)
        meta = _first(out[f"file {paths[pod_claim]}"])
        assert meta["apiVersion"] == "metadata.resource.k8s.io/v1beta1"
        assert meta["metadata"]["name"] == claim["metadata"]["name"]
        assert meta["metadata"]["uid"] == claim["metadata"]["uid"]
        assert meta.get("podClaimName") == ("spare" if pod_claim == "spare" else None)
        request, = meta["requests"]
        device, = request["devices"]
        assert request["name"] == "gpu"
        assert (device["driver"], device["pool"], device["name"]) == (DRIVER, NODE_NAME, result["device"])
        # Every attribute the slice publishes for the device, as published.
        assert device["attributes"] == published[result["device"]]["attributes"]
        attrs = device["attributes"]
        assert f"DRA_GPU_{attrs['index']['int']}_UUID={attrs['uuid']['string']}" in out["env"]
        minors.append(attrs["minor"]["int"])
    # The GPUs' device nodes, made by runc from the CDI specs (hex major:minor; 195 is NVIDIA's).
    dev = out["dev"].splitlines()
    for minor in minors:
        assert f"/dev/nvidia{minor} character special file c3:{minor:x}" in dev, dev

    uids = [c["metadata"]["uid"] for c in claims.values()]
    cdi_dir = agent.root / "cdi"
    metadata_dir = agent.root / "kubelet" / "plugins" / DRIVER / "dra-device-metadata"

    def left(uid: str) -> bool:
        return bool(list(cdi_dir.glob(f"*{uid}*"))) or (metadata_dir / uid).exists()

    assert all(left(uid) for uid in uids)
    api.delete(f"{pods}/reader")
    eventually(lambda: not api.get(pods)["items"], "the kubelet lets the pod go")
    # The kubelet unprepared both claims: the agent removed their CDI specs and metadata.
    eventually(lambda: not any(left(uid) for uid in uids), "the claims' CDI specs and metadata go")
    wanted = sorted(f"unprepared claim {NAMESPACE}/{c['metadata']['name']} ({c['metadata']['uid']})"
                    for c in claims.values())

    def unprepared() -> list[str]:  # the agent logs in the background: the files may go first
        return sorted(m for m in agent.messages() if m.startswith(f"unprepared claim {NAMESPACE}/"))

    eventually(lambda: unprepared() == wanted, "the agent says it unprepared both claims, once each")
    assert agent.messages("error") == []


# -- every workload example, as a pod through the real kubelet -----------------------------------------

EXAMPLES = REPO / "examples" / "workloads"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
NUMA = "resource.kubernetes.io/numaNode"
KUBEVIRT_METADATA = "metadata.resource.k8s.io/v1alpha1"  # the one version KubeVirt 1.9 reads
EXAMPLE_PODS = {"numa.yaml": "numa-pod", "gpu.yaml": "gpu-pod", "mig.yaml": "mig-pod",
                "gpu-share.yaml": "share-pod", "nic.yaml": "nic-pod", "extended-resource.yaml": "cuda-app"}
VM_FILE = "kubevirt-vm.yaml"


def on_the_node(doc: dict[str, Any]) -> dict[str, Any]:
    """An example's pod as the test runs it: on this node, each container the test image printing what
    it got (its resources, claims and limits as the example has them)."""
    if doc["kind"] == "Pod":
        doc["spec"]["nodeSelector"] = {"kubernetes.io/hostname": NODE_NAME}
        doc["spec"]["automountServiceAccountToken"] = False
        for c in doc["spec"]["containers"]:
            c.update(image=IMAGE, imagePullPolicy="Never", command=["/bin/sh", "-c", SCRIPT])
            c.pop("args", None)
    return doc


class Printed:
    """What one container printed: its metadata files (path -> objects), environment and device nodes."""

    def __init__(self, sections: dict[str, str]) -> None:
        self.files = {k.removeprefix("file "): [json.loads(line) for line in v.splitlines() if line.strip()]
                      for k, v in sections.items() if k.startswith("file ")}
        self.env = dict(line.split("=", 1) for line in sections["env"].splitlines() if "=" in line)
        self.dev = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in sections["dev"].splitlines() if line}
        # The container's network interfaces: name -> MAC.
        self.net = dict(line.split(" ", 1) for line in sections["net"].splitlines() if " " in line)

    def char_device(self, path: str) -> bool:
        return self.dev.get(path, "").startswith("character special file")


def running_and_printed(cluster: Cluster, node: Node, namespace: str, pod: str) -> tuple[dict[str, Any], Printed]:
    def probe() -> tuple[dict[str, Any], Printed] | None:
        p = _phase(cluster, namespace, pod, "Running")
        if p is None:
            return None
        sections = _sections(node.container_log(p, p["spec"]["containers"][0]["name"]))
        return (p, Printed(sections)) if "end" in sections else None

    found: tuple[dict[str, Any], Printed] = eventually(probe, f"pod {namespace}/{pod} runs and prints its devices")
    return found


def kubevirt_reads(printed: Printed, pod_claim: str, request: str) -> dict[str, Any]:
    """The device KubeVirt 1.9's virt-launcher takes for a template claim's request, by its rules: the
    request's directory (named by the pod's claim name) holds exactly one `*-metadata.json`; its object
    of the version KubeVirt knows lists the request with exactly one device; an `mdevUUID` attribute is
    taken before `pciBusID`."""
    directory = f"{ATTRIBUTES}/resourceclaimtemplates/{pod_claim}/{request}/"
    (path,) = [p for p in printed.files if p.startswith(directory) and p.endswith("-metadata.json")]
    first = next(o for o in printed.files[path] if o["apiVersion"] == KUBEVIRT_METADATA)
    (device,) = next(r["devices"] for r in first["requests"] if r["name"] == request)
    return dict(device)


def test_every_workload_example_runs_as_a_pod_through_the_real_kubelet(
        node_cluster: Cluster, real_node: Node, node_agent: AgentProcess,
        host_nic: Callable[[], HostNic]) -> None:
    ns = Namespace(node_cluster, "examples").create()
    try:
        # nic.yaml's NIC: the node's own (its uplink) is never offered to a pod.
        spare = host_nic()
        published_nic(node_cluster, spare)
        devices = devices_of(slices_of(node_cluster.admin, NODE_NAME))
        assert any(d["attributes"].get("uplink") == {"bool": True} for d in devices.values()), \
            "the NIC of the node's default route is published as its uplink"
        assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted([*EXAMPLE_PODS, VM_FILE])
        for name in EXAMPLE_PODS:
            docs = [on_the_node(d) for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]
            node_cluster.kubectl("apply", "--validate=strict", f"--namespace={ns.name}", "-f", "-",
                                 stdin=yaml.safe_dump_all(docs))
            ns.scheduled(EXAMPLE_PODS[name])
        # The VM: its claim templates, and in place of KubeVirt's virt-launcher a pod with the VM's claims
        # whose `compute` container uses each device's claim and request, as virt-controller makes it.
        vm_docs = [d for d in yaml.safe_load_all((EXAMPLES / VM_FILE).read_text()) if d]
        (vm,) = [d for d in vm_docs if d["kind"] == "VirtualMachine"]
        spec = vm["spec"]["template"]["spec"]
        vm_devices = spec["domain"]["devices"]
        uses = [{"name": d["claimName"], "request": d["requestName"]}
                for d in (*vm_devices.get("gpus", ()), *vm_devices.get("hostDevices", ()))]
        launcher = on_the_node({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "virt-launcher-vm-1"},
                                "spec": {"resourceClaims": spec["resourceClaims"], "containers": [
                                    {"name": "compute", "resources": {"claims": uses}}]}})
        node_cluster.kubectl("apply", "--validate=strict", f"--namespace={ns.name}", "-f", "-",
                             stdin=yaml.safe_dump_all([d for d in vm_docs if d["kind"] == "ResourceClaimTemplate"]
                                                      + [launcher]))

        pods = {pod: running_and_printed(node_cluster, real_node, ns.name, pod)
                for pod in [*EXAMPLE_PODS.values(), "virt-launcher-vm-1"]}

        def only(pod: str, pod_claim: str | None) -> tuple[dict[str, Any], Printed, dict[str, Any]]:
            """The one device of the pod's claim, what its container printed, and its allocation result."""
            claim = ns.extended_claim(pod) if pod_claim is None else ns.claims_of(pod)[pod_claim]
            (result,) = results_of(claim)
            return devices[result["device"]], pods[pod][1], result

        def env_name(device: dict[str, Any]) -> str:
            return "DRA_" + device["name"].upper().replace("-", "_")

        def gpu_node(printed: Printed, device: dict[str, Any]) -> bool:
            minor = device["attributes"]["minor"]["int"]
            return printed.dev.get(f"/dev/nvidia{minor}") == f"character special file c3:{minor:x}"

        # gpu.yaml: one whole GPU, its UUID and device node, and the metadata file its command reads.
        gpu, out, result = only("gpu-pod", "gpu")
        assert string(gpu, "type") == "gpu" and out.env[f"{env_name(gpu)}_UUID"] == string(gpu, "uuid")
        assert gpu_node(out, gpu), out.dev
        (meta,) = out.files[f"{ATTRIBUTES}/resourceclaimtemplates/gpu/gpu/{DRIVER}-metadata.json"][:1]
        assert meta["requests"][0]["devices"][0]["name"] == result["device"]

        # mig.yaml: a 1g.10gb MIG device, its own UUID, its parent GPU's device node.
        mig, out, _ = only("mig-pod", "mig")
        assert string(mig, "type") == "mig" and string(mig, "profile") == "1g.10gb"
        assert out.env[f"{env_name(mig)}_UUID"].startswith("MIG-")
        parent = next(d for d in devices.values() if string(d, "type") == "gpu"
                      and string(d, "uuid") == string(mig, "parentUUID"))
        assert gpu_node(out, parent), out.dev

        # gpu-share.yaml: 10Gi and half the compute of a shared GPU: its limits, share ID and the MPS limits
        # (memory keyed by the ordinal CUDA gives it, 0; threads in percent).
        share, out, result = only("share-pod", "share")
        assert string(share, "type") == "shared"
        assert result["consumedCapacity"] == {"memory": "10Gi", "compute": "500m"}
        assert out.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == out.env[f"{env_name(share)}_COMPUTE_PERCENT"] == "50"
        assert out.env[f"{env_name(share)}_MEMORY_LIMIT"] == str(10 << 30)
        assert out.env[f"{env_name(share)}_SHARE_ID"] == result["shareID"]
        assert out.env["CUDA_VISIBLE_DEVICES"] == string(share, "uuid")
        assert out.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={10 << 10}M"

        # nic.yaml: a NIC of the node, moved into the pod under its host name, with its MAC; its metadata's
        # networkData says so; the host no longer has it.
        nic, out, _ = only("nic-pod", "nic")
        assert string(nic, "type") == "nic" and out.env[f"{env_name(nic)}_INTERFACE"] == string(nic, "ifName")
        assert string(nic, "ifName") == spare.name and out.net.get(spare.name) == spare.mac, out.net
        assert not spare.on_the_host()
        (path,) = [p for p in out.files if "/resourceclaimtemplates/nic/nic/" in p]
        assert out.files[path][0]["requests"][0]["devices"][0]["networkData"]["interfaceName"] == string(nic, "ifName")

        # numa.yaml: a GPU, CPUs and memory of one NUMA node, and the CPUs the container may use.
        claim = ns.claims_of("numa-pod")["local"]
        local = {r["request"]: devices[r["device"]] for r in results_of(claim)}
        assert {r: string(d, "type") for r, d in local.items()} == {"gpu": "gpu", "cpu": "cpu", "memory": "memory"}
        assert len({json.dumps(d["attributes"][NUMA]) for d in local.values()}) == 1, local
        out = pods["numa-pod"][1]
        assert out.env[f"{env_name(local['cpu'])}_CPUS"] and gpu_node(out, local["gpu"])

        # extended-resource.yaml: the scheduler's claim for `example.com/gpu: 1`, one GPU in the container.
        gpu, out, _ = only("cuda-app", None)
        assert string(gpu, "type") == "gpu" and out.env[f"{env_name(gpu)}_UUID"] == string(gpu, "uuid")
        assert gpu_node(out, gpu), out.dev

        # kubevirt-vm.yaml: a GPU and a VF passed through, read where and as KubeVirt reads them, with the
        # VFIO container node and each function's group node in the container.
        out = pods["virt-launcher-vm-1"][1]
        templates = {d["metadata"]["name"]: d for d in vm_docs if d["kind"] == "ResourceClaimTemplate"}
        mac = templates["passthrough-vf"]["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]["mac"]
        assert out.char_device("/dev/vfio/vfio"), out.dev
        for pod_claim, request, native in (("gpu", "gpu", "gpu"), ("net", "vf", "nic")):
            dev, _, _ = only("virt-launcher-vm-1", pod_claim)
            assert (string(dev, "type"), string(dev, "nativeType")) == ("vfio", native)
            read = kubevirt_reads(out, pod_claim, request)
            assert "mdevUUID" not in read["attributes"]
            assert read["name"] == dev["name"] and read["attributes"][PCI_BUS_ID] == dev["attributes"][PCI_BUS_ID]
            group = dev["attributes"]["iommuGroup"]["int"]
            assert out.char_device(f"/dev/vfio/{group}"), out.dev
            if native == "nic":
                assert read["networkData"] == {"hardwareAddress": mac}
    finally:
        ns.clean()
    # Every pod gone: the kubelet unprepared every claim, and the agent holds none.
    eventually(lambda: not list((node_agent.root / "cdi").glob(f"{DRIVER}-claim_*")), "every claim is unprepared")


# -- device health in the pod's status -----------------------------------------------------------------

def agent_cli(agent: AgentProcess, *args: str) -> str:
    """`dra-agent ARGS` for the node's agent (its node, NVML and directories)."""
    cmd = [str(VENV_BIN / "dra-agent"), *args, f"--node-name={NODE_NAME}", "--nvml=sim:dgx-h100",
           f"--state-dir={agent.root / 'state'}", f"--kubelet-dir={agent.root / 'kubelet'}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"dra-agent {' '.join(args)}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_an_xid_on_a_prepared_gpu_shows_in_the_pods_status_through_the_kubelet(
        node_cluster: Cluster, real_node: Node, node_agent: AgentProcess) -> None:
    """The health stream the agent serves reaches the pod: the kubelet (ResourceHealthStatus) puts each
    device of a container's claims in `containerStatuses[].allocatedResourcesStatus`, Unhealthy after an
    XID that takes the GPU off the bus, Healthy again after the GPU's reset. The claim tolerates the
    XID's NoExecute taint (else the device taint eviction controller deletes the pod at once)."""
    ns = Namespace(node_cluster, "health").create()
    try:
        ns.cluster.admin.post(ns.path("resourceclaimtemplates"), {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "one-gpu"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": f"gpu.{DRIVER}",
                "tolerations": [{"key": f"{DRIVER}/xid", "operator": "Exists", "effect": "NoExecute"}]}}]}}}})
        ns.cluster.admin.post(ns.path("pods"), on_the_node({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "trainer"},
            "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
                     "containers": [{"name": "train", "resources": {"claims": [{"name": "gpu"}]}}]}}))
        running_and_printed(node_cluster, real_node, ns.name, "trainer")
        claim = ns.claims_of("trainer")["gpu"]
        (result,) = results_of(claim)
        # The kubelet names a device in the pod's status by the first CDI device ID of the agent's answer.
        device = f"{DRIVER}/claim={claim['metadata']['uid']}-{result['device']}"

        seen: list[dict[tuple[str, str], str]] = [{}]

        def health(wanted: str) -> bool:
            statuses = ns.get("pods", "trainer")["status"].get("containerStatuses") or []
            # The container names its claim without a request: the kubelet reports it as `claim:<name>`.
            seen[0] = {(a["name"], r["resourceID"]): r.get("health") for s in statuses
                       for a in s.get("allocatedResourcesStatus") or [] for r in a.get("resources") or []}
            return seen[0] == {("claim:gpu", device): wanted}

        for step, wanted in ((None, "Healthy"), (("xid", result["device"], "79"), "Unhealthy"),
                             (("recover", result["device"]), "Healthy")):
            if step is not None:
                agent_cli(node_agent, "sim", *step)
            try:
                eventually(lambda w=wanted: health(w), f"the pod's status says {device} is {wanted}")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; it says {seen[0]}") from None
    finally:
        ns.clean()


# -- the kubelet restarted -------------------------------------------------------------------------------

def running_gpu_pod(cluster: Cluster, node: Node, ns: Namespace, pod: str) -> tuple[dict[str, Any], str, str]:
    """A pod with one GPU from a template, running and through its script: the pod, its claim's UID, and
    the claim as the agent's log names it (`<namespace>/<name> (<uid>)`)."""
    cluster.admin.post(ns.path("resourceclaimtemplates"), {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "one-gpu"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": f"gpu.{DRIVER}"}}]}}}})
    cluster.admin.post(ns.path("pods"), on_the_node({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
        "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
                 "containers": [{"name": "work", "resources": {"claims": [{"name": "gpu"}]}}]}}))
    running, _ = running_and_printed(cluster, node, ns.name, pod)
    claim = ns.claims_of(pod)["gpu"]
    uid = claim["metadata"]["uid"]
    return running, uid, f"{ns.name}/{claim['metadata']['name']} ({uid})"


def said(agent: AgentProcess, message: str) -> int:
    """How many times the agent logged exactly `message`."""
    return sum(m == message for m in agent.messages())


def deleted_and_unprepared_once(ns: Namespace, pod: str, agent: AgentProcess, uid: str, ref: str) -> None:
    """The pod deleted: its claim's files go, unprepared once and prepared once in all, no error logged."""
    ns.cluster.admin.delete(ns.path("pods", pod))
    eventually(lambda: not list((agent.root / "cdi").glob(f"*{uid}*")), "the claim's CDI specs go")
    eventually(lambda: said(agent, f"unprepared claim {ref}") == 1, "the agent says it unprepared the claim")
    assert said(agent, f"prepared claim {ref}") == 1
    assert agent.messages("error") == []


def test_a_restarted_kubelet_keeps_every_prepared_claim_and_unprepares_it_once(
        node_cluster: Cluster, real_node: Node, node_agent: AgentProcess) -> None:
    """The kubelet restarted under a running pod: it deletes every ResourceSlice of its node as it starts
    and registers the plugin again, upon which the agent publishes them again; the pod's container goes
    on, the claim is prepared once (whatever the kubelet asks again is answered from the agent's
    record), and deleting the pod afterwards unprepares it once, every file gone."""
    ns = Namespace(node_cluster, "restart").create()
    try:
        before, uid, ref = running_gpu_pod(node_cluster, real_node, ns, "keeper")

        registered = said(node_agent, "the kubelet registered the plugin")
        assert said(node_agent, f"prepared claim {ref}") == 1
        published = devices_of(slices_of(node_cluster.admin, NODE_NAME))
        real_node.restart_kubelet()
        eventually(lambda: said(node_agent, "the kubelet registered the plugin") > registered,
                   "the kubelet registers the plugin again")
        eventually(lambda: ready(node_object(node_cluster)), "the Node is Ready again")
        container = before["status"]["containerStatuses"][0]

        def same_container() -> bool:
            (now,) = ns.get("pods", "keeper")["status"]["containerStatuses"]
            return bool(now.get("state", {}).get("running")) and now["containerID"] == container["containerID"] \
                and now["restartCount"] == container["restartCount"]

        eventually(same_container, "the pod's container runs on, the same one")
        # The agent's publishing runs with an hour between verifications here: only the registration
        # brings the slices back within the bound.
        eventually(lambda: devices_of(slices_of(node_cluster.admin, NODE_NAME)) == published,
                   "the node's devices are published again")
        assert said(node_agent, f"prepared claim {ref}") == 1
        assert list((node_agent.root / "cdi").glob(f"*{uid}*"))
        deleted_and_unprepared_once(ns, "keeper", node_agent, uid, ref)
    finally:
        ns.clean()


def test_the_node_restarted_with_its_containers_gets_every_claim_back_through_the_kubelet(
        node_cluster: Cluster, real_node: Node, node_agent: AgentProcess) -> None:
    """The kubelet and containerd stopped and every container killed with them, then started again: the
    kubelet finds the pod's sandbox gone and makes the pod's sandbox and container again, and the claim
    they use is the one the agent prepared before (answered from its record: prepared once, every file
    in place); deleting the pod afterwards unprepares it once."""
    ns = Namespace(node_cluster, "node-restart").create()
    try:
        before, uid, ref = running_gpu_pod(node_cluster, real_node, ns, "survivor")

        assert said(node_agent, f"prepared claim {ref}") == 1
        files = sorted(p.name for p in (node_agent.root / "cdi").glob(f"*{uid}*"))
        container = before["status"]["containerStatuses"][0]["containerID"]
        real_node.restart_with_containers()
        eventually(lambda: ready(node_object(node_cluster)), "the Node is Ready again")

        def again() -> dict[str, Any] | None:
            (now,) = ns.get("pods", "survivor")["status"].get("containerStatuses") or [{}]
            return now if now.get("state", {}).get("running") and now.get("containerID") != container else None

        eventually(again, "the pod's container runs again, a new one")
        # The same claim, prepared once: the kubelet's calls after its restart were answered from the record.
        assert ns.claims_of("survivor")["gpu"]["metadata"]["uid"] == uid
        assert said(node_agent, f"prepared claim {ref}") == 1
        assert sorted(p.name for p in (node_agent.root / "cdi").glob(f"*{uid}*")) == files
        deleted_and_unprepared_once(ns, "survivor", node_agent, uid, ref)
    finally:
        ns.clean()


# -- a claim of a PodGroup -------------------------------------------------------------------------------

def test_a_podgroups_claim_is_prepared_once_for_its_pods_and_unprepared_after_the_last(
        node_cluster: Cluster, real_node: Node, node_agent: AgentProcess) -> None:
    """DRAWorkloadResourceClaims (beta, with GenericWorkload and scheduling.k8s.io/v1beta1): one claim
    reserved for a PodGroup of three pods on the node. The scheduler reserves it for the PodGroup, not
    for each pod; the kubelet prepares it once and the three containers get the same GPU; it stays
    prepared (collection after a second's grace leaves it, `dra-agent claims` lists it) while any pod
    of the group runs, and is unprepared once the last one is gone."""
    ns = Namespace(node_cluster, "podgroup").create()
    api = node_cluster.admin
    pods = ("trainer-0", "trainer-1", "trainer-2")
    try:
        claim = api.post(ns.path("resourceclaims"), {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "group-gpu"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}}]}}})
        group = api.post(f"/apis/scheduling.k8s.io/v1beta1/namespaces/{ns.name}/podgroups", {
            "apiVersion": "scheduling.k8s.io/v1beta1", "kind": "PodGroup", "metadata": {"name": "trainers"},
            "spec": {"schedulingPolicy": {"basic": {}},
                     "resourceClaims": [{"name": "shared", "resourceClaimName": "group-gpu"}]}})
        for pod in pods:
            api.post(ns.path("pods"), on_the_node({
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod},
                "spec": {"schedulingGroup": {"podGroupName": "trainers"},
                         "resourceClaims": [{"name": "shared", "resourceClaimName": "group-gpu"}],
                         "terminationGracePeriodSeconds": 1,
                         "containers": [{"name": "train", "resources": {"claims": [{"name": "shared"}]}}]}}))
        printed = {pod: running_and_printed(node_cluster, real_node, ns.name, pod)[1] for pod in pods}
        now = ns.get("resourceclaims", "group-gpu")
        assert now["status"]["reservedFor"] == [{"apiGroup": "scheduling.k8s.io", "resource": "podgroups",
                                                 "name": "trainers", "uid": group["metadata"]["uid"]}]
        (result,) = results_of(now)
        uuids = {out.env[f"DRA_{result['device'].upper().replace('-', '_')}_UUID"] for out in printed.values()}
        assert len(uuids) == 1, uuids
        uid = claim["metadata"]["uid"]
        ref = f"{ns.name}/group-gpu ({uid})"

        assert said(node_agent, f"prepared claim {ref}") == 1
        listed = json.loads(agent_cli(node_agent, "claims", "-o", "json"))
        assert uid in json.dumps(listed), listed
        for pod in pods[:2]:
            api.delete(ns.path("pods", pod))
        eventually(lambda: [p["metadata"]["name"] for p in api.get(ns.path("pods"))["items"]] == [pods[2]],
                   "two of the group's pods go")
        # The collection's grace is a second: a claim that exists is never collected, whoever holds it.
        eventually(lambda: node_agent.metric("dra_agent_gc_sweeps_total") >= 3, "three collection sweeps")
        assert list((node_agent.root / "cdi").glob(f"*{uid}*")) and said(node_agent, f"unprepared claim {ref}") == 0
        api.delete(ns.path("pods", pods[2]))
        eventually(lambda: not list((node_agent.root / "cdi").glob(f"*{uid}*")), "the claim is unprepared")
        eventually(lambda: said(node_agent, f"unprepared claim {ref}") == 1, "the agent says it unprepared the claim")
        assert said(node_agent, f"prepared claim {ref}") == 1
        assert node_agent.messages("error") == []
    finally:
        # The group first: its claim is reserved for it while it exists, and cannot go before.
        api.request("DELETE", f"/apis/scheduling.k8s.io/v1beta1/namespaces/{ns.name}/podgroups")
        ns.clean()


# -- garbage collection from the node's own view ---------------------------------------------------------------

def test_a_claim_no_pod_on_the_node_uses_is_collected_with_one_read_once_its_resourceclaim_is_gone(
        node_cluster: Cluster, real_node: Node, node_agent: AgentProcess) -> None:
    """The kubelet's pod resources service (its socket in the kubelet's directory, which the agent's pod
    mounts) says which claims the node's pods use: a claim prepared here that no pod uses (the kubelet never
    asked for it: its unprepare is what never reaches the agent) is read by itself once the grace period is
    over, left prepared while its ResourceClaim exists, and unprepared once that is gone. The agent never
    lists claims for it: its token could not (deploy/base grants `get` alone)."""
    ns = Namespace(node_cluster, "gc-orphan").create()
    api = node_cluster.admin
    # The agent is the module's: a sweep while an earlier test restarted the kubelet found it silent.
    skipped_before = node_agent.metric("dra_agent_gc_skipped_total")
    try:
        made = api.post(ns.path("resourceclaims"), {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "orphan"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}}]}}})
        made["status"] = {"allocation": {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": NODE_NAME, "device": "gpu-7"}]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [NODE_NAME]}]}]}}}
        api.put(ns.path("resourceclaims", "orphan") + "/status", made)
        uid = made["metadata"]["uid"]
        ref = f"{ns.name}/orphan ({uid})"
        socket = node_agent.root / "kubelet" / "plugins" / DRIVER / "dra.sock"

        async def prepare() -> str:
            async with kc.DRAClient(socket) as client:
                answer = await client.prepare([ClaimRef(ns.name, "orphan", uid)])
            return str(answer.claims[uid].error)

        assert asyncio.run(prepare()) == ""
        assert said(node_agent, f"prepared claim {ref}") == 1
        # Used by no pod: looked up after the grace period (a second), found, and left prepared.
        eventually(lambda: any(m == f"claim {ref} is used by no pod on this node, but its ResourceClaim exists: "
                               "left prepared" for m in node_agent.messages()), "the claim looked up and kept")
        assert list((node_agent.root / "cdi").glob(f"*{uid}*"))
        api.delete(ns.path("resourceclaims", "orphan"))
        eventually(lambda: not list((node_agent.root / "cdi").glob(f"*{uid}*")), "the claim is collected")
        eventually(lambda: any(m.startswith(f"garbage-collected claim {ref}: no pod on this node has used it")
                               for m in node_agent.messages()), "the collection logged")
        # Every sweep of this test asked the real kubelet, and none found it silent.
        assert node_agent.metric("dra_agent_gc_skipped_total") == skipped_before
        assert node_agent.metric("dra_agent_gc_sweeps_total") >= 3
        assert node_agent.metric('dra_agent_api_requests_total{resource="resourceclaims",verb="LIST"}') == 0
        assert node_agent.messages("error") == []
    finally:
        ns.clean()


def test_the_kubelet_records_its_nodes_events_in_default(node_cluster: Cluster, real_node: Node) -> None:
    """Where a cluster-scoped object's Events live, which is where the agent creates its Node's (agent/events.py)
    and the only namespace deploy/ lets it create Events in: the real kubelet's about its Node are there."""
    items = node_cluster.admin.get("/api/v1/events")["items"]
    about_node = [e for e in items if e["involvedObject"].get("kind") == "Node"
                  and e["involvedObject"].get("name") == NODE_NAME]
    assert about_node, "the kubelet recorded no Event about its Node"
    assert {e["metadata"]["namespace"] for e in about_node} == {"default"}
    assert "kubelet" in {(e.get("source") or {}).get("component") or e.get("reportingComponent") for e in about_node}


def test_a_claimed_nic_moves_into_the_pod_under_the_name_the_claim_gives(
        node_cluster: Cluster, real_node: Node, node_agent: AgentProcess, host_nic: Callable[[], HostNic]) -> None:
    nic = host_nic()
    device = published_nic(node_cluster, nic)
    ns = Namespace(node_cluster, "netdev").create()
    try:
        params = {"apiVersion": f"{DRIVER}/v1alpha1", "kind": "NetworkConfig", "interfaceName": "net1"}
        ns.claim("data-net", {"devices": {
            "requests": [{"name": "nic", "exactly": {
                "deviceClassName": f"nic.{DRIVER}",
                "selectors": [{"cel": {"expression": f"device.attributes['{DRIVER}'].ifName == '{nic.name}'"}}]}}],
            "config": [{"requests": ["nic"], "opaque": {"driver": DRIVER, "parameters": params}}]}})
        node_cluster.admin.post(ns.path("pods"), on_the_node({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "netdev-pod", "namespace": ns.name},
            "spec": {"restartPolicy": "Never", "resourceClaims": [{"name": "net", "resourceClaimName": "data-net"}],
                     "containers": [{"name": "app", "resources": {"claims": [{"name": "net"}]}}]}}))
        _, out = running_and_printed(node_cluster, real_node, ns.name, "netdev-pod")
        # In the pod as net1, with its MAC; gone from the host's namespace.
        assert out.net.get("net1") == nic.mac and nic.name not in out.net, out.net
        assert not nic.on_the_host()
        # The claim's status says where it is: its name in the pod, the addresses it took along.
        def network_data() -> dict[str, Any] | None:
            claim = node_cluster.admin.get(ns.path("resourceclaims", "data-net"))
            entries = [d for d in claim.get("status", {}).get("devices") or [] if d["device"] == device]
            return entries[0].get("networkData") if entries else None
        net = eventually(network_data, "the claim's status reports the NIC's networkData")
        assert net["interfaceName"] == "net1" and nic.cidr in net["ips"] and net["hardwareAddress"] == nic.mac
        (path,) = [p for p in out.files if "/resourceclaims/data-net/nic/" in p]
        assert out.files[path][0]["requests"][0]["devices"][0]["networkData"]["interfaceName"] == "net1"
    finally:
        ns.clean()
    # A veth link ends with the pod's network namespace (a physical function would come back to the host):
    # the slice stops publishing it.
    eventually(lambda: device not in devices_of(slices_of(node_cluster.admin, NODE_NAME)),
               f"{device} leaves the slice once its pod's namespace is gone")
    assert not nic.on_the_host()
