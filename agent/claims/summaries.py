"""The book's summaries kept on disk for the next start (`<state dir>/claim-summaries`), so that a start
knows which claim holds which device without reading every record.

Why: the forms checks (`HostEffects.check`) ask the book which claims hold a form of a GPU, so the book
must know every record on disk (`ClaimBook.sync`). A start only lists the records (the full check of
each runs in the background, `agent.engine.recovery`), and the first prepare of a GPU after it read
every record the book did not know yet: 1.8 s with 10,000 claims prepared, while the kubelet waited.
Reading 10,000 small files costs a quarter of a second however it is done; a `stat` of each, a tenth
of that.

The file is a cache, never the truth. Each entry carries the identity of the record file its summary
was read from (`RecordStamp`: inode, mtime, size, which the book already compares before it answers
from a whole record it holds; every record write is a new file renamed into place), and a start takes
an entry only for a record it listed that is still that file. A record without an entry, or changed
since, is read as before; an entry whose record is gone is dropped. A file that cannot be read, of
another version, or whose checksum does not match, is ignored whole. Nothing is answered from a
summary: each claim's record is still checked before any operation on it, and a summary only says
which claim holds which device, as the record's listing would have.

Written atomically and not fsync'd (a file lost in a power cut costs the reads it saved, nothing else)
by the daemon: once start-up recovery has checked every record, every `SAVE_INTERVAL` seconds when the
book changed (a process killed keeps most of its entries valid), and when the agent stops.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
from pathlib import Path
from typing import Any

import orjson

from agent.claims.book import ClaimBook, ClaimSummary, DeviceSummary
from agent.claims.store import ClaimStore, RecordStamp
from agent.fsutil import atomic_write, is_temp_name

log = logging.getLogger(__name__)

FILE = "claim-summaries"
MAGIC = b"DRASUMS"
# The layout of an entry: [uid, inode, mtime ns, size, ClaimSummary.wire()]. A new version for any change of
# it or of the summary's wire form: a file of another version is ignored whole.
VERSION = 1
MAX_BYTES = 256 << 20  # some 300 bytes a claim: far more than a node holds
SAVE_INTERVAL = 600.0  # seconds between saves while the book changes (after start-up recovery, and at stop)


def path_of(state_dir: Path) -> Path:
    return state_dir / FILE


def save(path: Path, book: ClaimBook) -> int:
    """Write every summary the book holds, with the identity of its record file. Blocking. How many."""
    entries = book.stamped()
    body = orjson.dumps([[uid, *stamp, summary.wire()] for uid, stamp, summary in entries])
    header = b"%s %d %s %d\n" % (MAGIC, VERSION, hashlib.sha256(body).hexdigest().encode(), len(body))
    atomic_write(path, header + body, mode=0o600)
    return len(entries)


def restore(path: Path, book: ClaimBook, store: ClaimStore, uids: list[str]) -> int:
    """Give the book the kept summary of each listed record whose file is still the one summarized; how
    many. Temp files of a save cut short are removed. Blocking."""
    _remove_temp_files(path)
    entries = _load(path)
    if not entries:
        return 0
    listed = set(uids)
    devices: dict[tuple[Any, ...], DeviceSummary] = {}  # one object for the devices many claims hold alike
    found: list[tuple[str, RecordStamp, ClaimSummary]] = []
    try:
        for uid, ino, mtime, size, summary in entries:
            if uid in listed and store.stamp(uid) == (ino, mtime, size):
                found.append((uid, (ino, mtime, size), ClaimSummary.from_wire(uid, summary, devices)))
    except (ValueError, TypeError, KeyError, IndexError) as exc:  # a file of this version not of its layout
        log.info("ignoring %s: %s", path, exc)
        return 0
    return book.take(found)


def _load(path: Path) -> list[Any]:
    """The entries of the file; empty when there is no usable file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.info("ignoring %s: %s", path, exc)
        return []
    try:
        return _decode(_read(fd))
    except (OSError, ValueError, TypeError) as exc:  # orjson's error is a ValueError
        log.info("ignoring %s: %s", path, exc)
        return []
    finally:
        os.close(fd)


def _read(fd: int) -> bytes:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("not a regular file")
    if st.st_size > MAX_BYTES:
        raise ValueError(f"larger than {MAX_BYTES} bytes")
    data = os.read(fd, st.st_size + 1)  # (one read: a file written anew is renamed, never grown in place)
    while len(data) <= st.st_size and (more := os.read(fd, st.st_size + 1 - len(data))):
        data += more
    return data


def _decode(data: bytes) -> list[Any]:
    header, sep, body = data.partition(b"\n")
    parts = header.split(b" ")
    if not sep or len(parts) != 4 or parts[0] != MAGIC:
        raise ValueError("not a file of claim summaries")
    if parts[1] != b"%d" % VERSION:
        raise ValueError(f"version {parts[1].decode(errors='replace')}, this agent reads {VERSION}")
    if parts[3] != b"%d" % len(body) or hashlib.sha256(body).hexdigest().encode() != parts[2]:
        raise ValueError("truncated or corrupted")
    entries = orjson.loads(body)
    if not isinstance(entries, list):
        raise TypeError("not a list of entries")
    return entries


def _remove_temp_files(path: Path) -> None:
    prefix = f".{path.name}"
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(path.parent):
            if name.startswith(prefix) and is_temp_name(name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path.parent / name)
