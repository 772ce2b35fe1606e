"""`dra-agent taints`: the device taints the running agent holds, and clearing XID taints by hand.

The agent saves its current causes to `<state dir>/health/causes.json` on every change
(`agent.health.conditions`); listing reads that file, so it works without a socket and shows the
cause and age of each taint. Where a cluster is configured, the DeviceTaintRules that select this
node's devices are listed too (`agent.health.taintrules`): an administrator's taints, which the agent
does not clear. Clearing is a request the running agent applies (`agent.health.requests`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import difflib
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from agent import kube
from agent.app.output import EXIT_NOT_FOUND, EXIT_USAGE, dump, table
from agent.config import Settings
from agent.health.conditions import Cause, read_saved
from agent.health.requests import CLEAR_WAIT, health_dir, read_result, submit_clear
from agent.health.taintrules import EVERY_DEVICE, RuleTaint, read_rule_taints
from agent.names import InvalidName, check_device_name

log = logging.getLogger(__name__)

# -- the CLI ---------------------------------------------------------------------------------------

def _age(seconds: float) -> str:
    whole = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if whole >= size:
            return f"{whole // size}{unit}"
    return f"{whole}s"


def _rows(settings: Settings, causes: list[Cause], rules: list[RuleTaint], now: float) -> list[dict[str, Any]]:
    rows = []
    for c in causes:
        rows.append({"device": c.device, "key": f"{settings.driver_name}/{c.kind}", "value": c.value,
                     "effect": c.effect, "cause": c.detail, "since": c.since, "age": _age(now - c.since),
                     "source": "agent"})
    for r in rules:
        since = _seconds(r.time_added)
        rows.append({"device": r.device, "key": r.key, "value": r.value, "effect": r.effect,
                     "cause": _by_rule(r),
                     "since": since, "age": "" if since is None else _age(now - since),
                     "source": "DeviceTaintRule", "rule": r.rule})
    return rows


def _by_rule(r: RuleTaint) -> str:
    return f"DeviceTaintRule {r.rule} (an administrator's: the agent does not clear it)"


def _seconds(rfc3339: str) -> float | None:
    try:
        return datetime.datetime.fromisoformat(rfc3339).timestamp()
    except ValueError:
        return None


async def _rule_taints(settings: Settings) -> tuple[list[RuleTaint], str]:
    """The DeviceTaintRules selecting this node's devices of our driver, and why they could not be
    read ("" when they were). No cluster configured: none, and nothing to say."""
    if settings.offline is not None:
        return [], ""
    client, _ = await kube.connect(settings)
    if client is None:
        return [], ""
    try:
        return await read_rule_taints(client, settings.driver_name, settings.node_name), ""
    except Exception as exc:
        return [], kube.describe(exc)
    finally:
        await client.close()


def cmd_taints(args: argparse.Namespace, settings: Settings) -> int:
    if args.action == "clear":
        return _clear(settings, args.device)
    try:
        causes, saved_at = read_saved(health_dir(settings))
    except FileNotFoundError:
        causes, saved_at = [], None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"dra-agent: cannot read {health_dir(settings) / 'causes.json'}: {exc}", file=sys.stderr)
        return 1
    rules, unread = asyncio.run(_rule_taints(settings))
    if unread:
        print(f"dra-agent: DeviceTaintRules not read: {unread}", file=sys.stderr)
    rows = _rows(settings, causes, rules, time.time())
    if args.output == "json":
        print(dump(rows, "json"))
    else:
        print(table([(r["device"], r["key"], r["value"], r["effect"], r["cause"], r["age"]) for r in rows],
                     ("DEVICE", "KEY", "VALUE", "EFFECT", "CAUSE", "AGE")))
        if saved_at is None:
            print("(no agent has saved device conditions in this state directory yet)", file=sys.stderr)
    return 0


def _clear(settings: Settings, device: str) -> int:
    try:
        check_device_name(device)
        if (unknown := _not_here(settings, device)) is not None:
            print(f"dra-agent: {unknown}", file=sys.stderr)
            return EXIT_NOT_FOUND
        path = submit_clear(settings, device)
    except InvalidName as exc:
        print(f"dra-agent: {exc}", file=sys.stderr)
        return EXIT_USAGE
    deadline = time.monotonic() + CLEAR_WAIT
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if path.exists():
        print(f"queued: no running agent applied it within {CLEAR_WAIT:g}s; the agent applies it when it "
              f"starts ({path})")
        return 0
    cleared = read_result(path)
    try:
        left = [c for c in read_saved(health_dir(settings))[0] if c.device == device]
    except (OSError, ValueError, KeyError, TypeError):
        left = []
    if cleared is None:  # an agent that writes no result (older, or its write failed)
        said = f"applied: the XID taints of {device}, if any, are cleared"
    elif cleared:
        said = f"cleared the XID taints of {device}: {'; '.join(cleared)}"
    else:
        said = f"{device} had no XID taint: nothing cleared"
    still = [c.detail for c in left]
    rules, _ = asyncio.run(_rule_taints(settings))
    still += [_by_rule(r) for r in rules if r.device in (device, EVERY_DEVICE)]
    print(said + (f"; still tainted by: {'; '.join(still)}" if still else ""))
    return 0


def _not_here(settings: Settings, device: str) -> str | None:
    """Why `device` is not a device of this node, or None when it is: one the agent saved conditions of
    (a lost GPU, which discovery no longer finds), or one discovery finds with these settings."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        if any(c.device == device for c in read_saved(health_dir(settings))[0]):
            return None
    from agent.app import oneshot

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # what discovery cannot read is not this command's business
    try:
        names = asyncio.run(oneshot.device_names(settings))
    finally:
        root.setLevel(level)
    if device in names:
        return None
    close = difflib.get_close_matches(device, sorted(names), n=3)
    return (f"no device {device} on this node: discovery with these settings finds {len(names)} devices"
            + (f" (the closest: {', '.join(close)})" if close else "") + "; give the agent's settings (--nvml, "
            "--state-dir, --node-name) when it runs with others")


def add_parser(sub: Any, add_arguments: Callable[[argparse.ArgumentParser], None]) -> None:
    tp = sub.add_parser("taints", help="list the device taints the agent holds, or clear XID taints by hand",
                        description="list the device taints the agent holds (from its saved device conditions), or "
                                    "clear XID taints by hand (taints clear DEVICE)")
    tsub = tp.add_subparsers(dest="action", metavar="ACTION")
    tp.set_defaults(fn=cmd_taints, action="list")
    tp.add_argument("-o", "--output", choices=("table", "json"), default="table")
    add_arguments(tp)
    clear = ("clear a device's XID taints raised until now (lost-GPU and link taints go when the hardware "
             "recovers); a device this node does not have is refused")
    cp = tsub.add_parser("clear", help=clear, description=clear)
    cp.add_argument("device", metavar="DEVICE", help="the device as published, e.g. gpu-3")
    cp.set_defaults(fn=cmd_taints)
    add_arguments(cp)

