"""Unary gRPC calls over HTTP/2 (RFC 9113, cleartext with prior knowledge, as gRPC speaks on a unix
socket), served by one thread of its own: the registration service, which must answer before the
agent has imported gRPC, asyncio or protobuf (`agent.kubelet.registration`).

What it does of HTTP/2: the connection preface, SETTINGS and their acknowledgement, PING answers,
HEADERS (with CONTINUATION, padding and priority), DATA (flow control credit returned as it is
read), RST_STREAM, GOAWAY; every header block decoded in order (`agent.kubelet.hpack`). What it
does of gRPC: a request is one message (uncompressed) on a POST to `/<service>/<method>`; the
answer is its message and `grpc-status`, or a trailers-only error. Each call is answered at once,
in the server's thread: a handler must not block. Any protocol error closes the connection.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import struct
import threading
from collections.abc import Callable, Mapping
from urllib.parse import quote

from agent.kubelet import hpack

log = logging.getLogger("agent.kubelet.server")

Handler = Callable[[bytes], bytes]  # request message -> response message

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
PROTOCOL_ERROR, FRAME_SIZE_ERROR, COMPRESSION_ERROR = 0x1, 0x6, 0x9
MAX_FRAME = 16384  # SETTINGS_MAX_FRAME_SIZE: the default, which the server never raises
MAX_BLOCK = 65536  # the largest header block or request message taken
UNIMPLEMENTED, INTERNAL, RESOURCE_EXHAUSTED = 12, 13, 8  # gRPC status codes

_OK_HEADERS = b"\x88" + hpack.encode_literal(b"content-type", b"application/grpc")  # :status 200 indexed


class GrpcError(Exception):
    """A call's failure, answered with this gRPC status code and message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class _ConnectionError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


class _Stream:
    __slots__ = ("body", "ended", "headers")

    def __init__(self, headers: dict[bytes, bytes]) -> None:
        self.headers = headers
        self.body = bytearray()
        self.ended = False


class _Connection:
    def __init__(self, sock: socket.socket, handlers: Mapping[str, Handler]) -> None:
        self.sock = sock
        self.handlers = handlers
        self.inbuf = bytearray()
        self.out = bytearray(frame(SETTINGS, 0, 0))  # the server's preface
        self.preface = False
        self.decoder = hpack.Decoder()
        self.streams: dict[int, _Stream] = {}
        self.last_stream = 0
        self.block: tuple[int, int, bytearray] | None = None  # a header block awaiting CONTINUATION
        self.done = False  # answer what is written, then close

    def received(self, data: bytes) -> None:
        self.inbuf += data
        try:
            self._frames()
        except _ConnectionError as exc:
            log.debug("registration connection: %s", exc)
            self.out += frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream, exc.code))
            self.done = True
        except hpack.HpackError as exc:
            log.debug("registration connection: %s", exc)
            self.out += frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream, COMPRESSION_ERROR))
            self.done = True

    def _frames(self) -> None:
        if not self.preface:
            if len(self.inbuf) < len(PREFACE):
                if not PREFACE.startswith(bytes(self.inbuf)):
                    raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 client")
                return
            if self.inbuf[:len(PREFACE)] != PREFACE:
                raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 client")
            del self.inbuf[:len(PREFACE)]
            self.preface = True
        while len(self.inbuf) >= 9 and not self.done:
            length = int.from_bytes(self.inbuf[:3], "big")
            if length > MAX_FRAME:
                raise _ConnectionError(FRAME_SIZE_ERROR, f"a frame of {length} bytes")
            if len(self.inbuf) < 9 + length:
                return
            kind, flags = self.inbuf[3], self.inbuf[4]
            stream = int.from_bytes(self.inbuf[5:9], "big") & 0x7FFFFFFF
            payload = bytes(self.inbuf[9:9 + length])
            del self.inbuf[:9 + length]
            self._frame(kind, flags, stream, payload)

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if self.block is not None and kind != CONTINUATION:
            raise _ConnectionError(PROTOCOL_ERROR, "a header block interrupted")
        if kind == SETTINGS:
            if not flags & ACK:
                self.out += frame(SETTINGS, ACK, 0)
        elif kind == PING:
            if not flags & ACK:
                self.out += frame(PING, ACK, 0, payload)
        elif kind == GOAWAY:
            self.done = True
        elif kind == HEADERS:
            self._headers(flags, stream, payload)
        elif kind == CONTINUATION:
            if self.block is None or self.block[0] != stream:
                raise _ConnectionError(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
            self.block[2].extend(payload)
            if len(self.block[2]) > MAX_BLOCK:
                raise _ConnectionError(PROTOCOL_ERROR, "header block too large")
            if flags & END_HEADERS:
                sid, start_flags, block = self.block
                self.block = None
                self._header_block(sid, start_flags, bytes(block))
        elif kind == DATA:
            self._data(flags, stream, payload)
        elif kind == RST_STREAM:
            self.streams.pop(stream, None)
        elif kind == PUSH_PROMISE:
            raise _ConnectionError(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # PRIORITY, WINDOW_UPDATE (answers are a few hundred bytes) and unknown types: nothing to do.

    def _headers(self, flags: int, stream: int, payload: bytes) -> None:
        if stream == 0 or stream % 2 == 0:
            raise _ConnectionError(PROTOCOL_ERROR, f"HEADERS on stream {stream}")
        payload = _unpadded(flags, payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if flags & END_HEADERS:
            self._header_block(stream, flags, payload)
        else:
            self.block = (stream, flags, bytearray(payload))

    def _header_block(self, stream: int, flags: int, block: bytes) -> None:
        headers = dict(self.decoder.decode(block))  # decoded whatever becomes of it: the table must follow
        if stream in self.streams:  # trailers of a request: nothing in them matters
            if flags & END_STREAM:
                self._end(stream)
            return
        if stream <= self.last_stream:
            raise _ConnectionError(PROTOCOL_ERROR, f"stream {stream} reused")
        self.last_stream = stream
        self.streams[stream] = _Stream(headers)
        if flags & END_STREAM:
            self._end(stream)

    def _data(self, flags: int, stream: int, payload: bytes) -> None:
        if payload:  # credit back at once: the client's windows never run dry on a long connection
            credit = struct.pack(">I", len(payload))
            self.out += frame(WINDOW_UPDATE, 0, 0, credit)
            if not flags & END_STREAM and stream in self.streams:
                self.out += frame(WINDOW_UPDATE, 0, stream, credit)
        found = self.streams.get(stream)
        if found is None:
            return  # reset, or answered already
        found.body += _unpadded(flags, payload)
        if len(found.body) > MAX_BLOCK + 5:
            self.streams.pop(stream)
            self._error(stream, RESOURCE_EXHAUSTED, "request message too large")
        elif flags & END_STREAM:
            self._end(stream)

    def _end(self, stream: int) -> None:
        found = self.streams.pop(stream)
        path = found.headers.get(b":path", b"").decode(errors="replace")
        handler = self.handlers.get(path)
        body = bytes(found.body)
        if found.headers.get(b":method") != b"POST" or not found.headers.get(b"content-type", b"").startswith(
                b"application/grpc"):
            self._error(stream, INTERNAL, "not a gRPC request")
        elif handler is None:
            self._error(stream, UNIMPLEMENTED, f"unknown method {path}")
        elif len(body) < 5 or int.from_bytes(body[1:5], "big") != len(body) - 5:
            self._error(stream, INTERNAL, "a unary call takes exactly one request message")
        elif body[0] != 0:
            self._error(stream, UNIMPLEMENTED, "compressed messages are not supported")
        else:
            try:
                answer = handler(body[5:])
            except GrpcError as exc:
                self._error(stream, exc.code, str(exc))
                return
            except Exception as exc:
                log.exception("registration call %s failed", path)
                self._error(stream, INTERNAL, f"internal error: {exc!r}")
                return
            self.out += frame(HEADERS, END_HEADERS, stream, _OK_HEADERS)
            self.out += frame(DATA, 0, stream, b"\0" + len(answer).to_bytes(4, "big") + answer)
            self.out += frame(HEADERS, END_HEADERS | END_STREAM, stream, hpack.encode_literal(b"grpc-status", b"0"))

    def _error(self, stream: int, code: int, message: str) -> None:
        block = (_OK_HEADERS + hpack.encode_literal(b"grpc-status", str(code).encode())
                 + hpack.encode_literal(b"grpc-message", quote(message, safe=" ").encode()))
        self.out += frame(HEADERS, END_HEADERS | END_STREAM, stream, block)


def _unpadded(flags: int, payload: bytes) -> bytes:
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise _ConnectionError(PROTOCOL_ERROR, "bad padding")
    return payload[1:len(payload) - payload[0]]


class UnaryServer:
    """The server: listening sockets added and retired while it runs, one thread for all of it."""

    def __init__(self, handlers: Mapping[str, Handler], name: str) -> None:
        self.handlers = handlers
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._changes: list[tuple[bool, socket.socket]] = []  # (add?, listening socket)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def serve(self, listener: socket.socket) -> None:
        self._change(True, listener)

    def retire(self, listener: socket.socket) -> None:
        """Stop accepting on `listener` and close it; its connections go on."""
        self._change(False, listener)

    def _change(self, add: bool, listener: socket.socket) -> None:
        listener.setblocking(False)
        with self._lock:
            self._changes.append((add, listener))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # a wake-up is pending already (full), or the server is gone
            self._wake_w.send(b"\0")

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while not self._stopping:
                for key, events in self._selector.select():
                    if key.data is None:
                        self._drain_wake()
                    elif key.data == "listen":
                        self._accept(key.fileobj)  # type: ignore[arg-type]
                    else:
                        self._service(key.data, events)
        finally:
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            self._selector.close()
            self._wake_w.close()

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            self._wake_r.recv(4096)
        with self._lock:
            changes, self._changes = self._changes, []
        for add, listener in changes:
            if add:
                self._selector.register(listener, selectors.EVENT_READ, "listen")
            else:
                self._selector.unregister(listener)
                listener.close()

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        conn = _Connection(sock, self.handlers)
        self._selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)

    def _service(self, conn: _Connection, events: int) -> None:
        try:
            if events & selectors.EVENT_READ:
                data = conn.sock.recv(65536)
                if not data:
                    conn.done, conn.out = True, bytearray()
                else:
                    conn.received(data)
            if conn.out:
                sent = conn.sock.send(conn.out)
                del conn.out[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            conn.done, conn.out = True, bytearray()
        if conn.done and not conn.out:
            self._selector.unregister(conn.sock)
            conn.sock.close()
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        if self._selector.get_key(conn.sock).events != want:
            self._selector.modify(conn.sock, want, conn)
