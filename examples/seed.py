"""Seed an offline directory for `make run` from the example claims.

Fills in this node's name, the driver name and a NIC this node really has,
so every example can be prepared on the machine at hand:

    python examples/seed.py .run
"""

from __future__ import annotations

import string
import sys
from pathlib import Path

from agent.config import settings_from
from agent.inventory.nics import NicSource

HERE = Path(__file__).resolve().parent


def first_nic(settings) -> str | None:  # type: ignore[no-untyped-def]
    source = NicSource(settings)
    source.open()
    try:
        devices = sorted(source.scan().devices, key=lambda d: d.name)
    finally:
        source.close()
    return devices[0].name if devices else None


def seed(run_dir: Path) -> list[Path]:
    settings = settings_from(None)
    nic = first_nic(settings)
    values = {"DRIVER": settings.driver_name, "NODE_NAME": settings.node_name, "NIC_DEVICE": nic or ""}
    written = []
    for src in sorted((HERE / "resourceclaims").rglob("*.yaml")):
        text = src.read_text()
        if "${NIC_DEVICE}" in text and not nic:
            print(f"seed: no NIC published on this node, skipping {src.name}", file=sys.stderr)
            continue
        dst = run_dir / "offline" / src.relative_to(HERE)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(string.Template(text).substitute(values))
        written.append(dst)
    return written


if __name__ == "__main__":
    for path in seed(Path(sys.argv[1] if len(sys.argv) > 1 else ".run")):
        print(f"seed: {path}")
