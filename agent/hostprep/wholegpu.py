"""A whole GPU (or a share of it) is not prepared while the GPU is in MIG mode.

CUDA cannot use the whole GPU in MIG mode, only its MIG devices, so discovery does not publish the
whole GPU then (`agent.inventory.gpus.withhold_in_mig_mode`). A claim the scheduler allocated it to
before the mode changed, and before the next scan, still reaches prepare: NVML is asked for the GPU's
current mode here, and such a claim gets `WholeGpuInMigMode` naming the GPU, before anything is
written. The current mode, not the pending one: CUDA sees the GPU as it is now. When NVML cannot say
(released while another GPU changes drivers, the GPU not answering), the prepare goes on: health
reports a GPU that does not answer, and the claim's container finds the mode as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import pynvml

from agent.claims.metadata import AllocatedDevice
from agent.errors import WholeGpuInMigMode
from agent.facts import GpuFacts, GpuShare
from agent.hostprep.mig import NvmlAccess

log = logging.getLogger(__name__)


def check_not_in_mig_mode(allocated: Sequence[AllocatedDevice], access: Callable[[], NvmlAccess | None]) -> None:
    """WholeGpuInMigMode when a whole GPU or a share of one in `allocated` is in MIG mode now."""
    wanted = [a.device for a in allocated if isinstance(a.device.node, GpuFacts)
              and (a.device.node.target is None or isinstance(a.device.node.target, GpuShare))]
    if not wanted:
        return
    nv = access()
    if nv is None or nv.gate is None:
        return
    with nv.gate.use_if_up() as up:
        if up is None:
            return
        for dev in wanted:
            facts = dev.node
            assert isinstance(facts, GpuFacts)
            try:
                current = int(nv.nvml.nvmlDeviceGetMigMode(nv.nvml.nvmlDeviceGetHandleByUUID(facts.gpu.uuid))[0])
            except pynvml.NVMLError as exc:
                log.debug("device %s: MIG mode not readable (%s): not checked", dev.name, exc)
                continue
            if current == pynvml.NVML_DEVICE_MIG_ENABLE:
                raise WholeGpuInMigMode(f"device {dev.name}: GPU {facts.pci_bus_id} ({facts.gpu.uuid}) is in MIG mode: "
                                        "CUDA cannot use the whole GPU then, only its MIG devices (the mode was "
                                        "turned on after the claim was allocated); ask for a MIG device, or turn MIG "
                                        "mode off")
