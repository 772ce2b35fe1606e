"""`WatchThread` (agent/inotify.py), which the simulated machine's kernel and control directory run on:
every write closed in a watched tree is handed over, in a directory made after the watch began too,
even one written before the thread could watch it."""

from __future__ import annotations

import os
import queue
import subprocess
from pathlib import Path

from agent.inotify import IN_CLOSE_WRITE, Event, WatchThread


def closed_writes(events: queue.Queue[Event], count: int) -> set[str]:
    found: set[str] = set()
    while len(found) < count:
        event = events.get(timeout=30)
        if event.mask & IN_CLOSE_WRITE and not event.is_dir:
            found.add(event.path)
    return found


def seen(events: queue.Queue[Event], path: str) -> bool:
    """Whether a closed write of `path` is handed over (within 30 s), whatever comes before it."""
    while True:
        event = events.get(timeout=30)
        if event.mask & IN_CLOSE_WRITE and not event.is_dir and event.path == path:
            return True


def test_writes_below_a_recursive_root_are_handed_over_in_new_directories_too(tmp_path: Path) -> None:
    root = tmp_path / "devices"
    (root / "old").mkdir(parents=True)
    events: queue.Queue[Event] = queue.Queue()
    watch = WatchThread(events.put, "test-watch")
    watch.add(str(root), recursive=True)
    watch.start()
    try:
        (root / "old" / "bind").write_text("0000:01:00.0\n")
        assert closed_writes(events, 1) == {str(root / "old" / "bind")}
        # A tree made and written in one go (one process, no pause): the files inside were closed
        # before the thread saw the directory, and are handed over all the same.
        subprocess.run(["sh", "-c", f"mkdir -p {root}/new/deep && echo 1 > {root}/new/remove && "
                                    f"echo 2 > {root}/new/deep/create"], check=True)
        assert closed_writes(events, 2) >= {str(root / "new" / "remove"), str(root / "new" / "deep" / "create")}
        (root / "new" / "deep" / "later").write_text("3")  # its watch stays
        # (A file written while its directory was being taken in may be handed over twice: once found
        # there, once by its own event. What is still queued of those comes first.)
        assert seen(events, str(root / "new" / "deep" / "later"))
    finally:
        watch.stop()
    fds = len(os.listdir("/proc/self/fd"))
    other = WatchThread(events.put, "test-watch-2")
    other.add(str(root))
    other.start()
    other.stop()
    assert len(os.listdir("/proc/self/fd")) == fds  # a stopped watch leaves no descriptor behind


def test_a_watch_opened_past_descriptor_1024_still_hands_over_writes(tmp_path: Path) -> None:
    # A process holding many files (open GPUs, sockets, a long test run) gets descriptors numbered
    # 1024 and up; the watch's own must work there too.
    held: list[int] = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open("/dev/null", os.O_RDONLY))
        events: queue.Queue[Event] = queue.Queue()
        watch = WatchThread(events.put, "test-watch-high")
        watch.add(str(tmp_path))
        watch.start()
        try:
            (tmp_path / "bind").write_text("0000:01:00.0\n")
            assert closed_writes(events, 1) == {str(tmp_path / "bind")}
        finally:
            watch.stop()
    finally:
        for fd in held:
            os.close(fd)
