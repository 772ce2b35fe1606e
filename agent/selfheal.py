"""Self-healing: files and sockets removed or changed from under the running agent come back.

Watched with inotify (`watchdog`), design target 1 s from the event:
- a prepared claim's CDI specs (`<cdi dir>`) and metadata files (`<metadata dir>/<uid>/...`):
  deleted or changed by someone else -> rewritten from the claim's record. Each check holds the
  claim's locks (`PrepareEngine.claim_locked`) and reads the record as it is then, so it never
  races a prepare, unprepare or metadata refresh (of this agent or an overlapping one), and it
  rewrites only files whose content differs: the agent's own writes cause one check and no write.
- the registration and DRA sockets: removed (a kubelet restart cleaning its plugin directories)
  -> bound again (`Servers.restore_missing`), and the kubelet re-registers the plugin when it
  sees the registration socket appear.
- the CDI directory: removed -> re-created, and the prepared claims' specs restored into it.

Events come from watchdog's observer thread and are handed to the event loop; they are
debounced per claim, so a burst of events costs one check. A watched directory that is removed
is watched again once it exists again: the nearest existing ancestor of each directory is
watched too, and any directory event on the way re-arms the watches and checks everything
(events missed while a directory was gone are covered by that full check).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import warnings
from pathlib import Path

from watchdog.events import (
    EVENT_TYPE_CLOSED,
    EVENT_TYPE_CREATED,
    EVENT_TYPE_DELETED,
    EVENT_TYPE_MODIFIED,
    EVENT_TYPE_MOVED,
    DirCreatedEvent,
    DirDeletedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver, ObservedWatch

from agent import cdispecs
from agent.config import Settings
from agent.fsutil import is_temp_name, makedirs
from agent.names import InvalidName, check_uid
from agent.prepare import PrepareEngine
from agent.recovery import repair_claim
from agent.server import Servers

log = logging.getLogger(__name__)

# watchdog's recursive inotify watch warns when a new subdirectory is found both by its event and
# by its own scan of the parent (a claim's metadata directory written at once): the same watch is
# kept, nothing is lost.
warnings.filterwarnings("ignore", message="Callback with id", category=RuntimeWarning,
                        module=r"watchdog\.observers\.inotify")

DEBOUNCE = 0.1  # seconds: a burst of events on one claim costs one check
# Reads (opened, closed without writing) are left out: the checks read the files themselves.
_RELEVANT = {EVENT_TYPE_CREATED, EVENT_TYPE_DELETED, EVENT_TYPE_MODIFIED, EVENT_TYPE_MOVED, EVENT_TYPE_CLOSED}
_STRUCTURAL = {EVENT_TYPE_CREATED, EVENT_TYPE_DELETED, EVENT_TYPE_MOVED}
# The same events as inotify's mask: opens and reads (IN_OPEN, IN_CLOSE_NOWRITE) never reach the
# agent's process at all. Every prepare's writes and every check's reads of a claim's files caused
# them, and parsing them in watchdog's threads cost more CPU than the prepare itself (issue 11).
_EVENT_FILTER: list[type[FileSystemEvent]] = [
    FileCreatedEvent, DirCreatedEvent, FileDeletedEvent, DirDeletedEvent, FileMovedEvent, DirMovedEvent,
    FileModifiedEvent, FileClosedEvent]
_ALL = "*"  # the key of a full check
_SOCKETS = "sockets"


def _decode(path: str | bytes) -> str:
    return os.fsdecode(path)


def _dir_identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class _Handler(FileSystemEventHandler):
    def __init__(self, healer: SelfHealer) -> None:
        self.healer = healer

    def on_any_event(self, event: FileSystemEvent) -> None:  # the observer's thread
        if event.event_type not in _RELEVANT:
            return
        if event.is_directory and event.event_type not in _STRUCTURAL:
            return  # a directory's content changed: its files have their own events
        # A temp file is a write in progress (the agent's atomic writes: created, written, closed, then
        # renamed onto the file's name): only the rename's destination is a claim's file. Dropped here,
        # they cost no wake-up of the event loop (three per file the agent writes).
        paths = [path for path in (_decode(event.src_path), _decode(event.dest_path or b""))
                 if path and not is_temp_name(os.path.basename(path))]
        if not paths:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: the agent is stopping
            self.healer.loop.call_soon_threadsafe(self.healer.on_event, paths, event.is_directory)


class SelfHealer:
    def __init__(self, settings: Settings, engine: PrepareEngine, servers: Servers,
                 debounce: float = DEBOUNCE) -> None:
        self.settings = settings
        self.engine = engine
        self.servers = servers
        self.debounce = debounce
        self.loop = asyncio.get_running_loop()
        # The directories whose content matters, and whether their subdirectories do too.
        self.targets: dict[str, bool] = {}
        for path, recursive in ((settings.cdi_dir, False), (settings.metadata_dir, True),
                                (settings.dra_socket.parent, False), (settings.registration_socket.parent, False)):
            key = str(path)
            self.targets[key] = self.targets.get(key, False) or recursive
        self.sockets = {str(settings.dra_socket), str(settings.registration_socket)}
        self._observer: BaseObserver | None = None
        self._watches: dict[str, tuple[bool, tuple[int, int], ObservedWatch]] = {}
        self._arming = threading.Lock()
        self._pending: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._socket_lock = asyncio.Lock()
        self.restored = 0  # files and sockets restored (for tests and logs)

    async def start(self) -> None:
        observer = Observer()
        observer.daemon = True
        self._observer = observer
        await asyncio.to_thread(self._arm)
        # In a worker thread: starting the recursive watch of the metadata directory adds a watch per
        # claim directory (20,000 with 10,000 prepared claims), which must not hold up the event loop.
        await asyncio.to_thread(observer.start)
        log.info("self-healing: watching %s", ", ".join(sorted(self.targets)))

    async def stop(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            await asyncio.to_thread(observer.join, 5.0)
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

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
        observer = self._observer
        if observer is None:
            return
        plan = self._plan()
        # A watched directory that was removed ends its watch (the emitter stops), and one
        # re-created under the same name is another directory (its inode may be reused, hence both).
        alive = {e.watch for e in observer.emitters if e.is_alive() and e.should_keep_running()}
        for path, (recursive, identity, watch) in list(self._watches.items()):
            if plan.get(path) != recursive or watch not in alive or _dir_identity(path) != identity:
                with contextlib.suppress(Exception):
                    observer.unschedule(watch)
                del self._watches[path]
        for path, recursive in plan.items():
            if path in self._watches:
                continue
            try:
                now = _dir_identity(path)  # before the watch: a later replacement re-arms again
                if now is None:
                    continue  # removed meanwhile: its directory event re-arms
                watch = observer.schedule(_Handler(self), path, recursive=recursive, event_filter=_EVENT_FILTER)
                self._watches[path] = (recursive, now, watch)
            except OSError as exc:  # removed meanwhile (the next directory event re-arms), or out of watches
                log.warning("self-healing: cannot watch %s: %s", path, exc)

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
            return cdispecs.claim_uid_of_spec(name, s.cdi_vendor)
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
        if key in self._pending or self._observer is None:
            return
        self._pending.add(key)
        self.loop.call_later(self.debounce, self._fire, key)

    def _fire(self, key: str) -> None:
        self._pending.discard(key)
        if self._observer is None:
            return
        task = asyncio.create_task(self._check(key), name=f"selfheal {key}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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

