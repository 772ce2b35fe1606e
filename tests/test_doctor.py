"""`dra-agent doctor` against a healthy node layout (a running agent in temporary roots), a broken
one, and the API emulator for the Node and RBAC checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from agentkit import DRIVER, NODE, claim, result, roots, write_claim
from kubeapi import KubeApi

from agent.app import doctor
from agent.app.daemon import Agent
from agent.app.doctor.cluster import permissions
from agent.config import Settings
from agent.kube import NODE_ALLOCATABLE_FEATURE
from agent.kubelet import client as kc
from agent.names import ClaimRef

ROOT = Path(__file__).resolve().parent.parent
UID1 = "7b2f0d00-0000-4000-8000-000000000001"
UID_BAD = "7b2f0d00-0000-4000-8000-0000000000ee"


def containerd_config(host: Path, body: str) -> None:
    path = host / "etc" / "containerd" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)


def fake_sysfs(root: Path) -> Path:
    """IOMMU on, vfio-pci loaded."""
    (root / "kernel" / "iommu_groups" / "0").mkdir(parents=True)
    (root / "bus" / "pci" / "drivers" / "vfio-pci").mkdir(parents=True)
    return root


def by_check(results: list[doctor.Result]) -> dict[str, doctor.Result]:
    return {r.check: r for r in results}


def line(text: str, check: str) -> str:
    (found,) = [x for x in text.splitlines() if x[2:].startswith(f"{check}:")]
    return found



async def test_a_healthy_node(short_tmp, agents):
    settings = roots(short_tmp, metrics_address="127.0.0.1:0", rescan_interval=3600.0)
    agent = Agent(settings)
    agents.append(agent)
    await agent.start()
    await kc.notify_registration(settings.registration_socket, True)  # as the kubelet does
    write_claim(settings.offline / "resourceclaims", claim("one", UID1, [result("gpu-0")]))
    async with kc.DRAClient(settings.dra_socket) as client:
        assert (await client.prepare([ClaimRef("default", "one", UID1)])).claims[UID1].error == ""
    assert agent.publish is not None
    await agent.publish.wait_published()

    host = short_tmp / "host"
    containerd_config(host, f'version = 3\n[plugins."io.containerd.cri.v1.runtime"]\n'
                            f'cdi_spec_dirs = ["{settings.static_cdi_dir}", "{settings.cdi_dir}"]\n')
    assert agent.http is not None
    port = agent.http.addresses[0][1]
    checked = roots(short_tmp, metrics_address=f"127.0.0.1:{port}", sysfs_root=fake_sysfs(short_tmp / "sys"))
    results = await doctor.run(checked, host_root=host)
    text = doctor.format_text(results)
    assert doctor.exit_status(results) == 0, text
    assert all(r.ok for r in results), text

    assert line(text, "kubelet plugin directories").startswith("✓ ")
    assert line(text, "registration socket") == (
        f"✓ registration socket: GetInfo answers: {DRIVER}, endpoint {settings.dra_socket}, "
        "v1.DRAPlugin, v1beta1.DRAPlugin, v1.DRAResourceHealth, v1alpha1.DRAResourceHealth")
    assert line(text, "DRA socket") == f"✓ DRA socket: {settings.dra_socket} answers NodePrepareResources (mode 0600)"
    probes = line(text, "probes (/healthz, /readyz)")
    assert "kubelet-registration ok: the kubelet registered the plugin" in probes and "dra-server ok" in probes
    assert line(text, "CDI in containerd").startswith(f"✓ CDI in containerd: {host}/etc/containerd/config.toml: CDI on")
    assert line(text, "CDI specs").startswith("✓ CDI specs: 2 spec files")  # the claim's spec + its metadata spec
    assert line(text, "claim records") == "✓ claim records: 1 prepared claims, every record readable"
    assert line(text, "NVML") == "✓ NVML: --nvml sim:dgx-h100: simulated GPUs, the real NVML is not used"
    # With simulated GPUs, the IOMMU and vfio-pci the agent passes functions through are the simulated
    # machine's (before, doctor said the host's were off while the walk-through bound a GPU to vfio-pci).
    assert line(text, "IOMMU").startswith("✓ IOMMU: on: 13 groups in the simulated machine's ")
    assert line(text, "vfio-pci").startswith("✓ vfio-pci: loaded (the simulated machine's ")
    assert line(text, "Kubernetes API").startswith("- Kubernetes API: skipped: offline (--offline ")
    assert line(text, "RBAC") == "- RBAC: skipped: offline: no API server to ask"
    # Offline garbage collection reads the claim files, not the kubelet's pod resources service.
    assert line(text, "kubelet pod resources").startswith("- kubelet pod resources: skipped: offline (--offline ")
    # Offline there is no Node and no kubelet to tell whether a device plugin serves the GPUs.
    assert line(text, "device plugin").startswith("- device plugin: skipped: offline (--offline ")
    assert text.splitlines()[-1].endswith("0 failed (0 blocking), 4 skipped")


def broken_layout(tmp: Path) -> tuple[Settings, Path]:
    """No agent running, the kubelet's registry directory missing, an unreadable record, a CDI
    "directory" that is a file, containerd with CDI off, an invalid spec in the static CDI dir."""
    settings = roots(tmp, metrics_address="", sysfs_root=tmp / "sys")
    (settings.kubelet_dir / "plugins").mkdir(parents=True)
    settings.claims_state_dir.mkdir(parents=True, mode=0o700)
    settings.state_dir.chmod(0o700)
    (settings.claims_state_dir / f"{UID_BAD}.rec").write_bytes(b"DRAREC 1 0000 12\n{not a record")
    settings.cdi_dir.parent.mkdir(parents=True, exist_ok=True)
    settings.cdi_dir.write_text("")
    settings.static_cdi_dir.mkdir(parents=True)
    (settings.static_cdi_dir / "broken.json").write_text('{"cdiVersion": "0.5.0", "kind": "x"}')
    host = tmp / "host"
    containerd_config(host, 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\nenable_cdi = false\n')
    return settings, host


async def test_a_broken_node(short_tmp):
    settings, host = broken_layout(short_tmp)
    results = await doctor.run(settings, host_root=host)
    text = doctor.format_text(results)
    assert doctor.exit_status(results) == 1, text
    checks = by_check(results)

    assert line(text, "kubelet plugin directories") == (
        f"✗ kubelet plugin directories: missing: {settings.registry_dir} — fix: the kubelet creates them when it "
        f"starts: is the kubelet running with root directory {settings.kubelet_dir}? In a pod, mount both from "
        "the host")
    assert line(text, "registration socket").startswith(
        f"✗ registration socket: no socket at {settings.registration_socket} — fix: start the agent")
    assert line(text, "DRA socket").startswith("✗ DRA socket: no socket at ")
    assert line(text, "probes (/healthz, /readyz)").startswith("- probes (/healthz, /readyz): skipped: ")
    assert line(text, "CDI in containerd").startswith(
        f"✗ CDI in containerd: {host}/etc/containerd/config.toml: enable_cdi = false: containerd ignores the CDI "
        'devices of every claim — fix: set enable_cdi = true under [plugins."io.containerd.grpc.v1.cri"]')
    assert line(text, "CDI directory").startswith(f"✗ CDI directory: {settings.cdi_dir} is not a directory — fix: ")
    assert checks["CDI specs"].ok is False and "broken.json" in checks["CDI specs"].detail
    records = checks["claim records"]
    assert not records.ok and not records.blocking  # the agent starts; it sets the record aside
    assert records.detail.startswith(f"unreadable: {UID_BAD}.rec: ")
    assert line(text, "claim records").startswith("! claim records: unreadable: ")
    # No agent has made the simulated machine yet.
    assert line(text, "IOMMU").startswith("- IOMMU: skipped: --nvml sim: the simulated machine")
    # The host's, with the real NVML: off is a warning, since only passthrough needs it.
    (iommu,) = doctor.Doctor(roots(short_tmp, nvml="real", sysfs_root=short_tmp / "sys")).iommu()
    assert not iommu.ok and not iommu.blocking and iommu.detail.startswith(f"off: no groups in {short_tmp}/sys/")
    for name in ("kubelet plugin directories", "registration socket", "DRA socket", "CDI in containerd",
                 "CDI directory", "CDI specs"):
        assert checks[name].blocking and not checks[name].ok, name


def test_doctor_cli_json(short_tmp):
    settings, host = broken_layout(short_tmp)
    env = {**os.environ, "DRA_KUBELET_DIR": str(settings.kubelet_dir), "DRA_CDI_DIR": str(settings.cdi_dir),
           "DRA_STATIC_CDI_DIR": str(settings.static_cdi_dir), "DRA_STATE_DIR": str(settings.state_dir),
           "DRA_OFFLINE": str(settings.offline), "DRA_NVML": "sim", "NODE_NAME": NODE,
           "DRA_SYSFS_ROOT": str(settings.sysfs_root), "DRA_METRICS_ADDRESS": ""}
    proc = subprocess.run([sys.executable, "-m", "agent", "doctor", "-o", "json", "--host-root", str(host)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert all(set(item) == {"check", "ok", "detail", "fix", "blocking"} for item in out)
    found = {item["check"]: item for item in out}
    assert found["registration socket"]["ok"] is False and found["registration socket"]["blocking"] is True
    assert found["registration socket"]["fix"].startswith("start the agent")
    assert found["NVML"] == {"check": "NVML", "ok": True, "fix": "", "blocking": False,
                             "detail": "--nvml sim:dgx-h100: simulated GPUs, the real NVML is not used"}
    text = subprocess.run([sys.executable, "-m", "agent", "doctor", "--host-root", str(host)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert text.returncode == 1 and "✗ registration socket: no socket at " in text.stdout


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "emulator", "user": {"token": "emulator"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator"}}],
    }))
    return path


@pytest.fixture
def cluster_settings(short_tmp: Path, kube_api: KubeApi) -> Callable[..., Settings]:
    kubeconfig = write_kubeconfig(short_tmp / "kubeconfig", kube_api.url)

    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {"offline": None, "kubeconfig": kubeconfig, "api_timeout": 2.0,
                                  "metrics_address": "", "sysfs_root": fake_sysfs(short_tmp / "sys")}
        values.update(overrides)
        return roots(short_tmp, **values)

    return make


async def test_cluster_checks_node_and_every_permission(cluster_settings, kube_api):
    kube_api.add_node(NODE, uid="0b5c4a7e-0000-4000-8000-0000000000aa",
                      declared_features=[NODE_ALLOCATABLE_FEATURE])
    settings = cluster_settings()
    kube_api.mark()
    checks = by_check(await doctor.run(settings))
    assert checks["Kubernetes API"].ok and checks["Kubernetes API"].detail.startswith(f"{kube_api.url} answers")
    assert checks["Node"].ok
    assert f"declared features: {NODE_ALLOCATABLE_FEATURE}" in checks["Node"].detail
    assert "CPU and memory are published as node-allocatable" in checks["Node"].detail
    # The agent's default settings watch its Node for a device plugin's resources: that permission too.
    used = permissions(settings)
    assert ("watch", "nodes") in {(p.verb, p.resource) for p in used}
    assert checks["RBAC"].ok and checks["RBAC"].detail.startswith(f"all {len(used)} permissions")
    reviews = [r for r in kube_api.since_mark() if r.method == "POST"]
    # A subresource is asked as the API server expects it: resource and subresource apart.
    asked = {(a["verb"], a["resource"] + (f"/{a['subresource']}" if a.get("subresource") else ""))
             for a in (r.body["spec"]["resourceAttributes"] for r in reviews)}
    assert asked == {(p.verb, p.resource) for p in used}
    # Doctor only reads: every write it sent is a SelfSubjectAccessReview.
    assert all(r.path.endswith("/selfsubjectaccessreviews") for r in kube_api.writes())

    kube_api.deny("delete", "resourceslices", "resource.k8s.io")
    kube_api.deny("get", "resourceclaims", "resource.k8s.io")
    results = await doctor.run(settings)
    text = doctor.format_text(results)
    assert doctor.exit_status(results) == 1
    rbac = line(text, "RBAC")
    assert rbac.startswith("✗ RBAC: denied: get resourceclaims.resource.k8s.io (read a claim the kubelet asks to "
                           "prepare); delete resourceslices.resource.k8s.io (remove slices of an older generation)")
    assert "— fix: grant them to the agent's service account" in rbac


async def test_cluster_without_this_node(cluster_settings, kube_api):
    checks = by_check(await doctor.run(cluster_settings(node_name="elsewhere")))
    assert checks["Kubernetes API"].ok
    assert not checks["Node"].ok and checks["Node"].blocking
    assert checks["Node"].detail == "Node 'elsewhere' does not exist in the cluster"
    assert checks["RBAC"].ok


async def test_api_server_unreachable(cluster_settings, kube_api):
    await kube_api.stop()
    results = await doctor.run(cluster_settings(api_timeout=1.0))
    checks = by_check(results)
    assert not checks["Kubernetes API"].ok and checks["Kubernetes API"].blocking
    assert checks["RBAC"].skipped and checks["Node"].skipped
    assert doctor.exit_status(results) == 1


@pytest.mark.parametrize(("config", "ok", "words"), [
    ('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\nenable_cdi = true\n', True, "CDI on"),
    ("version = 3\n", True, "CDI on, specs from /etc/cdi, /var/run/cdi"),
    ('version = 3\n[plugins."io.containerd.cri.v1.runtime"]\ncdi_spec_dirs = ["/etc/cdi"]\n', False,
     "reads CDI specs from /etc/cdi"),
    ('version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]\n', True, "conf.d/cdi.toml"),
    ("version = 1\n", False, "config version 1"),
    ("version = [\n", False, "config.toml: "),
])
def test_containerd_configurations(short_tmp, config, ok, words):
    host = short_tmp / "host"
    containerd_config(host, config)
    dropin = host / "etc" / "containerd" / "conf.d" / "cdi.toml"
    dropin.parent.mkdir()
    dropin.write_text('[plugins."io.containerd.grpc.v1.cri"]\nenable_cdi = true\n')
    settings = roots(short_tmp, cdi_dir=Path("/var/run/cdi"))
    (found,) = doctor.Doctor(settings, host_root=host).runtime_cdi()
    assert found.ok is ok and words in found.detail, found


def test_crio_and_podman(short_tmp):
    host = short_tmp / "host"
    crio = host / "etc" / "crio" / "crio.conf.d" / "10-cdi.conf"
    crio.parent.mkdir(parents=True)
    crio.write_text('[crio.runtime]\ncdi_spec_dirs = ["/etc/cdi"]\n')
    podman = host / "etc" / "containers" / "containers.conf"
    podman.parent.mkdir(parents=True)
    podman.write_text("[engine]\n")
    settings = roots(short_tmp, cdi_dir=Path("/var/run/cdi"))
    crio_result, podman_result = doctor.Doctor(settings, host_root=host).runtime_cdi()
    assert crio_result.check == "CDI in CRI-O" and not crio_result.ok and crio_result.blocking
    assert "add /var/run/cdi to cdi_spec_dirs" in crio_result.fix
    assert podman_result.check == "CDI in podman" and podman_result.ok


async def test_api_server_unreachable_with_offline_fallback(cluster_settings, kube_api, short_tmp):
    await kube_api.stop()
    results = await doctor.run(cluster_settings(api_timeout=1.0, offline_fallback=short_tmp / "fallback"))
    api = by_check(results)["Kubernetes API"]
    assert not api.ok and not api.blocking  # the agent runs offline instead
    assert api.detail.endswith(f"the agent runs offline in {short_tmp / 'fallback'} (--offline-fallback)")


def test_the_toolkit_spec_gpu_claims_need(short_tmp: Path) -> None:
    # A node with NVIDIA GPUs (its sysfs and /dev, as the driver shows them) and the real NVML.
    from agent.sim.hardware import materialize
    from agent.sim.profiles import load_profile

    materialize(load_profile("dgx-h100"), short_tmp / "host")
    s = roots(short_tmp, nvml="real", sysfs_root=short_tmp / "host" / "sys", dev_root=short_tmp / "host" / "dev")
    s.static_cdi_dir.mkdir(parents=True, exist_ok=True)
    (result_,) = doctor.Doctor(s).toolkit()
    assert not result_.ok and result_.blocking
    assert result_.detail.startswith(f"no nvidia.com/gpu CDI spec in {s.static_cdi_dir} or {s.cdi_dir}")
    assert result_.fix.startswith(f"on the node: nvidia-ctk cdi generate --output={s.static_cdi_dir}/nvidia.yaml")
    (s.static_cdi_dir / "nvidia.yaml").write_text(
        "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: '0'\n  containerEdits: {}\n"
        "- name: GPU-1\n  containerEdits: {}\n- name: all\n  containerEdits: {}\n")
    (found,) = doctor.Doctor(s).toolkit()
    assert found.ok and found.detail == "nvidia.com/gpu: 2 GPUs (0, GPU-1); GPU claims get its devices"
    # Simulated GPUs, or none: nothing to give.
    assert doctor.Doctor(roots(short_tmp, nvml="sim")).toolkit()[0].ok
    bare = roots(short_tmp, nvml="real", sysfs_root=short_tmp / "nosys", dev_root=short_tmp / "nodev")
    assert doctor.Doctor(bare).toolkit()[0].ok


async def test_the_probe_check_knows_another_process_on_the_port(short_tmp, agents):
    """What answers on --metrics-address must be the agent doctor was given the settings of: another
    program that answers 200 there (an exporter, another driver's agent) is not taken for it."""
    import asyncio

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = b"[+]event-loop ok\n[+]kubelet-registration ok: registered\nhealthz check passed\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(impostor, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        settings = roots(short_tmp, metrics_address=f"127.0.0.1:{port}")
        (probes,) = [r for r in await doctor.Doctor(settings).probes()]
        assert not probes.ok and probes.blocking
        assert "does not name itself a dra-agent" in probes.detail and "another program" in probes.fix
    finally:
        server.close()
        await server.wait_closed()

    # An agent of another node (doctor given the wrong --node-name) is not this node's either.
    agent = Agent(roots(short_tmp, metrics_address="127.0.0.1:0", rescan_interval=3600.0))
    agents.append(agent)
    await agent.start()
    assert agent.http is not None
    port = agent.http.addresses[0][1]
    (probes,) = await doctor.Doctor(roots(short_tmp, metrics_address=f"127.0.0.1:{port}",
                                          node_name="node-b")).probes()
    assert not probes.ok and probes.blocking
    assert f"the agent of driver {DRIVER} on node {NODE}, not node-b" in probes.detail, probes.detail


async def test_doctor_finds_the_probes_on_their_own_listener(short_tmp, agents):
    # As the DaemonSet runs it: the probes on a listener of their own, /metrics alone on the other.
    settings = roots(short_tmp, metrics_address="127.0.0.1:0", probe_address="127.0.0.1:0", rescan_interval=3600.0)
    agent = Agent(settings)
    agents.append(agent)
    await agent.start()
    await kc.notify_registration(settings.registration_socket, True)
    assert agent.publish is not None
    await agent.publish.wait_published()
    assert agent.http is not None and agent.metrics_http is not None
    checked = roots(short_tmp, metrics_address=f"127.0.0.1:{agent.metrics_http.addresses[0][1]}",
                    probe_address=f"127.0.0.1:{agent.http.addresses[0][1]}")
    (probes,) = await doctor.Doctor(checked).probes()
    assert probes.ok and "kubelet-registration ok" in probes.detail, probes
