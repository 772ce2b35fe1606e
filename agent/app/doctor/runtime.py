"""Doctor checks of CDI on this node: whether the container runtime (containerd, CRI-O,
podman) reads CDI specs from the directory the agent writes them to, and that
directory itself (writable, its specs valid)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agent.app.doctor.base import Checks, existing_parent
from agent.app.doctor.results import Result, failed, passed

RUNTIME_DEFAULT_CDI_DIRS = ("/etc/cdi", "/var/run/cdi")  # containerd, CRI-O and podman alike


class RuntimeChecks(Checks):
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

    def toolkit(self) -> list[Result]:
        """The NVIDIA Container Toolkit's CDI spec: a GPU claim's containers get the driver's libraries
        through its devices (`agent.claims.plan.toolkit_device`); without it a CUDA image finds none."""
        from agent.claims.toolkit import KIND, ToolkitSpecs
        from agent.inventory.nvmlopen import nvidia_hardware

        name = "NVIDIA toolkit CDI"
        s = self.s
        if s.nvml.kind == "sim":
            return [passed(name, f"--nvml {s.nvml}: simulated GPUs, no driver libraries to give containers")]
        hardware = nvidia_hardware(s)
        if not hardware:
            return [passed(name, "no NVIDIA GPUs on this node: no GPU claims to give driver libraries")]
        names = ToolkitSpecs([s.static_cdi_dir, s.cdi_dir], skip_prefixes=(s.cdi_vendor,), min_interval=0).names()
        if not names:
            return [failed(name, f"no {KIND} CDI spec in {s.static_cdi_dir} or {s.cdi_dir}: containers of GPU "
                           "claims get the GPU's device nodes but not the driver's libraries (a CUDA image finds no "
                           "libcuda.so)", f"on the node: nvidia-ctk cdi generate --output={s.static_cdi_dir}/"
                           "nvidia.yaml (again after each driver upgrade; docs/claims.md)")]
        gpus = [n for n in names if n.startswith("GPU-") or n.isdigit()]
        return [passed(name, f"{KIND}: {len(gpus)} GPUs ({', '.join(sorted(gpus)[:4])}"
                       f"{', ...' if len(gpus) > 4 else ''}); GPU claims get its devices")]

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
            parent = existing_parent(cdi)
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


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _same_dir(a: Path, b: Path) -> bool:
    if os.path.normpath(a) == os.path.normpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)



def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK | os.X_OK) and not _read_only(path)


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False

