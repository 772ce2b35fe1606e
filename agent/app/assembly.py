"""What the running agent is put together from, shared with the one-shot CLI commands (`agent.app.oneshot`):
the discovery sources, the simulated machine's kernel, the form a device is published in, the
agent's root directories, and the switches the Node's declared features set (node-allocatable CPU,
memory and GPU fields; the list form of `numaNode`).

Imported light, like `agent.app.daemon`: every heavy module is imported where it is first used.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from agent.config import Settings
from agent.fsutil import UnsafeRoot, check_root, makedirs

if TYPE_CHECKING:
    from agent.host.vfio.sriov import VfLinks
    from agent.inventory import Inventory, Source
    from agent.inventory.numa import NumaForm
    from agent.inventory.nvmlapi import NvmlOpener
    from agent.kube import NodeInfo
    from agent.model import Device
    from agent.sim.kernel.emulator import KernelEmulator

log = logging.getLogger(__name__)


def build_sources(settings: Settings) -> list[Source]:
    from agent.inventory.cpus import CpuSource
    from agent.inventory.gpus import GpuSource
    from agent.inventory.memory import MemorySource
    from agent.inventory.nics import NicSource

    sources: list[Source] = [GpuSource(settings, opener=nvml_opener(settings)),
                             NicSource(settings, passthrough=settings.nic_passthrough),
                             CpuSource(settings), MemorySource(settings)]
    if settings.nvml.kind == "sim":
        # The simulated NIC's functions have no netdev for NIC discovery to find; listed after GPU
        # discovery, whose opening writes the simulated machine this source reads.
        from agent.sim.nicsource import SimNicSource

        sources.append(SimNicSource(settings))
    return sources


def nvml_opener(settings: Settings) -> NvmlOpener:
    """What GPU discovery opens NVML with: the host's driver library (`--nvml real`, or `auto`), or the
    simulated machine of `--nvml sim:<profile>`, written under the state directory, with the commands
    `dra-agent sim` gives it."""
    if settings.nvml.kind == "sim":
        from agent.sim.nvmlopen import open_sim_nvml

        return open_sim_nvml
    from agent.inventory.nvmlopen import open_real_nvml

    return open_real_nvml


def vf_links(settings: Settings) -> VfLinks:
    """Where prepare reads and sets a VF's MAC and VLAN: the host kernel's PF drivers over netlink, or,
    with `--nvml sim`, the simulated NIC's (which has no netlink device), kept under its machine's root."""
    if settings.nvml.kind == "sim":
        from agent.sim.vflinks import SimVfLinks

        return SimVfLinks(settings.sim_root)
    from agent.host.vfio.sriov import NetlinkVfLinks

    return NetlinkVfLinks()


def start_sim_kernel(settings: Settings) -> KernelEmulator | None:
    """With `--nvml sim`, the simulated machine's kernel, which applies binding writes (the agent's
    VFIO binds, an operator's echo into sysfs) while the agent runs. The running agent starts it, not
    GPU discovery: one-shot CLI commands open the same machine and must not run a second one on it.
    Started before recovery, which may bind functions again."""
    if settings.nvml.kind != "sim":
        return None
    from agent.host.vfio.host import VfioHost
    from agent.sim.kernel.emulator import KernelEmulator, unbind_hold_from_env
    from agent.sim.profiles import load_profile

    root = VfioHost.of(settings).sysfs.parent
    if not (root / "sys" / "bus" / "pci" / "drivers").is_dir():
        return None  # no simulated machine was written (GPU discovery is not among the sources)
    kernel = KernelEmulator(load_profile(settings.nvml.profile), root, unbind_hold=unbind_hold_from_env())
    kernel.start()
    return kernel


class PublishedForm:
    """Reduces a scanned device to what the API server accepts, so slices, metadata files and the
    CLI all show the same device. Each problem is logged once, not on every rescan. With `settings`,
    the standard `numaNode` attribute first takes the form the Node's features ask for (`NumaForm`,
    switched by `set_node_features`)."""

    def __init__(self, settings: Settings | None = None) -> None:
        self._reported: set[str] = set()
        self.numa: NumaForm | None = None
        if settings is not None:
            from agent.inventory.numa import NumaForm

            self.numa = NumaForm(settings.sysfs_root)

    def __call__(self, device: Device) -> Device | None:
        if self.numa is not None:
            device = self.numa(device)
        out, problems = published_form(device)
        for message in problems:
            if message not in self._reported:
                self._reported.add(message)
                log.warning("not published: %s", message)
        return out


def published_form(device: Device) -> tuple[Device | None, list[str]]:
    """The device without what the API server would reject, and what was removed."""
    from agent.publish import slices

    wire, problems = slices.sanitize_device(device)
    if wire is None:
        return None, problems
    attrs, caps = wire.get("attributes", {}), wire.get("capacity", {})
    if len(attrs) == len(device.attributes) and len(caps) == len(device.capacity):
        return device, problems
    return dataclasses.replace(
        device,
        attributes={k: v for k, v in device.attributes.items() if k in attrs},
        capacity={k: v for k, v in device.capacity.items() if k in caps},
    ), problems


def prepare_roots(settings: Settings) -> None:
    """Create the directories the agent writes below, and refuse to start on one that another user
    could plant links or files in (unless --allow-unsafe-roots): the agent never follows a link
    below its roots, but it must also trust the roots themselves."""
    roots = [("state directory", settings.state_dir, 0o700), ("records directory", settings.claims_state_dir, 0o700),
             ("CDI directory", settings.cdi_dir, 0o755), ("plugin directory", settings.plugin_dir, 0o755),
             ("metadata directory", settings.metadata_dir, 0o755),
             ("plugin registry directory", settings.registry_dir, 0o755)]
    for what, path, mode in roots:
        makedirs(path, mode)
        try:
            check_root(path, what)
        except UnsafeRoot as exc:
            if not settings.allow_unsafe_roots:
                from agent.app.connection import StartupError

                raise StartupError(f"{exc}: refusing to start (--allow-unsafe-roots overrides)") from None
            log.warning("%s (allowed by --allow-unsafe-roots)", exc)


def numa_lists(settings: Settings, node: NodeInfo | None) -> bool:
    """Whether `numaNode` is published as a list: `--numa-node-list`, and for `auto` whether the Node
    declares DRAListTypeAttributes (an API server with the gate off refuses a slice with a list
    attribute, `agent.publish.dropped`)."""
    if settings.numa_node_list == "auto":
        return bool(node and node.list_attributes)
    return settings.numa_node_list == "true"


def set_node_features(inventory: Inventory, node: NodeInfo | None, settings: Settings | None = None) -> None:
    """Set what the Node's declared features switch: node-allocatable fields on every source that has
    them, and (with `settings`) the form of `numaNode`. The sources must scan again for it to show."""
    enabled = bool(node and node.node_allocatable)
    for source in inventory.sources:
        if hasattr(source, "node_allocatable"):
            source.node_allocatable = enabled
    form = inventory.refine
    if settings is not None and isinstance(form, PublishedForm) and form.numa is not None:
        lists = numa_lists(settings, node)
        if lists != form.numa.lists:
            log.info("resource.kubernetes.io/numaNode is published as %s", "a list (the node, then its socket's "
                     "nearest nodes)" if lists else "the device's node")
        form.numa.set_lists(lists)
