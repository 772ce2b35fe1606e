"""The agent as a process (`dra-agent run`): the first log line, the worker threads, the signals, and
the exit status.

The registration socket opens first, while `agent.app.daemon` and the servers are all that is
imported; the rest of the agent's modules are imported in a worker thread meanwhile, so the
kubelet's GetInfo is answered from the first moment. SIGTERM, SIGINT and SIGHUP stop the agent; with
`--stop-with-parent` so does the exit of the process that started it (the kernel sends SIGTERM).
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor

from agent import __version__
from agent import config as config_mod
from agent.app.daemon import Agent, open_registration
from agent.config import Settings

# The lines the agent logs as a process keep the logger name they had in the daemon module.
log = logging.getLogger("agent.app.daemon")

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_MODULES = (
    "agent.engine.prepare",
    "agent.engine.recovery",
    "agent.app.connection",
    "agent.health.service",
    "agent.health.claimstatus",
    "agent.health.statussinks",
    "agent.engine.selfheal",
    "agent.engine.gc",
    "agent.publish.apiserver",
    "agent.metrics",
    "agent.app.httpserver",
    "agent.inventory.gpus",
    "agent.inventory.nics",
    "agent.inventory.cpus",
    "agent.inventory.memory",
    "agent.inventory.netwatch",
)


def _import_modules() -> None:
    for name in _MODULES:
        importlib.import_module(name)



async def run(settings: Settings) -> int:
    from agent.health.policy import PolicyError, load_policy

    log.info("dra-agent %s starting: driver %s, node %s, nvml %s", __version__, settings.driver_name,
             settings.node_name, settings.nvml)
    for flag, value in config_mod.describe(settings):
        log.debug("setting %s = %s", flag, value)
    try:
        load_policy(settings.taint_policy)  # a configuration error stops the agent before any socket opens
    except PolicyError as exc:
        log.error("cannot start: %s", exc)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Worker threads mostly wait on the disk: enough of them that 16+ claims in flight are not
    # queued behind the default pool's handful (cores + 4).
    loop.set_default_executor(ThreadPoolExecutor(max_workers=32, thread_name_prefix="dra-io"))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: the terminal of `make run` went away
        loop.add_signal_handler(sig, stop.set)
    if settings.stop_with_parent:
        try:
            stop_with_parent()
        except OSError as exc:
            log.error("cannot start: --stop-with-parent: %s", exc)
            return 1
    agent: Agent | None = None
    try:
        servers = await open_registration(settings)
    except Exception as exc:
        from agent.app.connection import StartupError  # (imported on this path only: it pulls in the API client)

        if not isinstance(exc, (StartupError, OSError, RuntimeError)):
            raise
        log.error("cannot start: %s", exc)
        return 1
    # The rest of the agent's modules are imported in a worker thread: the event loop keeps
    # answering GetInfo meanwhile (an import holds the interpreter only in short slices).
    await asyncio.to_thread(_import_modules)
    from agent.app.connection import StartupError
    from agent.inventory import DiscoveryError

    try:
        agent = Agent(settings, servers)
        await agent.start()
    except (DiscoveryError, StartupError, OSError, RuntimeError, PolicyError) as exc:
        log.error("cannot start: %s", exc)
        await (agent.stop() if agent is not None else servers.stop())
        return 1
    except BaseException:
        # The registration socket is open already: it goes before the error does.
        await (agent.stop() if agent is not None else servers.stop())
        raise
    await stop.wait()
    log.info("stopping")
    await agent.stop()
    return 0


def stop_with_parent() -> None:
    """SIGTERM for this process when its parent exits (prctl PR_SET_PDEATHSIG: one system call, through
    ctypes), so that `make run` stopped by any signal stops the agent, which make does not forward but
    for SIGTERM. A parent that exited before this call is seen by the parent process ID changing
    across it; one that exited before the agent's interpreter started is not."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
