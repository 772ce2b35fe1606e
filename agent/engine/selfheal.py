"""Self-healing: files and sockets removed or changed from under the running agent come back.

Watched with inotify, design target 1 s from the event:
- a prepared claim's CDI specs (`<cdi dir>`) and metadata files (`<metadata dir>/<uid>/...`):
  deleted or changed by someone else -> rewritten from the claim's record. Each check holds the
  claim's locks (`PrepareEngine.claim_locked`) and reads the record as it is then, so it never
  races a prepare, unprepare or metadata refresh (of this agent or an overlapping one), and it
  rewrites only files whose content differs: the agent's own writes cause one check and no write.
- the registration and DRA sockets: removed (a kubelet restart cleaning its plugin directories)
  -> bound again (`Servers.restore_missing`), and the kubelet re-registers the plugin when it
  sees the registration socket appear.
- the CDI directory: removed -> re-created, and the prepared claims' specs restored into it.

Events are read from inotify on the event loop (`agent.inotify`: no thread, one parse per event),
in batches: once the descriptor is readable the read waits READ_DELAY, so the events of many
prepares and unprepares cost one wake-up and one read, not several each (at a few milliseconds
per prepare, the wake-ups were most of self-healing's CPU). The temp files of the agent's own
atomic writes are dropped by name, and so are the events of the agent's own renames and removals,
as `agent.ownchanges` tells them from anyone else's, also when the agent changed the path again
before the batch was read. Events are debounced per claim, so a burst of events costs one check.
A watched directory that is removed is watched again once it exists again: the nearest existing
ancestor of each directory is watched too, and any directory event on the way re-arms the watches
and checks everything (events missed while a directory was gone are covered by that full check).

`settled()` waits until every event the kernel has queued so far has been read and judged and every
check they caused has finished: what a test (or a tool) awaits instead of guessing a delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Protocol

from agent.claims import filenames
from agent.config import Settings
from agent.engine.prepare import PrepareEngine
from agent.engine.recovery import repair_claim
from agent.fsutil import is_temp_name, makedirs
from agent.inotify import IN_CREATE, IN_MOVED_TO, Event, Inotify
from agent.names import InvalidName, check_uid

log = logging.getLogger(__name__)


class SocketOwner(Protocol):
    """Whoever serves the kubelet's sockets (`agent.kubelet.server.Servers`): binds again the ones
    removed under it and says which."""

    async def restore_missing(self) -> list[Path]: ...

DEBOUNCE = 0.1  # seconds: a burst of events on one claim costs one check
READ_DELAY = 0.05  # seconds from the first event of a batch to its read
_ALL = "*"  # the key of a full check
_SOCKETS = "sockets"


def _dir_identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class SelfHealer:
    def __init__(self, settings: Settings, engine: PrepareEngine, servers: SocketOwner,
                 debounce: float = DEBOUNCE, read_delay: float = READ_DELAY) -> None:
        self.settings = settings
        self.engine = engine
        self.servers = servers
        self.debounce = debounce
        self.read_delay = read_delay
        self._read_due: asyncio.TimerHandle | None = None  # a batch is being collected
        self.loop = asyncio.get_running_loop()
        # The directories whose content matters, and whether their subdirectories do too.
        self.targets: dict[str, bool] = {}
        for path, recursive in ((settings.cdi_dir, False), (settings.metadata_dir, True),
                                (settings.dra_socket.parent, False), (settings.registration_socket.parent, False)):
            key = str(path)
            self.targets[key] = self.targets.get(key, False) or recursive
        self.sockets = {str(settings.dra_socket), str(settings.registration_socket)}
        self._inotify: Inotify | None = None
        self._watches: dict[str, tuple[bool, tuple[int, int]]] = {}  # each planned directory: recursive, identity
        self._arming = threading.Lock()
        self._pending: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._socket_lock = asyncio.Lock()
        self._moved = asyncio.Event()  # set at every step of the work `settled()` waits for
        self.restored = 0  # files and sockets restored (for tests and logs)
        self.own_skipped = 0  # events of the agent's own changes, not checked
        self.claim_checks = 0  # claims checked (each under its lock, reading its record)

    async def start(self) -> None:
        self._inotify = Inotify()
        # In a worker thread: the recursive watch of the metadata directory adds a watch per claim
        # directory (20,000 with 10,000 prepared claims), which must not hold up the event loop.
        await asyncio.to_thread(self._arm)
        self.loop.add_reader(self._inotify.fd, self._readable)
        log.info("self-healing: watching %s", ", ".join(sorted(self.targets)))

    async def stop(self) -> None:
        inotify, self._inotify = self._inotify, None
        if inotify is not None:
            self.loop.remove_reader(inotify.fd)
            if self._read_due is not None:
                self._read_due.cancel()
                self._read_due = None
            with self._arming:
                inotify.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._moved.set()

    def _idle(self) -> bool:
        inotify = self._inotify
        unread = inotify is not None and (self._read_due is not None or inotify.queued() > 0)
        return not unread and not self._pending and not self._tasks

    async def settled(self) -> None:
        """Return once every event queued before the call (and every event the checks' own writes
        raise) has been read and judged, and every check it caused has finished."""
        while not self._idle():
            self._moved.clear()
            await self._moved.wait()

    def _step(self) -> None:
        self._moved.set()

    # -- watches ---------------------------------------------------------------------------------

    def _plan(self) -> dict[str, bool]:
        """Each target that exists (recursive where it matters), and the nearest existing ancestor
        of each, so its removal and re-creation are seen."""
        plan: dict[str, bool] = {}
        for target, recursive in self.targets.items():
            path = Path(target)
            if path.is_dir():
                plan[target] = plan.get(target, False) or recursive
            parent = path.parent
            while not parent.is_dir() and parent != parent.parent:
                parent = parent.parent
            plan.setdefault(str(parent), False)
        return plan

    def _arm(self) -> None:
        """Blocking (stat, inotify_add_watch): run in a worker thread or the observer's."""
        with self._arming:
            self._arm_locked()

    def _arm_locked(self) -> None:
        inotify = self._inotify
        if inotify is None:
            return
        plan = self._plan()
        # A watched directory that was removed lost its watch (the kernel dropped it), and one re-created
        # under the same name is another directory (its inode may be reused, hence both).
        for path, (recursive, identity) in list(self._watches.items()):
            if plan.get(path) != recursive or path not in inotify or _dir_identity(path) != identity:
                inotify.remove(path)
                if recursive:
                    for sub in inotify.watched():
                        if sub.startswith(path + os.sep):
                            inotify.remove(sub)
                del self._watches[path]
        for path, recursive in plan.items():
            if path in self._watches:
                continue
            try:
                now = _dir_identity(path)  # before the watch: a later replacement re-arms again
                if now is None:
                    continue  # removed meanwhile: its directory event re-arms
                inotify.add(path)
                self._watches[path] = (recursive, now)
                if recursive:
                    self._watch_below(inotify, path)
            except OSError as exc:  # removed meanwhile (the next directory event re-arms), or out of watches
                log.warning("self-healing: cannot watch %s: %s", path, exc)

    @staticmethod
    def _watch_below(inotify: Inotify, path: str) -> None:
        for parent, dirs, _files in os.walk(path):
            for name in dirs:
                with contextlib.suppress(OSError):  # removed meanwhile: its parent's event says so
                    inotify.add(os.path.join(parent, name))

    def _readable(self) -> None:
        """The inotify descriptor is readable (the event loop): the batch is read READ_DELAY later."""
        inotify = self._inotify
        if inotify is None or self._read_due is not None:
            return
        self.loop.remove_reader(inotify.fd)
        self._read_due = self.loop.call_later(self.read_delay, self._read_batch)
        self._step()

    def _read_batch(self) -> None:
        self._read_due = None
        inotify = self._inotify
        if inotify is None:
            return
        try:
            events = inotify.read()
        except OSError as exc:
            log.error("self-healing: reading inotify events failed: %s", exc)
            events = []
        finally:
            self.loop.add_reader(inotify.fd, self._readable)
        for event in events:
            self._on_inotify(inotify, event)
        self._step()

    def _on_inotify(self, inotify: Inotify, event: Event) -> None:
        if event.overflow:  # events were lost: everything is checked
            self._want(_ALL)
            return
        path = event.path
        if event.mask & (IN_CREATE | IN_MOVED_TO) and event.is_dir and self._below_recursive(path):
            # A new claim directory (or one of its request directories): watched too, with what is in it.
            with contextlib.suppress(OSError):
                inotify.add(path)
                self._watch_below(inotify, path)
        # A temp file is a write in progress (the agent's atomic writes: created, written, closed, then
        # renamed onto the file's name): only the rename's destination is a claim's file.
        if is_temp_name(os.path.basename(path)):
            return
        if event.mask & IN_CREATE and event.is_dir and not any(
                t == path or t.startswith(path + os.sep) for t in self.targets):
            return  # a claim's directory made (its files' events follow); one removed is what needs a check
        if self.engine.own_changes.is_own(path, event.mask):
            self.own_skipped += 1
            return  # the agent's own write or removal: nothing to restore
        self.on_event([path], event.is_dir)

    def _below_recursive(self, path: str) -> bool:
        return any(recursive and path.startswith(target + os.sep) for target, recursive in self.targets.items())

    # -- events (the event loop) -----------------------------------------------------------------

    def on_event(self, paths: list[str], is_directory: bool) -> None:
        for path in paths:
            if is_directory and any(t == path or t.startswith(path + os.sep) for t in self.targets):
                self._want(_ALL)  # a watched directory or one above it came or went
            elif path in self.sockets:
                self._want(_SOCKETS)
            elif (uid := self._uid_of(path)) is not None:
                self._want(uid)

    def _uid_of(self, path: str) -> str | None:
        s = self.settings
        parent, name = os.path.split(path)
        if parent == str(s.cdi_dir):
            return filenames.claim_uid_of_spec(name, s.cdi_vendor)
        prefix = str(s.metadata_dir) + os.sep
        if path.startswith(prefix):
            uid = path[len(prefix):].split(os.sep, 1)[0]
            try:
                check_uid(uid)
            except InvalidName:
                return None
            return uid
        return None

    def _want(self, key: str) -> None:
        if key in self._pending or self._inotify is None:
            return
        self._pending.add(key)
        self.loop.call_later(self.debounce, self._fire, key)

    def _fire(self, key: str) -> None:
        self._pending.discard(key)
        if self._inotify is None:
            self._step()
            return
        task = asyncio.create_task(self._check(key), name=f"selfheal {key}")
        self._tasks.add(task)
        task.add_done_callback(self._check_done)
        self._step()

    def _check_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._step()

    async def _check(self, key: str) -> None:
        try:
            if key == _ALL:
                await self.check_all()
            elif key == _SOCKETS:
                await self.check_sockets()
            else:
                await asyncio.to_thread(self._check_claim, key)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("self-healing check %s failed", key)

    # -- checks ----------------------------------------------------------------------------------

    async def check_all(self) -> None:
        """Re-arm the watches, then check the sockets, the CDI directory and every prepared claim."""
        await asyncio.to_thread(self._arm)
        await self.check_sockets()
        await asyncio.to_thread(self._check_claims)

    async def check_sockets(self) -> None:
        async with self._socket_lock:
            for path in await self.servers.restore_missing():
                self.restored += 1
                log.warning("socket %s was removed from under the agent: bound it again", path)

    def _check_claims(self) -> None:
        cdi_dir = self.settings.cdi_dir
        if not cdi_dir.is_dir():
            makedirs(cdi_dir, 0o755)
            log.warning("the CDI directory %s was removed from under the agent: re-created it", cdi_dir)
        uids = set(self.engine.records) | set(self.engine.store.uids())
        for uid in sorted(uids):
            with contextlib.suppress(InvalidName):
                check_uid(uid)
                self._check_claim(uid)

    def _check_claim(self, uid: str) -> None:
        """Worker thread: restore the claim's files from its record, under the claim's locks."""
        self.claim_checks += 1
        with self.engine.claim_locked(uid):
            self.engine.ensure_checked(uid)  # a record listed at start-up and not yet checked: now
            record = self.engine.current_or_purge(uid)
            if record is None:
                return  # not prepared: nothing of it is restored
            repaired = repair_claim(self.engine, record)
        for path in repaired:
            self.restored += 1
            log.warning("%s of claim %s/%s was removed or changed by someone else: restored it from the "
                        "claim's record", path, record.namespace, record.name)

