"""What every group of doctor checks shares: the settings and the host's root."""

from __future__ import annotations

from pathlib import Path

from agent.config import Settings


class Checks:
    """The agent's settings and the host's / (`--host-root`); the check groups extend this."""

    def __init__(self, settings: Settings, *, host_root: Path = Path("/")) -> None:
        self.s = settings
        self.host_root = Path(host_root)

    def host(self, path: str) -> Path:
        """`path` on the host (under --host-root)."""
        return self.host_root / path.lstrip("/")


def existing_parent(path: Path) -> Path:
    """`path`, or the nearest of its parents that exists."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path

