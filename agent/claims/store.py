"""The records directory (`<state dir>/claims`): one durable record file per claim, written, read,
listed and set aside. The record format itself is `agent.claims.records`."""

from __future__ import annotations

import os
from pathlib import Path

from agent.claims.dirsync import DirectorySync
from agent.claims.records import SUFFIX, ClaimRecord, RecordError, decode, encode
from agent.fsutil import Root, is_temp_name
from agent.names import InvalidName, check_uid
from cdi.atomic import write_at

RecordStamp = tuple[int, int, int]  # (inode, mtime ns, size) of a record file


class ClaimStore:
    """The records directory. Blocking: call from a worker thread."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._prefix = f"{directory}{os.sep}"
        self.root = Root(directory, dir_mode=0o700)
        self.dir_sync = DirectorySync(directory)

    def ensure(self) -> None:
        self.root.ensure()

    def path(self, uid: str) -> Path:
        return Path(self._file(uid))

    def _file(self, uid: str) -> str:
        # A string, not a Path: the operations on a claim build it several times each.
        check_uid(uid)
        return f"{self._prefix}{uid}{SUFFIX}"

    def write(self, record: ClaimRecord) -> None:
        """Durable when it returns: the file fsync'd, renamed into place, the directory fsync'd."""
        data = encode(record)
        check_uid(record.uid)
        name = f"{record.uid}{SUFFIX}"
        with self.root.directory((), create=True) as fd:
            write_at(fd, name, data, mode=0o600, durable=True, sync_dir=False)
        self.dir_sync.sync()

    def delete(self, uid: str) -> bool:
        """Durable when it returns (the directory fsync'd); True if there was a record."""
        removed = self.root.unlink(self._file(uid))
        if removed:
            self.dir_sync.sync()
        return removed

    def stamp(self, uid: str) -> RecordStamp | None:
        """The identity of the record file as it is now; None when there is no record."""
        try:
            st = os.stat(self._file(uid), follow_symlinks=False)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def read(self, uid: str) -> tuple[ClaimRecord, RecordStamp] | None:
        """The record and the identity of the file it was read from; None when there is none."""
        path = self._file(uid)
        for _ in range(3):  # replaced between the stat and the read: read the newer one
            before = self.stamp(uid)
            if before is None:
                return None
            try:
                data = self.root.read(path)
            except FileNotFoundError:
                return None
            if self.stamp(uid) == before:
                record = decode(data)
                if record.uid != uid:
                    raise RecordError(f"record {uid}{SUFFIX} names UID {record.uid}")
                return record, before
        raise RecordError(f"record {uid}{SUFFIX} keeps changing while read")

    def uids(self) -> list[str]:
        """The UIDs that have a record file (readable or not), and none of the temp files."""
        out = []
        for name in self.root.listdir():
            if name.endswith(SUFFIX) and not is_temp_name(name):
                out.append(name[: -len(SUFFIX)])
        return out

    def temp_files(self) -> list[str]:
        return [name for name in self.root.listdir() if is_temp_name(name)]

    def load_all(self) -> tuple[dict[str, ClaimRecord], list[tuple[str, str]]]:
        """All readable records, and (file name, problem) for those that are not (read-only)."""
        records: dict[str, ClaimRecord] = {}
        problems: list[tuple[str, str]] = []
        for uid in self.uids():
            try:
                check_uid(uid)
                found = self.read(uid)
            except (OSError, RecordError, InvalidName) as exc:
                problems.append((f"{uid}{SUFFIX}", str(exc)))
                continue
            if found is not None:
                records[uid] = found[0]
        return records, problems

    def quarantine(self, name: str) -> Path:
        """Move an unreadable record aside (kept for a person to look at, never read again)."""
        src = self.directory / name
        dst = self.directory / f"{name}.corrupt"
        os.replace(src, dst)
        return dst
