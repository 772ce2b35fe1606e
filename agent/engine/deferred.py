"""The engine's deferred start-up checks: records listed at start-up but not yet checked
(`agent.engine.recovery` lists them at once and checks them in the background). Any operation on one of
these claims runs the check first, under the claim's lock, and never serves the record unchecked.
Thread-safe: worker threads ask, the start-up task adds."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable


class DeferredChecks:
    def __init__(self) -> None:
        self._unverified: set[str] = set()
        self._unverified_guard = threading.Lock()
        self._check: Callable[[str], None] | None = None

    def defer(self, uids: Iterable[str], check: Callable[[str], None]) -> None:
        """Claims whose records must pass `check` (called with the claim locked) before any operation
        on them."""
        self._check = check
        with self._unverified_guard:
            self._unverified.update(uids)

    def unverified(self) -> list[str]:
        with self._unverified_guard:
            return sorted(self._unverified)

    def ensure_checked(self, uid: str) -> bool:
        """Run the deferred check of the claim, if it is still due (call with the claim locked: the
        claim's lock makes the check run once); whether it ran now."""
        if uid in self._unverified and self._check is not None:
            self._check(uid)
            with self._unverified_guard:
                self._unverified.discard(uid)
                if not self._unverified:
                    self._check = None  # (it holds the start-up report, with every record it checked)
            return True
        return False
