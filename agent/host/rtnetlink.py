"""rtnetlink (netlink(7), rtnetlink(7)) on a plain socket: dumps of the links and the addresses of a
network namespace, and its link and address events, as messages with their attributes undecoded.

The agent makes two dump requests and one subscription, and reads a handful of attributes: a
library for all of netlink costs more than that work (pyroute2 loads some 160 modules, about a
sixth of the agent's resident memory, for them). The message layouts are the kernel's
(<linux/netlink.h>, <linux/rtnetlink.h>, <linux/if_link.h>, <linux/if_addr.h>); what the
attributes mean is read by `agent.inventory.netlink`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass

# Message types (<linux/netlink.h>, <linux/rtnetlink.h>).
NLMSG_NOOP, NLMSG_ERROR, NLMSG_DONE, NLMSG_OVERRUN = 1, 2, 3, 4
RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK = 16, 17, 18
RTM_NEWADDR, RTM_DELADDR, RTM_GETADDR = 20, 21, 22
LINK_MESSAGES = (RTM_NEWLINK, RTM_DELLINK)
ADDRESS_MESSAGES = (RTM_NEWADDR, RTM_DELADDR)

NLM_F_REQUEST = 0x1
NLM_F_DUMP_INTR = 0x10  # the table changed while it was dumped: the dump is not consistent
NLM_F_DUMP = 0x300  # NLM_F_ROOT | NLM_F_MATCH

# Multicast groups (the RTMGRP_* bit masks of bind()).
RTMGRP_LINK = 0x1
RTMGRP_IPV4_IFADDR = 0x10
RTMGRP_IPV6_IFADDR = 0x100

# Attributes the agent reads.
IFLA_ADDRESS, IFLA_IFNAME, IFLA_MTU, IFLA_LINKINFO, IFLA_CARRIER, IFLA_PERM_ADDRESS = 1, 3, 4, 18, 33, 54
IFLA_INFO_KIND = 1  # nested in IFLA_LINKINFO
IFA_ADDRESS, IFA_LOCAL, IFA_LABEL, IFA_FLAGS = 1, 2, 3, 8

_NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED and NLA_F_NET_BYTEORDER
_CLONE_NEWNET = 0x40000000
_NETNS_DIR = "/run/netns"  # where `ip netns` keeps a name for each namespace
_RECV_SIZE = 65536  # the kernel sizes a dump's messages to the reads it has seen, up to this

_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port
_IFINFO = struct.Struct("=BxHiII")  # ifinfomsg: family, device type, index, flags, change
_IFADDR = struct.Struct("=BBBBI")  # ifaddrmsg: family, prefix length, flags, scope, index
_ATTR = struct.Struct("=HH")  # rtattr: length, type
_ERRNO = struct.Struct("=i")


class DumpInterrupted(Exception):
    """The kernel's table changed while it was being dumped (NLM_F_DUMP_INTR): dump again."""


@dataclass(frozen=True, slots=True)
class LinkMessage:
    type: int  # RTM_NEWLINK or RTM_DELLINK
    index: int
    flags: int  # IFF_*
    change: int
    attrs: dict[int, bytes]


@dataclass(frozen=True, slots=True)
class AddressMessage:
    type: int  # RTM_NEWADDR or RTM_DELADDR
    family: int
    prefixlen: int
    flags: int  # the low 8 bits of the address flags (IFA_FLAGS holds all 32)
    scope: int
    index: int
    attrs: dict[int, bytes]


Message = LinkMessage | AddressMessage


def attributes(data: bytes | memoryview, offset: int = 0, end: int | None = None) -> dict[int, bytes]:
    """The attributes from `offset` to `end`, by type; the first of a type repeated."""
    view = memoryview(data)
    end = len(view) if end is None else end
    out: dict[int, bytes] = {}
    while offset + _ATTR.size <= end:
        length, kind = _ATTR.unpack_from(view, offset)
        if length < _ATTR.size or offset + length > end:
            break
        out.setdefault(kind & _NLA_TYPE_MASK, bytes(view[offset + _ATTR.size:offset + length]))
        offset += (length + 3) & ~3
    return out


def text(value: bytes | None) -> str | None:
    """A string attribute (NUL-terminated)."""
    return None if value is None else value.split(b"\0", 1)[0].decode(errors="replace")


def u32(value: bytes | None) -> int | None:
    return None if value is None or len(value) < 4 else int(struct.unpack_from("=I", value)[0])


def messages(data: bytes) -> Iterator[tuple[int, int, int, Message | None]]:
    """(type, flags, sequence, message) for each message in one datagram; the message is None for
    types other than links and addresses. NLMSG_ERROR with an error raises it as OSError."""
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, kind, flags, seq, _port = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size or offset + length > len(data):
            break
        body = offset + _HEADER.size
        end = offset + length
        message: Message | None = None
        if kind == NLMSG_ERROR and end - body >= _ERRNO.size:
            (code,) = _ERRNO.unpack_from(data, body)
            if code < 0:
                raise OSError(-code, os.strerror(-code))
        elif kind in LINK_MESSAGES and end - body >= _IFINFO.size:
            _family, _dev, index, ifflags, change = _IFINFO.unpack_from(data, body)
            message = LinkMessage(kind, index, ifflags, change, attributes(data, body + _IFINFO.size, end))
        elif kind in ADDRESS_MESSAGES and end - body >= _IFADDR.size:
            family, prefixlen, aflags, scope, index = _IFADDR.unpack_from(data, body)
            message = AddressMessage(kind, family, prefixlen, aflags, scope, index,
                                     attributes(data, body + _IFADDR.size, end))
        yield kind, flags, seq, message
        offset += (length + 3) & ~3


class RtnlSocket:
    """A NETLINK_ROUTE socket, blocking, or non-blocking for the event loop (`fileno`, `received`).
    `groups`: the multicast groups whose events it receives; `netns`: a namespace named by `ip
    netns` to open it in (never created) instead of this process's own."""

    def __init__(self, *, groups: int = 0, rcvbuf: int = 0, netns: str | None = None) -> None:
        self.sock = _open(netns)
        try:
            if rcvbuf:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            self.sock.bind((0, groups))
        except BaseException:
            self.sock.close()
            raise
        self._seq = 0
        self.pending: list[Message] = []  # events that came in during a dump on a subscribed socket

    def __enter__(self) -> RtnlSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def fileno(self) -> int:
        return self.sock.fileno()

    def dump(self, kind: int) -> list[Message]:
        """Every link (RTM_GETLINK) or address (RTM_GETADDR); DumpInterrupted when the table changed
        meanwhile. The socket must be blocking (`setblocking(False)` after the dumps)."""
        self._seq += 1
        seq = self._seq
        family = (_IFINFO if kind == RTM_GETLINK else _IFADDR).pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        self.sock.send(_HEADER.pack(_HEADER.size + len(family), kind, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + family)
        out: list[Message] = []
        interrupted = False
        while True:
            data = self.sock.recv(_RECV_SIZE)
            for mtype, flags, mseq, message in messages(data):
                if mseq != seq:  # an event, multicast to this socket's groups
                    if message is not None:
                        self.pending.append(message)
                    continue
                interrupted |= bool(flags & NLM_F_DUMP_INTR)
                if mtype == NLMSG_DONE:
                    if interrupted:
                        raise DumpInterrupted(f"netlink dump {kind} interrupted")
                    return out
                if message is not None:
                    out.append(message)

    def received(self, data: bytes) -> list[Message]:
        """The link and address messages of one datagram read from a subscribed socket."""
        return [m for _, _, _, m in messages(data) if m is not None]


def _open(netns: str | None) -> socket.socket:
    if netns is None:
        return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, socket.NETLINK_ROUTE)
    # A socket belongs to the namespace of the thread that opens it: a thread of its own enters the
    # namespace (setns(2)), opens it and ends, and no other thread ever changes namespace.
    found: list[socket.socket | BaseException] = []

    def open_there() -> None:
        try:
            fd = os.open(os.path.join(_NETNS_DIR, netns), os.O_RDONLY | os.O_CLOEXEC)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    code = ctypes.get_errno()
                    raise OSError(code, f"setns into network namespace {netns}: {os.strerror(code)}")
            finally:
                os.close(fd)
            found.append(socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, socket.NETLINK_ROUTE))
        except BaseException as exc:
            found.append(exc)

    thread = threading.Thread(target=open_there, name="netns-socket")
    thread.start()
    thread.join()
    result = found[0] if found else OSError(errno.EIO, "opening a netlink socket in a namespace failed")
    if isinstance(result, BaseException):
        raise result
    return result
