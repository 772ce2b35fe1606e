"""The simulated machine's PCI tree (IOMMU groups, drivers, SR-IOV) and its kernel emulator, through real
files and the emulator's real inotify thread: what a write to sysfs does, as the agent would see it on a host."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.config import NvmlMode, Settings
from agent.inventory.gpus import GpuSource
from agent.sim.hardware import materialize
from agent.sim.kernel import mdev as simmdev
from agent.sim.kernel.emulator import KernelEmulator, WriteKind, unbind_hold_from_env
from agent.sim.kernel.tree import SimTree
from agent.sim.nvmlopen import open_sim_nvml
from agent.sim.profiles import ProfileError, SimProfile, load_profile, parse_profile

GPU = "0000:18:00.0"
AUDIO_GPU, AUDIO = "0000:2a:00.0", "0000:2a:00.1"
SHARED = ("0000:3a:00.0", "0000:3b:00.0")
BRIDGED_GPU = "0000:5d:00.0"
PF = "0000:4b:00.0"


TEST_MACHINE: dict[str, Any] = {
    "defaults": {"name": "NVIDIA H100 80GB HBM3", "memoryTotal": 85520809984, "pciDeviceId": "0x233010de"},
    "gpus": [
        {"busId": GPU},
        {"busId": AUDIO_GPU, "audio": True},
        {"busId": SHARED[0], "iommuGroup": 7},
        {"busId": SHARED[1], "iommuGroup": 7},
        {"busId": BRIDGED_GPU, "bridgeInGroup": True},
    ],
    "nics": [{"busId": PF, "interface": "ens75f0np0", "totalVfs": 4, "numVfs": 2}],
}


def machine_profile() -> SimProfile:
    return parse_profile("test", TEST_MACHINE)


def wait_for(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the simulated kernel did not act in time"
        time.sleep(0.01)


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[tuple[SimTree, KernelEmulator]]:
    profile = machine_profile()
    materialize(profile, tmp_path)
    with KernelEmulator(profile, tmp_path) as kernel:
        yield SimTree(tmp_path), kernel


def text(path: Path) -> str:
    return path.read_text()


# -- the machine on disk -------------------------------------------------------------------------

def test_dgx_h100_every_gpu_alone_in_its_group_and_the_vfio_files(tmp_path: Path) -> None:
    profile = load_profile("dgx-h100")
    materialize(profile, tmp_path)
    tree = SimTree(tmp_path)
    groups = {tree.group_of(g.bus_id) for g in profile.gpus}
    assert len(groups) == 8 and None not in groups
    for gpu in profile.gpus:
        group = tree.group_of(gpu.bus_id)
        assert group is not None and tree.group_members(group) == [gpu.bus_id]
        # Both directions of the kernel's links lead to the same function directory.
        member = tree.groups / str(group) / "devices" / gpu.bus_id
        assert os.path.realpath(member) == os.path.realpath(tree.devices / gpu.bus_id)
        assert tree.driver_of(gpu.bus_id) == "nvidia"
        assert text(tree.devices / gpu.bus_id / "driver_override") == "(null)\n"
    for driver in ("nvidia", "vfio-pci", "snd_hda_intel"):
        for command in ("bind", "unbind", "new_id"):
            assert text(tree.drivers / driver / command) == ""
    assert (tree.pci / "drivers_probe").is_file()
    assert (tmp_path / "dev" / "vfio" / "vfio").exists() and (tmp_path / "dev" / "iommu").exists()
    assert (tree.sys / "module" / "vfio_pci").is_dir()
    assert os.path.basename(os.readlink(tree.drivers / "vfio-pci" / "module")) == "vfio_pci"


def test_sriov_nic_pf_and_vfs(tmp_path: Path) -> None:
    profile = machine_profile()
    materialize(profile, tmp_path)
    tree = SimTree(tmp_path)
    pf = tree.devices / PF
    assert (text(pf / "sriov_totalvfs"), text(pf / "sriov_numvfs")) == ("4\n", "2\n")
    vfs = [os.path.basename(os.readlink(pf / f"virtfn{n}")) for n in range(2)]
    assert vfs == ["0000:4b:00.1", "0000:4b:00.2"] and not (pf / "virtfn2").exists()
    for n, vf in enumerate(vfs):
        assert os.path.basename(os.readlink(tree.devices / vf / "physfn")) == PF
        assert tree.driver_of(vf) == "mlx5_core"
        assert text(tree.devices / vf / "net" / f"ens75f0np0v{n}" / "address") == profile.nics[0].mac(n) + "\n"
        # Each VF alone in its group (ACS), apart from the PF's.
        assert tree.group_members(tree.group_of(vf) or -1) == [vf]
    assert tree.group_members(tree.group_of(PF) or -1) == [PF]


def test_test_profile_groups(tmp_path: Path) -> None:
    materialize(machine_profile(), tmp_path)
    tree = SimTree(tmp_path)
    assert tree.group_members(tree.group_of(AUDIO_GPU) or -1) == [AUDIO_GPU, AUDIO]
    assert tree.driver_of(AUDIO) == "snd_hda_intel" and tree.device_class(AUDIO) == 0x040300
    assert tree.group_of(SHARED[0]) == tree.group_of(SHARED[1]) == 7
    assert tree.group_members(7) == list(SHARED)
    port = os.path.basename(os.path.dirname(tree.function(BRIDGED_GPU)))
    assert tree.group_members(tree.group_of(BRIDGED_GPU) or -1) == sorted([port, BRIDGED_GPU])
    assert tree.driver_of(port) == "pcieport"


def test_profile_rejects_accidental_group_sharing() -> None:
    raw = {**TEST_MACHINE, "gpus": [{"busId": GPU, "iommuGroup": 101}, {"busId": AUDIO_GPU}]}
    with pytest.raises(ProfileError, match=r"gpus\[1\]: its automatic IOMMU group 101"):
        parse_profile("bad", raw)
    with pytest.raises(ProfileError, match="numVfs"):
        parse_profile("bad", {**TEST_MACHINE, "nics": [{"busId": PF, "totalVfs": 1, "numVfs": 2}]})


def test_hgx_16_has_16_gpus_in_16_groups(tmp_path: Path) -> None:
    settings = Settings(node_name="node-a", nvml=NvmlMode.parse("sim:hgx-16"), state_dir=tmp_path / "state")
    source = GpuSource(settings, opener=open_sim_nvml)
    source.open()
    try:
        result = source.scan()
    finally:
        source.close()
    gpus = [d for d in result.devices if d.kind == "gpu"]
    assert len(gpus) == 16
    tree = SimTree(source.sysfs_root.parent)
    bus_ids = [str(d.attributes["resource.kubernetes.io/pciBusID"]) for d in gpus]
    groups = {tree.group_of(b) for b in bus_ids}
    assert len(groups) == 16 and None not in groups
    assert all(tree.group_members(tree.group_of(b) or -1) == [b] for b in bus_ids)
    assert {d.attributes.get("resource.kubernetes.io/numaNode") for d in gpus} == {0, 1}


def test_materialize_again_keeps_the_kernels_state_and_a_boot_resets_it(tmp_path: Path) -> None:
    profile = machine_profile()
    materialize(profile, tmp_path)
    tree = SimTree(tmp_path)
    boot = text(tree.boot_id)
    tree.unbind(GPU)
    tree.set_override(GPU, "vfio-pci")
    tree.bind(GPU, "vfio-pci")
    tree.add_vfio_nodes(GPU, 100, cdevs=True)
    materialize(profile, tmp_path)  # an agent restart: the host kept its bindings
    assert tree.driver_of(GPU) == "vfio-pci" and tree.override_of(GPU) == "vfio-pci"
    assert (tmp_path / "dev" / "vfio" / "100").exists() and text(tree.boot_id) == boot
    materialize(profile, tmp_path, boot=True)  # a reboot: the kernel forgot them
    assert tree.driver_of(GPU) == "nvidia" and text(tree.devices / GPU / "driver_override") == "(null)\n"
    assert not (tmp_path / "dev" / "vfio" / "100").exists() and tree.vfio_cdev_of(GPU) is None
    assert not (tree.drivers / "vfio-pci" / GPU).exists() and text(tree.boot_id) != boot


# -- the kernel emulator -------------------------------------------------------------------------

def test_override_unbind_bind_as_the_kernel(machine: tuple[SimTree, KernelEmulator]) -> None:
    tree, kernel = machine
    override = tree.devices / GPU / "driver_override"
    override.write_text("vfio-pci")
    wait_for(lambda: text(override) == "vfio-pci\n")
    (tree.drivers / "nvidia" / "unbind").write_text(GPU)
    wait_for(lambda: tree.driver_of(GPU) is None)
    assert not (tree.drivers / "nvidia" / GPU).exists()
    assert text(tree.drivers / "nvidia" / "unbind") == ""  # the command file reads back empty
    assert text(override) == "vfio-pci\n"  # an unbind leaves the override, as the kernel does
    # With an override only that driver may bind.
    (tree.drivers / "nvidia" / "bind").write_text(GPU)
    wait_for(lambda: len(kernel.refusals) == 1)
    assert tree.driver_of(GPU) is None and "driver_override is vfio-pci" in str(kernel.refusals[0])
    (tree.pci / "drivers_probe").write_text(GPU)
    wait_for(lambda: tree.driver_of(GPU) == "vfio-pci")
    assert os.path.realpath(tree.drivers / "vfio-pci" / GPU) == str(tree.function(GPU))
    assert (tree.dev / "vfio" / "100").exists()
    cdev = tree.vfio_cdev_of(GPU)
    assert cdev == "vfio0" and (tree.dev / "vfio" / "devices" / cdev).exists()
    assert text(tree.function(GPU) / "vfio-dev" / cdev / "dev") == "242:0\n"
    # Back: clear the override (shown as "(null)"), leave vfio-pci, probe picks the native driver.
    override.write_text("\n")
    wait_for(lambda: text(override) == "(null)\n")
    (tree.drivers / "vfio-pci" / "unbind").write_text(GPU)
    wait_for(lambda: tree.driver_of(GPU) is None)
    assert not (tree.dev / "vfio" / "100").exists() and not (tree.dev / "vfio" / "devices" / "vfio0").exists()
    (tree.pci / "drivers_probe").write_text(GPU)
    wait_for(lambda: tree.driver_of(GPU) == "nvidia")
    assert len(kernel.refusals) == 1


def test_vfio_bind_refused_while_a_group_member_is_on_a_host_driver(
        machine: tuple[SimTree, KernelEmulator]) -> None:
    tree, kernel = machine
    (tree.devices / AUDIO_GPU / "driver_override").write_text("vfio-pci")
    (tree.drivers / "nvidia" / "unbind").write_text(AUDIO_GPU)
    wait_for(lambda: tree.driver_of(AUDIO_GPU) is None)
    (tree.drivers / "vfio-pci" / "bind").write_text(AUDIO_GPU)
    wait_for(lambda: bool(kernel.refusals))
    assert tree.driver_of(AUDIO_GPU) is None  # refused: nothing changed
    reason = str(kernel.refusals[0])
    assert f"member {AUDIO} is bound to host driver snd_hda_intel" in reason
    assert reason in text(tree.kernel_log)
    group = tree.group_of(AUDIO_GPU)
    assert not (tree.dev / "vfio" / str(group)).exists()
    # With the audio function off its driver too, the group goes to vfio-pci; the group node stays
    # until the last of its functions leaves vfio-pci.
    (tree.devices / AUDIO / "driver_override").write_text("vfio-pci")
    (tree.drivers / "snd_hda_intel" / "unbind").write_text(AUDIO)
    wait_for(lambda: tree.driver_of(AUDIO) is None)
    for bdf in (AUDIO_GPU, AUDIO):
        (tree.drivers / "vfio-pci" / "bind").write_text(bdf)
        wait_for(lambda b=bdf: tree.driver_of(b) == "vfio-pci")  # type: ignore[misc]
    (tree.drivers / "vfio-pci" / "unbind").write_text(AUDIO_GPU)
    wait_for(lambda: tree.driver_of(AUDIO_GPU) is None)
    assert (tree.dev / "vfio" / str(group)).exists()
    (tree.drivers / "vfio-pci" / "unbind").write_text(AUDIO)
    wait_for(lambda: not (tree.dev / "vfio" / str(group)).exists())


def test_bridge_in_group_does_not_block(machine: tuple[SimTree, KernelEmulator]) -> None:
    tree, kernel = machine
    (tree.devices / BRIDGED_GPU / "driver_override").write_text("vfio-pci")
    (tree.drivers / "nvidia" / "unbind").write_text(BRIDGED_GPU)
    wait_for(lambda: tree.driver_of(BRIDGED_GPU) is None)
    (tree.pci / "drivers_probe").write_text(BRIDGED_GPU)
    wait_for(lambda: tree.driver_of(BRIDGED_GPU) == "vfio-pci")
    assert kernel.refusals == []


def test_vf_loses_its_netdev_on_vfio_and_new_id_probes(machine: tuple[SimTree, KernelEmulator]) -> None:
    tree, kernel = machine
    vf = "0000:4b:00.1"
    (tree.drivers / "mlx5_core" / "unbind").write_text(vf)
    wait_for(lambda: tree.driver_of(vf) is None)
    assert not (tree.function(vf) / "net").exists()
    # No override: vfio-pci matches only once told the VF's vendor and device (and then probes it).
    (tree.drivers / "vfio-pci" / "bind").write_text(vf)
    wait_for(lambda: bool(kernel.refusals))
    assert "does not match" in str(kernel.refusals[0])
    (tree.drivers / "vfio-pci" / "new_id").write_text("15b3 101e")
    wait_for(lambda: tree.driver_of(vf) == "vfio-pci")
    assert tree.driver_of("0000:4b:00.2") == "mlx5_core"  # bound ones are left alone
    (tree.drivers / "vfio-pci" / "remove_id").write_text("15b3 101e")
    (tree.drivers / "vfio-pci" / "unbind").write_text(vf)
    wait_for(lambda: tree.driver_of(vf) is None)
    (tree.pci / "drivers_probe").write_text(vf)
    wait_for(lambda: tree.driver_of(vf) == "mlx5_core")
    assert (tree.function(vf) / "net" / "ens75f0np0v0" / "address").is_file()


def test_slow_and_failing_writes(machine: tuple[SimTree, KernelEmulator]) -> None:
    tree, kernel = machine
    kernel.delay = 0.3
    kernel.fail(WriteKind.UNBIND, GPU, reason="device is resetting")
    (tree.drivers / "nvidia" / "unbind").write_text(GPU)
    wait_for(lambda: bool(kernel.refusals))
    assert tree.driver_of(GPU) == "nvidia" and "device is resetting" in str(kernel.refusals[0])
    start = time.monotonic()
    (tree.drivers / "nvidia" / "unbind").write_text(GPU)  # the fault was for one write
    wait_for(lambda: tree.driver_of(GPU) is None)
    assert time.monotonic() - start >= 0.3  # the delay is a floor, not a performance bound
    # A refused override write leaves the value it had.
    kernel.delay = 0
    kernel.fail(WriteKind.OVERRIDE, GPU)
    (tree.devices / GPU / "driver_override").write_text("vfio-pci")
    wait_for(lambda: len(kernel.refusals) == 2)
    wait_for(lambda: text(tree.devices / GPU / "driver_override") == "(null)\n")


def test_a_slow_driver_remove_holds_that_function_alone(machine: tuple[SimTree, KernelEmulator]) -> None:
    tree, kernel = machine
    let_go, holding = threading.Event(), threading.Event()

    def hold(bdf: str) -> None:
        if bdf == GPU:
            holding.set()
            assert let_go.wait(30)

    kernel.unbind_hold = hold
    (tree.drivers / "nvidia" / "unbind").write_text(GPU)
    assert holding.wait(30)
    # Other functions' unbinds and binds go on meanwhile; the held one shows only once its driver let go.
    (tree.drivers / "nvidia" / "unbind").write_text(AUDIO_GPU)
    wait_for(lambda: tree.driver_of(AUDIO_GPU) is None)
    (tree.drivers / "nvidia" / "bind").write_text(AUDIO_GPU)
    wait_for(lambda: tree.driver_of(AUDIO_GPU) == "nvidia")
    (tree.drivers / "nvidia" / "unbind").write_text(GPU)  # written again while held: one remove, as before
    wait_for(lambda: text(tree.drivers / "nvidia" / "unbind") == "")  # taken
    assert tree.driver_of(GPU) == "nvidia" and kernel.refusals == []
    let_go.set()
    wait_for(lambda: tree.driver_of(GPU) is None)
    assert f"unbind nvidia {GPU}: the driver's remove is slow" in text(tree.kernel_log)


def test_the_unbind_delay_comes_from_the_environment() -> None:
    assert unbind_hold_from_env({}) is None and unbind_hold_from_env({"DRA_SIM_UNBIND_DELAY": "0"}) is None
    assert unbind_hold_from_env({"DRA_SIM_UNBIND_DELAY": "2"}) is not None
    with pytest.raises(ValueError, match="DRA_SIM_UNBIND_DELAY"):
        unbind_hold_from_env({"DRA_SIM_UNBIND_DELAY": "two"})


def test_an_nvidia_unbind_waits_while_the_gpu_is_open(machine: tuple[SimTree, KernelEmulator]) -> None:
    tree, kernel = machine
    # Another process holds the GPU's node (O_PATH: the simulated node has no driver behind it).
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys; fd = os.open(sys.argv[1], os.O_PATH); "
                               "print('holding', flush=True); sys.stdin.read()", str(tree.dev / "nvidia0")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        (tree.drivers / "nvidia" / "unbind").write_text(GPU)
        wait_for(lambda: tree.kernel_log.is_file() and "waits until the GPU is closed" in text(tree.kernel_log))
        assert f"pid {holder.pid} (python" in text(tree.kernel_log)
        assert tree.driver_of(GPU) == "nvidia" and kernel.refusals == []
        # Other functions' writes go on meanwhile.
        (tree.drivers / "nvidia" / "unbind").write_text(AUDIO_GPU)
        wait_for(lambda: tree.driver_of(AUDIO_GPU) is None)
        assert tree.driver_of(GPU) == "nvidia"
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
    wait_for(lambda: tree.driver_of(GPU) is None)  # carried out once the last holder is gone
    assert f"unbind nvidia {GPU}: done, the GPU was closed" in text(tree.kernel_log)


def test_writes_made_while_the_emulator_was_down_apply_at_start(tmp_path: Path) -> None:
    profile = machine_profile()
    materialize(profile, tmp_path)
    tree = SimTree(tmp_path)
    (tree.drivers / "nvidia" / "unbind").write_text(GPU)
    with KernelEmulator(profile, tmp_path):
        wait_for(lambda: tree.driver_of(GPU) is None)
        assert text(tree.drivers / "nvidia" / "unbind") == ""


# -- mediated devices (vGPU) -------------------------------------------------------------------------

def test_gpus_offer_vgpu_types_and_the_nic_none(tmp_path: Path) -> None:
    profile = load_profile("dgx-h100")
    materialize(profile, tmp_path)
    simmdev.materialize(profile, tmp_path)
    tree = SimTree(tmp_path)
    # Each GPU lists its types itself, but the one with SR-IOV VFs, whose VFs list them (and it none).
    parents = [g.bus_id for g in profile.gpus if not g.vgpu_vfs]
    parents += [g.vf_bus_id(n) for g in profile.gpus for n in range(g.vgpu_vfs)]
    assert sorted(os.listdir(tree.sys / "class" / "mdev_bus")) == sorted(parents) and len(parents) == 7 + 20
    assert not (tree.devices / "0000:db:00.0" / "mdev_supported_types").exists()
    types = tree.devices / "0000:18:00.0" / "mdev_supported_types"
    assert len(os.listdir(types)) == 6
    one = types / "nvidia-1021"
    assert (text(one / "name"), text(one / "device_api"), text(one / "available_instances")) == \
        ("GRID H100-4C\n", "vfio-pci\n", "20\n")
    assert "framebuffer=4096M" in text(one / "description") and "max_instance=20" in text(one / "description")
    assert text(types / "nvidia-1026" / "name") == "GRID H100-80C\n"
    assert not (tree.devices / "0000:4b:00.0" / "mdev_supported_types").exists()


def test_mdev_create_and_remove_as_the_host_driver(tmp_path: Path) -> None:
    profile = machine_profile()
    materialize(profile, tmp_path)
    simmdev.materialize(profile, tmp_path)
    tree = SimTree(tmp_path)
    types = tree.devices / GPU / "mdev_supported_types"
    a, b, c = (str(uuid.uuid4()) for _ in range(3))
    with KernelEmulator(profile, tmp_path) as kernel:
        (types / "nvidia-1023" / "create").write_text(a)
        mdev_dir = tree.sys / "bus" / "mdev" / "devices" / a
        wait_for(mdev_dir.exists)
        assert os.path.basename(os.readlink(mdev_dir / "mdev_type")) == "nvidia-1023"
        assert (mdev_dir / "remove").is_file() and text(types / "nvidia-1023" / "create") == ""
        group = int(os.path.basename(os.readlink(mdev_dir / "iommu_group")))
        assert (tree.dev / "vfio" / str(group)).exists() and tree.group_members(group) == [a]
        # One type per GPU: the type in use counts down, every other type offers none.
        assert text(types / "nvidia-1023" / "available_instances") == "7\n"
        assert {text(types / t / "available_instances") for t in os.listdir(types) if t != "nvidia-1023"} == {"0\n"}
        (types / "nvidia-1021" / "create").write_text(b)
        wait_for(lambda: len(kernel.refusals) == 1)
        assert "no instance of nvidia-1021" in str(kernel.refusals[0]) and not (types.parent / b).exists()
        # The parent cannot leave its driver while it has mediated devices.
        (tree.drivers / "nvidia" / "unbind").write_text(GPU)
        wait_for(lambda: len(kernel.refusals) == 2)
        assert tree.driver_of(GPU) == "nvidia" and "mediated devices" in str(kernel.refusals[1])
        (mdev_dir / "remove").write_text("1")
        wait_for(lambda: not os.path.lexists(mdev_dir))
        assert not (types.parent / a).exists() and not (tree.dev / "vfio" / str(group)).exists()
        assert text(types / "nvidia-1021" / "available_instances") == "20\n"
        # Not on its host driver: no creation.
        (tree.drivers / "nvidia" / "unbind").write_text(GPU)
        wait_for(lambda: tree.driver_of(GPU) is None)
        (types / "nvidia-1021" / "create").write_text(c)
        wait_for(lambda: len(kernel.refusals) == 3)
        assert "bound to no driver" in str(kernel.refusals[2]) and not (types.parent / c).exists()


def test_mdevs_survive_a_rewrite_of_the_machine_and_a_boot_forgets_them(tmp_path: Path) -> None:
    profile = machine_profile()
    materialize(profile, tmp_path)
    simmdev.materialize(profile, tmp_path)
    tree = SimTree(tmp_path)
    u = str(uuid.uuid4())
    (tree.devices / GPU / "mdev_supported_types" / "nvidia-1024" / "create").write_text(u)
    with KernelEmulator(profile, tmp_path):  # a write made while no emulator ran applies at its start
        wait_for((tree.sys / "bus" / "mdev" / "devices" / u).exists)
    group = int(os.path.basename(os.readlink(tree.sys / "bus" / "mdev" / "devices" / u / "iommu_group")))
    materialize(profile, tmp_path)  # an agent restart: the PCI tree's rewrite drops groups it does not know
    simmdev.materialize(profile, tmp_path)
    assert tree.group_members(group) == [u] and (tree.dev / "vfio" / str(group)).exists()
    materialize(profile, tmp_path, boot=True)
    simmdev.materialize(profile, tmp_path, boot=True)
    assert not os.path.lexists(tree.sys / "bus" / "mdev" / "devices" / u)
    assert not (tree.devices / GPU / u).exists() and tree.group_members(group) == []
    assert text(tree.devices / GPU / "mdev_supported_types" / "nvidia-1024" / "available_instances") == "4\n"
