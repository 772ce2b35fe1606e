"""What the claim status writer knows the API server holds, kept from one run to the next
(`<state dir>/claim-status-written`), so that a restarted agent neither reads nor writes the status of a
claim whose entries are still what it wrote before (`agent.health.claimstatus`, `WrittenStatus`).

Before, a restart read the stored status of its claims back, one LIST per namespace holding them: what
it cost stayed small, but it needed `list` on every namespace's claims, which let every node's agent read
every tenant's claims (docs/security.md). Now a restart after an orderly stop reads none, and one after a
crash GETs only the claims it prepared.

The file is trusted only when nothing can have written a claim's status since it was saved:
- it is saved when the agent stops in order (the writer's queue stopped, the writes in flight then left
  out), and only while no other agent is registered as a writer of this state directory
  (`agent.claims.writers`): a rolling update's other agent goes on writing after this one stops;
- it holds the writers' arrivals count at the save, and a start takes it only if its own arrival is
  the one right after (no agent came and went between) and no other agent is there;
- it is removed as it is taken: an agent killed later leaves nothing behind to trust.
Anything else (no file, another version, a file that does not decode) is ignored whole, and the start
reads each claim's stored status back instead (a GET of that claim). Written atomically, not fsync'd: a
file lost in a power cut costs those reads, nothing else.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from agent.claims.writers import RecordWriters
from agent.fsutil import atomic_write, unlink_quiet
from agent.health.claimstatus import WrittenStatus
from agent.health.readytimes import Transition

log = logging.getLogger(__name__)

FILE = "claim-status-written"
VERSION = 1
MAX_BYTES = 64 << 20  # some 100 bytes a claim: far more than a node holds


def path_of(state_dir: Path) -> Path:
    return state_dir / FILE


def save(path: Path, written: Mapping[str, WrittenStatus], writers: RecordWriters) -> int:
    """Keep `written` for the next start, unless another agent may write after this one. Blocking. How many
    claims were kept."""
    others, arrivals = writers.others()
    if others:
        unlink_quiet(path)
        log.info("another agent shares the state directory: the claim status it writes after this one stops is "
                 "not known here, so the next start reads the stored status back")
        return 0
    claims = [[uid, w.digest, [[device, share, t.status, t.time] for device, share, t in w.kept]]
              for uid, w in written.items()]
    atomic_write(path, orjson.dumps({"version": VERSION, "arrivals": arrivals, "claims": claims}), mode=0o600)
    return len(claims)


def take(path: Path, writers: RecordWriters) -> dict[str, WrittenStatus]:
    """What the last orderly stop kept, if nothing can have written since; the file removed. Blocking."""
    try:
        data = _read(path)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.info("ignoring %s: %s", path, exc)
        unlink_quiet(path)
        return {}
    unlink_quiet(path)
    others, arrivals = writers.others()
    try:
        doc = orjson.loads(data)
        if not isinstance(doc, dict) or doc.get("version") != VERSION:
            raise ValueError("not a file of this version")
        if others or doc["arrivals"] + 1 != arrivals:
            log.info("ignoring %s: another agent has run on this state directory since it was saved", path)
            return {}
        return {str(uid): WrittenStatus(str(digest), tuple((str(d), str(s), Transition(str(st), str(t)))
                                                           for d, s, st, t in kept))
                for uid, digest, kept in _claims(doc)}
    except (ValueError, TypeError, KeyError) as exc:  # orjson's error is a ValueError
        log.info("ignoring %s: %s", path, exc)
        return {}


def _claims(doc: dict[str, Any]) -> list[Any]:
    claims = doc["claims"]
    if not isinstance(claims, list):
        raise TypeError("claims: not a list")
    return claims


def _read(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES} bytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(MAX_BYTES + 1)
    finally:
        os.close(fd)
