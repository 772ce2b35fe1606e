"""Where prepare reads ResourceClaims: the API server, or a directory when offline.

Both answer `await get(namespace, name)` with the claim as a plain JSON dict,
raise ClaimNotFound when there is no such claim, and ClaimSourceError when the
claim cannot be read now. The API source answers within a deadline well under
the kubelet's 45 s, so the kubelet gets a per-claim error, not a timeout of the
whole call.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import lightkube
import yaml
from lightkube.resources.resource_v1 import ResourceClaim

from agent import kube
from agent.kube import Backoff

log = logging.getLogger(__name__)

DEFAULT_DEADLINE = 30.0
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ClaimNotFound(Exception):
    pass


class ClaimSourceError(Exception):
    pass


class ApiClaimSource:
    def __init__(self, client: lightkube.AsyncClient, concurrency: int = 16,
                 deadline: float = DEFAULT_DEADLINE, *, backoff: Backoff | None = None) -> None:
        self.client = client
        self.deadline = deadline
        # Attempts are bounded by the deadline, not counted.
        self.backoff = backoff or Backoff(initial=0.2, maximum=5.0, attempts=0)
        self._slots = asyncio.Semaphore(concurrency)

    async def get(self, namespace: str, name: str) -> dict[str, Any]:
        what = f"ResourceClaim {namespace}/{name}"
        failures = 0
        last = "no answer"
        try:
            async with asyncio.timeout(self.deadline):
                while True:
                    try:
                        async with self._slots:
                            claim = await self.client.get(ResourceClaim, name, namespace=namespace)
                        return kube.plain(claim)
                    except Exception as exc:
                        if kube.is_not_found(exc):
                            raise ClaimNotFound(f"{what} not found") from exc
                        last = kube.describe(exc)
                        if not kube.is_retryable(exc):
                            raise ClaimSourceError(f"reading {what} failed: {last}") from exc
                        failures += 1
                        delay = self.backoff.delay(failures, exc)
                        log.warning("reading %s: %s; retrying in %.2fs", what, last, delay)
                        await asyncio.sleep(delay)
        except TimeoutError as exc:
            raise ClaimSourceError(f"reading {what} did not succeed within {self.deadline:g}s "
                                   f"({failures} failed tries, last: {last})") from exc


class DirectoryClaimSource:
    """`DIR/resourceclaims/<namespace>/<name>.yaml` (YAML or JSON content)."""

    def __init__(self, directory: Path) -> None:
        self.root = Path(directory) / "resourceclaims"

    async def get(self, namespace: str, name: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.read, namespace, name)

    def path_of(self, namespace: str, name: str) -> Path:
        for part in (namespace, name):
            if not part or part in (".", "..") or "/" in part or "\0" in part or os.sep in part:
                raise ClaimSourceError(f"claim {namespace!r}/{name!r}: not a valid namespace and name")
        path = self.root / namespace / f"{name}.yaml"
        # A symlink may still point anywhere: the file read must lie under the root.
        real, root = os.path.realpath(path), os.path.realpath(self.root)
        if os.path.commonpath([real, root]) != root:
            raise ClaimSourceError(f"claim {namespace}/{name}: {path} leads outside {self.root}")
        return path

    def read(self, namespace: str, name: str) -> dict[str, Any]:
        path = self.path_of(namespace, name)
        try:
            text = path.read_bytes()
        except FileNotFoundError as exc:
            raise ClaimNotFound(f"ResourceClaim {namespace}/{name} not found "
                                f"({path} does not exist)") from exc
        except OSError as exc:
            raise ClaimSourceError(f"ResourceClaim {namespace}/{name}: cannot read {path}: {exc}") from exc
        try:
            doc = yaml.load(text, Loader=_LOADER)
        except yaml.YAMLError as exc:
            raise ClaimSourceError(f"ResourceClaim {namespace}/{name}: {path} is not valid YAML: "
                                   f"{_one_line(exc)}") from exc
        if not isinstance(doc, dict):
            raise ClaimSourceError(f"ResourceClaim {namespace}/{name}: {path} does not hold an object")
        return doc


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())
