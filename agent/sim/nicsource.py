"""The simulated machine's NIC functions (`--nvml sim`): their passthrough (VFIO) variants, found in
the simulated sysfs as NIC discovery finds a real host's in `/sys`.

NIC discovery starts from netlink, and the simulated functions have no netdev there (their `net/<if>`
directories exist only in the simulated sysfs), so without this source a running sim agent would never
publish a VF's passthrough device and a VM claim for one could not be prepared. It publishes exactly
what `NicVariants` makes of a real host's sysfs: a variant per enabled SR-IOV VF, and one for a PF
without enabled VFs whose interface `--nic-passthrough` names; `--nic-exclude` wins. Same names,
attributes (`macAddress` from `net/<if>/address` while the function has its netdev), counter sets and
node facts, so prepare binds them to vfio-pci through the simulated kernel as it would on a host.

No native NIC devices: the simulated functions have no link to publish one for. A VF's counter set is
then consumed by its variant alone, with the one port a real VF's set holds.
"""

from __future__ import annotations

import logging

from agent.config import Settings
from agent.host.vfio.host import VfioHost
from agent.inventory import ScanResult
from agent.inventory.passthrough import NicVariants

log = logging.getLogger(__name__)


class SimNicSource:
    """Discovery of the simulated machine's NIC functions. Listed after GPU discovery, whose opening
    writes the simulated machine (sources open in list order)."""

    kind = "simnic"

    def __init__(self, settings: Settings) -> None:
        self.sysfs = VfioHost.of(settings).sysfs
        self._variants = NicVariants(passthrough=tuple(settings.nic_passthrough),
                                     exclude=tuple(settings.nic_exclude))
        self._machine = False

    def open(self) -> None:
        # Absent where GPU discovery did not write it (tests replacing GPU discovery): nothing to
        # publish then, and no warning about IOMMU groups that a real host would deserve.
        self._machine = (self.sysfs / "bus" / "pci" / "devices").is_dir()
        if not self._machine:
            log.info("no simulated machine under %s: no simulated NIC functions to publish", self.sysfs.parent)

    def close(self) -> None:
        pass

    def scan(self) -> ScanResult:
        if not self._machine:
            return ScanResult()
        return ScanResult(devices=self._variants.apply(self.sysfs, []))
