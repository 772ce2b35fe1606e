"""Where the agent publishes slices and reads claims: a cluster, or an offline directory.

Order: `--offline DIR` if given; else in-cluster config, then kubeconfig. With
`--offline-fallback DIR` (what `make run` uses) a missing configuration, an API
server that does not answer, or a cluster that does not know this node sends
the agent offline, and the reason is logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agent import kube
from agent.claims.sources import ApiClaimSource, ClaimSource, DirectoryClaimSource
from agent.config import Settings
from agent.kube import NodeInfo
from agent.publish.directory import DirectoryPublisher
from agent.publish.loop import Publisher

# The API client and the API publisher are imported with a cluster only (`agent.kube`).
if TYPE_CHECKING:
    import lightkube

log = logging.getLogger(__name__)

NODE_PROBE_TIMEOUT = 5.0


class StartupError(RuntimeError):
    pass


@dataclass
class Connection:
    client: lightkube.AsyncClient | None
    offline: Path | None
    node: NodeInfo | None  # None: not read yet (the API server did not answer)
    reason: str

    @property
    def mode(self) -> str:
        return f"offline ({self.offline})" if self.offline else "cluster"

    def claim_source(self, settings: Settings) -> ClaimSource:
        if self.offline is not None:
            return DirectoryClaimSource(self.offline)
        assert self.client is not None
        return ApiClaimSource(self.client, concurrency=settings.claim_fetch_concurrency)

    def publisher(self, settings: Settings, node: NodeInfo) -> Publisher:
        if self.offline is not None:
            return DirectoryPublisher(self.offline, settings, node)
        assert self.client is not None
        from agent.publish.apiserver import ApiPublisher

        return ApiPublisher(self.client, settings, node)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


def _offline(settings: Settings, directory: Path, reason: str) -> Connection:
    directory.mkdir(parents=True, exist_ok=True)
    return Connection(None, directory, kube.read_offline_node(directory, settings.node_name), reason)


async def connect(settings: Settings, *, probe_timeout: float = NODE_PROBE_TIMEOUT,
                  count: Callable[[str, str], None] | None = None) -> Connection:
    """`count(verb, resource)` is told every request the connection's client sends (`kube.count_requests`)."""
    if settings.offline is not None:
        return _offline(settings, settings.offline, "--offline was given")
    client, source = await kube.connect(settings)
    if client is not None and count is not None:
        kube.count_requests(client, count)
    fallback = settings.offline_fallback
    if client is None:
        if fallback is not None:
            return _offline(settings, fallback, source)
        raise StartupError(f"{source}; give --kubeconfig, run in a pod, or use --offline DIR")
    try:
        async with asyncio.timeout(probe_timeout):
            node = await kube.read_node(client, settings.node_name)
    except kube.NodeNotFound as exc:
        if fallback is None:
            raise StartupError(f"{exc}: is --node-name / $NODE_NAME right?") from exc
        await client.close()
        return _offline(settings, fallback, f"{exc} (API server from {source})")
    except Exception as exc:
        why = kube.describe(exc) if not isinstance(exc, TimeoutError) else "no answer in time"
        if fallback is not None:
            await client.close()
            return _offline(settings, fallback, f"API server from {source} unreachable: {why}")
        # A DaemonSet pod keeps going: it serves the kubelet and publishes once the API answers.
        log.warning("reading Node %s failed (%s); will keep trying", settings.node_name, why)
        return Connection(client, None, None, source)
    return Connection(client, None, node, source)


async def wait_for_node(conn: Connection, name: str) -> NodeInfo:
    """The Node, retried with backoff until the API server answers (cluster mode only)."""
    assert conn.client is not None
    backoff = kube.Backoff(initial=1.0, maximum=30.0)
    failures = 0
    while True:
        try:
            return await kube.read_node(conn.client, name)
        except Exception as exc:
            failures += 1
            delay = backoff.delay(failures, exc)
            log.warning("reading Node %s failed (%s); retrying in %.1fs", name, kube.describe(exc), delay)
            await asyncio.sleep(delay)
