"""`dra-agent doctor`: the node checked the way a person would when a pod is stuck.

Each check gives one line: passed, failed (with the fix), or skipped (and why). A
failure is *blocking* when the agent cannot start or the kubelet cannot use it
(no registration, a CDI directory the runtime does not read, missing RBAC); other
failures are warnings (IOMMU off: only VM passthrough needs it). The exit status
is 1 when any blocking check failed.

Doctor reads; it never writes. It calls the agent's sockets the way the kubelet
does (GetInfo, and a NodePrepareResources without claims), its probes over
`--metrics-address`, and the API server (the Node, and one SelfSubjectAccessReview
per permission the agent needs). With `--offline DIR` it talks to no API server and
says which checks it skipped. Run it as the agent's user (root in the DaemonSet):
ownership and permission checks are made as the user that runs doctor.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import re
import shutil
import stat
import subprocess
import tomllib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pynvml

from agent import kube
from agent import kubelet_client as kc
from agent.config import Settings
from agent.fsutil import UnsafeRoot, check_root
from agent.inventory.pci import nvidia_display_functions
from agent.state import ClaimStore

RUNTIME_DEFAULT_CDI_DIRS = ("/etc/cdi", "/var/run/cdi")  # containerd, CRI-O and podman alike
MIN_FREE_BYTES = 16 * 1024 * 1024  # below: blocking (a record, a CDI spec may not fit)
LOW_FREE_BYTES = 256 * 1024 * 1024  # below: a warning
MIN_FREE_INODES = 100


@dataclass(frozen=True, slots=True)
class Permission:
    verb: str
    group: str
    resource: str
    why: str
    namespaced: bool = False

    def __str__(self) -> str:
        return f"{self.verb} {self.resource}{'.' + self.group if self.group else ''}"


# Every API call the agent makes: agent/kube.py (the Node), agent/claims.py (claims), agent/publisher.py
# (slices). A permission the agent does not use is not asked for.
PERMISSIONS: tuple[Permission, ...] = (
    Permission("get", "", "nodes", "read this Node: its UID (slice owner) and declared features"),
    Permission("get", "resource.k8s.io", "resourceclaims", "read a claim the kubelet asks to prepare",
               namespaced=True),
    Permission("list", "resource.k8s.io", "resourceslices", "read this node's published slices"),
    Permission("get", "resource.k8s.io", "resourceslices", "read back a slice whose create answer was lost"),
    Permission("create", "resource.k8s.io", "resourceslices", "publish devices"),
    Permission("update", "resource.k8s.io", "resourceslices", "republish changed devices"),
    Permission("delete", "resource.k8s.io", "resourceslices", "remove slices of an older generation"),
)


@dataclass(slots=True)
class Result:
    check: str
    ok: bool
    detail: str
    fix: str = ""
    blocking: bool = True  # when not ok: the agent, or the pods using it, cannot work
    skipped: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "ok": self.ok, "detail": self.detail, "fix": self.fix,
                "blocking": self.blocking and not self.ok}

    @property
    def mark(self) -> str:
        if self.skipped:
            return "-"
        if self.ok:
            return "✓"
        return "✗" if self.blocking else "!"


def passed(check: str, detail: str) -> Result:
    return Result(check, True, detail)


def failed(check: str, detail: str, fix: str, *, blocking: bool = True) -> Result:
    return Result(check, False, detail, fix, blocking)


def skipped(check: str, why: str) -> Result:
    return Result(check, True, f"skipped: {why}", skipped=True)


def exit_status(results: Iterable[Result]) -> int:
    return 1 if any(not r.ok and r.blocking for r in results) else 0


def format_text(results: Sequence[Result], *, ascii_only: bool = False) -> str:
    marks = {"✓": "OK", "✗": "FAIL", "!": "WARN", "-": "SKIP"} if ascii_only else {}
    lines = []
    for r in results:
        line = f"{marks.get(r.mark, r.mark)} {r.check}: {r.detail}"
        if r.fix and not r.ok:
            line += f" — fix: {r.fix}"
        lines.append(line)
    bad = [r for r in results if not r.ok]
    blocking = sum(r.blocking for r in bad)
    lines.append(f"{len(results)} checks: {sum(r.ok and not r.skipped for r in results)} passed, "
                 f"{len(bad)} failed ({blocking} blocking), {sum(r.skipped for r in results)} skipped")
    return "\n".join(lines)


# -- the checks -----------------------------------------------------------------------------------

class Doctor:
    def __init__(self, settings: Settings, *, host_root: Path = Path("/")) -> None:
        self.s = settings
        self.host_root = Path(host_root)
        self._client: Any = None  # lightkube.AsyncClient once connected

    def host(self, path: str) -> Path:
        """`path` on the host (under --host-root)."""
        return self.host_root / path.lstrip("/")

    async def run(self) -> list[Result]:
        def thread(fn: Callable[[], list[Result]]) -> Callable[[], Awaitable[list[Result]]]:
            return lambda: asyncio.to_thread(fn)

        steps: list[tuple[str, Callable[[], Awaitable[list[Result]]]]] = [
            ("kubelet plugin directories", thread(self.kubelet_dirs)),
            ("directory ownership and modes", thread(self.agent_dirs)),
            ("registration socket", self.registration),
            ("DRA socket", self.dra_socket),
            ("probes (/healthz, /readyz)", self.probes),
            ("container runtime CDI", thread(self.runtime_cdi)),
            ("CDI directory", thread(self.cdi_dirs)),
            ("NVML", thread(self.nvml)),
            ("IOMMU", thread(self.iommu)),
            ("vfio-pci", thread(self.vfio)),
            ("claim records", thread(self.records)),
            ("free space", thread(self.free_space)),
            ("Kubernetes API", self.cluster),
        ]
        results: list[Result] = []
        for name, step in steps:
            try:
                results += await step()
            except Exception as exc:  # a check that breaks says so and the others still run
                results.append(failed(name, f"the check itself failed: {type(exc).__name__}: {exc}",
                                      "report this as a bug of dra-agent doctor", blocking=False))
        return results

    # kubelet and sockets ---------------------------------------------------------------------

    def kubelet_dirs(self) -> list[Result]:
        s = self.s
        name = "kubelet plugin directories"
        if not s.kubelet_dir.is_dir():
            return [failed(name, f"{s.kubelet_dir} does not exist",
                           "give --kubelet-dir / $DRA_KUBELET_DIR the kubelet's --root-dir (default "
                           "/var/lib/kubelet); in a pod, mount its plugins and plugins_registry from the host")]
        missing = [p for p in (s.kubelet_dir / "plugins", s.registry_dir) if not p.is_dir()]
        if missing:
            return [failed(name, f"missing: {', '.join(map(str, missing))}",
                           "the kubelet creates them when it starts: is the kubelet running with root directory "
                           f"{s.kubelet_dir}? In a pod, mount both from the host")]
        return [passed(name, f"{s.kubelet_dir / 'plugins'} and {s.registry_dir} exist")]

    def agent_dirs(self) -> list[Result]:
        """The roots the agent refuses to start on (`daemon.prepare_roots`)."""
        s = self.s
        roots = [("state directory", s.state_dir), ("records directory", s.claims_state_dir),
                 ("CDI directory", s.cdi_dir), ("plugin directory", s.plugin_dir),
                 ("metadata directory", s.metadata_dir), ("plugin registry directory", s.registry_dir)]
        problems = []
        for what, path in roots:
            if not os.path.lexists(path):
                continue  # the agent creates it
            try:
                check_root(path, what)
            except UnsafeRoot as exc:
                problems.append(str(exc))
            except OSError as exc:
                problems.append(f"{what} {path}: {exc.strerror or exc}")
        name = "directory ownership and modes"
        if not problems:
            return [passed(name, f"the agent's directories are owned by uid {os.geteuid()} and not writable by "
                           "group or others (those missing are created at start)")]
        if s.allow_unsafe_roots:
            return [failed(name, "; ".join(problems), "chown/chmod them (--allow-unsafe-roots starts anyway)",
                           blocking=False)]
        return [failed(name, "; ".join(problems), "chown them to the agent's user and chmod go-w (the agent "
                       "refuses to start otherwise; --allow-unsafe-roots overrides)")]

    async def registration(self) -> list[Result]:
        s = self.s
        name = "registration socket"
        path = s.registration_socket
        results = self._other_registrations()
        if not _is_socket(path):
            return [failed(name, f"no socket at {path}", "start the agent (dra-agent run, or its DaemonSet pod: "
                           "kubectl logs shows why it stopped); the kubelet finds plugins by this socket"),
                    *results]
        try:
            info = await kc.get_info(path)
        except grpc.aio.AioRpcError as exc:
            return [failed(name, f"GetInfo on {path}: {exc.code().name}: {exc.details()}",
                           "a socket that nobody answers is left by an agent that died: restart the agent"), *results]
        problems = []
        if info.name != s.driver_name:
            problems.append(f"it names driver {info.name!r}, not {s.driver_name!r}")
        if info.endpoint != str(s.dra_socket):
            problems.append(f"its endpoint is {info.endpoint}, not {s.dra_socket}")
        if problems:
            return [failed(name, f"GetInfo answered, but {'; '.join(problems)}",
                           "give doctor the agent's settings (--driver-name, --kubelet-dir, "
                           "--rolling-update-pod-uid)"), *results]
        return [passed(name, f"GetInfo answers: {info.name}, endpoint {info.endpoint}, "
                       f"{', '.join(info.supported_versions)}"), *results]

    def _other_registrations(self) -> list[Result]:
        """Registration sockets of this driver other than ours: a rolling update, or leftovers."""
        s = self.s
        try:
            names = sorted(os.listdir(s.registry_dir))
        except OSError:
            return []
        pattern = re.compile(re.escape(s.driver_name) + r"(-.+)?-reg\.sock")
        others = [s.registry_dir / n for n in names
                  if pattern.fullmatch(n) and s.registry_dir / n != s.registration_socket]
        if not others:
            return []
        return [passed("other registration sockets", f"{', '.join(map(str, others))}: another agent of this "
                       "driver (a rolling update with --rolling-update-pod-uid); the kubelet uses the newest")]

    async def dra_socket(self) -> list[Result]:
        s = self.s
        name = "DRA socket"
        path = s.dra_socket
        if not _is_socket(path):
            return [failed(name, f"no socket at {path}", "start the agent; it opens this socket before the "
                           "registration socket")]
        mode = stat.S_IMODE(os.stat(path).st_mode)
        try:
            await kc.empty_prepare(path, timeout=2.0)
        except grpc.aio.AioRpcError as exc:
            return [failed(name, f"NodePrepareResources on {path}: {exc.code().name}: {exc.details()}",
                           "restart the agent; its log says what it was doing")]
        if mode & 0o077:
            return [failed(name, f"{path} has mode {mode:04o}: other users can call it", "restart the agent "
                           "(it binds its sockets 0600)", blocking=False)]
        return [passed(name, f"{path} answers NodePrepareResources (mode {mode:04o})")]

    async def probes(self) -> list[Result]:
        s = self.s
        name = "probes (/healthz, /readyz)"
        endpoint = s.metrics_endpoint
        if endpoint is None:
            return [skipped(name, "--metrics-address is empty: the agent serves no probes")]
        host, port = endpoint
        host = host or "127.0.0.1"
        base = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        if port == 0:
            return [skipped(name, f"--metrics-address {s.metrics_address}: the port is chosen at start (the "
                            "agent logs it)")]
        answers = {}
        try:
            async with httpx2.AsyncClient(timeout=5.0, trust_env=False) as client:
                for path in ("/healthz", "/readyz"):
                    answers[path] = await client.get(base + path)
        except httpx2.HTTPError as exc:
            return [failed(name, f"{base}: {exc or type(exc).__name__}", "is the agent running, with this "
                           "--metrics-address? (its first log lines say where it serves)", blocking=False)]
        bad = [line[3:] for r in answers.values() for line in r.text.splitlines() if line.startswith("[-]")]
        if bad:
            return [failed(name, "; ".join(bad), "see the failing checks: the kubelet registers the plugin when "
                           "it sees the registration socket; slices are published once the Node is read")]
        return [passed(name, "; ".join(line[3:] for r in answers.values() for line in r.text.splitlines()
                                       if line.startswith("[+]") and "event-loop" not in line))]

    # container runtime and CDI -----------------------------------------------------------------

    def runtime_cdi(self) -> list[Result]:
        results = self._containerd() + self._crio() + self._podman()
        if not results:
            return [failed("container runtime CDI", f"no containerd, CRI-O or podman configuration under "
                           f"{self.host('/etc')}", "cannot tell whether the runtime reads CDI specs; in the "
                           "agent's pod, mount the host's / and give --host-root", blocking=False)]
        return results

    def _reads_cdi_dir(self, runtime: str, dirs: Sequence[str], where: str) -> Result | None:
        cdi = self.s.cdi_dir
        if any(_same_dir(self.host(d), cdi) or _same_dir(Path(d), cdi) for d in dirs):
            return None
        return failed(f"CDI in {runtime}", f"{runtime} reads CDI specs from {', '.join(dirs)} ({where}), the "
                      f"agent writes them to {cdi}", f"add {cdi} to cdi_spec_dirs, or give the agent --cdi-dir "
                      "one of them")

    def _containerd(self) -> list[Result]:
        name = "CDI in containerd"
        main = self.host("/etc/containerd/config.toml")
        if not main.is_file():
            return []
        try:
            files, config = self._load_containerd(main)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            return [failed(name, f"{main}: {exc}", "fix the file; containerd does not start with it either")]
        where = ", ".join(map(str, files))
        version = config.get("version", 1)
        plugins = config.get("plugins") or {}
        if version >= 3:  # containerd 2.x
            cri = plugins.get("io.containerd.cri.v1.runtime") or {}
            table, default_on = '[plugins."io.containerd.cri.v1.runtime"]', True
        elif version == 2:
            cri = plugins.get("io.containerd.grpc.v1.cri") or {}
            table, default_on = '[plugins."io.containerd.grpc.v1.cri"]', (self._containerd_major() or 1) >= 2
        else:
            return [failed(name, f"{where}: config version {version} (containerd 1.x): CDI needs a version 2 "
                           "config with enable_cdi", "containerd config default > /etc/containerd/config.toml, "
                           "set enable_cdi = true, restart containerd")]
        enabled = cri.get("enable_cdi", default_on)
        if not enabled:
            why = "enable_cdi = false" if "enable_cdi" in cri else "enable_cdi is not set (off before containerd 2.0)"
            return [failed(name, f"{where}: {why}: containerd ignores the CDI devices of every claim",
                           f"set enable_cdi = true under {table}, then systemctl restart containerd")]
        dirs = cri.get("cdi_spec_dirs", list(RUNTIME_DEFAULT_CDI_DIRS))
        wrong = self._reads_cdi_dir("containerd", dirs, where)
        if wrong:
            return [wrong]
        return [passed(name, f"{where}: CDI on, specs from {', '.join(dirs)}")]

    def _load_containerd(self, main: Path) -> tuple[list[Path], dict[str, Any]]:
        config = tomllib.loads(main.read_text())
        files = [main]
        for pattern in config.get("imports") or []:
            for found in sorted(glob.glob(str(self.host(str(pattern))))):
                path = Path(found)
                files.append(path)
                _merge(config, tomllib.loads(path.read_text()))
        return files, config

    def _containerd_major(self) -> int | None:
        binary = shutil.which("containerd")
        if binary is None:
            return None
        try:
            out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        found = re.search(r"\sv?(\d+)\.\d+", out)
        return int(found.group(1)) if found else None

    def _crio(self) -> list[Result]:
        main = self.host("/etc/crio/crio.conf")
        drop_ins = sorted(self.host("/etc/crio/crio.conf.d").glob("*.conf")) if self.host(
            "/etc/crio/crio.conf.d").is_dir() else []
        files = ([main] if main.is_file() else []) + drop_ins
        if not files:
            return []
        dirs: list[str] = list(RUNTIME_DEFAULT_CDI_DIRS)
        for path in files:
            try:
                config = tomllib.loads(path.read_text())
            except (OSError, tomllib.TOMLDecodeError) as exc:
                return [failed("CDI in CRI-O", f"{path}: {exc}", "fix the file; CRI-O does not start with it")]
            dirs = ((config.get("crio") or {}).get("runtime") or {}).get("cdi_spec_dirs", dirs)
        where = ", ".join(map(str, files))
        return [self._reads_cdi_dir("CRI-O", dirs, where)
                or passed("CDI in CRI-O", f"{where}: CDI is always on in CRI-O; specs from {', '.join(dirs)}")]

    def _podman(self) -> list[Result]:
        path = self.host("/etc/containers/containers.conf")
        if not path.is_file():
            return []
        try:
            config = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            return [failed("CDI in podman", f"{path}: {exc}", "fix the file", blocking=False)]
        dirs = (config.get("engine") or {}).get("cdi_spec_dirs", list(RUNTIME_DEFAULT_CDI_DIRS))
        result = self._reads_cdi_dir("podman", dirs, str(path))
        if result is not None:
            result.blocking = False  # podman is not the kubelet's runtime
            return [result]
        return [passed("CDI in podman", f"{path}: specs from {', '.join(dirs)}")]

    def cdi_dirs(self) -> list[Result]:
        from cdi.validate import validate_dirs

        s = self.s
        out = []
        name = "CDI directory"
        cdi = s.cdi_dir
        if os.path.lexists(cdi) and not cdi.is_dir():
            out.append(failed(name, f"{cdi} is not a directory", "remove it, or give --cdi-dir the directory "
                              "the runtime reads (/var/run/cdi)"))
        elif cdi.is_dir() and not _writable(cdi):
            out.append(failed(name, f"{cdi} is not writable by uid {os.geteuid()}" + (
                " (read-only mount)" if _read_only(cdi) else ""), "mount it read-write into the agent's pod"))
        elif not cdi.is_dir():
            parent = _existing_parent(cdi)
            if _writable(parent):
                out.append(passed(name, f"{cdi} does not exist yet; the agent creates it"))
            else:
                out.append(failed(name, f"{cdi} does not exist and {parent} is not writable",
                                  f"create {cdi}, or mount it from the host"))
        else:
            out.append(passed(name, f"{cdi} exists and is writable"))
        report = validate_dirs([s.static_cdi_dir, s.cdi_dir])
        bad = [f for f in report.files if not f.ok]
        problems = [f"{f.path}: {f.problems[0]}" for f in bad[:3]] + report.conflicts[:3]
        if problems:
            more = len(bad) + len(report.conflicts) - len(problems)
            out.append(failed("CDI specs", "; ".join(problems) + (f"; and {more} more" if more > 0 else ""),
                              "dra-agent cdi validate lists every problem; fix or remove the files (runtimes "
                              "refuse an invalid file's devices)"))
        else:
            out.append(passed("CDI specs", f"{len(report.files)} spec files in {s.static_cdi_dir} and {s.cdi_dir}, "
                              f"{len(report.devices)} devices, all valid"))
        return out

    # hardware ------------------------------------------------------------------------------------

    def nvml(self) -> list[Result]:
        name = "NVML"
        mode = self.s.nvml
        if mode.kind == "sim":
            return [passed(name, f"--nvml {mode}: simulated GPUs, the real NVML is not used")]
        try:
            pynvml.nvmlInit()
        except (pynvml.NVMLError, OSError) as exc:
            hardware = nvidia_display_functions(self.s.sysfs_root)
            if (self.s.dev_root / "nvidiactl").exists():
                hardware.append(str(self.s.dev_root / "nvidiactl"))
            why = str(exc) or type(exc).__name__
            if mode.kind == "real" or hardware:
                seen = f" although NVIDIA hardware is present ({', '.join(hardware)})" if hardware else ""
                return [failed(name, f"NVML does not load{seen}: {why}", "install the NVIDIA driver on the host "
                               "and make libnvidia-ml.so.1 visible to the agent (mount the driver root, "
                               "LD_LIBRARY_PATH), or run with --nvml sim")]
            return [passed(name, f"no NVIDIA GPUs on this node (NVML: {why}); none are published")]
        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion())
            count = pynvml.nvmlDeviceGetCount()
            try:
                cuda = pynvml.nvmlSystemGetCudaDriverVersion()
                cuda_text = f", CUDA {cuda // 1000}.{cuda % 1000 // 10}"
            except pynvml.NVMLError:
                cuda_text = ""
        except pynvml.NVMLError as exc:
            return [failed(name, f"NVML loads but does not answer: {exc}", "nvidia-smi shows the same; check the "
                           "driver (dmesg: Xid errors) and reboot if a GPU fell off the bus")]
        finally:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()
        return [passed(name, f"driver {driver}{cuda_text}, {count} GPUs")]

    def iommu(self) -> list[Result]:
        groups = self.s.sysfs_root / "kernel" / "iommu_groups"
        try:
            count = len(os.listdir(groups))
        except OSError:
            count = 0
        if count:
            return [passed("IOMMU", f"on: {count} groups in {groups}")]
        return [failed("IOMMU", f"off: no groups in {groups}", "only VFIO passthrough to VMs needs it: enable "
                       "VT-d / AMD-Vi in the firmware and boot with intel_iommu=on iommu=pt", blocking=False)]

    def vfio(self) -> list[Result]:
        name = "vfio-pci"
        driver = self.s.sysfs_root / "bus" / "pci" / "drivers" / "vfio-pci"
        if driver.is_dir():
            node = self.s.dev_root / "vfio" / "vfio"
            return [passed(name, f"loaded ({driver})" + ("" if node.exists() else f"; {node} is missing"))]
        release = os.uname().release
        for modules in (self.host(f"/lib/modules/{release}"), self.host(f"/usr/lib/modules/{release}")):
            for index in ("modules.builtin", "modules.dep"):
                try:
                    text = (modules / index).read_text()
                except OSError:
                    continue
                if re.search(r"(^|/)vfio-pci\.ko", text, re.MULTILINE):
                    return [failed(name, f"available ({modules / index}) but not loaded", "only VFIO passthrough "
                                   "needs it: modprobe vfio-pci, and list it in /etc/modules-load.d/",
                                   blocking=False)]
        return [failed(name, f"not loaded, and no vfio-pci module for kernel {release} under "
                       f"{self.host('/lib/modules')}", "only VFIO passthrough needs it: install the kernel's "
                       "modules package", blocking=False)]

    # state -----------------------------------------------------------------------------------------

    def records(self) -> list[Result]:
        name = "claim records"
        directory = self.s.claims_state_dir
        if not directory.is_dir():
            return [passed(name, f"{directory} does not exist yet: nothing prepared")]
        if not os.access(directory, os.R_OK | os.X_OK):
            return [failed(name, f"cannot read {directory} as uid {os.geteuid()}", "run doctor as the agent's "
                           "user (root)", blocking=False)]
        store = ClaimStore(directory)
        records, problems = store.load_all()
        corrupt = sorted(n for n in os.listdir(directory) if n.endswith(".corrupt"))
        out = []
        if problems:
            out.append(failed(name, "unreadable: " + "; ".join(f"{n}: {why}" for n, why in problems),
                              "the agent sets an unreadable record aside at its next start and removes that "
                              "claim's files: restart the agent, then the pods using those claims",
                              blocking=False))
        else:
            out.append(passed(name, f"{len(records)} prepared claims, every record readable"))
        if corrupt:
            out.append(failed("records set aside", f"{len(corrupt)} in {directory}: {', '.join(corrupt[:5])}",
                              "look at them (a disk or filesystem problem?), then delete them", blocking=False))
        return out

    def free_space(self) -> list[Result]:
        s = self.s
        seen: dict[int, list[str]] = {}
        stats: dict[int, os.statvfs_result] = {}
        for what, path in (("state", s.state_dir), ("CDI", s.cdi_dir), ("plugin", s.plugin_dir)):
            where = _existing_parent(path)
            try:
                st = os.statvfs(where)
                dev = os.stat(where).st_dev
            except OSError:
                continue
            seen.setdefault(dev, []).append(f"{what} dir")
            stats[dev] = st
        problems, warnings, details = [], [], []
        for dev, whats in seen.items():
            st = stats[dev]
            free, inodes = st.f_bavail * st.f_frsize, st.f_favail
            label = ", ".join(whats)
            details.append(f"{label}: {_size(free)} free")
            if st.f_flag & os.ST_RDONLY:
                problems.append(f"{label}: read-only filesystem")
            elif free < MIN_FREE_BYTES or (st.f_files and inodes < MIN_FREE_INODES):
                problems.append(f"{label}: {_size(free)} and {inodes} inodes free")
            elif free < LOW_FREE_BYTES:
                warnings.append(f"{label}: only {_size(free)} free")
        if problems:
            return [failed("free space", "; ".join(problems), "free space there: prepares fail (and say so) when "
                           "a record or a CDI spec cannot be written")]
        if warnings:
            return [failed("free space", "; ".join(warnings), "free space there before prepares start failing",
                           blocking=False)]
        return [passed("free space", "; ".join(details))]

    # the cluster -----------------------------------------------------------------------------------

    async def cluster(self) -> list[Result]:
        s = self.s
        if s.offline is not None:
            return [skipped("Kubernetes API", f"offline (--offline {s.offline}): the agent talks to no API "
                            "server"), self._offline_node(s.offline),
                    skipped("RBAC", "offline: no API server to ask")]
        client, source = await kube.connect(s)
        if client is None:
            if s.offline_fallback is not None:
                return [passed("Kubernetes API", f"{source}: the agent runs offline in {s.offline_fallback} "
                               "(--offline-fallback)"), self._offline_node(s.offline_fallback),
                        skipped("RBAC", "offline: no API server to ask")]
            return [failed("Kubernetes API", source, "give --kubeconfig, or run in the agent's pod"),
                    skipped("Node", "no API server"), skipped("RBAC", "no API server")]
        try:
            results = await self._cluster(client, source)
        finally:
            await client.close()
        if s.offline_fallback is not None:
            # What fails here sends the agent offline (connection.connect), it does not stop it.
            for r in results:
                if not r.ok and r.check in ("Kubernetes API", "Node"):
                    r.blocking = False
                    r.detail += f"; the agent runs offline in {s.offline_fallback} (--offline-fallback)"
        return results

    async def _cluster(self, client: Any, source: str) -> list[Result]:
        s = self.s
        server = client.config.cluster.server
        try:
            async with asyncio.timeout(s.api_timeout):
                node = await kube.read_node(client, s.node_name)
        except kube.NodeNotFound as exc:
            return [passed("Kubernetes API", f"{server} answers ({source})"),
                    failed("Node", str(exc), "give --node-name / $NODE_NAME the Node's name (the DaemonSet "
                           "sets it from spec.nodeName)"), *await self.rbac(client)]
        except Exception as exc:
            why = "no answer in time" if isinstance(exc, TimeoutError) else kube.describe(exc)
            if kube.status_code(exc) in (401, 403):
                return [failed("Kubernetes API", f"{server}: {why}", "check the credentials (the service "
                               "account token) and RBAC: get nodes"), skipped("Node", "cannot read it"),
                        *await self.rbac(client)]
            return [failed("Kubernetes API", f"{server} ({source}): {why}", "check the network path to the "
                           "API server from this node, and --kubeconfig"),
                    skipped("Node", "no API server"), skipped("RBAC", "no API server")]
        return [passed("Kubernetes API", f"{server} answers ({source})"), _node_result(node, "the API server"),
                *await self.rbac(client)]

    def _offline_node(self, directory: Path) -> Result:
        node = kube.read_offline_node(directory, self.s.node_name)
        if not node.uid:
            return passed("Node", f"offline, no {directory / 'node.yaml'}: slices carry no owner reference, "
                          "CPU and memory are not node-allocatable")
        return _node_result(node, str(directory / "node.yaml"))

    async def rbac(self, client: Any) -> list[Result]:
        from lightkube.models.authorization_v1 import ResourceAttributes, SelfSubjectAccessReviewSpec
        from lightkube.resources.authorization_v1 import SelfSubjectAccessReview

        async def review(p: Permission) -> tuple[Permission, bool | None, str]:
            attributes = ResourceAttributes(verb=p.verb, group=p.group, resource=p.resource,
                                            name=self.s.node_name if p.resource == "nodes" else None)
            try:
                async with asyncio.timeout(self.s.api_timeout):
                    answer = await client.create(SelfSubjectAccessReview(
                        spec=SelfSubjectAccessReviewSpec(resourceAttributes=attributes)))
            except Exception as exc:
                return p, None, kube.describe(exc) if not isinstance(exc, TimeoutError) else "no answer in time"
            status = answer.status
            return p, bool(status and status.allowed), (status.reason or "") if status else ""

        answers = await asyncio.gather(*(review(p) for p in PERMISSIONS))
        errors = [f"{p}: {why}" for p, allowed, why in answers if allowed is None]
        denied = [p for p, allowed, _ in answers if allowed is False]
        if errors:
            return [failed("RBAC", "SelfSubjectAccessReview failed: " + "; ".join(errors[:3]),
                           "the API server must answer SelfSubjectAccessReviews (authorization.k8s.io/v1)",
                           blocking=False)]
        if denied:
            return [failed("RBAC", "denied: " + "; ".join(f"{p} ({p.why})" for p in denied),
                           "grant them to the agent's service account (deploy/base has the ClusterRole): "
                           "kubectl auth can-i --as=system:serviceaccount:<namespace>:<account> ...")]
        return [passed("RBAC", f"all {len(PERMISSIONS)} permissions the agent uses are granted: "
                       + ", ".join(map(str, PERMISSIONS)))]


def _node_result(node: kube.NodeInfo, where: str) -> Result:
    features = ", ".join(sorted(node.declared_features)) or "none"
    allocatable = ("CPU and memory are published as node-allocatable" if node.node_allocatable else
                   f"no {kube.NODE_ALLOCATABLE_FEATURE}: CPU and memory are published as plain devices")
    return passed("Node", f"{node.name} (uid {node.uid or 'unknown'}) from {where}; declared features: "
                  f"{features}; {allocatable}")


# -- helpers ------------------------------------------------------------------------------------------

def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _same_dir(a: Path, b: Path) -> bool:
    if os.path.normpath(a) == os.path.normpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK | os.X_OK) and not _read_only(path)


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def run(settings: Settings, *, host_root: Path = Path("/")) -> list[Result]:
    return await Doctor(settings, host_root=host_root).run()
