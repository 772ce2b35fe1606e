"""Where prepare reads ResourceClaims: the API server, or a directory when offline.

Both are a `ClaimSource`: `await get(namespace, name)` answers with the claim as a
plain JSON dict, raises ClaimNotFound when there is no such claim, and
ClaimSourceError when the claim cannot be read now. A source that reads local
files is also a `LocalClaimSource`, whose blocking `read` the prepare engine
calls in the worker thread that writes the claim's files (one thread hop).
The API source answers within a deadline well under the kubelet's 45 s, so the
kubelet gets a per-claim error, not a timeout of the whole call.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import yaml

from agent import kube
from agent.errors import ClaimFailure
from agent.kube import Backoff

if TYPE_CHECKING:  # the API client is imported by the API source's first read (`agent.kube`)
    import lightkube

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_DEADLINE = 30.0
NAME_MAX = 255  # bytes in one file name
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ClaimNotFound(ClaimFailure):
    pass


class ClaimSourceError(ClaimFailure):
    pass


class ClaimSource(Protocol):
    async def get(self, namespace: str, name: str) -> Mapping[str, Any]: ...


@runtime_checkable
class LocalClaimSource(ClaimSource, Protocol):
    def read(self, namespace: str, name: str) -> Mapping[str, Any]: ...


class ApiClaimSource:
    def __init__(self, client: lightkube.AsyncClient, concurrency: int = 16,
                 deadline: float = DEFAULT_DEADLINE, *, backoff: Backoff | None = None) -> None:
        self.client = client
        self.deadline = deadline
        # Attempts are bounded by the deadline, not counted.
        self.backoff = backoff or Backoff(initial=0.2, maximum=5.0, attempts=0)
        self._slots = asyncio.Semaphore(concurrency)

    async def get(self, namespace: str, name: str) -> dict[str, Any]:
        from lightkube.resources.resource_v1 import ResourceClaim

        async def read() -> dict[str, Any]:
            return kube.plain(await self.client.get(ResourceClaim, name, namespace=namespace))

        return await self._call(f"ResourceClaim {namespace}/{name}", read)

    async def _call(self, what: str, read: Callable[[], Awaitable[T]]) -> T:
        """`read()`, retried on what may heal until the deadline; ClaimNotFound for a 404."""
        failures = 0
        last = "no answer"
        try:
            async with asyncio.timeout(self.deadline):
                while True:
                    try:
                        async with self._slots:
                            return await read()
                    except Exception as exc:
                        if kube.is_not_found(exc):
                            raise ClaimNotFound(f"{what} not found") from exc
                        last = kube.describe(exc)
                        if not kube.is_retryable(exc):
                            raise ClaimSourceError(f"reading {what} failed: {last}") from exc
                        failures += 1
                        delay = self.backoff.delay(failures, exc)
                        log.warning("reading %s: %s; retrying in %.2fs", what, last, delay)
                        await asyncio.sleep(delay)
        except TimeoutError as exc:
            raise ClaimSourceError(f"reading {what} did not succeed within {self.deadline:g}s "
                                   f"({failures} failed tries, last: {last})") from exc


class DirectoryClaimSource:
    """`DIR/resourceclaims/<namespace>/<name>.yaml` (YAML or JSON content).

    A claim name may be 253 bytes, so `<name>.yaml` can exceed the 255-byte limit of a file
    name: such a claim may be stored under any `*.yaml` name in its namespace directory, and
    is found by the name inside the object.
    """

    # A prepared claim is answered from its record and never read again: the cache serves a prepare
    # after an unprepare, retries, and the claim status written after each (a large one held
    # thousands of parsed claims for nothing). A node full of pods (the kubelet's default limit is
    # 110) prepared at once fits: a smaller cache read in a cycle would parse every claim each time.
    CACHE_SIZE = 128

    def __init__(self, directory: Path) -> None:
        self.root = Path(directory) / "resourceclaims"
        # Parsed claims by path, valid while the file's (inode, mtime, size) stay the same: the
        # kubelet asks for the same claims again and again, and parsing YAML is the slow part.
        self._cache: OrderedDict[Path, tuple[tuple[int, int, int], dict[str, Any]]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._root_real: str | None = None  # reads run in several worker threads at once

    async def get(self, namespace: str, name: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.read, namespace, name)

    def path_of(self, namespace: str, name: str) -> Path:
        for part in (namespace, name):
            if not part or part in (".", "..") or "/" in part or "\0" in part or os.sep in part:
                raise ClaimSourceError(f"claim {namespace!r}/{name!r}: not a valid namespace and name")
        path = self.root / namespace / f"{name}.yaml"
        if len(os.fsencode(path.name)) > NAME_MAX:
            path = self._find_by_name(namespace, name)
        # A symlink may still point anywhere: the file read must lie under the root. Without a link
        # in the two components below the root it does (resolving the whole path cost more).
        if not (_plain(path) and _plain(path.parent)) and not _within(path, self._real_root()):
            raise ClaimSourceError(f"claim {namespace}/{name}: {path} leads outside {self.root}")
        return path

    def read(self, namespace: str, name: str) -> dict[str, Any]:
        """The claim (shared with later callers: treat it as read-only)."""
        return self.read_path(namespace, name, self.path_of(namespace, name))

    def read_path(self, namespace: str, name: str, path: Path) -> dict[str, Any]:
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                key = (st.st_ino, st.st_mtime_ns, st.st_size)
                with self._cache_lock:
                    cached = self._cache.get(path)
                    if cached is not None and cached[0] == key:
                        self._cache.move_to_end(path)
                        return cached[1]
                text = f.read()
        except FileNotFoundError as exc:
            with self._cache_lock:
                self._cache.pop(path, None)
            raise ClaimNotFound(f"ResourceClaim {namespace}/{name} not found "
                                f"({path} does not exist)") from exc
        except OSError as exc:
            raise ClaimSourceError(f"ResourceClaim {namespace}/{name}: cannot read {path}: {exc}") from exc
        doc = self._parse(namespace, name, path, text)
        with self._cache_lock:
            self._cache[path] = (key, doc)
            if len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        return doc

    def _find_by_name(self, namespace: str, name: str) -> Path:
        directory = self.root / namespace
        try:
            entries = sorted(e for e in os.listdir(directory) if e.endswith(".yaml"))
        except OSError:
            entries = []
        for entry in entries:
            path = directory / entry
            try:
                doc = self.read_path(namespace, name, path)
            except ClaimFailure:
                continue
            meta = doc.get("metadata")
            if isinstance(meta, Mapping) and meta.get("name") == name:
                return path
        raise ClaimNotFound(f"ResourceClaim {namespace}/{name} not found (the name is too long for a "
                            f"file of its own, and no *.yaml file in {directory} holds it)")

    def _real_root(self) -> str:
        if self._root_real is None or not os.path.isdir(self._root_real):
            self._root_real = os.path.realpath(self.root)
        return self._root_real

    @staticmethod
    def _parse(namespace: str, name: str, path: Path, text: bytes) -> dict[str, Any]:
        try:
            doc = yaml.load(text, Loader=_LOADER)
        except yaml.YAMLError as exc:
            raise ClaimSourceError(f"ResourceClaim {namespace}/{name}: {path} is not valid YAML: "
                                   f"{_one_line(exc)}") from exc
        if not isinstance(doc, dict):
            raise ClaimSourceError(f"ResourceClaim {namespace}/{name}: {path} does not hold an object")
        return doc


def _plain(path: Path) -> bool:
    """Not a symbolic link (a missing path is judged by the read that follows)."""
    try:
        return not stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return True


def _within(path: Path, root: str) -> bool:
    return os.path.commonpath([os.path.realpath(path), root]) == root


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())
