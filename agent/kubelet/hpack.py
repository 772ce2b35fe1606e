"""HPACK (RFC 7541), the header compression of HTTP/2, as the registration server needs it: every
request header block decoded (the dynamic table kept in step with the client's encoder), and
response headers encoded as literals that touch no table.

The static table is RFC 7541 Appendix A; the Huffman code, Appendix B, is canonical (codes are
assigned in order of length, then of symbol), so its 257 code lengths are all it takes.
"""

from __future__ import annotations

STATIC = (
    (b":authority", b""), (b":method", b"GET"), (b":method", b"POST"), (b":path", b"/"),
    (b":path", b"/index.html"), (b":scheme", b"http"), (b":scheme", b"https"), (b":status", b"200"),
    (b":status", b"204"), (b":status", b"206"), (b":status", b"304"), (b":status", b"400"),
    (b":status", b"404"), (b":status", b"500"), (b"accept-charset", b""), (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""), (b"accept-ranges", b""), (b"accept", b""), (b"access-control-allow-origin", b""),
    (b"age", b""), (b"allow", b""), (b"authorization", b""), (b"cache-control", b""),
    (b"content-disposition", b""), (b"content-encoding", b""), (b"content-language", b""),
    (b"content-length", b""), (b"content-location", b""), (b"content-range", b""), (b"content-type", b""),
    (b"cookie", b""), (b"date", b""), (b"etag", b""), (b"expect", b""), (b"expires", b""), (b"from", b""),
    (b"host", b""), (b"if-match", b""), (b"if-modified-since", b""), (b"if-none-match", b""),
    (b"if-range", b""), (b"if-unmodified-since", b""), (b"last-modified", b""), (b"link", b""),
    (b"location", b""), (b"max-forwards", b""), (b"proxy-authenticate", b""), (b"proxy-authorization", b""),
    (b"range", b""), (b"referer", b""), (b"refresh", b""), (b"retry-after", b""), (b"server", b""),
    (b"set-cookie", b""), (b"strict-transport-security", b""), (b"transfer-encoding", b""),
    (b"user-agent", b""), (b"vary", b""), (b"via", b""), (b"www-authenticate", b""),
)

# The Huffman code length of each symbol 0..256 (256: EOS), as letters: "A" is 5 bits, "Z" 30.
_LENGTHS = (
    "ISXXXXXXXTZXXZXXXXXXXXZXXXXXXXXXBFFHIBDGFFDGDBBBAAABBBBBBBCDKBHF"
    "IBCCCCCCCCCCCCCCCCCCCCCCDCDIOIJBKABABABBBACCBBBABCBAABCCCCCKGJIX"
    "PRPPRRRSRSSSSSTSTTRSTSSSSQRSRSSTRQPRRSSQSRRTQRSSQQRQSRSSPRRRSRRS"
    "VVPORSRUVVVWWVTUOQVWWVWTQQVVXWWWPTPQRQQSRRUUTTVSVWVVWWWWWXWWWWWV"
    "Z"
)
EOS = 256
DEFAULT_TABLE_SIZE = 4096  # SETTINGS_HEADER_TABLE_SIZE, which the server never changes


class HpackError(Exception):
    """A header block that cannot be decoded: a COMPRESSION_ERROR, fatal to the connection."""


def _canonical() -> tuple[list[int], list[int], list[list[int]]]:
    """Per code length: the first code, how many codes, and their symbols in code order."""
    lengths = [ord(c) - ord("A") + 5 for c in _LENGTHS]
    longest = max(lengths)
    symbols: list[list[int]] = [[] for _ in range(longest + 1)]
    for symbol, length in sorted(enumerate(lengths), key=lambda item: (item[1], item[0])):
        symbols[length].append(symbol)
    first, code = [0] * (longest + 1), 0
    for length in range(1, longest + 1):
        first[length] = code
        code = (code + len(symbols[length])) << 1
    return first, [len(s) for s in symbols], symbols


_FIRST, _COUNT, _SYMBOLS = _canonical()


def huffman_decode(data: bytes) -> bytes:
    out = bytearray()
    code = length = 0
    for byte in data:
        for shift in range(7, -1, -1):
            code = (code << 1) | ((byte >> shift) & 1)
            length += 1
            if length < len(_FIRST) and 0 <= (offset := code - _FIRST[length]) < _COUNT[length]:
                symbol = _SYMBOLS[length][offset]
                if symbol == EOS:
                    raise HpackError("EOS in a Huffman-coded string")
                out.append(symbol)
                code = length = 0
            elif length >= len(_FIRST):
                raise HpackError("not a Huffman code")
    # What is left is padding: fewer than 8 bits, all ones (the start of EOS).
    if length > 7 or code != (1 << length) - 1:
        raise HpackError("bad padding of a Huffman-coded string")
    return bytes(out)


class Decoder:
    """One connection's decoding state: the dynamic table, newest entry first."""

    def __init__(self, max_size: int = DEFAULT_TABLE_SIZE) -> None:
        self.max_size = self.limit = max_size  # limit: what the encoder may ask for (our setting)
        self.table: list[tuple[bytes, bytes]] = []
        self.size = 0

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        headers: list[tuple[bytes, bytes]] = []
        pos = 0
        while pos < len(block):
            byte = block[pos]
            if byte & 0x80:  # indexed field
                index, pos = _integer(block, pos, 7)
                headers.append(self._entry(index))
            elif byte & 0x40:  # literal, added to the table
                name, value, pos = self._literal(block, pos, 6)
                headers.append((name, value))
                self._add(name, value)
            elif byte & 0x20:  # dynamic table size update
                size, pos = _integer(block, pos, 5)
                if size > self.limit:
                    raise HpackError(f"table size {size} over the limit {self.limit}")
                self.max_size = size
                self._evict()
            else:  # literal, not added (0000) or never to be added (0001)
                name, value, pos = self._literal(block, pos, 4)
                headers.append((name, value))
        return headers

    def _entry(self, index: int) -> tuple[bytes, bytes]:
        if 0 < index <= len(STATIC):
            return STATIC[index - 1]
        if 0 < index - len(STATIC) <= len(self.table):
            return self.table[index - len(STATIC) - 1]
        raise HpackError(f"no table entry {index}")

    def _literal(self, block: bytes, pos: int, prefix: int) -> tuple[bytes, bytes, int]:
        index, pos = _integer(block, pos, prefix)
        if index:
            name = self._entry(index)[0]
        else:
            name, pos = _string(block, pos)
        value, pos = _string(block, pos)
        return name, value, pos

    def _add(self, name: bytes, value: bytes) -> None:
        self.table.insert(0, (name, value))
        self.size += len(name) + len(value) + 32
        self._evict()

    def _evict(self) -> None:
        while self.size > self.max_size and self.table:
            name, value = self.table.pop()
            self.size -= len(name) + len(value) + 32


def _integer(block: bytes, pos: int, prefix: int) -> tuple[int, int]:
    if pos >= len(block):
        raise HpackError("header block ends inside an integer")
    mask = (1 << prefix) - 1
    value = block[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        if pos >= len(block) or shift > 28:
            raise HpackError("bad integer in a header block")
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _string(block: bytes, pos: int) -> tuple[bytes, int]:
    if pos >= len(block):
        raise HpackError("header block ends before a string")
    huffman = block[pos] & 0x80
    length, pos = _integer(block, pos, 7)
    if pos + length > len(block):
        raise HpackError("header block ends inside a string")
    raw = block[pos:pos + length]
    return (huffman_decode(raw) if huffman else raw), pos + length


def encode_int(value: int, prefix: int, first: int = 0) -> bytes:
    """An integer with a `prefix`-bit prefix; `first`: the bits above the prefix in the first byte."""
    mask = (1 << prefix) - 1
    if value < mask:
        return bytes([first | value])
    out = bytearray([first | mask])
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_literal(name: bytes, value: bytes) -> bytes:
    """A literal field never added to a table (whatever the client's table size), its name a
    static table entry's when there is one, its strings not Huffman-coded."""
    index = next((i for i, (n, _) in enumerate(STATIC, 1) if n == name), 0)
    out = encode_int(index, 4) if index else b"\x00" + encode_int(len(name), 7) + name
    return out + encode_int(len(value), 7) + value
