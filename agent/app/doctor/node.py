"""Doctor checks of the node's hardware and the agent's state on it: NVML, IOMMU and
vfio-pci, the node's uplinks, the claim records, and free space where the agent writes."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

import pynvml

from agent.app.doctor.base import Checks, existing_parent
from agent.app.doctor.results import Result, failed, passed, skipped
from agent.claims.leftovers import Leftovers, leftovers_dir
from agent.claims.store import ClaimStore
from agent.inventory.netlink import net_state
from agent.inventory.nvmlopen import LibraryMissing, init_real, nvidia_hardware
from agent.inventory.uplinks import node_addresses, uplink_reasons

MIN_FREE_BYTES = 16 * 1024 * 1024  # below: blocking (a record, a CDI spec may not fit)
LOW_FREE_BYTES = 256 * 1024 * 1024  # below: a warning
MIN_FREE_INODES = 100


class NodeChecks(Checks):
    # hardware ------------------------------------------------------------------------------------

    def nvml(self) -> list[Result]:
        name = "NVML"
        mode = self.s.nvml
        if mode.kind == "sim":
            return [passed(name, f"--nvml {mode}: simulated GPUs, the real NVML is not used")]
        try:
            init_real(self.s.driver_root)
        except (LibraryMissing, pynvml.NVMLError, OSError) as exc:
            hardware = nvidia_hardware(self.s)
            why = str(exc) or type(exc).__name__
            if mode.kind == "real" or hardware:
                seen = f" although NVIDIA hardware is present ({', '.join(hardware)})" if hardware else ""
                fix = ("set --driver-root to where the NVIDIA driver is installed, mounted into the agent's pod "
                       "(docs/deployment.md), or run with --nvml sim") if isinstance(exc, LibraryMissing) else \
                    "load the NVIDIA kernel driver (nvidia-smi shows the same), or run with --nvml sim"
                return [failed(name, f"NVML does not load{seen}: {why}", fix)]
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

    def _simulated(self, name: str) -> Result | None:
        """With simulated GPUs the IOMMU and vfio-pci the agent uses are the simulated machine's: a skip
        while that machine is not made yet (the agent makes it when it starts), else None."""
        if self.s.nvml.kind == "sim" and not (self.s.sim_root / "sys").is_dir():
            return skipped(name, f"--nvml sim: the simulated machine ({self.s.sim_root}) is made when the agent "
                           "starts")
        return None

    def _machine(self) -> tuple[Path, Path, str]:
        """The sysfs and /dev the agent passes functions through in, and how to name them."""
        if self.s.nvml.kind == "sim":
            return self.s.sim_root / "sys", self.s.sim_root / "dev", "the simulated machine's "
        return self.s.sysfs_root, self.s.dev_root, ""

    def iommu(self) -> list[Result]:
        if (skip := self._simulated("IOMMU")) is not None:
            return [skip]
        sysfs, _, whose = self._machine()
        groups = sysfs / "kernel" / "iommu_groups"
        count = _entries(groups)
        if count and whose:
            # The simulated machine's GPUs and VF have its groups; the host's own NIC functions are
            # discovered in the host's sysfs, whose groups decide theirs (and the warning `devices` gives
            # when one of them is an SR-IOV VF that gets no passthrough variant).
            host = self.s.sysfs_root / "kernel" / "iommu_groups"
            own = _entries(host)
            host_text = (f"{own} groups in this host's {host}" if own else
                         f"none in this host's {host} (its IOMMU is off): only this host's own SR-IOV NIC "
                         "functions would need them")
            return [passed("IOMMU", f"on: {count} groups in {whose}{groups}; {host_text}")]
        if count:
            return [passed("IOMMU", f"on: {count} groups in {groups}")]
        return [failed("IOMMU", f"off: no groups in {groups}", "only VFIO passthrough to VMs needs it: enable "
                       "VT-d / AMD-Vi in the firmware and boot with intel_iommu=on iommu=pt", blocking=False)]

    def vfio(self) -> list[Result]:
        name = "vfio-pci"
        if (skip := self._simulated(name)) is not None:
            return [skip]
        sysfs, dev, whose = self._machine()
        driver = sysfs / "bus" / "pci" / "drivers" / "vfio-pci"
        if driver.is_dir():
            node = dev / "vfio" / "vfio"
            return [passed(name, f"loaded ({whose}{driver})" + ("" if node.exists() else f"; {node} is missing"))]
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

    def uplinks(self) -> list[Result]:
        """The links of this network namespace (the agent's: the host's) that are the node's uplink, and why:
        what prepare never moves into a pod nor passes through (`agent.inventory.uplinks`)."""
        name = "NIC uplinks"
        state = net_state()
        names = {link.index: link.ifname for link in state.links}
        found = uplink_reasons(state, node_addresses(tuple(self.s.node_ips)))
        if found:
            return [passed(name, "; ".join(f"{names[i]}: {why}" for i, why in sorted(found.items()))
                           + " (never moved into a pod nor passed through)")]
        none = "no link carries a default route (in any routing table) or an address --node-ips names"
        if self.s.offline is not None:
            return [passed(name, f"{none}: no NIC is held back as the uplink")]
        return [failed(name, f"{none}: nothing keeps a claim from moving the NIC the node is reached by into a pod",
                       "run the agent with the host's network and --node-ips from the Node's status.hostIPs, as "
                       "deploy/base/daemonset.yaml does", blocking=False)]

    # state ---------------------------------------------------------------------------------------

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
        return out + self.leftovers()

    def leftovers(self) -> list[Result]:
        """Host changes unprepared claims left because they could not be undone (`agent.claims.leftovers`)."""
        name = "host changes left undone"
        found = Leftovers(leftovers_dir(self.s.state_dir)).all()
        if not found:
            return [passed(name, "none: every unprepared claim's host changes are undone")]
        return [failed(name, lo.describe(), f"the devices are tainted undo-failed and not prepared again until this "
                       f"is undone: the agent retries at start and every garbage collection sweep (a GPU reset or "
                       f"a reboot mostly undoes it); once fixed by hand, clear the taint of the device on "
                       f"{', '.join(lo.functions) or 'its hardware'} that `dra-agent taints` lists (its GPU or "
                       f"function): dra-agent taints clear <device>",
                       blocking=False) for lo in found]

    def free_space(self) -> list[Result]:
        s = self.s
        seen: dict[int, list[str]] = {}
        stats: dict[int, os.statvfs_result] = {}
        for what, path in (("state", s.state_dir), ("CDI", s.cdi_dir), ("plugin", s.plugin_dir)):
            where = existing_parent(path)
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


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _entries(directory: Path) -> int:
    try:
        return len(os.listdir(directory))
    except OSError:
        return 0
