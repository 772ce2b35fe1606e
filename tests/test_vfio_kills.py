"""The crash suite for passthrough (VFIO) claims: an agent process SIGKILLed at every failpoint a
passthrough prepare or unprepare reaches (its intent record, before and after each binding step,
the claim's files, the final record), then a restarted agent's recovery. Each time the GPU must end
bound to exactly the driver the surviving record says (vfio-pci with its override when the claim
stayed prepared, nvidia without one otherwise), and nothing of the claim may be left behind.

The agent runs in a child process with the simulated machine's kernel emulator (it runs in the
agent's process, as with `--nvml sim`); the test's own emulator is stopped meanwhile, so each
binding write is applied once."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

from agentkit import claim, make_node, restarted, result, write_claim, written_files

from agent.claims.records import RecordState
from agent.claims.store import ClaimStore
from agent.engine.recovery import recover
from agent.host.vfio.pci import current_driver, current_override
from agent.hostprep.mig import nvml_of
from agent.names import ClaimRef
from agent.sim.kernel.emulator import KernelEmulator
from agent.sim.profiles import load_profile

TESTS = Path(__file__).resolve().parent
UID = "2f1a0000-0000-4000-8000-000000000001"
GPU_BUS, GPU_VARIANT = "0000:18:00.0", "gpu-0000-18-00-0-vfio"
PROFILE = "dgx-h100"
# The VFIO failpoints each operation must reach, with how often (the GPU's plan has three bind
# steps: set the override, unbind from nvidia, bind to vfio-pci; its restore three: clear the
# override, unbind from vfio-pci, bind to nvidia).
PREPARE_POINTS = {"after-bind-intent": 1, "bind-before-step": 3, "bind-after-step": 3, "after-record": 1}
UNPREPARE_POINTS = {"unprepare-after-restore-intent": 1, "restore-before-step": 3, "restore-after-step": 3,
                    "unprepare-after-record": 1}


def _in_child(tmp: Path, op: str, kill_at: int) -> tuple[int, str, str]:
    """Run `op` on the claim in a new agent process killed at the `kill_at`-th failpoint it reaches;
    returns its exit status, the failpoint it died at ("" when it finished), and its output."""
    code = textwrap.dedent(f"""
        import asyncio, sys
        from pathlib import Path
        sys.path.insert(0, {str(TESTS)!r})
        import agentkit
        from agent import failpoints
        from agent.sim.profiles import load_profile
        from agent.names import ClaimRef
        from agent.sim.kernel.emulator import KernelEmulator
        async def main():
            node = await agentkit.make_node(Path({str(tmp)!r}))
            with KernelEmulator(load_profile({PROFILE!r}), node.settings.state_dir / "nvml-sim"):
                failpoints.before_kill = lambda step: print("KILLED-AT", step, flush=True)
                failpoints.configure("*@{kill_at}=kill")
                print(await node.engine.{op}([ClaimRef("default", "vm-gpu", {UID!r})]), flush=True)
        asyncio.run(main())
    """)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    point = next((line.split()[1] for line in child.stdout.splitlines() if line.startswith("KILLED-AT ")), "")
    return child.returncode, point, child.stdout + child.stderr


async def _kill_at_every_point(tmp_path: Path, op: str) -> Counter[str]:
    reached: Counter[str] = Counter()
    for kill_at in range(1, 40):
        node = await make_node(tmp_path / f"kill-{kill_at}")
        root = node.settings.state_dir / "nvml-sim"
        sysfs = root / "sys"
        before = written_files(node.settings)
        write_claim(node.claims_dir, claim("vm-gpu", UID, [result(GPU_VARIANT, "vm")]))
        if op == "unprepare":
            with KernelEmulator(load_profile(PROFILE), root):
                (res,) = (await node.engine.prepare([ClaimRef("default", "vm-gpu", UID)])).values()
                assert res.error == ""
        # The test's own agent lets go of NVML while the child agent runs: its handles hold every GPU open,
        # and the child's unbind would wait for them (as a new agent's does for an old one's that still runs).
        access = nvml_of(node.inventory)()
        assert access is not None and access.gate is not None
        with access.gate.released("another agent process runs"):
            status, point, output = _in_child(tmp_path / f"kill-{kill_at}", op, kill_at)
        where = f"{op} killed at failpoint {kill_at} ({point or 'none: it finished'})"
        with KernelEmulator(load_profile(PROFILE), root) as kernel:
            report = recover(restarted(node))
            found = ClaimStore(node.settings.claims_state_dir).read(UID)
            driver, override = current_driver(sysfs, GPU_BUS), current_override(sysfs, GPU_BUS)
            if UID in report.records:
                # Only a prepare killed after its final record stays prepared (or one that finished).
                assert op == "prepare" and point in ("after-record", ""), where
                assert found is not None and found[0].state is RecordState.PREPARED, where
                assert (driver, override) == ("vfio-pci", "vfio-pci"), where
            else:
                assert (op, point) != ("prepare", ""), where
                assert found is None, where  # no dangling record
                assert (driver, override) == ("nvidia", None), where
                assert written_files(node.settings) == before, where  # no dangling CDI spec or metadata
            assert kernel.refusals == [], where
        if point == "":
            assert status == 0, output
            return reached
        assert status == -9, f"{where}: {output}"
        reached[point] += 1
    raise AssertionError(f"{op} still reached failpoints after 39 kills: {dict(reached)}")


async def test_killed_at_every_step_of_a_passthrough_prepare_recovery_converges(tmp_path: Path) -> None:
    reached = await _kill_at_every_point(tmp_path, "prepare")
    assert {p: reached[p] for p in PREPARE_POINTS} == PREPARE_POINTS, dict(reached)


async def test_killed_at_every_step_of_a_passthrough_unprepare_recovery_finishes_it(tmp_path: Path) -> None:
    reached = await _kill_at_every_point(tmp_path, "unprepare")
    assert {p: reached[p] for p in UNPREPARE_POINTS} == UNPREPARE_POINTS, dict(reached)
