"""Mediated devices (vGPU) on a host and on the simulated machine: the one place that knows their
sysfs paths (`sysfs`) and their failures (`errors`). Inventory (`agent.inventory.vgpu`) reads the
types a GPU offers; prepare (`agent.hostprep.vgpu`) creates and removes devices; tests drive both.

The writes wait (bounded) for the kernel: call them off the event loop.
"""

from agent.host.mdev.errors import (
    MdevError,
    MdevStepFailed,
    NoInstanceAvailable,
    ParentUnavailable,
    TypeNotOffered,
)
from agent.host.mdev.sysfs import (
    DEFAULT_TIMEOUT,
    MdevType,
    create,
    exists,
    gpu_mdevs,
    gpu_types,
    iommu_group,
    list_types,
    mdevs_of,
    parent_for,
    parent_of,
    parents,
    read_type,
    remove,
    type_of,
    vfio_nodes,
    vgpu_parents,
    wait_created,
)

__all__ = [
    "DEFAULT_TIMEOUT", "MdevError", "MdevStepFailed", "MdevType", "NoInstanceAvailable", "ParentUnavailable",
    "TypeNotOffered", "create", "exists", "gpu_mdevs", "gpu_types", "iommu_group", "list_types", "mdevs_of",
    "parent_for", "parent_of", "parents", "read_type", "remove", "type_of", "vfio_nodes", "vgpu_parents",
    "wait_created",
]
