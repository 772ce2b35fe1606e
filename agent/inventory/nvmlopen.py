"""Opening the host's NVML for GPU discovery (`open_real_nvml`, the `NvmlOpener` of real hardware,
`agent.inventory.nvmlapi`): the driver's library from the driver root.

`pynvml` loads `libnvidia-ml.so.1` by that name through the dynamic linker, once per process, into its
module global `nvmlLib`, and uses whatever library that global holds. In a container the linker only
searches the container's own filesystem, where the driver is not; so the agent finds the library below
the driver root (`--driver-root`, `agent.host.driverroot`), loads that file by its path with ctypes and
hands it to pynvml through `nvmlLib` (under pynvml's own `libLoadLock`) before the first `nvmlInit`.

In auto mode a node that shows NVIDIA hardware but whose NVML does not load or initialize is an error,
never a quiet switch to the simulation: publishing made-up GPUs on a real GPU node would be worse than
publishing none. A node without NVIDIA hardware publishes no GPUs, with a warning.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from pathlib import Path

import pynvml

from agent.config import Settings
from agent.host.driverroot import NVML_LIBRARY, find_library
from agent.host.pci import nvidia_display_functions
from agent.inventory import DiscoveryError
from agent.inventory.nvmlapi import OpenNvml
from agent.inventory.nvmlvalues import describe_error

log = logging.getLogger(__name__)


class LibraryMissing(Exception):
    """No loadable libnvidia-ml.so.1 below the driver root; the message names the root and every path tried."""


def load_library(root: Path) -> str:
    """Load the driver's NVML library from below `root` into pynvml (once per process); its path.
    LibraryMissing when there is none, or it does not load."""
    with pynvml.libLoadLock:
        loaded = pynvml.nvmlLib
        if loaded is not None:
            return str(getattr(loaded, "_name", NVML_LIBRARY))
        search = find_library(root)
        tried = ", ".join(search.tried) or "nothing"
        if search.found is None:
            raise LibraryMissing(f"no {NVML_LIBRARY} under the driver root {root} (tried {tried})")
        try:
            pynvml.nvmlLib = ctypes.CDLL(str(search.found))
        except OSError as exc:
            raise LibraryMissing(f"{search.found} (the {NVML_LIBRARY} under the driver root {root}) does not "
                                 f"load: {exc}") from exc
        return str(search.found)


def init_real(root: Path) -> str:
    """Load the library from `root` and initialize NVML; the library's path. LibraryMissing, or the
    pynvml.NVMLError of nvmlInit."""
    path = load_library(root)
    pynvml.nvmlInit()
    return path


def open_real_nvml(settings: Settings) -> OpenNvml:
    """The host's NVML (`--nvml real` or `auto`), initialized; in auto mode none (no GPUs) on a node
    without NVIDIA hardware. DiscoveryError when it cannot be opened where it should be, with why."""
    mode = settings.nvml
    plain = OpenNvml(pynvml, settings.sysfs_root, settings.dev_root)
    root = settings.driver_root
    try:
        path = init_real(root)
    except LibraryMissing as exc:
        found = nvidia_hardware(settings)
        if mode.kind == "real":
            raise DiscoveryError(f"--nvml real: {exc}; set --driver-root to where the NVIDIA driver is "
                                 "installed (mounted)") from exc
        if found:
            raise DiscoveryError(f"NVIDIA hardware is present ({', '.join(found)}) but {exc}; set --driver-root "
                                 "to where the NVIDIA driver is installed (mounted), or pass --nvml sim to publish "
                                 "simulated GPUs instead") from exc
        log.warning("no NVIDIA GPUs on this node (%s; no NVIDIA hardware in %s or %s); publishing none "
                    "(--nvml sim publishes simulated GPUs)", exc, settings.sysfs_root, settings.dev_root)
        return OpenNvml(None, settings.sysfs_root, settings.dev_root)
    except pynvml.NVMLError as exc:
        if mode.kind == "real":
            raise DiscoveryError(f"--nvml real: NVML did not initialize: {describe_error(exc)}") from exc
        found = nvidia_hardware(settings)
        if found:
            raise DiscoveryError(
                f"NVIDIA hardware is present ({', '.join(found)}) but NVML did not initialize: "
                f"{describe_error(exc)}; is the NVIDIA kernel driver loaded? (or pass --nvml sim to publish "
                "simulated GPUs instead)") from exc
        log.warning("no NVIDIA GPUs on this node (NVML: %s; no NVIDIA hardware in %s or %s); publishing none "
                    "(--nvml sim publishes simulated GPUs)", describe_error(exc), settings.sysfs_root,
                    settings.dev_root)
        return OpenNvml(None, settings.sysfs_root, settings.dev_root)
    log.info("NVML: %s", path)
    return plain


def nvidia_hardware(settings: Settings) -> list[str]:
    """Signs of NVIDIA GPUs on this node: /dev/nvidiactl, NVIDIA display functions in sysfs."""
    found = []
    ctl = settings.dev_root / "nvidiactl"
    if ctl.exists():
        found.append(str(ctl))
    functions = nvidia_display_functions(settings.sysfs_root)
    if functions:
        found.append(f"NVIDIA display functions {', '.join(functions)} in {settings.sysfs_root}")
    return found


def probe(root: Path = Path("/")) -> str:
    """`real` when the NVML library below `root` loads and initializes here, else `sim`."""
    try:
        init_real(root)
    except (LibraryMissing, pynvml.NVMLError, OSError):
        return "sim"
    with contextlib.suppress(pynvml.NVMLError):
        pynvml.nvmlShutdown()
    return "real"
