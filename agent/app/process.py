"""The agent as a process (`dra-agent run`): the first log line, the roots checked, the worker
threads, the signals, and the exit status.

The agent's roots are checked first, before asyncio, gRPC, protobuf or any of the agent's heavier
modules are imported, so a bad directory is said at once. Then the event loop starts, and the rest
of the agent's modules are imported in a worker thread while the loop sets up. The kubelet's sockets
open in `agent.app.daemon` (the registration socket last, once the DRA socket it names answers).
SIGTERM, SIGINT and SIGHUP stop the agent from the start, and remove whatever socket exists; with
`--stop-with-parent` so does the exit of the process that started it (the kernel sends SIGTERM).
"""

from __future__ import annotations

import logging
import os
import signal

from agent import __version__
from agent import config as config_mod
from agent.config import Settings

# The lines the agent logs as a process keep the logger name they had in the daemon module.
log = logging.getLogger("agent.app.daemon")

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
M_ARENA_MAX = -8  # <malloc.h>
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGHUP: the terminal of `make run` went away

_MODULES = (
    "agent.app.daemon",
    "agent.kubelet.server",
    "agent.engine.prepare",
    "agent.engine.recovery",
    "agent.app.connection",
    "agent.health.service",
    "agent.health.claimstatus",
    "agent.health.statussinks",
    "agent.engine.selfheal",
    "agent.engine.gc",
    "agent.metrics",
    "agent.app.httpserver",
    "agent.inventory.gpus",
    "agent.inventory.nics",
    "agent.inventory.cpus",
    "agent.inventory.memory",
    "agent.inventory.netwatch",
)
# With a cluster to talk to: the API client and what uses it (offline, none of it is ever loaded).
_CLUSTER_MODULES = ("agent.publish.apiserver", "lightkube.resources.resource_v1", "lightkube.resources.core_v1")


def _import_modules(settings: Settings) -> None:
    import importlib

    for name in (*_MODULES, *(_CLUSTER_MODULES if settings.offline is None else ())):
        importlib.import_module(name)


def main(settings: Settings) -> int:
    """`dra-agent run`: its exit status."""
    log.info("dra-agent %s starting: driver %s, node %s, nvml %s", __version__, settings.driver_name,
             settings.node_name, settings.nvml)
    for flag, value in config_mod.describe(settings):
        log.debug("setting %s = %s", flag, value)
    if settings.taint_policy is not None:  # without one, the defaults: nothing to check
        from agent.health.policy import PolicyError, load_policy

        try:
            load_policy(settings.taint_policy)  # a configuration error stops the agent before any socket opens
        except PolicyError as exc:
            log.error("cannot start: %s", exc)
            return 1
    # A stop asked for before the event loop is up is kept for it (the socket must go on the way out).
    early: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: early.append(signum)) for sig in STOP_SIGNALS}
    if settings.stop_with_parent:
        try:
            stop_with_parent()
        except OSError as exc:
            log.error("cannot start: --stop-with-parent: %s", exc)
            return 1
    try:
        from agent.app.assembly import prepare_roots

        prepare_roots(settings)
    except (OSError, RuntimeError) as exc:
        log.error("cannot start: %s", exc)
        return 1
    limit_malloc_arenas()
    try:
        import asyncio

        return asyncio.run(run(settings, early))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def run(settings: Settings, early: list[int]) -> int:
    """The agent on the event loop; `early`: stop signals that came before the loop."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Worker threads mostly wait on the disk: enough of them that 16+ claims in flight are not
    # queued behind the default pool's handful (cores + 4).
    loop.set_default_executor(ThreadPoolExecutor(max_workers=32, thread_name_prefix="dra-io"))
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    if early:
        stop.set()
    # The rest of the agent's modules are imported in a worker thread: the loop goes on meanwhile.
    await asyncio.to_thread(_import_modules, settings)
    from agent.app.connection import StartupError
    from agent.app.daemon import Agent
    from agent.health.policy import PolicyError
    from agent.inventory import DiscoveryError
    from agent.kubelet.server import Servers

    servers = Servers(settings)
    agent: Agent | None = None
    try:
        agent = Agent(settings, servers)
        await agent.start()
    except (DiscoveryError, StartupError, OSError, RuntimeError, PolicyError) as exc:
        log.error("cannot start: %s", exc)
        await (agent.stop() if agent is not None else servers.stop())
        return 1
    except BaseException:
        # A socket may be open already: it goes before the error does.
        await (agent.stop() if agent is not None else servers.stop())
        raise
    await stop.wait()
    log.info("stopping")
    await agent.stop()
    return 0


def limit_malloc_arenas() -> None:
    """Two malloc arenas for the whole process (glibc's mallopt M_ARENA_MAX), unless MALLOC_ARENA_MAX
    says otherwise. By default every worker thread that allocates gets an arena of its own (up to
    eight per core) and keeps what it freed there: after a burst of claims on 32 workers, several MiB
    the agent never uses again. There is little to contend for: most of the threads' allocations come
    from the interpreter's own allocator, under its lock."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    mallopt(M_ARENA_MAX, 2)


def stop_with_parent() -> None:
    """SIGTERM for this process when its parent exits (prctl PR_SET_PDEATHSIG: one system call, through
    ctypes), so that `make run` stopped by any signal stops the agent, which make does not forward but
    for SIGTERM. A parent that exited before this call is seen by the parent process ID changing
    across it; one that exited before the agent's interpreter started is not."""
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
