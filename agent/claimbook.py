"""The engine's book of prepared claims: the durable records as they are on disk, read cheaply.

The record files (`agent.state`) are the truth, shared with any other agent on the
node. The book keeps a copy of each record with the identity of its file
(inode, mtime, size) and reads the file again only when that identity changed:
one `stat` per operation, and never a stale answer after another agent prepared,
refreshed or unprepared the claim. It also indexes which claims hold each device,
for metadata refreshes. Call it with the claim's locks held (`agent.locks`).
"""

from __future__ import annotations

import threading

from agent.state import ClaimRecord, ClaimStore, RecordStamp


class ClaimBook:
    def __init__(self, store: ClaimStore) -> None:
        self.store = store
        self._guard = threading.Lock()  # over the two indexes below
        self._records: dict[str, tuple[ClaimRecord, RecordStamp]] = {}
        self._device_claims: dict[str, set[str]] = {}  # device name -> UIDs of claims holding it

    def records(self) -> dict[str, ClaimRecord]:
        """The prepared claims this agent has seen (a copy)."""
        with self._guard:
            return {uid: rec for uid, (rec, _) in self._records.items()}

    def record_of(self, uid: str) -> ClaimRecord | None:
        """The copy held for `uid` (no disk access)."""
        with self._guard:
            held = self._records.get(uid)
        return held[0] if held is not None else None

    def claims_holding(self, devices: set[str]) -> list[str]:
        with self._guard:
            return sorted({uid for n in devices for uid in self._device_claims.get(n, ())})

    def current(self, uid: str) -> ClaimRecord | None:
        """The claim's record as it is on disk now; RecordError when it is unreadable."""
        stamp = self.store.stamp(uid)
        with self._guard:
            cached = self._records.get(uid)
        if stamp is None:
            if cached is not None:
                self.forget(uid)
            return None
        if cached is not None and cached[1] == stamp:
            return cached[0]
        found = self.store.read(uid)
        if found is None:
            self.forget(uid)
            return None
        self._remember(*found)
        return found[0]

    def write(self, record: ClaimRecord) -> None:
        """Write the record durably, and keep it as the current one."""
        self.store.write(record)
        stamp = self.store.stamp(record.uid)
        assert stamp is not None
        self._remember(record, stamp)

    def forget(self, uid: str) -> None:
        with self._guard:
            old = self._records.pop(uid, None)
            if old is not None:
                self._unindex(old[0])

    def _remember(self, record: ClaimRecord, stamp: RecordStamp) -> None:
        with self._guard:
            old = self._records.get(record.uid)
            if old is not None:
                self._unindex(old[0])
            self._records[record.uid] = (record, stamp)
            for d in record.devices:
                self._device_claims.setdefault(d.device, set()).add(record.uid)

    def _unindex(self, record: ClaimRecord) -> None:
        for d in record.devices:
            owners = self._device_claims.get(d.device)
            if owners is not None:
                owners.discard(record.uid)
                if not owners:
                    del self._device_claims[d.device]
