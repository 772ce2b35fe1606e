"""How the CLI prints: tables for people, JSON and YAML for programs; and what its exit statuses mean
(docs/cli.md, "Exit status")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

EXIT_FAILED = 1  # the command ran and failed: it says why
EXIT_USAGE = 2  # the command line is wrong: one line, and a pointer to --help
EXIT_NOT_FOUND = 3  # what the command names (a claim, a device) is not there
EXIT_NO_AGENT = 4  # no agent answers on the sockets these settings name


def dump(obj: Any, fmt: str) -> str:
    """`obj` as indented JSON, or YAML (a list of Kubernetes objects as a multi-document stream)."""
    if fmt == "json":
        import orjson

        return orjson.dumps(obj, option=orjson.OPT_INDENT_2).decode()
    import yaml

    docs = obj if isinstance(obj, list) and obj and all(isinstance(o, dict) and "kind" in o for o in obj) else None
    if docs is not None:
        return yaml.safe_dump_all(docs, sort_keys=False, explicit_start=True)
    return yaml.safe_dump(obj, sort_keys=False)


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """Rows under a header, each column as wide as its widest cell."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in [header, *rows]]
    return "\n".join(lines)
