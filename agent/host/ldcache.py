"""The dynamic linker's cache (`etc/ld.so.cache`, written by ldconfig): library name -> path.

glibc writes one of two layouts, and older ldconfig both in one file:

- new (`glibc-ld.so.cache1.1`): a 48-byte header (magic and version, 20 bytes; `nlibs`, `len_strings`,
  a flags byte and 3 padding bytes, `extension_offset`, 3 unused words), then `nlibs` entries of 24
  bytes (`int32 flags`, `uint32 key`, `uint32 value`, `uint32 osversion`, `uint64 hwcap`); `key` (the
  library's name) and `value` (its path) are offsets of NUL-terminated strings from the header's start;
- old (`ld.so-1.7.0`): a 16-byte header (magic, 11 bytes and one of padding; `nlibs`), entries of 12
  bytes (`int32 flags`, `uint32 key`, `uint32 value`) whose offsets count from the end of the entry
  table; a new-layout cache may follow, at the next multiple of 8, and is preferred when it does.

An entry's flags say what it is for: the low byte its ABI (`3`, an ELF library for glibc), the next its
machine (`0x03` x86-64, `0x0a` AArch64; none: the machine's default word size, 32-bit on x86-64).
Only the running machine's libraries are any use to this process.

Blocking (reads one file); a file in neither layout is a `CacheError`.
"""

from __future__ import annotations

import platform
import struct
from dataclasses import dataclass
from pathlib import Path

NEW_MAGIC = b"glibc-ld.so.cache1.1"
OLD_MAGIC = b"ld.so-1.7.0"
_NEW_HEADER = struct.Struct("<20sIIB3xI12x")  # magic+version, nlibs, len_strings, flags, extension_offset
_NEW_ENTRY = struct.Struct("<iIIIQ")
_OLD_HEADER = struct.Struct("<11sxI")
_OLD_ENTRY = struct.Struct("<iII")
_ELF_LIBC6 = 0x0003
_TYPE_MASK = 0x00FF
_MACHINE_MASK = 0xFF00
# The machine byte of this process's own libraries, by `platform.machine()`.
MACHINE_FLAGS = {"x86_64": 0x0300, "amd64": 0x0300, "aarch64": 0x0A00, "arm64": 0x0A00}
MAX_CACHE_BYTES = 64 << 20  # a real cache is a few hundred KiB


class CacheError(ValueError):
    """The file is not an ld.so.cache this reader knows."""


@dataclass(frozen=True, slots=True)
class CacheEntry:
    name: str  # the library's name (its soname), `libnvidia-ml.so.1`
    path: str  # where it is, absolute inside the root the cache belongs to
    flags: int


def read_cache(path: Path) -> list[CacheEntry]:
    """Every entry of the cache at `path`, in the file's order. OSError when it cannot be read."""
    with open(path, "rb") as f:
        data = f.read(MAX_CACHE_BYTES + 1)
    if len(data) > MAX_CACHE_BYTES:
        raise CacheError(f"{path} is larger than {MAX_CACHE_BYTES} bytes")
    return parse_cache(data)


def parse_cache(data: bytes) -> list[CacheEntry]:
    if data.startswith(NEW_MAGIC):
        return _parse_new(data, 0)
    if data.startswith(OLD_MAGIC):
        nlibs = _unpack(_OLD_HEADER, data, 0)[1]
        table = _OLD_HEADER.size + nlibs * _OLD_ENTRY.size
        if table > len(data):
            raise CacheError(f"{nlibs} entries do not fit in {len(data)} bytes")
        new = (table + 7) // 8 * 8
        if data[new:new + len(NEW_MAGIC)] == NEW_MAGIC:
            return _parse_new(data, new)
        out = []
        for i in range(nlibs):
            flags, key, value = _unpack(_OLD_ENTRY, data, _OLD_HEADER.size + i * _OLD_ENTRY.size)
            out.append(CacheEntry(_string(data, table + key), _string(data, table + value), flags))
        return out
    raise CacheError("not an ld.so.cache (neither glibc-ld.so.cache1.1 nor ld.so-1.7.0)")


def _parse_new(data: bytes, start: int) -> list[CacheEntry]:
    nlibs = _unpack(_NEW_HEADER, data, start)[1]
    if start + _NEW_HEADER.size + nlibs * _NEW_ENTRY.size > len(data):
        raise CacheError(f"{nlibs} entries do not fit in {len(data)} bytes")
    out = []
    for i in range(nlibs):
        flags, key, value, _, _ = _unpack(_NEW_ENTRY, data, start + _NEW_HEADER.size + i * _NEW_ENTRY.size)
        out.append(CacheEntry(_string(data, start + key), _string(data, start + value), flags))
    return out


def _unpack(layout: struct.Struct, data: bytes, at: int) -> tuple[int, ...]:
    if at + layout.size > len(data):
        raise CacheError(f"truncated at byte {at}")
    return layout.unpack_from(data, at)


def _string(data: bytes, at: int) -> str:
    end = data.find(b"\0", at)
    if at >= len(data) or end < 0:
        raise CacheError(f"string at byte {at} is outside the file or not terminated")
    return data[at:end].decode("utf-8", "surrogateescape")


def for_this_machine(entry: CacheEntry, machine: str | None = None) -> bool:
    """Whether this process can load the entry's library: a glibc ELF library of its own machine."""
    if entry.flags & _TYPE_MASK != _ELF_LIBC6:
        return False
    wanted = MACHINE_FLAGS.get((machine or platform.machine()).lower())
    return wanted is None or entry.flags & _MACHINE_MASK == wanted


def lookup(entries: list[CacheEntry], name: str, machine: str | None = None) -> list[str]:
    """The paths the cache gives for library `name` on this machine, in the cache's order (the linker's)."""
    return [e.path for e in entries if e.name == name and for_this_machine(e, machine)]
