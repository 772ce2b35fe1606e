"""The agent's unix socket files in the kubelet's directories: served by a gRPC server bound under a
private name and put in place atomically (`serve_at`, `ServedSocket`), replaced only when they are
sockets, removed only while they are still this process's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from agent.config import UNIX_PATH_MAX

if TYPE_CHECKING:
    import grpc

log = logging.getLogger("agent.kubelet.server")

SocketIdentity = tuple[int, int]  # (device, inode) of a socket file this process bound


def check_length(path: Path) -> None:
    if len(os.fsencode(str(path))) >= UNIX_PATH_MAX:
        raise RuntimeError(f"socket path {path} is {len(os.fsencode(str(path)))} bytes, over the unix limit of "
                           f"{UNIX_PATH_MAX - 1}: use a shorter --kubelet-dir")


def check_replaceable(path: Path) -> None:
    """A socket left by an earlier run (or held by an agent being replaced) may be replaced; anything
    else at that path is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise RuntimeError(f"{path} exists and is not a socket: refusing to replace it")


def identity(path: Path) -> SocketIdentity | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def private_name(path: Path) -> Path:
    """A name beside `path` to bind first and rename into place."""
    return path.parent / f".{os.urandom(4).hex()}.sock"


def put_in_place(bound: Path, path: Path) -> SocketIdentity:
    """The socket bound at `bound` (mode 0600: the kubelet runs as root, nobody else may connect)
    renamed onto `path`: atomically replacing an earlier agent's socket, with no moment without one."""
    os.chmod(bound, 0o600)
    try:
        check_replaceable(path)  # a non-socket may have appeared meanwhile
    except RuntimeError:
        os.unlink(bound)
        raise
    os.rename(bound, path)
    found = identity(path)
    if found is None:
        raise RuntimeError(f"{path} vanished right after it was bound")
    return found


def remove_own_socket(path: Path, own: SocketIdentity) -> bool:
    """Remove the socket file only if it is still the one this process bound: during a restart or
    a rolling update with default names, a newer agent may have replaced it with its own, and
    removing that would silently deregister the plugin."""
    if identity(path) != own:
        log.info("not removing %s: another agent has bound it since", path)
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return True


async def serve_at(server: grpc.aio.Server, path: Path) -> SocketIdentity:
    """Start `server` on the unix socket `path`: bound under a private name, 0600, renamed into place
    (replacing an earlier agent's socket); the identity of the file, for `remove_own_socket`."""
    check_length(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    check_replaceable(path)
    # gRPC unlinks the path it bound when the server shuts down, whoever owns that path by then.
    # Binding a private name and renaming it into place keeps a stopping agent from removing the
    # socket of the agent that replaced it; the rename also leaves no moment without a socket.
    bound = private_name(path)
    # The kubelet runs as root: nobody else may connect. Bind under a restrictive umask so the
    # socket never exists with wider permissions, even for an instant.
    old = os.umask(0o177)
    try:
        if server.add_insecure_port(f"unix://{bound}") == 0:
            raise RuntimeError(f"cannot listen on {bound}")
        await server.start()
    finally:
        os.umask(old)
    return put_in_place(bound, path)


class ServedSocket:
    """A gRPC server on a socket of the kubelet's directories; `make` builds a fresh server with its
    servicers. `restore` binds a fresh one when the file was removed from under the agent (a kubelet
    restart cleaning its plugin directories; gRPC cannot add a port to a started server) and stops the
    old one, unreachable now, in the background; a path that holds another socket (an agent that
    replaced this one) is left alone. `stop` removes the file only while it is still this process's."""

    def __init__(self, path: Path, make: Callable[[], grpc.aio.Server]) -> None:
        self.path = path
        self.make = make
        self.server: grpc.aio.Server | None = None
        self._identity: SocketIdentity | None = None
        self._retiring: set[asyncio.Task[None]] = set()  # replaced servers, stopping in the background

    @property
    def started(self) -> bool:
        return self.server is not None

    async def start(self) -> None:
        if self.server is None:
            server = self.make()
            self._identity = await serve_at(server, self.path)
            self.server = server

    async def restore(self, grace: float) -> bool:
        if self.server is None or identity(self.path) is not None:
            return False
        old, fresh = self.server, self.make()
        self._identity = await serve_at(fresh, self.path)
        self.server = fresh
        task = asyncio.create_task(old.stop(grace))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        return True

    async def stop(self, grace: float) -> None:
        server, self.server = self.server, None
        own, self._identity = self._identity, None
        if server is not None:
            await server.stop(grace)
            if own is not None:
                with contextlib.suppress(OSError):
                    remove_own_socket(self.path, own)
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)
