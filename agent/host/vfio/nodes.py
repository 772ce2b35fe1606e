"""The VFIO device nodes a container needs for passed-through functions.

Two ways for QEMU to reach a function: the legacy group interface (`/dev/vfio/vfio`, the container,
and `/dev/vfio/<group>` per IOMMU group) — the default — and iommufd (`/dev/iommu`, and the
function's own cdev `/dev/vfio/devices/vfio<N>`), only where the host has `/dev/iommu`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path

from agent.host.vfio.errors import VfioError
from agent.host.vfio.pci import VFIO_PCI, current_driver, function_dir, iommu_group
from agent.model import DeviceNode


class IommuBackend(StrEnum):
    LEGACY = "legacy"
    IOMMUFD = "iommufd"


def host_has_iommufd(dev_root: Path) -> bool:
    return (dev_root / "iommu").exists()


def vfio_device_nodes(sysfs: Path, dev_root: Path, bdfs: Sequence[str],
                      backend: IommuBackend = IommuBackend.LEGACY) -> tuple[DeviceNode, ...]:
    """The nodes for `bdfs`, each already bound to vfio-pci; VfioError naming what is missing."""
    for bdf in bdfs:
        if current_driver(sysfs, bdf) != VFIO_PCI:
            raise VfioError(f"PCI function {bdf} is not bound to {VFIO_PCI}: it has no VFIO device node")
    if backend is IommuBackend.LEGACY:
        nodes = [DeviceNode("/dev/vfio/vfio", str(dev_root / "vfio" / "vfio"))]
        for group in sorted({g for g in (iommu_group(sysfs, b) for b in bdfs) if g is not None}):
            nodes.append(DeviceNode(f"/dev/vfio/{group}", str(dev_root / "vfio" / str(group))))
    else:
        if not host_has_iommufd(dev_root):
            raise VfioError(f"the iommufd backend was asked for, but this host has no {dev_root / 'iommu'} "
                            "(a kernel with CONFIG_IOMMUFD and CONFIG_VFIO_DEVICE_CDEV): use the legacy backend")
        nodes = [DeviceNode("/dev/iommu", str(dev_root / "iommu"))]
        for bdf in bdfs:
            try:
                (cdev,) = os.listdir(function_dir(sysfs, bdf) / "vfio-dev")
            except (OSError, ValueError):
                raise VfioError(f"PCI function {bdf} has no VFIO device cdev (no vfio-dev/ in sysfs): the "
                                "kernel lacks CONFIG_VFIO_DEVICE_CDEV; use the legacy backend") from None
            nodes.append(DeviceNode(f"/dev/vfio/devices/{cdev}", str(dev_root / "vfio" / "devices" / cdev)))
    missing = [n.host_path for n in nodes if not os.path.exists(n.host_path)]
    if missing:
        raise VfioError(f"VFIO device nodes missing on the host: {', '.join(missing)}")
    return tuple(nodes)
