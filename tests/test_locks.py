"""The in-process lock table (agent/claims/locks.py): keys held alone, or shared by the claims of a
device handed out in shares; one holding a key alone excludes every other holder. And the byte lock
that extends a key to the other agents of the node, shared too."""

from __future__ import annotations

import fcntl
import gc
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from agent.claims.locks import CLAIMS_LOCK_FILE, DEVICES_LOCK_FILE, KeyFileLock, LockTable
from agent.claims.writers import WRITERS_LOCK_FILE, RecordWriters
from agent.sharedlock import SharedLock

WAIT = 30.0


def in_thread(fn: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def holder(table: LockTable, key: str, shared: bool, inside: threading.Event, leave: threading.Event,
           log: list[str], name: str) -> threading.Thread:
    def run() -> None:
        with table.hold([key], shared=[key] if shared else []):
            log.append(f"{name} in")
            inside.set()
            assert leave.wait(WAIT)
            log.append(f"{name} out")
    return in_thread(run)


def test_sharers_hold_a_key_at_once_and_one_alone_waits_for_them_all() -> None:
    table, log = LockTable(), []
    inside = [threading.Event() for _ in range(3)]
    leave = [threading.Event() for _ in range(3)]
    a = holder(table, "device/gpu-0-shared", True, inside[0], leave[0], log, "a")
    b = holder(table, "device/gpu-0-shared", True, inside[1], leave[1], log, "b")
    assert inside[0].wait(WAIT) and inside[1].wait(WAIT)  # both hold it
    alone = holder(table, "device/gpu-0-shared", False, inside[2], leave[2], log, "alone")
    leave[0].set()
    a.join(WAIT)
    assert not inside[2].is_set()  # b still shares it
    leave[1].set()
    b.join(WAIT)
    assert inside[2].wait(WAIT)
    leave[2].set()
    alone.join(WAIT)
    assert log == ["a in", "b in", "a out", "b out", "alone in", "alone out"]
    assert len(table) == 0  # dropped once nobody holds or waits for it


def test_different_keys_never_wait_for_each_other() -> None:
    table = LockTable()
    barrier = threading.Barrier(2, timeout=WAIT)

    def hold(key: str) -> None:
        with table.hold([key]):
            barrier.wait()  # both inside at once, or the barrier breaks

    threads = [in_thread(lambda k=k: hold(k)) for k in ("claim/a", "claim/b")]
    for t in threads:
        t.join(WAIT)
    assert not barrier.broken


def test_a_device_held_shared_by_two_claims_stays_held_for_other_agents_until_the_last_lets_go(
        tmp_path: Path) -> None:
    path, key = tmp_path / "devices.lock", "pci/0000:2a:00.0"
    agent = KeyFileLock(path)

    def another_agent_would_wait() -> bool:  # a write lock from another open file description, as another agent's
        fd = os.open(path, os.O_RDWR)
        try:
            probe = struct.pack("@hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, KeyFileLock.offset(key), 1, 0)
            return struct.unpack("@hhqqi4x", fcntl.fcntl(fd, fcntl.F_OFD_GETLK, probe))[0] != fcntl.F_UNLCK
        finally:
            os.close(fd)

    first, second = agent.hold(key, shared=True), agent.hold(key, shared=True)
    first.__enter__()
    second.__enter__()  # the second claim of the shared GPU, in another worker thread of the same agent
    assert another_agent_would_wait()
    first.__exit__(None, None, None)
    assert another_agent_would_wait()  # the second claim still holds it
    second.__exit__(None, None, None)
    assert not another_agent_would_wait()
    agent.close()


def descriptors_on(*paths: Path) -> int:
    """How many descriptors of this process are on these files."""
    wanted, count = {str(p) for p in paths}, 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") in wanted
        except OSError:
            continue
    return count


def test_an_engine_dropped_without_close_lets_go_of_its_lock_files(tmp_path: Path) -> None:
    """An engine's lock files are closed by its process's exit. One dropped without `close` in a long process
    (a test's: a test run piled up three descriptors an engine) lets go of them once it is garbage: its
    descriptors, and with them its registration as a writer of records, which would make every later engine
    on the state directory list the records directory before each forms check."""
    paths = [tmp_path / CLAIMS_LOCK_FILE, tmp_path / DEVICES_LOCK_FILE, tmp_path / WRITERS_LOCK_FILE]
    claims, devices, writers = KeyFileLock(paths[0]), KeyFileLock(paths[1]), RecordWriters(paths[2])
    claims.open()
    devices.open()
    writers.open()
    with devices.hold("pci/0000:2a:00.0", shared=True):
        pass
    later = RecordWriters(paths[2])  # the next engine on the same state directory
    later.open()
    assert descriptors_on(*paths) == 4 and later.others()[0]
    del claims, devices, writers
    gc.collect()
    assert descriptors_on(*paths) == 1 and not later.others()[0]
    later.close()
    assert descriptors_on(*paths) == 0


def test_one_that_gives_up_waiting_to_hold_a_lock_alone_lets_the_sharers_behind_it_in() -> None:
    # (A thread waits for a claim's or device's lock holding its claim slot only so long:
    # agent/workslots.py, PATIENCE.) A sharer that arrived while one waited to hold the lock alone
    # waits behind it, and goes in once that one gives up.
    lock = SharedLock()
    assert lock.acquire(True)
    gave_up = threading.Event()

    def alone() -> None:
        assert not lock.acquire(False, timeout=0.2)  # held shared throughout
        gave_up.set()

    waiter = in_thread(alone)
    for _ in range(int(WAIT / 0.01)):  # until it waits (or has given up already)
        if lock._waiting_alone or gave_up.is_set():
            break
        threading.Event().wait(0.01)
    sharer_in = threading.Event()
    sharer = in_thread(lambda: (lock.acquire(True), sharer_in.set()))
    assert sharer_in.wait(WAIT) and gave_up.is_set()
    waiter.join(WAIT)
    sharer.join(WAIT)
    lock.release(True)
    lock.release(True)
    assert lock.acquire(False, timeout=0)  # free again, for one alone
