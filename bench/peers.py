"""The peer driver of `make bench` (bench/peer/, a Go module): building it once per source, and
running it with the claims API stand-in it reads claims from.

The build goes to a cache outside the repository ($XDG_CACHE_HOME or ~/.cache, then
dra-agent/bench-peer/<digest>/), keyed by the Go version and every file of the module, so an
unchanged peer is built once. Without Go there is no peer: `build` says why and returns None.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULE = HERE / "peer"
PROGRAMS = ("driver", "claimsapi")


@dataclass(frozen=True)
class PeerBinaries:
    driver: Path
    claims_api: Path
    go_version: str


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dra-agent" / "bench-peer"


def source_digest(go_version: str) -> str:
    """The Go version and every file of the module (path and content)."""
    h = hashlib.sha256(go_version.encode())
    for path in sorted(p for p in MODULE.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(MODULE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def build(log: list[str]) -> PeerBinaries | None:
    """The peer's binaries, built now unless the cache has them; None (and the reason in `log`)
    when Go is not installed. A build that fails with Go present is an error."""
    go = shutil.which("go")
    if go is None:
        log.append("no Go on PATH: no peer driver; its figures and the ratios are left out")
        return None
    version = subprocess.run([go, "env", "GOVERSION"], check=True, capture_output=True, text=True).stdout.strip()
    root = cache_root()
    target = root / source_digest(version)
    binaries = PeerBinaries(target / "driver", target / "claimsapi", version)
    if binaries.driver.is_file() and binaries.claims_api.is_file():
        log.append(f"peer driver: cached build {target} ({version})")
        return binaries
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        env = {**os.environ, "GOFLAGS": "-mod=readonly"}
        done = subprocess.run([go, "build", "-trimpath", "-o", str(staging) + "/", *(f"./{p}" for p in PROGRAMS)],
                              cwd=MODULE, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"building the peer driver failed:\n{done.stderr}")
        # Older builds are of sources that no longer exist here.
        for old in root.iterdir():
            if old != staging and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.append(f"peer driver: built {target} ({version})")
    return binaries


class ClaimsApi:
    """The claims API stand-in (bench/peer/claimsapi): GET of a ResourceClaim over HTTP on loopback,
    answered from the offline directory the agent reads."""

    def __init__(self, binary: Path, offline: Path, log: Path) -> None:
        self.proc = subprocess.Popen([str(binary), "--dir", str(offline)], stdout=subprocess.PIPE,
                                     stderr=log.open("ab"))
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().decode().strip()
        if not self.url.startswith("http://"):
            self.proc.kill()
            raise SystemExit(f"the claims API did not start; see {log}")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
