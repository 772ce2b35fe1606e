"""A real node for the cluster tests: containerd (runc, CDI) and the kubelet, built by
`tests/cluster/build.py --node`, registered with the test control plane under their own node name.

What the node leaves on the host, and what it does not:
- containerd and the kubelet run in a mount namespace of their own (`unshare`, then `nsenter` for
  each program), so the kubelet's mounts (its root directory made a shared bind mount, pod volumes)
  and containerd's (image layers, sandbox /dev/shm) go away with it;
- in that namespace the kernel settings the kubelet insists on (`KUBELET_TUNABLES`; it rewrites
  any that differ, and `protectKernelDefaults` would only refuse to start) read as files holding
  the values it wants: the host's own settings are never written;
- the paths both programs hard-code (`HOST_PATHS`: the kubelet's device-plugin socket directory,
  the shims' socket directory) and the cgroups containerd makes (`k8s.io`) are removed afterwards
  when this node made them. A host where a kubelet already owns the device-plugin socket is refused.
Everything else (state, sockets, logs, containers' files) lives under the node's root directory.

The image is a static busybox root filesystem made here as an OCI archive and imported with ctr;
it is also the sandbox ("pause") image. Containers run with the runc built beside the kubelet (1.5:
CDI's `netDevices` need runc >= 1.4), and pods get a network of their own: containerd's CNI
configuration (`cni_config`) puts each pod's network namespace on a bridge of this node's own
(`Node.bridge`, deleted at `stop`) with an address from a node-local range that has no gateway and no
route on the host: pods reach each other, nothing else, and nothing reaches them. With it the
runtime reports its network ready, the kubelet reports the Node Ready, and the node lifecycle
controller takes the `node.kubernetes.io/not-ready` taint away as on any node.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .clusterkit import AgentRuns, Cluster
from .controlplane import DEPENDENCY_GATES, DRA_GATES, Component, ControlPlane, free_port, kubeconfig, tail

IMAGE = "localhost/dra-test-busybox:node"
APPLETS = ("sh", "cat", "echo", "env", "ls", "stat", "sleep", "true")
NAMESPACE = "k8s.io"  # containerd's namespace for what the CRI plugin runs
# The kernel settings the kubelet's container manager sets (pkg/kubelet/cm, setupKernelTunables).
KUBELET_TUNABLES: Mapping[str, int] = {
    "vm/overcommit_memory": 1, "vm/panic_on_oom": 0, "kernel/panic": 10, "kernel/panic_on_oops": 1,
    "kernel/keys/root_maxkeys": 1000000, "kernel/keys/root_maxbytes": 25000000,
}
DEVICE_PLUGIN_SOCKET = Path("/var/lib/kubelet/device-plugins/kubelet.sock")  # fixed in the kubelet
# Deepest first: each is removed afterwards only when it was not there before.
HOST_PATHS = (DEVICE_PLUGIN_SOCKET.parent, DEVICE_PLUGIN_SOCKET.parent.parent,
              Path("/run/containerd/s"), Path("/run/containerd"))
CGROUP = "k8s.io"
# The pod network's addresses: one /24 for the node's pods, on the node's bridge alone. The bridge gets no
# address and the host no route to it (`isGateway` off), so no host traffic is ever sent there.
POD_SUBNET = "10.217.0.0/24"
CNI_NETWORK = "dra-test-pods"
# One test kubelet per host: its device-plugin socket and containerd's /run paths are fixed. Test runs
# of several checkouts on one machine take turns through this lock instead of refusing each other.
HOST_LOCK = Path("/run/dra-agent-test-kubelet.lock")
HOST_LOCK_WAIT = 1200.0  # a bound, not an expectation: another run's kubelet tests take minutes
START_LIMIT = 120.0  # a bound, not an expectation


# Where the kubelet's device manager listens for device plugins (k8s.io/kubelet's deviceplugin/v1beta1
# DevicePluginPath): not below --root-dir.
DEVICE_PLUGIN_PATH = "/var/lib/kubelet/device-plugins"


class NodeError(RuntimeError):
    """The node could not start; the message says which program and carries its log."""


def _blob(out: tarfile.TarFile, data: bytes, media_type: str) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    _add_file(out, f"blobs/sha256/{digest}", data)
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}


def _add_file(out: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    out.addfile(info, io.BytesIO(data))


def _rootfs_layer(busybox: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as layer:
        for d in ("bin", "dev", "etc", "proc", "sys", "tmp", "var", "var/run"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            layer.addfile(info)
        _add_file(layer, "bin/busybox", busybox.read_bytes(), 0o755)
        for applet in APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, "busybox", 0o777
            layer.addfile(info)
    return buf.getvalue()


def oci_archive(path: Path, name: str, busybox: Path) -> None:
    """An OCI image layout archive of one linux/amd64 image `name`: a busybox root filesystem whose
    default command sleeps (what a sandbox's pause process does)."""
    with tarfile.open(path, "w") as out:
        layer = _blob(out, _rootfs_layer(busybox), "application/vnd.oci.image.layer.v1.tar")
        config = _blob(out, json.dumps({
            "architecture": "amd64", "os": "linux",
            "config": {"Cmd": ["/bin/sleep", "2147483647"], "Env": ["PATH=/bin"]},
            "rootfs": {"type": "layers", "diff_ids": [layer["digest"]]}}).encode(),
            "application/vnd.oci.image.config.v1+json")
        manifest = _blob(out, json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": config, "layers": [layer]}).encode(), "application/vnd.oci.image.manifest.v1+json")
        manifest["annotations"] = {"io.containerd.image.name": name,
                                   "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]}
        manifest["platform"] = {"architecture": "amd64", "os": "linux"}
        _add_file(out, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        _add_file(out, "index.json", json.dumps({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [manifest]}).encode())


def cni_config(bridge: str, ipam_dir: Path) -> dict[str, Any]:
    """The pod network: each pod's interface on `bridge` with an address of POD_SUBNET, no gateway,
    no masquerading (no iptables, no forwarding set on the host), the addresses' leases kept in
    `ipam_dir` (host-local's default, /var/lib/cni, is the host's). containerd adds the loopback
    network itself."""
    return {"cniVersion": "1.1.0", "name": CNI_NETWORK, "plugins": [{
        "type": "bridge", "bridge": bridge, "isGateway": False, "ipMasq": False,
        "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]], "dataDir": str(ipam_dir)}}]}


def containerd_config(root: Path, cdi_dir: Path, bin_dir: Path) -> str:
    """containerd's configuration (version 3): everything under `root` (the pods' network namespaces
    mounted under its state directory, not /var/run/netns), CDI specs read from `cdi_dir` only, the
    busybox image as the sandbox image, the CNI plugins and runc of `bin_dir`, cgroupfs, and no container
    given an oom_score_adj below containerd's own (lowering it needs CAP_SYS_RESOURCE, which these
    machines lack; the kubelet asks -998 for sandboxes)."""
    return f"""version = 3
root = "{root / 'root'}"
state = "{root / 'state'}"
[grpc]
  address = "{root / 'containerd.sock'}"
[ttrpc]
  address = "{root / 'containerd.sock.ttrpc'}"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{IMAGE}"
[plugins."io.containerd.cri.v1.runtime"]
  cdi_spec_dirs = ["{cdi_dir}"]
  restrict_oom_score_adj = true
  disable_apparmor = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{bin_dir}"]
    conf_dir = "{root / 'cni' / 'conf'}"
    max_conf_num = 1
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{bin_dir / 'runc'}"
        Root = "{root / 'runc'}"
        SystemdCgroup = false
"""


def kubelet_config(*, socket: Path, ca: Path, port: int, healthz_port: int, pod_logs: Path,
                   gates: Mapping[str, bool]) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        # Hybrid cgroup hosts (these VMs) are cgroup v1 to the kubelet; 1.37 refuses them unless told.
        "failCgroupV1": False, "cgroupDriver": "cgroupfs",
        # No QoS cgroup tree of its own on the host: containers go where containerd puts them.
        "cgroupsPerQOS": False, "enforceNodeAllocatable": [],
        "containerRuntimeEndpoint": f"unix://{socket}",
        "address": "127.0.0.1", "port": port, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": healthz_port,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(ca)}},
        "authorization": {"mode": "AlwaysAllow"},
        # The kubelet lowers its own oom_score_adj by default: refused without CAP_SYS_RESOURCE.
        "oomScoreAdj": 0, "failSwapOn": False, "podLogsDir": str(pod_logs),
        "rotateCertificates": False, "serverTLSBootstrap": False,
        # A busy shared disk must not make the node evict the test's pod or collect its image.
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "featureGates": dict(gates),
    }


@dataclass
class HostTraces:
    """The host paths and cgroups the node's programs make outside its root, removed at `clean`
    when they were not there before."""

    absent: list[Path] = field(default_factory=list)
    absent_cgroups: list[Path] = field(default_factory=list)

    @staticmethod
    def cgroups() -> list[Path]:
        base = Path("/sys/fs/cgroup")
        return [base / CGROUP, *(p / CGROUP for p in sorted(base.iterdir()) if p.is_dir())]

    def record(self) -> None:
        if DEVICE_PLUGIN_SOCKET.exists():
            raise NodeError(f"{DEVICE_PLUGIN_SOCKET} exists: a kubelet runs on this host, and the test's "
                            "kubelet would take over its device-plugin socket")
        self.absent = [p for p in HOST_PATHS if not p.exists()]
        self.absent_cgroups = [p for p in self.cgroups() if p.parent.is_dir() and not p.exists()]

    def clean(self) -> None:
        for path in self.absent:
            shutil.rmtree(path, ignore_errors=True)
        for group in self.absent_cgroups:
            # A cgroup goes with rmdir once it holds no process and no child: deepest first.
            for sub in sorted((p for p in group.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    sub.rmdir()
            with contextlib.suppress(OSError):
                group.rmdir()


@dataclass
class Node:
    """containerd and the kubelet for node `name`, the kubelet's root directory `kubelet_dir`
    (where the agent's sockets go), CDI specs read from `cdi_dir` (where the agent writes them)."""

    bin: Path
    root: Path
    name: str
    plane: ControlPlane
    kubelet_dir: Path
    cdi_dir: Path
    busybox: Path
    components: list[Component] = field(default_factory=list)
    traces: HostTraces = field(default_factory=HostTraces)
    holder: Component | None = None
    started_in: float = 0.0
    healthz_port: int = 0

    @property
    def socket(self) -> Path:
        return self.root / "containerd" / "containerd.sock"

    @property
    def pod_logs(self) -> Path:
        return self.root / "pod-logs"

    @property
    def bridge(self) -> str:
        """The pod network's bridge on the host: a name of this node's own (15 characters at most)."""
        return "drapods" + hashlib.sha256(str(self.root).encode()).hexdigest()[:8]

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(self.bin / "ctr"), f"--address={self.socket}", f"--namespace={NAMESPACE}", *args],
                              capture_output=True, text=True, timeout=120, check=False)
        if check and done.returncode != 0:
            raise NodeError(f"ctr {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()[-2000:]}")
        return done

    def _in_namespace(self, name: str, args: Sequence[str]) -> Component:
        assert self.holder is not None and self.holder.proc is not None
        env_path = f"PATH={self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        c = Component(name, ["nsenter", f"--mount=/proc/{self.holder.proc.pid}/ns/mnt", "--", "env", env_path,
                             *args], self.root / f"{name}.log")
        self.components.append(c)
        c.start()
        return c

    def _start_holder(self) -> None:
        """A process that keeps the node's mount namespace, with the kubelet's kernel settings
        shadowed by files holding the values it wants."""
        values = self.root / "tunables"
        values.mkdir(parents=True)
        binds = []
        for key, value in KUBELET_TUNABLES.items():
            f = values / key.replace("/", ".")
            f.write_text(f"{value}\n")
            binds.append(f"mount --bind {f} /proc/sys/{key}")
        # The kubelet's device manager serves device plugins at a fixed path, whatever its root directory: the
        # node's own directory there, so the host's is never used and each node's device plugins are its own.
        plugins = self.kubelet_dir / "device-plugins"
        plugins.mkdir(parents=True, exist_ok=True)
        binds.append(f"mkdir -p {DEVICE_PLUGIN_PATH} && mount --bind {plugins} {DEVICE_PLUGIN_PATH}")
        ready = self.root / "namespace-ready"
        script = " && ".join([*binds, f"touch {ready}", "exec sleep 2147483647"])
        self.holder = Component("namespace", ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                                              script], self.root / "namespace.log")
        self.components.append(self.holder)
        self.holder.start()
        self._wait(self.holder, ready.exists, "its mount namespace is ready")

    def _wait(self, component: Component, probe: Any, what: str, limit: float = START_LIMIT) -> None:
        deadline = time.monotonic() + limit
        while not probe():
            if not component.running():
                code = component.proc.returncode if component.proc else None
                raise NodeError(f"{component.name} stopped (exit {code}) before {what}; log {component.log}:\n"
                                f"{tail(component.log)}")
            if time.monotonic() > deadline:
                raise NodeError(f"{component.name}: not within {limit:g} s: {what}; log {component.log}:\n"
                                f"{tail(component.log)}")
            time.sleep(0.1)

    def start(self) -> None:
        started = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        self.traces.record()
        self._start_holder()
        runtime_root = self.root / "containerd"
        for d in (runtime_root / "cni" / "conf", self.cdi_dir, self.pod_logs):
            d.mkdir(parents=True, exist_ok=True)
        (runtime_root / "cni" / "conf" / f"10-{CNI_NETWORK}.conflist").write_text(
            json.dumps(cni_config(self.bridge, runtime_root / "cni" / "ipam"), indent=1))
        config = self.root / "containerd.toml"
        config.write_text(containerd_config(runtime_root, self.cdi_dir, self.bin))
        containerd = self._in_namespace("containerd", [str(self.bin / "containerd"), f"--config={config}"])
        self._wait(containerd, lambda: self.ctr("version", check=False).returncode == 0, "it answers ctr")
        archive = self.root / "image.tar"
        oci_archive(archive, IMAGE, self.busybox)
        self.ctr("images", "import", str(archive))

        pki = self.plane.pki
        pair = pki.client(f"kubelet-{self.name}", f"system:node:{self.name}", "system:nodes")
        config_path = self.root / "kubelet.yaml"
        healthz = free_port()
        gates = {g: True for g in (*DRA_GATES, *DEPENDENCY_GATES)} | dict(self.plane.gates)
        config_path.write_text(yaml.safe_dump(kubelet_config(
            socket=self.socket, ca=pki.ca, port=free_port(), healthz_port=healthz, pod_logs=self.pod_logs,
            gates=gates)))
        kubelet = self._in_namespace("kubelet", [
            str(self.bin / "kubelet"), f"--config={config_path}",
            f"--kubeconfig={kubeconfig(self.root / 'kubelet.kubeconfig', self.plane.server, pki.ca, cert=pair)}",
            f"--root-dir={self.kubelet_dir}", f"--cert-dir={self.root / 'kubelet-pki'}",
            f"--hostname-override={self.name}", "--v=2"])

        self.healthz_port = healthz
        self._wait(kubelet, self.kubelet_healthy, "its /healthz answers")
        self.started_in = time.monotonic() - started

    def kubelet_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.healthz_port}/healthz", timeout=2) as r:
                return bool(r.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def restart_kubelet(self) -> None:
        """The kubelet stopped (SIGTERM) and started again with the same configuration and directories,
        as a node's service manager restarts it (an upgrade, a crash): containerd and the pods' containers
        go on meanwhile."""
        kubelet = next(c for c in self.components if c.name == "kubelet")
        kubelet.stop(grace=10)
        kubelet.start()
        self._wait(kubelet, self.kubelet_healthy, "its /healthz answers again")

    def restart_with_containers(self) -> None:
        """The kubelet and containerd stopped and every container with them (killed: what a node's crash
        or a runtime upgrade that does not keep its shims leaves), then containerd and the kubelet
        started again with the same configuration and directories: the kubelet finds every pod's
        sandbox gone and makes it again, with its containers."""
        kubelet = next(c for c in self.components if c.name == "kubelet")
        containerd = next(c for c in self.components if c.name == "containerd")
        kubelet.stop(grace=10)
        self._remove_tasks()
        containerd.stop(grace=10)
        containerd.start()
        self._wait(containerd, lambda: self.ctr("version", check=False).returncode == 0, "it answers ctr again")
        kubelet.start()
        self._wait(kubelet, self.kubelet_healthy, "its /healthz answers again")

    def container_log(self, pod: Mapping[str, Any], container: str) -> str:
        """What the container wrote (stdout and stderr), from the log file the runtime keeps for the
        kubelet (CRI format: time, stream, P for a partial line or F, the text)."""
        meta = pod["metadata"]
        path = self.pod_logs / f"{meta['namespace']}_{meta['name']}_{meta['uid']}" / container / "0.log"
        out = []
        for line in path.read_text(errors="replace").splitlines():
            _, _, tag, text = [*line.split(" ", 3), "", "", ""][:4]
            out.append(text if tag == "P" else text + "\n")
        return "".join(out)

    def logs(self, lines: int = 60) -> str:
        return "\n\n".join(f"--- {c.name} ({c.log}):\n{tail(c.log, lines)}" for c in self.components)

    def _remove_tasks(self) -> None:
        """Whatever still runs in containerd: killed and deleted, so that no shim outlives the node."""
        listed = self.ctr("tasks", "ls", "--quiet", check=False)
        for task in listed.stdout.split():
            self.ctr("tasks", "delete", "--force", task, check=False)

    def stop(self) -> None:
        for c in self.components:
            if c.name == "kubelet":
                c.stop(grace=10)
        if any(c.name == "containerd" and c.running() for c in self.components):
            self._remove_tasks()
        for c in reversed(self.components):
            c.stop(grace=10)
        # The pods' network namespaces went with the node's mount namespace, and their veth pairs with
        # them; the bridge the CNI plugin made on the host is the node's to remove.
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True, timeout=30, check=False)
        self.traces.clean()


@contextlib.contextmanager
def host_turn(path: Path = HOST_LOCK, wait: float = HOST_LOCK_WAIT) -> Iterator[None]:
    """This host's test kubelet for the caller alone, while another test run's kubelet is not done
    (a bounded wait); a kubelet that is not a test's still makes `HostTraces.record` refuse."""
    with path.open("a") as lock:
        deadline, said = time.monotonic() + wait, False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise NodeError(f"another test run held {path} (its kubelet) for {wait:g} s") from None
                if not said:
                    print(f"waiting for another test run's kubelet on this host ({path})", flush=True)
                    said = True
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def running(node: Node) -> Iterator[Node]:
    with host_turn():
        try:
            node.start()
            yield node
        finally:
            node.stop()


@dataclass
class NodeReport:
    """What a failing real-node test's report shows, filled in as the module's fixtures come up (so a
    node that never became Ready is reported too): its cluster's Events and components' logs, the
    kubelet's and containerd's logs, and the agent's."""

    cluster: Cluster | None = None
    node: Node | None = None
    runs: AgentRuns | None = None
