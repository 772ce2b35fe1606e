"""The bench's reference points and helpers: the floor server (an empty unary call, and one with a
durable write), process memory, timing, percentiles and the file system under a path. Kept apart
from bench.py, which drives the drivers."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

FLOOR_SERVER = r"""
import asyncio, os, sys
import grpc
sys.path.insert(0, sys.argv[3])
from agent.fsutil import atomic_write
from pathlib import Path

async def main(sock, directory):
    target = Path(directory) / "floor.rec"
    payload = b"x" * 512

    def ping(request, context):
        atomic_write(target, payload, mode=0o600, durable=True)
        return b""

    async def handler(request, context):
        return await asyncio.to_thread(ping, request, context)

    async def empty(request, context):
        return b""

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Floor", {
        "Ping": grpc.unary_unary_rpc_method_handler(handler),
        "Empty": grpc.unary_unary_rpc_method_handler(empty)})])
    server.add_insecure_port("unix://" + sock)
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""

Call = Callable[[], Awaitable[Any]]


class Floor:
    """The floor server, in its own process like the agent. `ping`: an empty unary call over a unix
    socket whose handler does one atomic, fsync'd 512-byte write in a worker thread (the least a
    durable prepare can cost); `empty`: the same call answered at once on the event loop (the least
    any call over that kind of socket costs)."""

    def __init__(self, work: Path, root: Path) -> None:
        sock = work / "floor.sock"
        self.proc = subprocess.Popen([sys.executable, "-c", FLOOR_SERVER, str(sock), str(work), str(root)],
                                     stdout=subprocess.PIPE)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == b"ready"
        self.channel = grpc.aio.insecure_channel(f"unix://{sock}")
        ping: Any = self.channel.unary_unary("/bench.Floor/Ping")
        empty: Any = self.channel.unary_unary("/bench.Floor/Empty")
        self.ping: Call = lambda: ping(b"")
        self.empty: Call = lambda: empty(b"")

    async def close(self) -> None:
        await self.channel.close()
        self.proc.terminate()
        self.proc.wait()


def pct(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def timed(fn: Call) -> float:
    """Milliseconds."""
    started = time.perf_counter()
    await fn()
    return (time.perf_counter() - started) * 1000


def rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def run_seconds(argv: list[str], cwd: Path, runs: int = 5) -> float:
    """The median wall time of a command (a CLI call), which must succeed."""
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(argv, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        samples.append(time.perf_counter() - started)
    return sorted(samples)[len(samples) // 2]


def filesystem_of(path: Path) -> str:
    """The type of the file system `path` lies on (the longest mount point above it)."""
    best, kind = "", "unknown"
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        mount = fields[1].replace("\\040", " ")
        if (str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
            best, kind = mount, fields[2]
    return kind
