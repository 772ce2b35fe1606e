"""The agent as a process (`dra-agent run`): the first log line, the worker threads, the signals, and
the exit status.

The registration socket opens first, while `agent.app.daemon` and the servers are all that is
imported; the rest of the agent's modules are imported in a worker thread meanwhile, so the
kubelet's GetInfo is answered from the first moment. SIGTERM and SIGINT stop the agent.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import signal
from concurrent.futures import ThreadPoolExecutor

from agent import __version__
from agent import config as config_mod
from agent.app.daemon import Agent, open_registration
from agent.config import Settings

log = logging.getLogger(__name__)

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
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
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
