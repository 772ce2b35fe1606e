"""Link and address events from rtnetlink, as an asyncio async iterator.

The daemon rescans NICs when links or addresses change. It does not trust the
events to carry the whole truth: they only say *when* to look. So the one
thing the watcher must never do is lose events silently. When the kernel drops
messages (the socket's receive buffer overflowed) or the socket fails, the
watcher opens a new one and then says `resync`: anything may have changed.

    async with NetlinkWatcher() as watcher:
        async for _ in debounced(watcher, settings.netlink_debounce):
            await inventory.scan(["nic"])
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from agent.host.rtnetlink import (
    RTM_DELLINK,
    RTM_GETLINK,
    RTM_NEWADDR,
    RTMGRP_IPV4_IFADDR,
    RTMGRP_IPV6_IFADDR,
    RTMGRP_LINK,
    LinkMessage,
    Message,
    RtnlSocket,
)
from agent.inventory.netlink import CHANGE_NEW_LINK, address_of, label_of, link_of

log = logging.getLogger(__name__)

GROUPS = RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR

LINK_ADDED = "link-added"
LINK_REMOVED = "link-removed"
LINK_CHANGED = "link-changed"
ADDRESS_ADDED = "address-added"
ADDRESS_REMOVED = "address-removed"
RESYNC = "resync"  # events were lost: rescan everything

_MAX_BACKOFF = 5.0
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class NetEvent:
    kind: str
    ifname: str = ""
    index: int = 0
    link_up: bool | None = None  # link events: admin up and carrier
    address: str = ""  # address events: CIDR


class NetlinkWatcher:
    """Subscribes to link and IPv4/IPv6 address events of this network namespace.

    Use it from one event loop: `start()` (or `async with`), iterate, `close()`.
    `netns` names a network namespace to watch instead of this process's own.
    """

    def __init__(self, *, netns: str | None = None, queue_size: int = 4096,
                 rcvbuf: int = 4 * 1024 * 1024) -> None:
        self.netns = netns
        self.rcvbuf = rcvbuf
        self._queue: asyncio.Queue[NetEvent | None] = asyncio.Queue(maxsize=max(queue_size, 2))
        self._sock: RtnlSocket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._names: dict[int, str] = {}  # link index -> ifname
        self._closed = False
        self.reconnects = 0

    async def start(self) -> None:
        """Subscribe; events from this point on are delivered."""
        if self._closed:
            raise RuntimeError("this netlink watcher is closed")
        if self._reader is not None:
            return
        await self._connect()
        self._reader = asyncio.create_task(self._read_forever(), name="netlink-watcher")

    async def close(self) -> None:
        """Close the socket and end the reader; iteration then ends."""
        if self._closed:
            return
        self._closed = True
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        self._drop_socket()
        self._put(None)

    async def __aenter__(self) -> NetlinkWatcher:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    def events(self) -> AsyncIterator[NetEvent]:
        return self

    def __aiter__(self) -> NetlinkWatcher:
        return self

    async def __anext__(self) -> NetEvent:
        if self._closed and self._queue.empty():
            raise StopAsyncIteration
        event = await self._queue.get()
        if event is None:
            self._queue.put_nowait(None)  # every later call ends as well
            raise StopAsyncIteration
        return event

    # -- the socket ---------------------------------------------------------

    async def _connect(self) -> None:
        opening = asyncio.ensure_future(asyncio.to_thread(self._subscribe))
        try:
            sock, names = await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(_close_opened)  # the thread goes on: what it opens is closed
            raise
        if self._closed:
            sock.close()
            return
        self._sock, self._names = sock, names
        for msg in sock.pending:  # events that came in during the dump, in their order
            self._take(msg)
        sock.pending.clear()

    def _subscribe(self) -> tuple[RtnlSocket, dict[int, str]]:
        """(Worker thread.) The subscribed socket and the links known now."""
        sock = RtnlSocket(groups=GROUPS, rcvbuf=self.rcvbuf, netns=self.netns)
        try:
            # Known links, so that RTM_NEWLINK can tell "added" from "changed" and address
            # events carry names. Events that come in during the dump are kept for after it.
            names = {m.index: link_of(m).ifname for m in sock.dump(RTM_GETLINK) if isinstance(m, LinkMessage)}
            sock.sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock, names

    def _drop_socket(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except Exception:
                log.debug("closing the netlink socket failed", exc_info=True)

    async def _read_forever(self) -> None:
        backoff = 0.1
        while not self._closed:
            try:
                if self._sock is None:
                    await self._connect()
                    self.reconnects += 1
                    # Only now, with the new socket subscribed, is a rescan sure to see everything.
                    self._put(NetEvent(RESYNC))
                    backoff = 0.1
                await self._pump()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._closed:
                    return
                # ENOBUFS (the kernel dropped messages) lands here too: the socket is then unusable.
                log.warning("netlink events: %s; reopening the socket", _describe(exc))
                self._drop_socket()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF)

    async def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed and (sock := self._sock) is not None:
            data = await loop.sock_recv(sock.sock, 65536)
            if not data:
                # An empty read means the socket was shut under us: reopen rather than spin.
                raise ConnectionError("netlink socket closed")
            for msg in sock.received(data):
                self._take(msg)

    def _take(self, msg: Message) -> None:
        event = self._event_of(msg)
        if event is not None:
            self._put(event)

    def _event_of(self, msg: Message) -> NetEvent | None:
        if isinstance(msg, LinkMessage):
            link = link_of(msg)
            if msg.type == RTM_DELLINK:
                self._names.pop(link.index, None)
                return NetEvent(LINK_REMOVED, link.ifname, link.index, link.link_up)
            known = link.index in self._names
            self._names[link.index] = link.ifname
            added = not known or msg.change == CHANGE_NEW_LINK
            return NetEvent(LINK_ADDED if added else LINK_CHANGED, link.ifname, link.index, link.link_up)
        addr = address_of(msg)
        if addr is None:
            return None
        ifname = self._names.get(addr.index) or label_of(msg)
        return NetEvent(ADDRESS_ADDED if msg.type == RTM_NEWADDR else ADDRESS_REMOVED, ifname, addr.index,
                        address=addr.cidr)

    def _put(self, event: NetEvent | None) -> None:
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            # Nobody is keeping up: what matters is that a rescan follows, not each event.
            while not self._queue.empty():
                self._queue.get_nowait()
            self._queue.put_nowait(NetEvent(RESYNC))
            if event is None:
                self._queue.put_nowait(None)


def _close_opened(opening: asyncio.Future[tuple[RtnlSocket, dict[int, str]]]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result()[0].close()


def _describe(exc: BaseException) -> str:
    code = getattr(exc, "code", None) if not isinstance(exc, OSError) else exc.errno
    if isinstance(code, int) and code > 0:
        return f"{os.strerror(code)} ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"


async def _next(source: AsyncIterator[T]) -> T:
    return await anext(source)


async def debounced(source: AsyncIterator[Any], delay: float,
                    max_wait: float | None = None) -> AsyncIterator[None]:
    """Yield once per burst of events, `delay` seconds after its last event.

    A link that flaps forever would hold a pure debounce off forever; so a burst
    also ends `max_wait` seconds (default ten delays) after its first event.
    Events that arrive while the consumer works start the next burst. With a
    delay of 0 every event (after the consumer is back) is a burst of its own.
    """
    loop = asyncio.get_running_loop()
    limit = max_wait if max_wait is not None else 10 * delay
    pending: asyncio.Task[Any] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.create_task(_next(source))
            try:
                await pending
            except StopAsyncIteration:
                return
            pending = None
            deadline = loop.time() + limit
            ended = False
            while (left := min(delay, deadline - loop.time())) > 0:
                pending = asyncio.create_task(_next(source))
                done, _ = await asyncio.wait({pending}, timeout=left)
                if not done:
                    break  # quiet for `delay`: the burst is over; `pending` waits for the next one
                task, pending = pending, None
                try:
                    task.result()
                except StopAsyncIteration:
                    ended = True
                    break
            yield None
            if ended:
                return
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
