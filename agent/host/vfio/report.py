"""A read-only look at a host's passthrough candidates: `python -m agent.host.vfio.report [--sysfs /sys]
[--proc /proc] [--dev /dev]`. For each NVIDIA GPU: its driver, IOMMU group with every member's role,
whether the group can be passed through, and whether the GPU is in use. Nothing is written."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from agent.host.pci import nvidia_display_functions
from agent.host.vfio.errors import VfioError
from agent.host.vfio.inuse import check_gpu_idle
from agent.host.vfio.pci import passthrough_set, read_function


def _minor(proc: Path, bdf: str) -> int | None:
    try:
        text = (proc / "driver" / "nvidia" / "gpus" / bdf / "information").read_text()
    except OSError:
        return None
    found = re.search(r"Device Minor:\s*(\d+)", text)
    return int(found.group(1)) if found else None


def report(sysfs: Path, proc: Path, dev: Path) -> list[str]:
    lines: list[str] = []
    for bdf in nvidia_display_functions(sysfs):
        fn = read_function(sysfs, bdf)
        lines.append(f"{fn.describe()}: driver {fn.driver or '-'}, override {fn.override or '-'}, "
                     f"IOMMU group {fn.iommu_group if fn.iommu_group is not None else '-'}")
        try:
            group = passthrough_set(sysfs, bdf)
            members = ", ".join(f"{m.function.bdf} {m.role} ({m.function.driver or 'unbound'})" for m in group.members)
            lines.append(f"  passable: {members}")
        except VfioError as exc:
            lines.append(f"  not passable: {exc}")
        minor = _minor(proc, bdf)
        try:
            if minor is None:
                lines.append("  in use: unknown (no minor number in /proc/driver/nvidia/gpus)")
            else:
                check_gpu_idle(sysfs, proc, dev, bdf, minor)
                lines.append(f"  in use: no (nothing holds /dev/nvidia{minor}, no SR-IOV VFs)")
        except VfioError as exc:
            lines.append(f"  in use: {exc}")
    return lines or [f"no NVIDIA GPU in {sysfs}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sysfs", type=Path, default=Path("/sys"))
    parser.add_argument("--proc", type=Path, default=Path("/proc"))
    parser.add_argument("--dev", type=Path, default=Path("/dev"))
    args = parser.parse_args()
    print("\n".join(report(args.sysfs, args.proc, args.dev)))


if __name__ == "__main__":
    main()
