"""The simulated machine behind GPU discovery's seam (`agent.inventory.nvmlapi`): `open_sim_nvml`, the
`NvmlOpener` of `--nvml sim`, and `SimCommands`, its `GpuCommands` (`dra-agent sim` commands applied to
the simulated NVML while the event watcher runs, and the resets they made). `agent.app.assembly`
chooses them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pynvml

from agent.config import Settings
from agent.inventory import DiscoveryError
from agent.inventory.nvmlapi import OpenNvml
from agent.inventory.nvmlvalues import describe_error
from agent.sim.control import control_dir
from agent.sim.nvml import SimulatedNvml
from agent.sim.profiles import ProfileError

log = logging.getLogger(__name__)


def open_sim_nvml(settings: Settings) -> OpenNvml:
    """The simulated NVML of `--nvml sim:<profile>`, initialized, its machine (sysfs, /dev) written under
    the settings' `sim_root`, taking `dra-agent sim` commands from its control directory."""
    profile = settings.nvml.profile
    try:
        sim = SimulatedNvml.from_profile(profile)
    except ProfileError as exc:
        raise DiscoveryError(f"--nvml sim:{profile}: {exc}") from exc
    root = settings.sim_root
    try:
        sim.materialize(root)
    except OSError as exc:
        raise DiscoveryError(f"--nvml sim:{profile}: cannot write the simulated hardware under "
                             f"{root}: {exc}") from exc
    try:
        sim.nvmlInit()
    except pynvml.NVMLError as exc:
        raise DiscoveryError(f"--nvml sim:{profile}: NVML did not initialize: "
                             f"{describe_error(exc)}") from exc
    log.info("simulated NVML: profile %s, %d GPUs, hardware under %s", sim.profile.name,
             len(sim.profile.gpus), root)
    # Its /dev is a directory of the state dir, where an unprivileged agent cannot make device nodes.
    return OpenNvml(sim, root / "sys", root / "dev", SimCommands(sim, control_dir(settings)),
                    node_placeholders=True)


class SimCommands:
    """`GpuCommands` of a simulated NVML: the command files written to `directory` (None: none are
    watched), applied from `start` until `stop`."""

    def __init__(self, sim: SimulatedNvml, directory: Path | None = None) -> None:
        self.sim = sim
        self.directory = directory
        self._watching = False

    def start(self) -> None:
        if self.directory is None or self._watching:
            return
        try:
            self.sim.watch_control(self.directory)
        except OSError as exc:  # out of inotify instances, an unwritable state dir: events still flow
            log.warning("dra-agent sim commands are not applied: cannot watch %s: %s", self.directory, exc)
            self.directory = None
            return
        self._watching = True

    def stop(self) -> None:
        if self._watching:
            self._watching = False
            self.sim.stop_watching()

    def resets(self, index: int) -> int:
        return self.sim.reset_count(index)

    def raised_at(self, data: Any) -> float | None:
        # Set by the simulated NVML's event data (`agent.sim.events.event_data`) for an event a command raised.
        raised = getattr(data, "raised_at", None)
        return None if raised is None else float(raised)
