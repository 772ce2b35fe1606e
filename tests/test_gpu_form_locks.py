"""Two forms of one GPU (whole, shared, MIG, vGPU, passthrough) are never both prepared: not by two
claims of one kubelet call, not by two agents sharing the state directory (a rolling update). The
forms check and the claim of the GPU happen under one lock per GPU that every agent honours (a byte
lock in `<state>/devices.lock`, as the per-claim locks in `claims.lock`), and the check reads which
claim holds a form of the GPU from the records on disk under that lock."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from agentkit import Node, claim, make_node, restarted, result, write_claim
from handshakes import device_lock_waiters, until

from agent import failpoints
from agent.claims.locks import DEVICES_LOCK_FILE, KeyFileLock
from agent.claims.records import RecordState
from agent.engine.recovery import recover
from agent.names import ClaimRef
from agent.sim.kernel.emulator import KernelEmulator
from agent.sim.profiles import load_profile

TESTS = Path(__file__).resolve().parent
GPU0_BUS = "0000:18:00.0"
GPU0_KEY = f"pci/{GPU0_BUS}"
MIG = "gpu-0-mig-1g10gb-4"
UID_A = "f0a10000-0000-4000-8000-00000000000a"
UID_B = "f0a10000-0000-4000-8000-00000000000b"


@pytest.fixture(autouse=True)
def no_failpoints() -> Any:
    yield
    failpoints.configure("")


def shared(share_id: str = "7c9e6679-7425-40de-944b-e07fc1f90ae7") -> dict[str, Any]:
    return result("gpu-0-shared", "gpu", shareID=share_id, consumedCapacity={"memory": "4Gi"})


def _agent(tmp: Path, name: str, uid: str, go: Path | None = None, **env: str) -> subprocess.Popen[str]:
    """Another agent process over the same roots: it prepares claim `name` once `go` exists (at once
    without one) and prints the error ("" for prepared)."""
    code = textwrap.dedent(f"""
        import asyncio, pathlib, sys, time
        sys.path.insert(0, {str(TESTS)!r})
        import agentkit
        from agent.names import ClaimRef
        async def main():
            node = await agentkit.make_node(pathlib.Path({str(tmp)!r}), gpu_sharing=True)
            go = {str(go) if go else None!r}
            print("ready", flush=True)
            while go is not None and not pathlib.Path(go).exists():
                time.sleep(0.001)
            (res,) = (await node.engine.prepare([ClaimRef('default', {name!r}, {uid!r})])).values()
            print("error:" + res.error, flush=True)
        asyncio.run(main())
    """)
    return subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _error_of(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    (line,) = [x for x in out.splitlines() if x.startswith("error:")]
    return line[len("error:"):]


@pytest.fixture
async def node(tmp_path: Path) -> Node:
    return await make_node(tmp_path, gpu_sharing=True)


async def test_two_forms_in_one_kubelet_call_never_both_prepare(node: Node) -> None:
    write_claim(node.claims_dir, claim("whole", UID_A, [result("gpu-0", "gpu")]))
    write_claim(node.claims_dir, claim("share", UID_B, [shared()]))
    failpoints.configure("after-claim-spec=pause")
    call = asyncio.create_task(node.engine.prepare([ClaimRef("default", "whole", UID_A),
                                                     ClaimRef("default", "share", UID_B)]))
    await asyncio.to_thread(failpoints.wait_paused, "after-claim-spec")
    # The other claim waits for the GPU's lock; it has not judged the forms yet.
    await until(lambda: node.engine.locks.users(GPU0_KEY) >= 2, "the second claim waiting for the GPU")
    failpoints.release("after-claim-spec")
    results = await call
    errors = sorted(r.error for r in results.values())
    assert errors[0] == "" and "a form it cannot share the GPU with" in errors[1], errors
    assert len(node.engine.records) == 1


async def test_a_second_agent_waits_for_the_gpu_and_sees_the_first_agents_claim(node: Node, tmp_path: Path) -> None:
    """Agent A (this process) is in the middle of preparing the whole GPU; agent B (another process,
    the same state directory) prepares a MIG device of it: B waits for the GPU, then finds A's record."""
    write_claim(node.claims_dir, claim("whole", UID_A, [result("gpu-0", "gpu")]))
    write_claim(node.claims_dir, claim("mig", UID_B, [result(MIG, "part")]))
    failpoints.configure("after-claim-spec=pause")
    first = asyncio.create_task(node.engine.prepare([ClaimRef("default", "whole", UID_A)]))
    await asyncio.to_thread(failpoints.wait_paused, "after-claim-spec")
    other = _agent(tmp_path, "mig", UID_B)
    # B has reached the GPU and waits on its byte lock (or, without the lock, it is done already).
    await until(lambda: device_lock_waiters(node.settings.state_dir, GPU0_KEY) or other.poll() is not None,
                "the second agent waiting for the GPU, or done")
    assert other.poll() is None, "the second agent prepared a form of a GPU the first one is preparing"
    failpoints.release("after-claim-spec")
    assert (await first)[UID_A].error == ""
    error = await asyncio.to_thread(_error_of, other)
    assert f"GPU {GPU0_BUS} is prepared as gpu-0 for claim default/whole ({UID_A})" in error, error
    mig_state = (node.settings.state_dir / "nvml-sim" / "nvml-mig.json").read_text()
    assert '"gis":[]' in mig_state.replace(" ", "")  # B made no GPU instance


@pytest.mark.parametrize("forms", [("gpu-0", MIG), (MIG, "gpu-0"), ("gpu-0-shared", "gpu-0-0000-18-00-0-vfio")])
async def test_two_agents_20ms_apart_prepare_one_form_only(node: Node, tmp_path: Path,
                                                          forms: tuple[str, str]) -> None:
    """A rolling update: two agent processes, each with a claim for another form of GPU 0, the second
    starting 20 ms after the first (which is slowed right after its CDI spec, as by a slow disk)."""
    first, second = ("gpu-0000-18-00-0-vfio" if f.endswith("-vfio") else f for f in forms)
    for name, uid, device in (("a", UID_A, first), ("b", UID_B, second)):
        res = shared() if device == "gpu-0-shared" else result(device, "r")
        write_claim(node.claims_dir, claim(name, uid, [res]))
    go_a, go_b = tmp_path / "go-a", tmp_path / "go-b"
    a = _agent(tmp_path, "a", UID_A, go_a, DRA_AGENT_FAILPOINTS="after-claim-spec=sleep:0.5")
    b = _agent(tmp_path, "b", UID_B, go_b)
    for proc in (a, b):
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    # The machine's kernel, for whichever agent binds the passthrough form.
    with KernelEmulator(load_profile("dgx-h100"), node.settings.state_dir / "nvml-sim"):
        go_a.touch()
        await asyncio.sleep(0.02)
        go_b.touch()
        errors = [await asyncio.to_thread(_error_of, p) for p in (a, b)]
    assert sorted(e == "" for e in errors) == [False, True], errors
    assert f"GPU {GPU0_BUS} is prepared as" in "".join(errors) or f"PCI function {GPU0_BUS} is prepared as" \
        in "".join(errors), errors
    assert len(node.engine.store.uids()) == 1


async def test_recovery_settles_a_partition_holding_its_gpus_lock(node: Node) -> None:
    """Start-up recovery rolls back a MIG prepare that stopped halfway only while it holds the GPU's lock
    (`pci/<bus>`), the one a prepare of another form of the GPU holds in another agent."""
    write_claim(node.claims_dir, claim("mig", UID_A, [result(MIG, "part")]))
    assert (await node.engine.prepare([ClaimRef("default", "mig", UID_A)]))[UID_A].error == ""
    record = node.engine.whole_record(UID_A)
    assert record is not None
    node.engine.book.write(dataclasses.replace(record, state=RecordState.BINDING, files=[], dirs=[]))
    held, done, waited = threading.Event(), threading.Event(), threading.Event()
    other = KeyFileLock(node.settings.state_dir / DEVICES_LOCK_FILE)  # another agent's descriptor

    def other_agent() -> None:
        with other.hold(GPU0_KEY):
            held.set()
            while not done.is_set():
                if device_lock_waiters(node.settings.state_dir, GPU0_KEY):
                    waited.set()  # recovery waits for the GPU: let it have it
                    break
                time.sleep(0.005)
    holder = threading.Thread(target=other_agent)
    holder.start()
    assert held.wait(10)
    engine = restarted(node)

    def recovery() -> Any:
        try:
            return recover(engine)
        finally:
            done.set()
    report = await asyncio.to_thread(recovery)
    holder.join(10)
    other.close()
    assert waited.is_set(), "recovery settled the GPU's partition without its lock"
    assert report.settled == [UID_A] and engine.whole_record(UID_A) is None


async def test_a_claim_another_agent_prepared_and_left_is_seen_by_the_agent_alone_again(node: Node) -> None:
    """Agent A has checked forms alone (and so stopped reading the records directory); agent B (a second
    engine on the same state directory) prepares the whole GPU 0 and goes away. A's next forms check
    reads the records again and finds B's claim: B's arrival is counted in `<state>/writers.lock`."""
    write_claim(node.claims_dir, claim("first", UID_A, [result("gpu-1", "gpu")]))
    assert (await node.engine.prepare([ClaimRef("default", "first", UID_A)]))[UID_A].error == ""
    other = restarted(node)
    write_claim(node.claims_dir, claim("whole", UID_B, [result("gpu-0", "gpu")]))
    assert (await other.prepare([ClaimRef("default", "whole", UID_B)]))[UID_B].error == ""
    other.close()
    uid_c = "f0a10000-0000-4000-8000-00000000000c"
    write_claim(node.claims_dir, claim("mig", uid_c, [result(MIG, "part")]))
    error = (await node.engine.prepare([ClaimRef("default", "mig", uid_c)]))[uid_c].error
    assert f"GPU {GPU0_BUS} is prepared as gpu-0 for claim default/whole ({UID_B})" in error, error


async def test_an_agent_alone_lists_the_records_once(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no other writer of records, the forms checks read the records directory once, not at every
    prepare (a listing costs milliseconds with thousands of claims); with one, at every check."""
    listings = 0
    real = node.engine.store.uids

    def counted() -> list[str]:
        nonlocal listings
        listings += 1
        return real()

    monkeypatch.setattr(node.engine.store, "uids", counted)
    refs = []
    for i in range(4):
        uid = f"f0a10000-0000-4000-8000-0000000001{i:02d}"
        write_claim(node.claims_dir, claim(f"c{i}", uid, [result(f"gpu-{i}", "gpu")]))
        refs.append(ClaimRef("default", f"c{i}", uid))
    for ref in refs[:2]:
        assert (await node.engine.prepare([ref]))[ref.uid].error == ""
    assert listings == 1
    other = restarted(node)  # another writer is there: every check lists
    for ref in refs[2:]:
        assert (await node.engine.prepare([ref]))[ref.uid].error == ""
    assert listings == 3
    other.close()
