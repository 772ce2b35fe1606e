"""The host-side VFIO library against the simulated machine and its kernel emulator (real files, the real
watchdog thread): binding to vfio-pci and back, group rules, slow and failing kernels, crash at every
step, the in-use checks and the device nodes."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import need_root
from test_simkernel import AUDIO, AUDIO_GPU, BRIDGED_GPU, GPU, SHARED, machine_profile

from agent.host.pci import pci_function
from agent.host.vfio.bind import BindPlan, BindStep, StepKind, apply_plan, apply_step, plan_bind
from agent.host.vfio.errors import DeviceBusy, GroupNotViable, StepFailed, VfioError
from agent.host.vfio.inuse import check_gpu_idle, open_holders
from agent.host.vfio.nodes import IommuBackend, vfio_device_nodes
from agent.host.vfio.pci import Role, passthrough_set, read_function
from agent.host.vfio.report import report
from agent.model import DeviceNode
from agent.sim.hardware import materialize
from agent.sim.kernel.emulator import KernelEmulator, WriteKind
from agent.sim.kernel.tree import SimTree


class Machine:
    def __init__(self, root: Path, kernel: KernelEmulator) -> None:
        self.tree = SimTree(root)
        self.kernel = kernel
        self.sys = root / "sys"
        self.dev = root / "dev"

    def state(self, *bdfs: str) -> list[tuple[str | None, str | None]]:
        """(driver, override) of each function, as the library reads them."""
        return [(f.driver, f.override) for f in (read_function(self.sys, b) for b in bdfs)]


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[Machine]:
    profile = machine_profile()
    materialize(profile, tmp_path)
    with KernelEmulator(profile, tmp_path) as kernel:
        yield Machine(tmp_path, kernel)


def test_gpu_to_vfio_and_back(machine: Machine) -> None:
    plan = plan_bind(machine.sys, GPU)
    assert [str(s) for s in plan.steps] == [
        f"set driver_override of {GPU} to vfio-pci", f"unbind {GPU} from nvidia", f"bind {GPU} to vfio-pci"]
    assert BindPlan.from_wire(plan.wire()) == plan
    apply_plan(machine.sys, plan)
    assert machine.state(GPU) == [("vfio-pci", "vfio-pci")]
    group = plan.group
    assert (machine.dev / "vfio" / str(group)).exists()
    legacy = vfio_device_nodes(machine.sys, machine.dev, [GPU])
    assert legacy == (DeviceNode("/dev/vfio/vfio", str(machine.dev / "vfio" / "vfio")),
                      DeviceNode(f"/dev/vfio/{group}", str(machine.dev / "vfio" / str(group))))
    iommufd = vfio_device_nodes(machine.sys, machine.dev, [GPU], IommuBackend.IOMMUFD)
    assert [n.path for n in iommufd] == ["/dev/iommu", "/dev/vfio/devices/vfio0"]
    apply_plan(machine.sys, plan.restore())
    assert machine.state(GPU) == [("nvidia", None)]
    assert (machine.tree.devices / GPU / "driver_override").read_text() == "(null)\n"
    assert not (machine.dev / "vfio" / str(group)).exists()
    with pytest.raises(VfioError, match="not bound to vfio-pci"):
        vfio_device_nodes(machine.sys, machine.dev, [GPU])
    assert machine.kernel.refusals == []


def test_gpu_with_its_audio_function_go_together(machine: Machine) -> None:
    group = passthrough_set(machine.sys, AUDIO_GPU)
    assert [(m.function.bdf, m.role) for m in group.members] == [(AUDIO_GPU, Role.TARGET), (AUDIO, Role.COMPANION)]
    plan = plan_bind(machine.sys, AUDIO_GPU)
    assert [f.bdf for f in plan.functions] == [AUDIO_GPU, AUDIO]
    apply_plan(machine.sys, plan)
    assert machine.state(AUDIO_GPU, AUDIO) == [("vfio-pci", "vfio-pci")] * 2
    assert len(vfio_device_nodes(machine.sys, machine.dev, [AUDIO_GPU, AUDIO])) == 2  # one group node
    apply_plan(machine.sys, plan.restore())
    assert machine.state(AUDIO_GPU, AUDIO) == [("nvidia", None), ("snd_hda_intel", None)]
    assert machine.kernel.refusals == []


def test_group_shared_by_two_gpus_is_refused_before_any_write(machine: Machine) -> None:
    with pytest.raises(GroupNotViable) as err:
        plan_bind(machine.sys, SHARED[0])
    assert str(err.value) == (
        f"PCI function {SHARED[0]} cannot be passed through: its IOMMU group 7 also holds {SHARED[1]} "
        "(class 0x030200, 0x10de:2330) bound to nvidia, which the host uses and VFIO would have to take too")
    assert machine.state(*SHARED) == [("nvidia", None)] * 2
    # Once the neighbour is off the host driver, the group can go.
    apply_step(machine.sys, BindStep(StepKind.UNBIND, SHARED[1], "nvidia"))
    assert [m.role for m in passthrough_set(machine.sys, SHARED[0]).members] == [Role.TARGET, Role.UNBOUND]


def test_bridge_in_the_group_stays_on_its_driver(machine: Machine) -> None:
    roles = {m.function.bdf: m.role for m in passthrough_set(machine.sys, BRIDGED_GPU).members}
    port = next(b for b, r in roles.items() if r is Role.BRIDGE)
    plan = plan_bind(machine.sys, BRIDGED_GPU)
    apply_plan(machine.sys, plan)
    assert machine.state(BRIDGED_GPU, port) == [("vfio-pci", "vfio-pci"), ("pcieport", None)]


def test_a_slow_kernel_is_waited_for(machine: Machine) -> None:
    machine.kernel.delay = 0.25
    plan = plan_bind(machine.sys, AUDIO_GPU)
    apply_plan(machine.sys, plan, timeout=30)
    assert machine.state(AUDIO_GPU, AUDIO) == [("vfio-pci", "vfio-pci")] * 2
    apply_plan(machine.sys, plan.restore(), timeout=30)
    assert machine.state(AUDIO_GPU, AUDIO) == [("nvidia", None), ("snd_hda_intel", None)]


def test_a_refused_bind_is_a_precise_error_and_a_retry_converges(machine: Machine) -> None:
    plan = plan_bind(machine.sys, GPU)
    machine.kernel.fail(WriteKind.BIND, GPU, reason="vfio-pci probe failed: -22")
    done: list[int] = []
    with pytest.raises(StepFailed) as err:
        apply_plan(machine.sys, plan, timeout=1.5, before_step=lambda k, _: done.append(k))
    assert str(err.value) == (f"bind {GPU} to vfio-pci: not done after 1.5s: the function is unbound, "
                              "driver_override vfio-pci (the kernel log says why it refused)")
    assert err.value.retryable
    assert machine.state(GPU) == [(None, "vfio-pci")]  # read back: exactly where the refusal left it
    assert "vfio-pci probe failed: -22" in machine.tree.kernel_log.read_text()
    apply_plan(machine.sys, plan, start=done[-1])  # the fault was for one write
    assert machine.state(GPU) == [("vfio-pci", "vfio-pci")]


def test_binding_to_another_driver_or_an_unloaded_one_is_refused(machine: Machine) -> None:
    step = plan_bind(machine.sys, GPU).steps[-1]
    with pytest.raises(StepFailed, match="bound to nvidia, not unbound"):
        apply_step(machine.sys, step)
    with pytest.raises(VfioError, match="driver vfio-foo is not loaded"):
        plan_bind(machine.sys, GPU, driver="vfio-foo")


@pytest.mark.parametrize("bdf", [GPU, AUDIO_GPU])
def test_crash_after_any_step_converges(machine: Machine, bdf: str) -> None:
    """A crash after step k took effect, before its completion was recorded: recovery re-applies from k
    (forward), or applies the restore plan (rollback); both end on one driver, the one the record says."""
    bind = plan_bind(machine.sys, bdf)
    functions = [f.bdf for f in bind.functions]
    original = machine.state(*functions)
    bound = [("vfio-pci", "vfio-pci")] * len(functions)
    restore = bind.restore()
    for k in range(len(bind.steps)):
        for step in bind.steps[:k + 1]:
            apply_step(machine.sys, step)
        apply_plan(machine.sys, bind, start=k)  # forward: step k again, then the rest
        assert machine.state(*functions) == bound, f"forward from bind step {k}"
        apply_plan(machine.sys, restore)
        assert machine.state(*functions) == original
    for k in range(len(bind.steps)):
        for step in bind.steps[:k + 1]:
            apply_step(machine.sys, step)
        apply_plan(machine.sys, restore)  # rollback from a half-done bind
        assert machine.state(*functions) == original, f"rollback after bind step {k}"
    for k in range(len(restore.steps)):
        apply_plan(machine.sys, bind)
        for step in restore.steps[:k + 1]:
            apply_step(machine.sys, step)
        apply_plan(machine.sys, restore, start=k)
        assert machine.state(*functions) == original, f"forward from restore step {k}"
    assert machine.kernel.refusals == []
    assert not any(name.isdigit() for name in os.listdir(machine.dev / "vfio"))


def test_reboot_forgets_the_binding(machine: Machine) -> None:
    apply_plan(machine.sys, plan_bind(machine.sys, GPU))
    machine.kernel.stop()
    materialize(machine_profile(), machine.tree.root, boot=True)
    assert machine.state(GPU) == [("nvidia", None)]


def test_vf_passthrough_and_back(machine: Machine) -> None:
    vf = "0000:4b:00.2"
    plan = plan_bind(machine.sys, vf)
    assert [f.driver for f in plan.functions] == ["mlx5_core"]
    apply_plan(machine.sys, plan)
    assert machine.state(vf) == [("vfio-pci", "vfio-pci")] and not (machine.tree.function(vf) / "net").exists()
    apply_plan(machine.sys, plan.restore())
    assert machine.state(vf) == [("mlx5_core", None)] and (machine.tree.function(vf) / "net").is_dir()


def test_restore_puts_an_operators_override_back(machine: Machine) -> None:
    apply_step(machine.sys, BindStep(StepKind.SET_OVERRIDE, GPU, "nvidia"))  # e.g. driverctl's doing
    plan = plan_bind(machine.sys, GPU)
    assert plan.functions[0].override == "nvidia"
    apply_plan(machine.sys, plan)
    apply_plan(machine.sys, plan.restore())
    assert machine.state(GPU) == [("nvidia", "nvidia")]


# -- in use ---------------------------------------------------------------------------------------

def fake_proc(root: Path, pid: int, command: str, fds: dict[int, str]) -> None:
    fd_dir = root / str(pid) / "fd"
    fd_dir.mkdir(parents=True)
    (root / str(pid) / "comm").write_text(command + "\n")
    for fd, target in fds.items():
        (fd_dir / str(fd)).symlink_to(target)


def test_gpu_open_on_the_host_is_busy(machine: Machine, tmp_path: Path) -> None:
    proc = tmp_path / "fakeproc"
    fake_proc(proc, 4242, "python3", {0: "/dev/null", 1: "pipe:[123]"})
    check_gpu_idle(machine.sys, proc, machine.dev, GPU, 0)  # nothing holds it
    fake_proc(proc, 4343, "python3", {3: "/dev/nvidiactl", 7: "/dev/nvidia0"})
    (proc / "self").mkdir()  # non-numeric entries are not processes
    with pytest.raises(DeviceBusy) as err:
        check_gpu_idle(machine.sys, proc, machine.dev, GPU, 0)
    assert str(err.value) == (f"GPU {GPU} is in use on the host: pid 4343 (python3) fd 7 on /dev/nvidia0; it can "
                              "leave the NVIDIA driver once they close it")
    assert err.value.retryable
    check_gpu_idle(machine.sys, proc, machine.dev, AUDIO_GPU, 1)  # another GPU is free


def test_gpu_open_through_another_node_name_is_found_by_device_number(machine: Machine, tmp_path: Path) -> None:
    need_root()  # mknod
    other = tmp_path / "elsewhere" / "gpu0"
    other.parent.mkdir()
    os.mknod(other, stat.S_IFCHR | 0o600, os.stat(machine.dev / "nvidia0").st_rdev)
    proc = tmp_path / "fakeproc"
    fake_proc(proc, 77, "qemu", {5: str(other)})
    assert [(h.pid, h.fd) for h in open_holders(proc, {"/dev/nvidia0"}, os.stat(other).st_rdev)] == [(77, 5)]
    with pytest.raises(DeviceBusy, match="pid 77 \\(qemu\\)"):
        check_gpu_idle(machine.sys, proc, machine.dev, GPU, 0)


def test_gpu_with_sriov_vfs_enabled_is_busy(machine: Machine, tmp_path: Path) -> None:
    (machine.tree.function(GPU) / "sriov_numvfs").write_text("2\n")
    with pytest.raises(DeviceBusy, match="has 2 SR-IOV virtual functions enabled"):
        check_gpu_idle(machine.sys, tmp_path / "noproc", machine.dev, GPU, 0)


def test_iommufd_needs_dev_iommu(machine: Machine) -> None:
    apply_plan(machine.sys, plan_bind(machine.sys, GPU))
    (machine.dev / "iommu").unlink()
    with pytest.raises(VfioError, match=r"has no .*/dev/iommu"):
        vfio_device_nodes(machine.sys, machine.dev, [GPU], IommuBackend.IOMMUFD)


def test_real_sysfs_reads_agree_with_discovery() -> None:
    """Read-only, on this machine's own /sys: the library reads each function's driver as discovery does,
    and each function in an IOMMU group is listed by its group."""
    sys_root = Path("/sys")
    try:
        functions = sorted(os.listdir(sys_root / "bus" / "pci" / "devices"))
    except OSError:
        functions = []
    for bdf in functions:
        fn, seen = read_function(sys_root, bdf), pci_function(sys_root, bdf)
        assert seen is not None and fn.driver == seen.driver and f"0x{fn.device_class:06x}" == seen.device_class
        if fn.iommu_group is not None:
            assert bdf in os.listdir(sys_root / "kernel" / "iommu_groups" / str(fn.iommu_group) / "devices")


def test_read_only_report(machine: Machine, tmp_path: Path) -> None:
    proc = tmp_path / "fakeproc"
    fake_proc(proc, 9, "nvidia-smi", {4: "/dev/nvidia2"})
    (proc / "driver").symlink_to(machine.tree.root / "proc" / "driver")
    lines = report(machine.sys, proc, machine.dev)
    assert lines[:3] == [
        f"{GPU} (class 0x030200, 0x10de:2330): driver nvidia, override -, IOMMU group 100",
        f"  passable: {GPU} target (nvidia)",
        "  in use: no (nothing holds /dev/nvidia0, no SR-IOV VFs)"]
    assert f"  passable: {AUDIO_GPU} target (nvidia), {AUDIO} companion (snd_hda_intel)" in lines
    assert any(line.startswith("  not passable: PCI function 0000:3a:00.0 cannot") for line in lines)
    assert "  in use: GPU 0000:3a:00.0 is in use on the host: pid 9 (nvidia-smi) fd 4 on /dev/nvidia2; it can " \
           "leave the NVIDIA driver once they close it" in lines
