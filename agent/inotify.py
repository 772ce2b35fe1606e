"""inotify for the event loop: directory watches, and their events read and parsed where they are used.

Self-healing watched through watchdog first: each event crossed three threads (the inotify reader,
the emitter, the observer's dispatcher) and was parsed into several objects before the agent saw it,
which cost more CPU than a prepare's own work (the agent's atomic writes cause a dozen events per
prepare). Here the descriptor is non-blocking, read on the event loop when readable (`read`), and an
event is one `struct.unpack_from` and a dict lookup. Watches are added by path (`add`); the table is
shared with a worker thread that arms them, hence the lock.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import threading
from dataclasses import dataclass

IN_MODIFY = 0x00000002
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_ISDIR = 0x40000000

# Changes only: opens and reads (IN_OPEN, IN_ACCESS, IN_CLOSE_NOWRITE) never reach the agent.
CHANGES = (IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF
           | IN_MOVE_SELF)
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len
_libc = ctypes.CDLL(None, use_errno=True)


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


def _error(what: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}")


class Inotify:
    def __init__(self) -> None:
        fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise _error("inotify_init1")
        self.fd: int = fd
        self._guard = threading.Lock()
        self._paths: dict[int, str] = {}  # watch descriptor -> directory path
        self._wds: dict[str, int] = {}

    def add(self, path: str) -> None:
        """Watch the directory (never through a link). OSError when it is gone or out of watches."""
        wd = _libc.inotify_add_watch(self.fd, os.fsencode(path), CHANGES | IN_ONLYDIR | IN_DONT_FOLLOW)
        if wd < 0:
            raise _error(f"inotify_add_watch {path}")
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
        _libc.inotify_rm_watch(self.fd, wd)  # (fails harmlessly when the kernel dropped it already)

    def watched(self) -> list[str]:
        with self._guard:
            return list(self._wds)

    def __contains__(self, path: str) -> bool:
        return path in self._wds

    def read(self) -> list[Event]:
        """Every event queued now (non-blocking)."""
        events: list[Event] = []
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return events
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            if not data:
                return events
            offset = 0
            with self._guard:
                while offset < len(data):
                    wd, mask, _cookie, length = _HEADER.unpack_from(data, offset)
                    name = data[offset + _HEADER.size: offset + _HEADER.size + length].rstrip(b"\0")
                    offset += _HEADER.size + length
                    if mask & IN_Q_OVERFLOW:
                        events.append(Event("", mask))
                        continue
                    parent = self._paths.get(wd)
                    if parent is None:
                        continue
                    if mask & IN_IGNORED:  # the directory is gone (or its watch removed)
                        del self._paths[wd]
                        if self._wds.get(parent) == wd:
                            del self._wds[parent]
                        continue
                    events.append(Event(os.path.join(parent, os.fsdecode(name)) if name else parent, mask))

    def close(self) -> None:
        with self._guard:
            self._paths.clear()
            self._wds.clear()
        os.close(self.fd)
