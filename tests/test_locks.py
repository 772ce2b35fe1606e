"""The in-process lock table (agent/claims/locks.py): keys held alone, or shared by the claims of a
device handed out in shares; one holding a key alone excludes every other holder."""

from __future__ import annotations

import threading
from collections.abc import Callable

from agent.claims.locks import LockTable

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
