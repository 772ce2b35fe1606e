"""inotify: directory watches, and their events read where they are used.

Self-healing watched through watchdog first: each event crossed three threads (the inotify reader,
the emitter, the observer's dispatcher) and was parsed into several objects before the agent saw it,
which cost more CPU than a prepare's own work (the agent's atomic writes cause a dozen events per
prepare). Here the descriptor (`inotify_simple`: the system calls and the event parsing, nothing
more) is non-blocking and read on the event loop when readable (`read`); this module keeps which
directory each watch is for. Watches are added by path (`add`); the table is shared with a worker
thread that arms them, hence the lock. Where events are handled in a thread rather than on the
loop (the simulated machine's control directory and kernel), `WatchThread` reads them there: one
thread for all of its directories.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import select
import struct
import termios
import threading
from collections.abc import Callable
from dataclasses import dataclass

from inotify_simple import INotify, flags

IN_MODIFY = int(flags.MODIFY)
IN_CLOSE_WRITE = int(flags.CLOSE_WRITE)
IN_MOVED_FROM = int(flags.MOVED_FROM)
IN_MOVED_TO = int(flags.MOVED_TO)
IN_CREATE = int(flags.CREATE)
IN_DELETE = int(flags.DELETE)
IN_DELETE_SELF = int(flags.DELETE_SELF)
IN_MOVE_SELF = int(flags.MOVE_SELF)
IN_Q_OVERFLOW = int(flags.Q_OVERFLOW)
IN_IGNORED = int(flags.IGNORED)
IN_ONLYDIR = int(flags.ONLYDIR)
IN_DONT_FOLLOW = int(flags.DONT_FOLLOW)
IN_ISDIR = int(flags.ISDIR)

log = logging.getLogger(__name__)

# Changes only: opens and reads (IN_OPEN, IN_ACCESS, IN_CLOSE_NOWRITE) never reach the agent.
CHANGES = (IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF
           | IN_MOVE_SELF)


@dataclass(frozen=True, slots=True)
class Event:
    path: str  # the watched directory's path joined with the event's name ("" for a queue overflow)
    mask: int

    @property
    def is_dir(self) -> bool:
        return bool(self.mask & IN_ISDIR) or bool(self.mask & (IN_DELETE_SELF | IN_MOVE_SELF))

    @property
    def overflow(self) -> bool:
        return bool(self.mask & IN_Q_OVERFLOW)


class Inotify:
    def __init__(self) -> None:
        self._inotify = INotify(nonblocking=True)
        self.fd: int = self._inotify.fileno()
        self._guard = threading.Lock()
        self._paths: dict[int, str] = {}  # watch descriptor -> directory path
        self._wds: dict[str, int] = {}

    def add(self, path: str) -> None:
        """Watch the directory (never through a link). OSError when it is gone or out of watches."""
        wd = self._inotify.add_watch(path, CHANGES | IN_ONLYDIR | IN_DONT_FOLLOW)
        with self._guard:
            old = self._paths.get(wd)
            if old is not None and old != path:
                self._wds.pop(old, None)
            self._paths[wd] = path
            self._wds[path] = wd

    def remove(self, path: str) -> None:
        with self._guard:
            wd = self._wds.pop(path, None)
            if wd is None:
                return
            self._paths.pop(wd, None)
        with contextlib.suppress(OSError):  # the kernel dropped it already (the directory is gone)
            self._inotify.rm_watch(wd)

    def watched(self) -> list[str]:
        with self._guard:
            return list(self._wds)

    def __contains__(self, path: str) -> bool:
        return path in self._wds

    def queued(self) -> int:
        """Bytes of events the kernel holds for this descriptor, not read yet (FIONREAD)."""
        raw = fcntl.ioctl(self.fd, termios.FIONREAD, b"\0\0\0\0")
        return int(struct.unpack("i", raw)[0])

    def read(self) -> list[Event]:
        """Every event queued now (non-blocking)."""
        events: list[Event] = []
        while True:
            try:
                batch = self._inotify.read(timeout=0)
            except BlockingIOError:
                return events
            if not batch:
                return events
            with self._guard:
                for raw in batch:
                    if raw.mask & IN_Q_OVERFLOW:
                        events.append(Event("", raw.mask))
                        continue
                    parent = self._paths.get(raw.wd)
                    if parent is None:
                        continue
                    if raw.mask & IN_IGNORED:  # the directory is gone (or its watch removed)
                        del self._paths[raw.wd]
                        if self._wds.get(parent) == raw.wd:
                            del self._wds[parent]
                        continue
                    events.append(Event(os.path.join(parent, raw.name) if raw.name else parent, raw.mask))

    def close(self) -> None:
        with self._guard:
            self._paths.clear()
            self._wds.clear()
        self._inotify.close()


class WatchThread:
    """Directories watched by a thread of its own, which calls `handle` with each event, in order.
    `add(path, recursive=True)` watches every directory below `path` too, and each one made there
    later; the files found in such a directory are handed to `handle` as if just written
    (IN_CLOSE_WRITE), so a write made there before its watch began is not lost."""

    def __init__(self, handle: Callable[[Event], None], name: str) -> None:
        self._handle = handle
        self._inotify = Inotify()
        self._recursive: list[str] = []
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def add(self, path: str, recursive: bool = False) -> None:
        """Watch `path` (from now on: the watch exists when this returns)."""
        self._inotify.add(path)
        if recursive:
            self._recursive.append(path)
            self._add_below(path, announce=False)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._inotify.close()
        for fd in (self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _add_below(self, path: str, announce: bool) -> None:
        for parent, dirs, files in os.walk(path):
            for name in dirs:
                with contextlib.suppress(OSError):  # removed meanwhile: its parent's event says so
                    self._inotify.add(os.path.join(parent, name))
            if announce:
                for name in files:
                    self._call(Event(os.path.join(parent, name), IN_CLOSE_WRITE))

    def _run(self) -> None:
        # poll, not select: select fails on a descriptor numbered 1024 or above, and a process
        # holding many files (an agent with open GPUs and sockets) gets such numbers.
        poller = select.poll()
        poller.register(self._inotify.fd, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._stop_r in ready:
                return
            for event in self._inotify.read():
                if (event.mask & (IN_CREATE | IN_MOVED_TO) and event.mask & IN_ISDIR
                        and any(event.path.startswith(r + os.sep) for r in self._recursive)):
                    with contextlib.suppress(OSError):
                        self._inotify.add(event.path)
                    self._call(event)
                    self._add_below(event.path, announce=True)
                    continue
                self._call(event)

    def _call(self, event: Event) -> None:
        try:
            self._handle(event)
        except Exception:  # a handler's failure must not end the watch
            log.exception("handling the inotify event of %s failed", event.path)
