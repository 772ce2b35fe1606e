"""The agent's unix socket files in the kubelet's directories: put in place atomically, replaced only
when they are sockets, removed only while they are still this process's own. Light to import (the registration server,
`agent.kubelet.registration`, imports it and needs neither gRPC nor asyncio).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
from pathlib import Path

from agent.config import UNIX_PATH_MAX

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


def listen(path: Path) -> tuple[socket.socket, SocketIdentity]:
    """A listening socket at `path`, bound under a private name and renamed into place."""
    check_length(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    check_replaceable(path)
    bound = private_name(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Bound under a restrictive umask: the socket never exists with wider permissions, even for an instant.
        old = os.umask(0o177)
        try:
            sock.bind(str(bound))
        finally:
            os.umask(old)
        sock.listen(64)
        return sock, put_in_place(bound, path)
    except BaseException:
        sock.close()
        with contextlib.suppress(OSError):
            os.unlink(bound)
        raise


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
