"""Network interfaces: PCI network functions and SR-IOV VFs, from netlink and sysfs; each PCI
function's counter set, and passthrough variants of VFs (`agent.inventory.passthrough`).

Netlink says which links exist, their addresses, MTU and state; sysfs
(`class/net/<ifname>/...` under the sysfs root) says what hardware is behind
them. Software links (veth, bridge, bond, ...) are left out unless the
operator asks for them by name; excluded names are never published.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

from agent.apirules import attribute_value_errors
from agent.config import Settings
from agent.facts import NicFacts
from agent.host.pci import PciFunction, pci_function_of
from agent.inventory import DeviceFailure, ScanResult, SourceProblem
from agent.inventory.netlink import Address, Link, net_state
from agent.inventory.passthrough import NicVariants, Variants
from agent.inventory.published import attributes
from agent.inventory.uplinks import node_addresses, uplink_reasons
from agent.kinds import Kind
from agent.model import AttrValue, Device

log = logging.getLogger(__name__)

MAX_NAME = 63  # a device name is a DNS label

# errno values with which sysfs says "this value is not known now" (e.g. `speed`
# of a link without carrier) rather than "this file could not be read".
_UNKNOWN = frozenset({errno.ENOENT, errno.EINVAL, errno.EOPNOTSUPP, errno.ENODEV, errno.ENXIO})


class NicUnreadable(Exception):
    """This NIC's facts could not be read; the others are not affected."""


@dataclass(frozen=True, slots=True)
class _Identity:
    name: str
    netdir: Path
    pci: PciFunction | None


@dataclass(slots=True)
class _Picked:
    """Which links a scan publishes, and the ones it could not."""

    devices: list[Device] = field(default_factory=list)
    failed_devices: list[DeviceFailure] = field(default_factory=list)
    # Links that failed before they had a device name (or whose name another link holds).
    problems: list[SourceProblem] = field(default_factory=list)
    owners: dict[str, str] = field(default_factory=dict)  # device name -> ifname


def _read(path: Path) -> str | None:
    """A sysfs value; None when sysfs says it is unknown or absent, NicUnreadable on a real failure."""
    try:
        return path.read_text().strip()
    except OSError as exc:
        if exc.errno in _UNKNOWN:
            return None
        raise NicUnreadable(f"reading {path}: {exc.strerror or exc}") from exc


def _read_int(path: Path) -> int | None:
    text = _read(path)
    if text is None or text == "":
        return None
    try:
        return int(text, 0)
    except ValueError as exc:
        raise NicUnreadable(f"{path}: not an integer: {text[:40]!r}") from exc


def _basename_of_link(path: Path) -> str | None:
    if not os.path.lexists(path):
        return None
    try:
        return os.path.basename(os.path.realpath(path, strict=True))
    except OSError:
        return None


def pci_device_name(bus_id: str, dev_port: int) -> str:
    """`0000:3b:00.1` -> `nic-0000-3b-00-1`; `-p<N>` for the N-th port of a multi-port function."""
    name = "nic-" + bus_id.replace(":", "-").replace(".", "-")
    return f"{name}-p{dev_port}" if dev_port > 0 else name


def mac_device_name(mac: str) -> str:
    """`02:a1:b2:c3:d4:e5` -> `nic-mac-02a1b2c3d4e5`; long (e.g. InfiniBand) addresses are hashed to fit."""
    digits = mac.replace(":", "").replace("-", "").lower()
    name = f"nic-mac-{digits}"
    if len(name) > MAX_NAME:
        name = f"nic-mac-h{hashlib.sha256(digits.encode()).hexdigest()[:32]}"
    return name


def _matches(ifname: str, globs: Sequence[str]) -> bool:
    return any(fnmatchcase(ifname, g) for g in globs)


class NicSource:
    kind = "nic"

    def __init__(self, settings: Settings, *, passthrough: Sequence[str] = ()) -> None:
        """`passthrough`: interface globs (`--nic-passthrough`) naming PFs without VFs that get a
        passthrough variant too; every SR-IOV VF gets one anyway."""
        self.settings = settings
        # Each PCI function's counter set, and the passthrough variants (agent.inventory.passthrough).
        # "of this host": with simulated GPUs the simulated machine's NIC functions are another source's
        # (`agent.app.assembly.build_sources` adds it), and what is said here is of the host's own.
        self._variants = NicVariants(passthrough=tuple(passthrough), exclude=tuple(settings.nic_exclude),
                                     variants=Variants("NIC function of this host"))
        self._node_ips = node_addresses(tuple(settings.node_ips))

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def scan(self) -> ScanResult:
        state = net_state()
        picked = _Picked()
        uplinks = uplink_reasons(state, self._node_ips)
        for link in state.links:  # by index: on a name collision the older link keeps the name
            self._consider(link, state.addresses.get(link.index, []), picked, uplinks.get(link.index, ""))
        devices = self._variants.apply(self.settings.sysfs_root, picked.devices)
        return ScanResult(devices=devices, failed_devices=picked.failed_devices, problems=picked.problems)

    def _consider(self, link: Link, addresses: list[Address], picked: _Picked, uplink: str) -> None:
        try:
            ident = self._identify(link)
        except NicUnreadable as exc:
            picked.problems.append(SourceProblem(f"interface {link.ifname}", str(exc)))
            return
        if ident is None:
            return
        if (owner := picked.owners.get(ident.name)) is not None:
            # The device under that name is published (through the older link): this link is
            # the problem, not the device.
            picked.problems.append(SourceProblem(f"interface {link.ifname}",
                                                 f"device name {ident.name} is already taken by {owner}"))
            return
        try:
            device = self._device(link, ident, addresses, uplink)
        except NicUnreadable as exc:
            picked.failed_devices.append(DeviceFailure(ident.name, f"interface {link.ifname}: {exc}"))
            return
        picked.owners[ident.name] = link.ifname
        picked.devices.append(device)

    def _identify(self, link: Link) -> _Identity | None:
        """The device name, or None when this link is not published."""
        if not link.ifname or _matches(link.ifname, self.settings.nic_exclude):
            return None
        included = _matches(link.ifname, self.settings.nic_include)
        if link.kind and not included:
            return None
        netdir = self.settings.sysfs_root / "class" / "net" / link.ifname
        self._check_same_link(netdir, link)
        pci: PciFunction | None = None
        device_link = netdir / "device"
        if os.path.lexists(device_link):
            pci = pci_function_of(device_link)
            if pci is None and not os.path.exists(device_link):
                raise NicUnreadable(f"{device_link} points nowhere (device removed during the scan?)")
        if pci is None and not included:
            return None
        if pci is not None:
            name = pci_device_name(pci.bus_id, _read_int(netdir / "dev_port") or 0)
        elif mac := link.perm_mac or link.mac:
            name = mac_device_name(mac)
        else:
            log.debug("nic %s has neither a PCI function nor a MAC address: not published", link.ifname)
            return None
        return _Identity(name=name, netdir=netdir, pci=pci)

    @staticmethod
    def _check_same_link(netdir: Path, link: Link) -> None:
        # The name may have moved to another link between the netlink dump and now.
        if not os.path.lexists(netdir):
            raise NicUnreadable(f"{netdir} does not exist (interface removed or renamed during the scan?)")
        index = _read_int(netdir / "ifindex")
        if index is not None and index != link.index:
            raise NicUnreadable(f"{netdir} is now interface index {index}, not {link.index} "
                                "(renamed during the scan?)")

    def _device(self, link: Link, ident: _Identity, addresses: list[Address], uplink: str) -> Device:
        """`uplink`: why the link is the node's uplink (`agent.inventory.uplinks`), "" when it is not."""
        netdir, pci = ident.netdir, ident.pci
        usable = [a for a in addresses if a.usable_global]
        v4 = [a.cidr for a in usable if a.family == socket.AF_INET]
        v6 = [a.cidr for a in usable if a.family == socket.AF_INET6]
        facts = NicFacts(interface=link.ifname, mac=link.mac, ips=tuple(v4 + v6), link_up=link.link_up,
                         pci_bus_id=pci.bus_id if pci is not None else "", uplink_reason=uplink)
        attrs = attributes(facts)
        attrs["mtu"] = link.mtu
        speed = _read_int(netdir / "speed")
        if speed is not None and speed > 0:  # -1 (unknown) while a link is down
            attrs["speedMbps"] = speed
        if driver := _basename_of_link(netdir / "device" / "driver"):
            attrs["driver"] = driver
        attrs.update(self._pci_attributes(pci))
        if pci is not None:
            attrs.update(pci.standard_attributes())
        self._check_same_link(netdir, link)
        return Device(
            name=ident.name,
            kind=Kind.NIC,
            attributes=_publishable(ident.name, attrs),
            node=facts,
        )

    @staticmethod
    def _pci_attributes(pci: PciFunction | None) -> dict[str, AttrValue]:
        if pci is None:
            return {"isVf": False, "rdma": False}
        attrs: dict[str, AttrValue] = {}
        if pci.vendor:
            attrs["pciVendor"] = pci.vendor
        if pci.device:
            attrs["pciDevice"] = pci.device
        fn = pci.sysfs_path
        total = _read_int(fn / "sriov_totalvfs")
        if total is not None:
            attrs["sriovTotalVfs"] = total
            attrs["sriovNumVfs"] = _read_int(fn / "sriov_numvfs") or 0
        physfn = fn / "physfn"
        attrs["isVf"] = os.path.lexists(physfn)
        if attrs["isVf"]:
            try:
                pf_names = sorted(os.listdir(physfn / "net"))
            except FileNotFoundError:
                pf_names = []  # the PF has no netdev here (another namespace, or switchdev)
            except OSError as exc:
                raise NicUnreadable(f"listing {physfn / 'net'}: {exc.strerror or exc}") from exc
            if pf_names:
                attrs["pfName"] = pf_names[0]
        attrs["rdma"] = (fn / "infiniband").is_dir()
        return attrs


def _publishable(name: str, attrs: dict[str, AttrValue]) -> dict[str, AttrValue]:
    # The API server rejects the whole slice for one bad value; drop just that value.
    out: dict[str, AttrValue] = {}
    for key, value in attrs.items():
        if errs := attribute_value_errors(value):
            log.warning("nic %s: attribute %s left out: %s", name, key, "; ".join(errs))
            continue
        out[key] = value
    return out
