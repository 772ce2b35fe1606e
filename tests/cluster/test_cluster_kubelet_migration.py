"""A node moving off a device plugin through the real kubelet (1.37), with its pods running: a device plugin
(tests/gocheck/deviceplugin: the real device plugin API, v1beta1 Registration, ListAndWatch and Allocate, over
grpc-go) serves `nvidia.com/gpu` with the simulated GPUs' UUIDs, as the NVIDIA device plugin's default ID
strategy names them; a DeviceClass serves the same name through DRA (`extendedResourceName`), as
deploy/overlays/device-plugin-migration installs it.

The agent learns who holds what from the Node (its allocatable) and the kubelet's own pod resources service:
while the device plugin serves, every GPU and form of it is published with the agent's `device-plugin` taint
and a claim gets none; when the device plugin stops, an unchanged pod asking for `nvidia.com/gpu: 1` starts
with a GPU through the agent, never the one the device plugin's pod still has, which is free once that pod
ends. The agent started before the device plugin, restarted midway, and the device plugin coming back are
steps of the same move. docs/migration.md is the procedure this follows.

Marker `kubelet` (docs/tests.md, "A real kubelet")."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gocheck import build

from .clusterkit import DRIVER, AgentProcess, AgentRuns, Cluster, devices_of, eventually, slices_of
from .nodekit import IMAGE, Node, NodeReport
from .realnode import AGENT_ROOT, NODE_NAME, SLEEPER
from .workloads import Namespace, claim_spec, request, results_of

pytestmark = [pytest.mark.cluster, pytest.mark.kubelet]

RESOURCE = "nvidia.com/gpu"
HOLD = f"{DRIVER}/device-plugin"
BUS = "resource.kubernetes.io/pciBusID"
AGENT_FLAGS = ("--dynamic-mig=true", "--gpu-sharing=true", "--gpu-host-memory-overhead=0", "--gc-grace-period=1")
PRINT_ENV = "env; echo '=== end'; trap 'exit 0' TERM; sleep 2147483647 & wait"


@pytest.fixture(scope="module", autouse=True)
def _reported(node_report: NodeReport) -> None:
    """Every test of the module has the node's report (conftest.py, realnode.py)."""


@pytest.fixture(scope="module")
def device_plugin_program() -> Path:
    return build.GOCHECK.for_test("deviceplugin")


class DevicePlugin:
    """The device plugin stand-in, registered with the node's kubelet while it runs."""

    def __init__(self, program: Path, kubelet_dir: Path, ids: list[str]) -> None:
        self.args = [str(program), str(kubelet_dir / "device-plugins"), RESOURCE, ",".join(ids)]
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> DevicePlugin:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "serving", f"the device plugin did not register: {line}{self.proc.stderr.read()}"
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        self.proc = None


def allocatable(cluster: Cluster) -> str:
    return str(cluster.admin.get(f"/api/v1/nodes/{NODE_NAME}")["status"].get("allocatable", {}).get(RESOURCE, ""))


def published(cluster: Cluster) -> dict[str, dict[str, Any]]:
    return devices_of(slices_of(cluster.admin, NODE_NAME))


def held(cluster: Cluster) -> dict[str, str]:
    """Published device -> the device-plugin taint's value, for each device that has one."""
    return {name: next(t.get("value", "") for t in d["taints"] if t["key"] == HOLD)
            for name, d in published(cluster).items() if any(t["key"] == HOLD for t in d.get("taints") or [])}


def forms(devices: dict[str, dict[str, Any]], gpu: str) -> set[str]:
    """The GPU and every form of it (the same PCI function)."""
    bus = devices[gpu]["attributes"][BUS]["string"]
    return {name for name, d in devices.items() if d["attributes"].get(BUS, {}).get("string") == bus}


def env_of(node: Node, cluster: Cluster, ns: Namespace, pod: str) -> dict[str, str]:
    """The environment the pod's container printed, once it runs."""
    def probe() -> dict[str, str] | None:
        obj = ns.get("pods", pod)
        phase = obj["status"].get("phase")
        assert phase in ("Pending", "Running"), obj["status"]
        if phase != "Running":
            return None
        try:
            text = node.container_log(obj, "work")
        except FileNotFoundError:
            return None
        if "=== end" not in text:
            return None
        return dict(line.split("=", 1) for line in text.split("=== end")[0].splitlines() if "=" in line)
    found: dict[str, str] = eventually(probe, f"pod {pod} runs and prints its environment", 120)
    return found


def unchanged_pod(ns: Namespace, name: str) -> None:
    """A pod as written for the device plugin: `nvidia.com/gpu: 1`, no claim."""
    ns.cluster.admin.post(ns.path("pods"), {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "nodeSelector": {"kubernetes.io/hostname": NODE_NAME}, "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 0, "containers": [{
            "name": "work", "image": IMAGE, "imagePullPolicy": "Never", "command": ["/bin/sh", "-c", PRINT_ENV],
            "resources": {"limits": {RESOURCE: "1"}}}]}})


def claim_pod(ns: Namespace, name: str, claim: str) -> None:
    ns.cluster.admin.post(ns.path("pods"), {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "nodeSelector": {"kubernetes.io/hostname": NODE_NAME}, "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 0, "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
        "containers": [{"name": "work", "image": IMAGE, "imagePullPolicy": "Never",
                        "command": ["/bin/sh", "-c", PRINT_ENV], "resources": {"claims": [{"name": "gpu"}]}}]}})


@contextlib.contextmanager
def agent_on_the_node(runs: AgentRuns, kubeconfig: Path) -> Iterator[AgentProcess]:
    with runs.run(AGENT_ROOT, kubeconfig, *AGENT_FLAGS, node=NODE_NAME, own_kubelet=False) as agent:
        agent.wait_published()
        eventually(lambda: agent.metric("dra_agent_kubelet_registered") == 1.0, "the kubelet registers the plugin")
        yield agent


@pytest.fixture
def nvidia_class(node_cluster: Cluster) -> Iterator[str]:
    """The gpu class's devices served for `nvidia.com/gpu` too, as the migration overlay's class does."""
    path = "/apis/resource.k8s.io/v1/deviceclasses"
    gpu = node_cluster.admin.get(f"{path}/gpu.{DRIVER}")
    name = f"gpu-nvidia.{DRIVER}"
    node_cluster.admin.post(path, {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                                   "metadata": {"name": name},
                                   "spec": {**gpu["spec"], "extendedResourceName": RESOURCE}})
    yield name
    node_cluster.admin.delete(f"{path}/{name}")


def test_a_node_moves_off_the_device_plugin_with_its_pods_running_and_no_gpu_in_two_pods(
        node_cluster: Cluster, real_node: Node, node_runs: AgentRuns, device_plugin_program: Path,
        nvidia_class: str) -> None:
    cluster = node_cluster
    ns = Namespace(cluster, "migration").create()
    plugin: DevicePlugin | None = None
    try:
        # The agent runs first; then the device plugin registers with the kubelet and serves every GPU.
        kubeconfig = cluster.agent_kubeconfig(NODE_NAME, container=SLEEPER)
        with agent_on_the_node(node_runs, kubeconfig):
            devices = published(cluster)
            gpus = {name: d["attributes"]["uuid"]["string"] for name, d in devices.items()
                    if d["attributes"].get("type", {}).get("string") == "gpu"}
            every_form = set().union(*(forms(devices, g) for g in gpus))
            assert held(cluster) == {}
            plugin = DevicePlugin(device_plugin_program, real_node.kubelet_dir, sorted(gpus.values())).start()
            eventually(lambda: allocatable(cluster) == str(len(gpus)), "the kubelet reports the device plugin's GPUs")
            eventually(lambda: held(cluster) == dict.fromkeys(every_form, "serving"),
                       "every GPU and every form of it held while the device plugin serves")

            # A pod written for the device plugin gets GPU X through it.
            unchanged_pod(ns, "legacy")
            x_uuid = env_of(real_node, cluster, ns, "legacy")["DEVICE_PLUGIN_DEVICES"]
            (x,) = (name for name, uuid in gpus.items() if uuid == x_uuid)

            # No claim gets X, or any GPU, while the device plugin serves.
            ns.claim("wants-a-gpu", claim_spec(request("gpu", "gpu")))
            claim_pod(ns, "claimed", "wants-a-gpu")
            ns.unschedulable("claimed")

        # The agent restarted midway: its first slices hold every GPU again.
        with agent_on_the_node(node_runs, kubeconfig) as agent:
            assert held(cluster) == dict.fromkeys(every_form, "serving")

            # The device plugin stops: every GPU but X comes free at once, X stays held for the pod that has it.
            plugin.stop()
            eventually(lambda: allocatable(cluster) == "0", "the kubelet reports the device plugin gone")
            eventually(lambda: held(cluster) == dict.fromkeys(forms(devices, x), "in-use"),
                       "only X and its forms held, for the device plugin's pod")
            ns.scheduled("claimed")
            (result,) = results_of(ns.claims_of("claimed")["gpu"])
            claimed = result["device"]
            assert claimed in gpus and claimed != x
            env_of(real_node, cluster, ns, "claimed")

            # An unchanged pod asking for nvidia.com/gpu: 1 starts with a GPU through the agent: the scheduler's
            # claim, the agent's CDI environment in the container; never X.
            unchanged_pod(ns, "moved")
            env = env_of(real_node, cluster, ns, "moved")
            (result,) = results_of(ns.extended_claim("moved"))
            got = result["device"]
            assert got in gpus and got not in (x, claimed)
            assert env[f"DRA_{got.upper().replace('-', '_')}_UUID"] == gpus[got]
            assert "DEVICE_PLUGIN_DEVICES" not in env

            # The device plugin's pod ends: X is free.
            cluster.admin.delete(ns.path("pods", "legacy"))
            eventually(lambda: held(cluster) == {}, "X free once the device plugin's pod is gone")
            assert agent.metric("dra_agent_device_plugin_held_gpus") == 0

            # The device plugin back: every GPU held again (those claims hold keep running: the taint is
            # NoSchedule).
            plugin = DevicePlugin(device_plugin_program, real_node.kubelet_dir, sorted(gpus.values())).start()
            eventually(lambda: held(cluster) == dict.fromkeys(every_form, "serving"),
                       "every GPU held again once the device plugin is back")
            assert ns.get("pods", "moved")["status"]["phase"] == "Running"
    finally:
        if plugin is not None:
            plugin.stop()
        ns.clean()
