"""What a doctor check gives, and how the results are reported.

One `Result` per line of the report: passed, failed (with the fix; blocking or a
warning), or skipped (and why). `format_text` writes the report a person reads,
`Result.to_json` the one `-o json` prints, and `exit_status` the command's status.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Result:
    check: str
    ok: bool
    detail: str
    fix: str = ""
    blocking: bool = True  # when not ok: the agent, or the pods using it, cannot work
    skipped: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "ok": self.ok, "detail": self.detail, "fix": self.fix,
                "blocking": self.blocking and not self.ok}

    @property
    def mark(self) -> str:
        if self.skipped:
            return "-"
        if self.ok:
            return "✓"
        return "✗" if self.blocking else "!"


def passed(check: str, detail: str) -> Result:
    return Result(check, True, detail)


def failed(check: str, detail: str, fix: str, *, blocking: bool = True) -> Result:
    return Result(check, False, detail, fix, blocking)


def skipped(check: str, why: str) -> Result:
    return Result(check, True, f"skipped: {why}", skipped=True)


def exit_status(results: Iterable[Result]) -> int:
    return 1 if any(not r.ok and r.blocking for r in results) else 0


def format_text(results: Sequence[Result], *, ascii_only: bool = False) -> str:
    marks = {"✓": "OK", "✗": "FAIL", "!": "WARN", "-": "SKIP"} if ascii_only else {}
    lines = []
    for r in results:
        line = f"{marks.get(r.mark, r.mark)} {r.check}: {r.detail}"
        if r.fix and not r.ok:
            line += f" — fix: {r.fix}"
        lines.append(line)
    bad = [r for r in results if not r.ok]
    blocking = sum(r.blocking for r in bad)
    lines.append(f"{len(results)} checks: {sum(r.ok and not r.skipped for r in results)} passed, "
                 f"{len(bad)} failed ({blocking} blocking), {sum(r.skipped for r in results)} skipped")
    return "\n".join(lines)

