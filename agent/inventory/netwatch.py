"""Link and address events from rtnetlink (pyroute2's AsyncIPRoute on the event loop), as an asyncio
async iterator.

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
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from pyroute2 import AsyncIPRoute
from pyroute2.netlink.rtnl import (
    RTM_DELADDR,
    RTM_DELLINK,
    RTM_NEWADDR,
    RTM_NEWLINK,
    RTMGRP_IPV4_IFADDR,
    RTMGRP_IPV6_IFADDR,
    RTMGRP_LINK,
)

from agent.inventory.netlink import CHANGE_NEW_LINK, Message, address_of, dump, label_of, link_of, route_socket

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
        self._ipr: Any = None  # pyroute2's AsyncIPRoute over self._sock
        self._sock: socket.socket | None = None
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

    def known_links(self) -> dict[int, str]:
        """The links this watcher knows now, by index (their names): from its last dump, kept by events."""
        return dict(self._names)

    # -- the socket ---------------------------------------------------------

    async def _connect(self) -> None:
        # Opening the socket may enter a namespace (a thread that is started and joined): off the loop.
        opening = asyncio.ensure_future(asyncio.to_thread(route_socket, self.netns))
        try:
            sock = await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(_close_opened)  # the thread goes on: what it opens is closed
            raise
        ipr = AsyncIPRoute(use_socket=sock, groups=GROUPS)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
            # Subscribed before the dump: a change during it waits as an event, in pyroute2's queue
            # (read by the loop meanwhile), and is taken after the dump, in its order.
            await ipr.bind(groups=GROUPS)
            # Known links, so that RTM_NEWLINK can tell "added" from "changed" and address events
            # carry names. A dump (retried when interrupted) decodes every link: in a worker thread.
            links, _ = await asyncio.to_thread(dump, self.netns, addresses=False)
        except BaseException:
            _close(ipr, sock)
            raise
        if self._closed:
            _close(ipr, sock)
            return
        self._ipr, self._sock = ipr, sock
        self._names = {link.index: link.ifname for link in links}

    def _drop_socket(self) -> None:
        ipr, sock, self._ipr, self._sock = self._ipr, self._sock, None, None
        if sock is not None:
            try:
                _close(ipr, sock)
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
                # ENOBUFS (the kernel dropped events: the receive buffer overflowed) lands here too:
                # pyroute2 then refuses the socket for good, and events were lost anyway.
                log.warning("netlink events: %s; reopening the socket", _describe(exc))
                self._drop_socket()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF)

    async def _pump(self) -> None:
        while not self._closed and (ipr := self._ipr) is not None:
            # One datagram's messages per get(); an error the socket reported (ENOBUFS, a reset)
            # comes out of it as an exception, after the messages received before it.
            received = False
            async for msg in ipr.get():
                received = True
                self._take(msg)
            if not received:
                # Nothing at all means the socket was shut under us: reopen rather than spin.
                raise ConnectionError("netlink socket closed")

    def _take(self, msg: Message) -> None:
        event = self._event_of(msg)
        if event is not None:
            self._put(event)

    def _event_of(self, msg: Message) -> NetEvent | None:
        kind = msg["header"]["type"]
        if kind == RTM_DELLINK:
            # Deleted, or moved to another network namespace (RTM_DELLINK here, RTM_NEWLINK there):
            # gone from this one either way.
            link = link_of(msg)
            self._names.pop(link.index, None)
            return NetEvent(LINK_REMOVED, link.ifname, link.index, link.link_up)
        if kind == RTM_NEWLINK:
            # A rename is a change of a known index: the name is taken from the message each time.
            link = link_of(msg)
            known = link.index in self._names
            self._names[link.index] = link.ifname
            added = not known or int(msg["change"]) == CHANGE_NEW_LINK
            return NetEvent(LINK_ADDED if added else LINK_CHANGED, link.ifname, link.index, link.link_up)
        if kind not in (RTM_NEWADDR, RTM_DELADDR):
            return None
        addr = address_of(msg)
        if addr is None:
            return None
        ifname = self._names.get(addr.index) or label_of(msg)
        return NetEvent(ADDRESS_ADDED if kind == RTM_NEWADDR else ADDRESS_REMOVED, ifname, addr.index,
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


def _close(ipr: Any, sock: socket.socket) -> None:
    """Close pyroute2's side (its transport on the loop), then the socket: given to it with
    `use_socket`, it is ours to close."""
    try:
        ipr.close()
    finally:
        sock.close()


def _close_opened(opening: asyncio.Future[socket.socket]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


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
