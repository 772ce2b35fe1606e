"""`dra-agent sim xid|lose|recover DEVICE`: tell the simulated machine, from outside the agent, to
raise an XID on a GPU, to lose it, or to reset it; `dra-agent sim driver unload|load`: take its NVIDIA
driver away and bring it back, as the GPU Operator's driver container does to reload it.

The command is a file in the simulated machine's control directory
(`<state dir>/nvml-sim/control/`, see `agent.sim.control`), written atomically and
named `<nanoseconds>-<pid>-<n>.json` so names sort in the order commands were written. An agent
running with `--nvml sim` applies it within moments and deletes the file; the CLI waits a few
seconds for that, then for the agent's saved device conditions to show it (`dra-agent taints`), and
says "applied" (or that the taints do not show it yet), else that it is queued for the next agent.
The same settings as `run` (`--state-dir`, `--nvml`) locate the machine.

The driver is the machine's, not NVML's (`agent.sim.driver`, `agent.sim.hardware.unload_driver`): the CLI
changes the machine on disk itself, with or without an agent running. Every simulated NVML of the machine
sees it at its next call (an agent, at its next GPU probe): unloaded, `/dev/nvidia*` and the driver's GPU
list are gone and NVML answers nothing; loaded again, they are back and NVML answers a new initialization.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from agent.app.output import EXIT_USAGE
from agent.config import Settings
from agent.fsutil import atomic_write, makedirs
from agent.health.conditions import GPU_LOST, XID, read_saved
from agent.health.policy import PolicyError, load_policy
from agent.health.requests import health_dir
from agent.sim.control import (
    BAD_SUFFIX,
    XID_RANGE,
    Action,
    CommandError,
    SimCommand,
    control_dir,
    device_index,
)
from agent.sim.hardware import load_driver, unload_driver
from agent.sim.profiles import ProfileError, load_profile

WAIT = 3.0  # seconds the CLI waits for a running agent to apply the command
_sequence = itertools.count()

__all__ = ["SimCommand", "SimctlError", "add_sim_parser", "cmd_sim", "control_dir", "make_command", "submit",
           "wait_applied", "wait_taints"]


class SimctlError(Exception):
    """A `dra-agent sim` command that cannot be written, with what to do instead."""


def make_command(settings: Settings, action: str, device: str, xid: str | int | None = None) -> SimCommand:
    """The command for `dra-agent sim ACTION DEVICE [XID]`, checked against the settings' machine."""
    if settings.nvml.kind != "sim":
        raise SimctlError(f"dra-agent sim drives the simulated NVML, but --nvml is {settings.nvml} "
                          "(DRA_NVML); pass the same --nvml sim[:PROFILE] and --state-dir as the agent's run")
    try:
        profile = load_profile(settings.nvml.profile)
    except ProfileError as exc:
        raise SimctlError(f"--nvml {settings.nvml}: {exc}") from exc
    number: int | None = None
    if action == "xid":
        try:
            number = int(str(xid), 10)
        except ValueError:
            number = None
        if number is None or number not in XID_RANGE:
            raise SimctlError(f"XID must be an integer {XID_RANGE.start}..{XID_RANGE.stop - 1}, not {xid!r}")
    elif action not in ("lose", "recover"):
        raise SimctlError(f"unknown sim command {action!r}; one of xid, lose, recover")
    try:
        device_index(profile, device)
        return SimCommand(cast(Action, action), device, number)
    except CommandError as exc:
        raise SimctlError(str(exc)) from exc


def submit(settings: Settings, command: SimCommand) -> Path:
    """Write `command` into the control directory of the settings' simulated machine; its path."""
    if settings.nvml.kind != "sim":
        raise SimctlError(f"dra-agent sim drives the simulated NVML, but --nvml is {settings.nvml} (DRA_NVML)")
    directory = control_dir(settings)
    try:
        makedirs(settings.sim_root, 0o700)  # as the machine itself makes it, if no agent has yet
        makedirs(directory)
        path = directory / f"{time.time_ns():020d}-{os.getpid()}-{next(_sequence):04d}.json"
        atomic_write(path, command.encode())
    except OSError as exc:
        raise SimctlError(f"cannot write the command into {directory}: {exc}") from exc
    return path


def wait_applied(path: Path, timeout: float = WAIT, poll: float = 0.05) -> bool | None:
    """True once the command file is consumed (applied), False when the agent set it aside as bad,
    None when it is still waiting after `timeout` seconds."""
    bad = path.with_name(path.name + BAD_SUFFIX)
    deadline = time.monotonic() + timeout
    while True:
        if bad.exists():
            return False
        if not path.exists():
            # Set aside between the two checks, or applied.
            return not bad.exists()
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll)


def wait_taints(settings: Settings, command: SimCommand, timeout: float = WAIT, poll: float = 0.05) -> bool:
    """Whether, within `timeout` seconds, the device conditions the agent saves show what an applied
    command does (an XID taint, a lost GPU, or neither after a reset), as `dra-agent taints` lists them.
    The agent takes in an XID when its event arrives, a lost or reset GPU at its next probe."""
    try:
        policy = load_policy(settings.taint_policy)
    except PolicyError:
        return True  # what the agent makes of it is not known here: nothing to wait for
    if command.command == "xid" and command.xid is not None and not policy.for_xid(command.xid).taints:
        return True
    if command.command == "lose" and not policy.gpu_lost.taints:
        return True

    def shown() -> bool:
        try:
            causes = [c for c in read_saved(health_dir(settings))[0] if c.device == command.device]
        except FileNotFoundError:  # what applied it keeps no device conditions here (a bare simulated NVML)
            return True
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if command.command == "xid":
            return any(c.kind == XID and c.value == str(command.xid) for c in causes)
        if command.command == "lose":
            return any(c.kind == GPU_LOST for c in causes)
        return not any(c.kind in (XID, GPU_LOST) for c in causes)

    deadline = time.monotonic() + timeout
    while not shown():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
    return True


def cmd_sim(args: argparse.Namespace, settings: Settings) -> int:
    try:
        command = make_command(settings, args.action, args.device, getattr(args, "xid", None))
        path = submit(settings, command)
    except SimctlError as exc:
        print(f"dra-agent sim: {exc}", flush=True, file=sys.stderr)
        return EXIT_USAGE
    what = f"{command.command} {command.device}" + (f" XID {command.xid}" if command.xid is not None else "")
    applied = wait_applied(path, float(args.wait))
    if applied:
        if wait_taints(settings, command, float(args.wait)):
            print(f"{what}: applied")
        else:
            print(f"{what}: applied; `dra-agent taints` does not show it yet (the agent sees a GPU answer again "
                  "at its next probe, every --gpu-probe-interval)")
        return 0
    if applied is False:
        print(f"{what}: rejected by the simulated NVML (see the agent's log; the command is in "
              f"{path.name}{BAD_SUFFIX})", file=sys.stderr)
        return 1
    print(f"{what}: queued: an agent running with --nvml sim will apply it when it starts ({path})")
    return 0


def cmd_sim_driver(args: argparse.Namespace, settings: Settings) -> int:
    """`dra-agent sim driver unload|load`."""
    if settings.nvml.kind != "sim":
        print(f"dra-agent sim: the NVIDIA driver of the simulated machine, but --nvml is {settings.nvml} (DRA_NVML); "
              "pass the same --nvml sim[:PROFILE] and --state-dir as the agent's run", file=sys.stderr)
        return EXIT_USAGE
    try:
        profile = load_profile(settings.nvml.profile)
    except ProfileError as exc:
        print(f"dra-agent sim: --nvml {settings.nvml}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    root = settings.sim_root
    try:
        makedirs(root, 0o700)  # as the machine itself makes it, if no agent has yet
        changed = unload_driver(root) if args.state == "unload" else load_driver(profile, root)
    except OSError as exc:
        print(f"dra-agent sim: cannot change the simulated machine in {root}: {exc}", file=sys.stderr)
        return 1
    if not changed:
        print(f"NVIDIA driver: already {args.state}ed")
    elif args.state == "unload":
        print("NVIDIA driver unloaded: /dev/nvidia* gone, NVML does not answer (a running agent taints its GPUs "
              "nvml-lost at its next GPU probe)")
    else:
        print("NVIDIA driver loaded: /dev/nvidia* back, NVML answers once initialized again (a running agent "
              "does so at its next GPU probe)")
    return 0


def add_sim_parser(subparsers: argparse._SubParsersAction[Any],
                   add_arguments: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    """`dra-agent sim xid DEVICE XID | lose DEVICE | recover DEVICE`; each takes the run settings."""
    sp: argparse.ArgumentParser = subparsers.add_parser(
        "sim", help="drive the simulated NVML: raise an XID, lose or reset a GPU, unload or load the driver",
        description="Tell the simulated machine (--nvml sim) to raise an XID on a GPU, lose it, or reset it, or "
                    "unload or load its NVIDIA driver. DEVICE is the published name (gpu-3).")
    actions = sp.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, help in (("xid", "raise XID on DEVICE (13, 31, 43, 45, 68, 109 are application errors)"),
                         ("lose", "DEVICE falls off the bus: every NVML call about it fails (GPU_IS_LOST)"),
                         ("recover", "reset DEVICE: it answers again and needs no recovery action")):
        ap = actions.add_parser(action, help=help, description=help)
        ap.set_defaults(fn=cmd_sim)
        ap.add_argument("device", metavar="DEVICE", help="the GPU as published, e.g. gpu-3")
        if action == "xid":
            ap.add_argument("xid", metavar="XID", help=f"an integer {XID_RANGE.start}..{XID_RANGE.stop - 1}")
        ap.add_argument("--wait", type=float, default=WAIT, metavar="SECONDS",
                        help=f"how long to wait for a running agent to apply it (default: {WAIT:g})")
        add_arguments(ap)
    help = ("unload the NVIDIA driver (its device nodes go, NVML stops answering) or load it again, as the GPU "
            "Operator's driver container does to reload it")
    ap = actions.add_parser("driver", help=help, description=help)
    ap.set_defaults(fn=cmd_sim_driver)
    ap.add_argument("state", choices=("unload", "load"), metavar="unload|load")
    add_arguments(ap)
    return sp
