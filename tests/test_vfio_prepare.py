"""Prepare and unprepare of passthrough (VFIO) devices through the engine, on the simulated machine with
its kernel emulator running (real sysfs files, its real inotify thread): a GPU and a NIC VF bound to
vfio-pci and back, the CDI spec's VFIO nodes, the metadata KubeVirt reads, VfioConfig, the two forms of
one function kept apart, a busy GPU and a refusing kernel, and recovery from every state a crash can
leave (mid-bind, mid-restore, a reboot)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from agentkit import Node, claim, make_node, nic, restarted, result, write_claim, written_files
from handshakes import paused
from test_vfio import fake_proc

from agent import failpoints
from agent.claims import metadata
from agent.claims.allocation import config_api_version
from agent.claims.records import ClaimRecord, RecordState
from agent.claims.store import ClaimStore
from agent.engine.recovery import recover
from agent.host.vfio.bind import BindStep, StepKind, apply_step
from agent.host.vfio.errors import VfioError
from agent.host.vfio.pci import current_driver, current_override, iommu_group
from agent.host.vfio.sriov import NO_MAC, VfLink
from agent.hostprep.mig import nvml_of
from agent.inventory.passthrough import NicVariants
from agent.names import ClaimRef
from agent.sim.hardware import materialize
from agent.sim.kernel.emulator import KernelEmulator, WriteKind
from agent.sim.kernel.tree import SimTree
from agent.sim.profiles import BUILTIN, load_profile
from agent.sim.vflinks import SimVfLinks

GPU_BUS, GPU_GROUP = "0000:18:00.0", 100  # gpu-0 of dgx-h100
GPU_VARIANT = "gpu-0000-18-00-0-vfio"
VF_BUS = "0000:4b:00.1"  # VF 0 of the ConnectX-7
VF_VARIANT = "nic-0000-4b-00-1-vfio"
PF_IF = "ens75f0np0"  # the ConnectX-7 PF's interface
TENANT = VfLink("02:00:00:00:0e:01", 100, 2)  # what a previous tenant left on VF 0
UID = "2f1a0000-0000-4000-8000-000000000001"
UID2 = "2f1a0000-0000-4000-8000-000000000002"
DRIVER = "dra.example.com"


@dataclasses.dataclass
class VmNode:
    node: Node
    kernel: KernelEmulator
    tree: SimTree

    def driver(self, bdf: str) -> str | None:
        return current_driver(self.tree.sys, bdf)

    async def prepare(self, name: str, uid: str, device: str, request: str = "vm",
                      config: list[dict[str, Any]] | None = None) -> Any:
        write_claim(self.node.claims_dir, claim(name, uid, [result(device, request)], config=config or []))
        (res,) = (await self.node.engine.prepare([ClaimRef("default", name, uid)])).values()
        return res

    async def unprepare(self, name: str, uid: str) -> str:
        (err,) = (await self.node.engine.unprepare([ClaimRef("default", name, uid)])).values()
        return err


@pytest.fixture
async def vm(tmp_path: Path) -> AsyncIterator[VmNode]:
    node = await make_node(tmp_path)
    root = node.settings.state_dir / "nvml-sim"
    tree = SimTree(root)
    # The NIC VFs' passthrough variants, as NIC discovery finds them in (this machine's) sysfs.
    node.nic_source.devices = NicVariants().apply(tree.sys, [nic()])
    await node.inventory.scan(["nic"])
    with KernelEmulator(load_profile("dgx-h100"), root) as kernel:
        yield VmNode(node, kernel, tree)


def vfio_config(**fields: Any) -> list[dict[str, Any]]:
    return [{"source": "FromClaim", "requests": ["vm"], "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": config_api_version(DRIVER), "kind": "VfioConfig", **fields}}}]


def whole(vm: VmNode, uid: str) -> ClaimRecord:
    record = vm.node.engine.whole_record(uid)
    assert record is not None
    return record


def spec_of(vm: VmNode, uid: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((vm.node.settings.cdi_dir / f"{DRIVER}-claim_{uid}.json").read_text())
    return data


def kubevirt_device(vm: VmNode, uid: str, request: str = "vm") -> dict[str, Any]:
    """What KubeVirt 1.9 reads: the v1alpha1 object, exactly one device in the request."""
    stream = metadata.parse_stream(metadata.host_file(vm.node.settings.metadata_dir, uid, request).read_bytes())
    (obj,) = [o for o in stream if o["apiVersion"] == "metadata.resource.k8s.io/v1alpha1"]
    (req,) = obj["requests"]
    (device,) = req["devices"]
    return dict(device)


async def test_gpu_bound_to_vfio_gets_vfio_nodes_and_comes_back(vm: VmNode) -> None:
    before = written_files(vm.node.settings)
    res = await vm.prepare("vm-gpu", UID, GPU_VARIANT)
    assert res.error == ""
    assert vm.driver(GPU_BUS) == "vfio-pci" and current_override(vm.tree.sys, GPU_BUS) == "vfio-pci"
    (dev,) = spec_of(vm, UID)["devices"]
    nodes = dev["containerEdits"]["deviceNodes"]
    assert [n["path"] for n in nodes] == ["/dev/vfio/vfio", f"/dev/vfio/{GPU_GROUP}"]
    assert all(os.path.exists(n["hostPath"]) for n in nodes)
    assert "nvidia" not in json.dumps(spec_of(vm, UID))
    kv = kubevirt_device(vm, UID)
    assert kv["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": GPU_BUS}
    assert "mdevUUID" not in kv["attributes"]
    record = whole(vm, UID)
    assert record.state is RecordState.PREPARED and [b.device for b in record.bindings] == [GPU_VARIANT]
    assert (vm.node.settings.claims_state_dir / f"{UID}.rec").read_bytes().startswith(b"DRAREC 2 ")
    # A second prepare is answered from the record.
    assert (await vm.prepare("vm-gpu", UID, GPU_VARIANT)).devices == res.devices

    assert await vm.unprepare("vm-gpu", UID) == ""
    assert vm.driver(GPU_BUS) == "nvidia" and current_override(vm.tree.sys, GPU_BUS) is None
    assert not (vm.tree.dev / "vfio" / str(GPU_GROUP)).exists()
    assert written_files(vm.node.settings) == before
    assert vm.kernel.refusals == []


async def test_native_and_passthrough_forms_exclude_each_other(vm: VmNode) -> None:
    assert (await vm.prepare("pod-gpu", UID, "gpu-0", request="gpu")).error == ""
    res = await vm.prepare("vm-gpu", UID2, GPU_VARIANT)
    assert f"PCI function {GPU_BUS} is prepared as gpu-0 for claim default/pod-gpu ({UID})" in res.error
    assert vm.driver(GPU_BUS) == "nvidia" and UID2 not in vm.node.engine.records
    assert await vm.unprepare("pod-gpu", UID) == ""

    assert (await vm.prepare("vm-gpu", UID2, GPU_VARIANT)).error == ""
    res = await vm.prepare("pod-gpu", UID, "gpu-0", request="gpu")
    assert f"PCI function {GPU_BUS} is prepared as {GPU_VARIANT} for claim default/vm-gpu ({UID2})" in res.error
    assert await vm.unprepare("vm-gpu", UID2) == ""
    assert vm.driver(GPU_BUS) == "nvidia"


async def test_vf_with_mac_vlan_and_iommufd_gets_them_and_gives_back_the_tenants(vm: VmNode) -> None:
    links = SimVfLinks(vm.tree.root)
    links.set(PF_IF, 0, TENANT)  # what the VF's previous tenant left (its PF's driver keeps it)
    res = await vm.prepare("vm-net", UID, VF_VARIANT,
                           config=vfio_config(iommu="iommufd", mac="02:aa:bb:cc:dd:01", vlan=42))
    assert res.error == ""
    assert vm.driver(VF_BUS) == "vfio-pci"
    assert links.get(PF_IF, 0) == VfLink("02:aa:bb:cc:dd:01", 42, 0)
    assert links.get(PF_IF, 1) == VfLink()  # another VF is not touched
    (dev,) = spec_of(vm, UID)["devices"]
    assert [n["path"] for n in dev["containerEdits"]["deviceNodes"]] == ["/dev/iommu", "/dev/vfio/devices/vfio0"]
    kv = kubevirt_device(vm, UID)
    assert kv["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": VF_BUS}
    assert kv["networkData"] == {"hardwareAddress": "02:aa:bb:cc:dd:01"}
    assert await vm.unprepare("vm-net", UID) == ""
    assert vm.driver(VF_BUS) == "mlx5_core"
    assert links.get(PF_IF, 0) == TENANT


async def test_vlan_0_clears_the_previous_tenants_vlan(vm: VmNode) -> None:
    """`vlan: 0` is "none": the VM's VF must not stay on the VLAN the last tenant left; the MAC, not asked
    for, stays. Unprepare puts the tenant's VLAN back (the VF is as it was before the claim)."""
    links = SimVfLinks(vm.tree.root)
    links.set(PF_IF, 0, TENANT)
    assert (await vm.prepare("vm-net", UID, VF_VARIANT, config=vfio_config(vlan=0))).error == ""
    assert links.get(PF_IF, 0) == VfLink(TENANT.mac, 0, 0)
    (b,) = whole(vm, UID).bindings
    assert (b.vlan, b.previous) == (0, TENANT)
    # The record says "cleared", not "left": recovery after a reboot clears it again.
    materialize(load_profile("dgx-h100"), vm.tree.root, boot=True)
    links.set(PF_IF, 0, TENANT)
    assert UID in recover(restarted(vm.node)).records
    assert links.get(PF_IF, 0) == VfLink(TENANT.mac, 0, 0)
    assert await vm.unprepare("vm-net", UID) == ""
    assert links.get(PF_IF, 0) == TENANT


async def test_no_vlan_asked_leaves_the_vlan(vm: VmNode) -> None:
    links = SimVfLinks(vm.tree.root)
    links.set(PF_IF, 0, TENANT)
    assert (await vm.prepare("vm-net", UID, VF_VARIANT, config=vfio_config(mac="02:aa:bb:cc:dd:02"))).error == ""
    assert links.get(PF_IF, 0) == VfLink("02:aa:bb:cc:dd:02", TENANT.vlan, TENANT.qos)
    assert await vm.unprepare("vm-net", UID) == ""
    assert links.get(PF_IF, 0) == TENANT


async def test_a_vlan_only_claim_never_sends_the_pf_a_mac(vm: VmNode, monkeypatch: pytest.MonkeyPatch) -> None:
    """Some PF drivers refuse a MAC of zeros (what a VF without an administrative MAC has): a claim that sets
    only the VLAN sends the PF no MAC, at prepare or at unprepare."""
    links = vm.node.engine.passthrough.links
    assert isinstance(links, SimVfLinks)
    sent: list[bool] = []
    real = links.set

    def like_such_a_driver(ifname: str, vf: int, link: VfLink, *, with_mac: bool = True) -> None:
        sent.append(with_mac)
        if with_mac and link.mac == NO_MAC:
            raise VfioError(f"setting VF {vf} of {ifname}: Invalid argument")
        real(ifname, vf, link, with_mac=with_mac)

    monkeypatch.setattr(links, "set", like_such_a_driver)
    links.set(PF_IF, 0, VfLink(NO_MAC, 100, 0), with_mac=False)  # no MAC, the previous tenant's VLAN
    sent.clear()
    assert (await vm.prepare("vm-net", UID, VF_VARIANT, config=vfio_config(vlan=0))).error == ""
    assert links.get(PF_IF, 0) == VfLink(NO_MAC, 0, 0)
    assert await vm.unprepare("vm-net", UID) == ""
    assert links.get(PF_IF, 0) == VfLink(NO_MAC, 100, 0) and sent == [False, False]


async def test_the_vfs_settings_are_recorded_before_they_change(vm: VmNode) -> None:
    """Held just after the VF was set: the record on disk already says what the VF had before, so a crash
    here loses nothing; the next start (recovery) puts it back."""
    links = SimVfLinks(vm.tree.root)
    links.set(PF_IF, 0, TENANT)
    failpoints.configure("vf-after-set=pause")
    try:
        task = asyncio.create_task(vm.prepare("vm-net", UID, VF_VARIANT, config=vfio_config(vlan=0)))
        await paused("vf-after-set")
        assert links.get(PF_IF, 0) == VfLink(TENANT.mac, 0, 0)
        found = ClaimStore(vm.node.settings.claims_state_dir).read(UID)
        assert found is not None
        (b,) = found[0].bindings
        assert found[0].state is RecordState.BINDING and b.previous == TENANT and b.vlan == 0
        # The next step fails: the prepare rolls back, the VF's settings included.
        failpoints.configure("bind-before-step=raise")
        assert "bind-before-step" in (await task).error
    finally:
        failpoints.configure("")
    assert links.get(PF_IF, 0) == TENANT and vm.driver(VF_BUS) == "mlx5_core"
    assert UID not in vm.node.engine.records


async def test_recovery_puts_back_the_vf_of_a_prepare_killed_after_setting_it(vm: VmNode) -> None:
    """What a prepare killed just after setting the VF leaves: its intent record (with what the VF had) and
    the VF changed. The next start rolls it back, the VF's settings included."""
    links = SimVfLinks(vm.tree.root)
    links.set(PF_IF, 0, TENANT)
    engine = vm.node.engine
    write_claim(vm.node.claims_dir, claim("vm-net", UID, [result(VF_VARIANT, "vm")], config=vfio_config(vlan=0)))
    from agent.claims.allocation import parse_claim
    from agent.claims.records import PreparedDevice

    alloc = parse_claim(engine.claims.read("default", "vm-net"), ClaimRef("default", "vm-net", UID),  # type: ignore[attr-defined]
                        driver=DRIVER, pool=vm.node.settings.node_name, lookup=engine.inventory.get)
    bindings = await asyncio.to_thread(engine.passthrough.plan, alloc)  # blocking, as in a claim's thread
    engine.book.write(ClaimRecord(uid=UID, namespace="default", name="vm-net", state=RecordState.BINDING,
                                  bindings=bindings,
                                  devices=[PreparedDevice("vm", vm.node.settings.node_name, VF_VARIANT, ())]))
    links.set(PF_IF, 0, VfLink(TENANT.mac, 0, 0))
    assert recover(restarted(vm.node)).settled == [UID]
    assert links.get(PF_IF, 0) == TENANT and vm.driver(VF_BUS) == "mlx5_core"


@pytest.mark.parametrize("steps_done", [0, 2])
async def test_recovery_puts_back_the_vf_of_a_restore_that_stopped(vm: VmNode, steps_done: int) -> None:
    links = SimVfLinks(vm.tree.root)
    links.set(PF_IF, 0, TENANT)
    config = vfio_config(mac="02:aa:bb:cc:dd:03", vlan=5)
    assert (await vm.prepare("vm-net", UID, VF_VARIANT, config=config)).error == ""
    record = whole(vm, UID)
    vm.node.engine.book.write(dataclasses.replace(record, state=RecordState.RESTORING, files=[], dirs=[],
                                                  bindings=[dataclasses.replace(b, step=steps_done)
                                                            for b in record.bindings]))
    for step in record.bindings[0].plan.restore().steps[:steps_done]:
        apply_step(vm.tree.sys, step)
    assert recover(restarted(vm.node)).settled == [UID]
    assert links.get(PF_IF, 0) == TENANT and vm.driver(VF_BUS) == "mlx5_core"


async def test_the_crash_suites_vf_check_can_fail(vm: VmNode) -> None:
    """`make stress` counts a VF whose MAC or VLAN is not what the records say as an inconsistency."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "stress"))
    import stress

    links = SimVfLinks(vm.tree.root)
    for (pf, n), link in stress.TENANT_VF_LINKS.items():
        links.set(pf, n, link)
    assert stress.check_vf_links(vm.node.settings, {}) == []
    assert (await vm.prepare("vm-net", UID, VF_VARIANT, config=vfio_config(vlan=0))).error == ""
    records = vm.node.engine.store.load_all()[0]
    assert stress.check_vf_links(vm.node.settings, records) == []
    assert stress.check_vf_links(vm.node.settings, {}) != []
    links.set(PF_IF, 0, stress.TENANT_VF_LINKS[(PF_IF, 0)])  # the VLAN clear undone behind the agent's back
    assert stress.check_vf_links(vm.node.settings, records) != []
    assert await vm.unprepare("vm-net", UID) == ""
    assert stress.check_vf_links(vm.node.settings, {}) == []


@pytest.mark.parametrize(("fields", "message"), [
    ({"iommu": "vfio"}, "parameters.iommu must be 'legacy' or 'iommufd'"),
    ({"mac": "02:00:00:00:00:01"}, "parameters.mac: only a NIC function"),
    ({"vlan": 5000}, "parameters.vlan must be a VLAN ID from 0 (none) to 4094"),
    ({"mtu": 9000}, "parameters: unknown field(s) 'mtu'"),
])
async def test_vfio_config_errors_name_the_field(vm: VmNode, fields: dict[str, Any], message: str) -> None:
    res = await vm.prepare("vm-gpu", UID, GPU_VARIANT, config=vfio_config(**fields))
    assert f"status.allocation.devices.config[0].opaque.{message}" in res.error
    assert vm.driver(GPU_BUS) == "nvidia" and UID not in vm.node.engine.records


async def test_iommufd_without_dev_iommu_is_refused_before_any_write(vm: VmNode) -> None:
    (vm.tree.dev / "iommu").unlink()  # a kernel without CONFIG_IOMMUFD
    before = written_files(vm.node.settings)
    override = vm.tree.sys / "bus" / "pci" / "devices" / VF_BUS / "driver_override"
    untouched = override.stat().st_mtime_ns  # a plan's first step writes it
    res = await vm.prepare("vm-net", UID, VF_VARIANT, config=vfio_config(iommu="iommufd"))
    assert f"iommufd was asked for, but this host has no {vm.tree.dev / 'iommu'}" in res.error
    assert "ask for legacy" in res.error
    assert vm.driver(VF_BUS) == "mlx5_core" and current_override(vm.tree.sys, VF_BUS) is None
    assert written_files(vm.node.settings) == before and UID not in vm.node.engine.records
    assert override.stat().st_mtime_ns == untouched and vm.kernel.refusals == []


async def test_gpu_open_on_the_host_is_busy_and_retryable(vm: VmNode) -> None:
    # A process of the simulated machine (its /proc) holding the GPU open.
    fake_proc(vm.tree.root / "proc", 4343, "python3", {7: "/dev/nvidia0"})
    res = await vm.prepare("vm-gpu", UID, GPU_VARIANT)
    assert f"GPU {GPU_BUS} is in use on the host: pid 4343 (python3) fd 7 on /dev/nvidia0" in res.error
    assert vm.driver(GPU_BUS) == "nvidia" and UID not in vm.node.engine.records
    shutil.rmtree(vm.tree.root / "proc" / "4343")  # it closes the GPU
    assert (await vm.prepare("vm-gpu", UID, GPU_VARIANT)).error == ""
    assert await vm.unprepare("vm-gpu", UID) == ""


async def test_a_refused_bind_is_rolled_back(vm: VmNode) -> None:
    vm.node.engine.passthrough.timeout = 1.0
    before = written_files(vm.node.settings)
    vm.kernel.fail(WriteKind.BIND, GPU_BUS, reason="probe failed")
    res = await vm.prepare("vm-gpu", UID, GPU_VARIANT)
    assert f"bind {GPU_BUS} to vfio-pci: not done after 1s" in res.error
    assert vm.driver(GPU_BUS) == "nvidia" and current_override(vm.tree.sys, GPU_BUS) is None
    assert written_files(vm.node.settings) == before


# -- recovery: what a crash leaves, settled by the next start ----------------------------------------------

async def _crash_mid_bind(vm: VmNode, steps_done: int) -> None:
    """The state a prepare killed after its intent record and `steps_done` bind steps leaves."""
    engine = vm.node.engine
    write_claim(vm.node.claims_dir, claim("vm-gpu", UID, [result(GPU_VARIANT, "vm")]))
    from agent.claims.allocation import parse_claim
    from agent.claims.records import ClaimRecord, PreparedDevice

    alloc = parse_claim(engine.claims.read("default", "vm-gpu"), ClaimRef("default", "vm-gpu", UID),  # type: ignore[attr-defined]
                        driver=DRIVER, pool=vm.node.settings.node_name, lookup=engine.inventory.get)
    bindings = engine.passthrough.plan(alloc)
    intent = ClaimRecord(uid=UID, namespace="default", name="vm-gpu", state=RecordState.BINDING, bindings=bindings,
                         devices=[PreparedDevice("vm", vm.node.settings.node_name, GPU_VARIANT, ())])
    engine.book.write(intent)
    # Killed inside the agent's release of NVML (whose handles hold the GPU open, and would keep the
    # unbind waiting): a dead process holds nothing, so the steps it made are made without them.
    access = nvml_of(vm.node.inventory)()
    assert access is not None and access.gate is not None
    with access.gate.released("a prepare that is killed"):
        for step in bindings[0].plan.steps[:steps_done]:
            apply_step(vm.tree.sys, step)


@pytest.mark.parametrize("steps_done", [0, 1, 2, 3])
async def test_recovery_rolls_back_a_bind_that_stopped(vm: VmNode, steps_done: int) -> None:
    before = written_files(vm.node.settings)
    await _crash_mid_bind(vm, steps_done)
    report = recover(restarted(vm.node))
    assert report.settled == [UID] and UID not in report.records
    assert vm.driver(GPU_BUS) == "nvidia" and current_override(vm.tree.sys, GPU_BUS) is None
    assert written_files(vm.node.settings) == before


@pytest.mark.parametrize("steps_done", [0, 1, 2, 3])
async def test_recovery_finishes_a_restore_that_stopped(vm: VmNode, steps_done: int) -> None:
    before = written_files(vm.node.settings)
    assert (await vm.prepare("vm-gpu", UID, GPU_VARIANT)).error == ""
    record = whole(vm, UID)
    restoring = dataclasses.replace(record, state=RecordState.RESTORING, files=[], dirs=[],
                                    bindings=[dataclasses.replace(b, step=steps_done) for b in record.bindings])
    vm.node.engine.book.write(restoring)
    for step in record.bindings[0].plan.restore().steps[:steps_done]:
        apply_step(vm.tree.sys, step)
    report = recover(restarted(vm.node))
    assert report.settled == [UID]
    assert vm.driver(GPU_BUS) == "nvidia" and current_override(vm.tree.sys, GPU_BUS) is None
    assert written_files(vm.node.settings) == before


async def test_a_prepare_that_stopped_is_settled_by_the_next_prepare(vm: VmNode) -> None:
    await _crash_mid_bind(vm, 2)  # unbound from nvidia, not yet on vfio-pci
    res = await vm.prepare("vm-gpu", UID, GPU_VARIANT)
    assert res.error == "" and vm.driver(GPU_BUS) == "vfio-pci"
    assert whole(vm, UID).state is RecordState.PREPARED
    assert await vm.unprepare("vm-gpu", UID) == ""
    assert vm.driver(GPU_BUS) == "nvidia"


async def test_after_a_reboot_recovery_binds_again(vm: VmNode) -> None:
    assert (await vm.prepare("vm-gpu", UID, GPU_VARIANT)).error == ""
    boot = whole(vm, UID).bindings[0].boot_id
    materialize(load_profile("dgx-h100"), vm.tree.root, boot=True)  # the kernel forgot every binding
    assert vm.driver(GPU_BUS) == "nvidia" and vm.tree.boot_id.read_text().strip() != boot
    report = recover(restarted(vm.node))
    assert UID in report.records and report.repaired == []
    assert vm.driver(GPU_BUS) == "vfio-pci" and (vm.tree.dev / "vfio" / str(GPU_GROUP)).exists()
    found = ClaimStore(vm.node.settings.claims_state_dir).read(UID)
    assert found is not None
    assert found[0].bindings[0].boot_id == vm.tree.boot_id.read_text().strip()
    assert await vm.unprepare("vm-gpu", UID) == ""
    assert vm.driver(GPU_BUS) == "nvidia"


async def test_cli_vfio_status_and_devices_show_the_binding(vm: VmNode, capsys: pytest.CaptureFixture[str]) -> None:
    from agent.app import cli

    s = vm.node.settings
    flags = ["--nvml", "sim", "--state-dir", str(s.state_dir), "--nic-exclude", "*", "--offline", str(s.offline)]
    assert (await vm.prepare("vm-gpu", UID, GPU_VARIANT)).error == ""
    capsys.readouterr()
    assert cli.main(["vfio", "status", *flags]) == 0
    (row,) = capsys.readouterr().out.splitlines()[1:]
    assert row.split() == ["default/vm-gpu", "prepared", GPU_VARIANT, GPU_BUS, "target", str(GPU_GROUP), "legacy",
                           "nvidia", "vfio-pci"]
    assert await asyncio.to_thread(cli.main, ["devices", "-o", "json", *flags]) == 0  # it runs its own loop
    shown = {d["name"]: d for d in json.loads(capsys.readouterr().out)}
    assert shown[GPU_VARIANT]["pciFunction"] == {"driver": "vfio-pci", "iommuGroup": GPU_GROUP}
    assert shown["gpu-1"]["pciFunction"] == {"driver": "nvidia", "iommuGroup": 101}
    # Someone puts the GPU back behind the agent's back: status says so and fails.
    for step in whole(vm, UID).bindings[0].plan.restore().steps:
        apply_step(vm.tree.sys, step)
    assert cli.main(["vfio", "status", *flags]) == 1
    assert "nvidia (record says vfio-pci)" in capsys.readouterr().out


async def test_the_crash_suites_binding_check_can_fail(vm: VmNode) -> None:
    """`make stress` counts a function bound otherwise than the records say as an inconsistency."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "stress"))
    import stress

    settings = vm.node.settings
    assert stress.check_bindings(settings, {}) == []
    # Bound by hand. (The agent's NVML holds the GPU open, which keeps an unbind waiting in the driver:
    # let go of, as it lets go of it for a prepare.)
    access = nvml_of(vm.node.inventory)()
    assert access is not None and access.gate is not None
    with access.gate.released("bound by hand"):
        for step in (BindStep(StepKind.SET_OVERRIDE, GPU_BUS, "vfio-pci"), BindStep(StepKind.UNBIND, GPU_BUS, "nvidia"),
                     BindStep(StepKind.BIND, GPU_BUS, "vfio-pci")):
            apply_step(vm.tree.sys, step)
    assert stress.check_bindings(settings, {}) == [
        f"PCI function {GPU_BUS} is bound to vfio-pci (override vfio-pci), the records say nvidia (override None)"]
    # The same binding made by a prepare: its record says so. (Prepared now, it would record vfio-pci as the
    # driver to go back to, so the GPU goes back to nvidia first.)
    for step in (BindStep(StepKind.CLEAR_OVERRIDE, GPU_BUS), BindStep(StepKind.UNBIND, GPU_BUS, "vfio-pci"),
                 BindStep(StepKind.BIND, GPU_BUS, "nvidia")):
        apply_step(vm.tree.sys, step)
    assert (await vm.prepare("vm-gpu", UID, GPU_VARIANT)).error == ""
    assert stress.check_bindings(settings, vm.node.engine.store.load_all()[0]) == []
    assert stress.check_bindings(settings, {}) != []
    assert await vm.unprepare("vm-gpu", UID) == ""
    assert stress.check_bindings(settings, {}) == []


async def test_a_device_of_a_kind_prepare_does_not_know_is_refused_before_any_side_effect(
        tmp_path, monkeypatch) -> None:
    import dataclasses

    from agentkit import StaticSource

    from agent import kinds
    from agent.inventory import Inventory

    node = await make_node(tmp_path)
    gpu = node.inventory.get("gpu-0")
    assert gpu is not None
    # Every kind is preparable today: a kind whose traits say it is not stands in for one published ahead
    # of its prepare path.
    monkeypatch.setitem(kinds.TRAITS, gpu.kind, dataclasses.replace(gpu.kind.traits, preparable=False))
    future = dataclasses.replace(gpu, name="gpu-0-npu-0")
    node.engine.inventory = Inventory([StaticSource("npu", [future])])
    await node.engine.inventory.scan()
    before = written_files(node.settings)
    uid = "2f1a0000-0000-4000-8000-0000000000aa"
    write_claim(node.claims_dir, claim("npu", uid, [result(future.name, "gpu")]))
    (res,) = (await node.engine.prepare([ClaimRef("default", "npu", uid)])).values()
    assert "gpu-0-npu-0 cannot be prepared" in res.error and res.devices == []
    assert written_files(node.settings) == before


# -- what must stop a GPU from leaving its host driver, at prepare and after a reboot ------------------------

def sim_nvml(vm: VmNode) -> Any:
    access = nvml_of(vm.node.inventory)()
    assert access is not None
    return access.nvml


def set_persistence(vm: VmNode, on: bool) -> None:
    nv = sim_nvml(vm)
    nv.nvmlDeviceSetPersistenceMode(nv.nvmlDeviceGetHandleByPciBusId(GPU_BUS), int(on))


async def test_gpu_with_persistence_mode_on_is_busy_and_retryable(vm: VmNode) -> None:
    before = written_files(vm.node.settings)
    set_persistence(vm, True)
    res = await vm.prepare("vm-gpu", UID, GPU_VARIANT)
    assert f"GPU {GPU_BUS} has NVML persistence mode on" in res.error and "-pm 0" in res.error
    assert vm.driver(GPU_BUS) == "nvidia" and UID not in vm.node.engine.records
    assert written_files(vm.node.settings) == before
    set_persistence(vm, False)
    assert (await vm.prepare("vm-gpu", UID, GPU_VARIANT)).error == ""
    assert await vm.unprepare("vm-gpu", UID) == ""


@pytest.mark.parametrize("code", ["FUNCTION_NOT_FOUND", "NOT_SUPPORTED"])
async def test_persistence_mode_nvml_cannot_tell_does_not_refuse(vm: VmNode, code: str) -> None:
    # A library without the call (an older driver's, the stand-in) or a GPU without the feature.
    set_persistence(vm, True)
    sim_nvml(vm).inject_error(0, "nvmlDeviceGetPersistenceMode", code)
    assert (await vm.prepare("vm-gpu", UID, GPU_VARIANT)).error == ""
    assert vm.driver(GPU_BUS) == "vfio-pci"
    assert await vm.unprepare("vm-gpu", UID) == ""


async def _variant_alone(vm: VmNode) -> None:
    """The passthrough side sees only the variant: NVML does not list the GPU, nor does the driver's
    /proc list (its minor is unknown)."""
    from agentkit import StaticSource

    from agent.inventory import Inventory

    variant = vm.node.inventory.get(GPU_VARIANT)
    assert variant is not None
    inventory = Inventory([StaticSource("vfio", [variant])])
    await inventory.scan()
    vm.node.engine.passthrough.inventory = inventory
    shutil.rmtree(vm.tree.root / "proc" / "driver" / "nvidia" / "gpus" / GPU_BUS)


async def test_gpu_with_unknown_minor_is_refused_not_skipped(vm: VmNode) -> None:
    await _variant_alone(vm)
    res = await vm.prepare("vm-gpu", UID, GPU_VARIANT)
    assert f"GPU {GPU_BUS} is bound to nvidia but its device minor is not known" in res.error
    assert vm.driver(GPU_BUS) == "nvidia" and UID not in vm.node.engine.records


async def test_gpu_with_sriov_vfs_is_busy_even_with_unknown_minor(vm: VmNode) -> None:
    await _variant_alone(vm)
    (vm.tree.sys / "bus" / "pci" / "devices" / GPU_BUS / "sriov_numvfs").write_text("2\n")
    res = await vm.prepare("vm-gpu", UID, GPU_VARIANT)
    assert f"GPU {GPU_BUS} has 2 SR-IOV virtual functions enabled" in res.error
    assert vm.driver(GPU_BUS) == "nvidia" and UID not in vm.node.engine.records


@pytest.mark.parametrize("busy", ["open", "persistence"])
async def test_after_a_reboot_a_busy_gpu_drops_the_claim(vm: VmNode, busy: str) -> None:
    assert (await vm.prepare("vm-gpu", UID, GPU_VARIANT)).error == ""
    before_spec = spec_of(vm, UID)
    assert before_spec
    materialize(load_profile("dgx-h100"), vm.tree.root, boot=True)  # the kernel forgot every binding
    access = nvml_of(vm.node.inventory)()
    assert access is not None and access.gate is not None
    with access.gate.released("the new boot"):
        pass  # NVML of the new boot lists the GPU, back on nvidia
    if busy == "open":  # something of the new boot opened the GPU before the agent started
        fake_proc(vm.tree.root / "proc", 4343, "python3", {7: "/dev/nvidia0"})
    else:
        set_persistence(vm, True)
    report = recover(restarted(vm.node))
    assert report.dropped == [UID] and UID not in report.records
    assert vm.driver(GPU_BUS) == "nvidia" and current_override(vm.tree.sys, GPU_BUS) is None
    assert not (vm.node.settings.cdi_dir / f"{DRIVER}-claim_{UID}.json").exists()
    assert ClaimStore(vm.node.settings.claims_state_dir).read(UID) is None


def _renumbered(tmp_path: Path, **groups: int) -> Path:
    """dgx-h100 with GPU i in IOMMU group `groups[f"gpu{i}"]`."""
    raw = copy.deepcopy(BUILTIN["dgx-h100"])
    for key, group in groups.items():
        raw["gpus"][int(key[3:])]["iommuGroup"] = group
    path = tmp_path / "renumbered.json"
    path.write_text(json.dumps(raw))
    return path


async def test_after_a_reboot_that_renumbered_the_group_the_spec_names_the_new_group(
        vm: VmNode, tmp_path: Path) -> None:
    assert (await vm.prepare("vm-gpu", UID, GPU_VARIANT)).error == ""
    answer = whole(vm, UID).devices
    materialize(load_profile(str(_renumbered(tmp_path, gpu0=150))), vm.tree.root, boot=True)
    assert iommu_group(vm.tree.sys, GPU_BUS) == 150
    report = recover(restarted(vm.node))
    assert UID in report.records and report.dropped == []
    assert vm.driver(GPU_BUS) == "vfio-pci"
    (dev,) = spec_of(vm, UID)["devices"]
    nodes = dev["containerEdits"]["deviceNodes"]
    assert [n["path"] for n in nodes] == ["/dev/vfio/vfio", "/dev/vfio/150"]  # never the gone /dev/vfio/100
    assert all(os.path.exists(n["hostPath"]) for n in nodes)
    record = whole(vm, UID)
    assert record.bindings[0].plan.group == 150 and record.devices == answer  # the kubelet's answer is the same
    assert await vm.unprepare("vm-gpu", UID) == ""
    assert vm.driver(GPU_BUS) == "nvidia"


async def test_after_a_reboot_that_put_another_function_in_the_group_recovery_drops_the_claim(
        vm: VmNode, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    before = written_files(vm.node.settings)
    assert (await vm.prepare("vm-gpu", UID, GPU_VARIANT)).error == ""
    # GPU 1 (on its host driver) shares the group now: binding the recorded plan would not be viable.
    materialize(load_profile(str(_renumbered(tmp_path, gpu0=150, gpu1=150))), vm.tree.root, boot=True)
    report = recover(restarted(vm.node))
    assert report.dropped == [UID] and UID not in report.records
    assert f"PCI function {GPU_BUS} is " in caplog.text and f"it was in group {GPU_GROUP}" in caplog.text
    assert vm.driver(GPU_BUS) == "nvidia" and current_override(vm.tree.sys, GPU_BUS) is None
    assert written_files(vm.node.settings) == before  # no CDI spec naming /dev/vfio/100 is left
