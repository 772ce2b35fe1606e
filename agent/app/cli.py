"""`dra-agent`: the daemon and the node debug CLI.

    dra-agent run                      the agent (what the DaemonSet runs)
    dra-agent devices [-o table|json|yaml]
    dra-agent slices [-o yaml|json]    the exact ResourceSlices that would be published
    dra-agent claims [NAMESPACE/NAME] [-o table|json] [--files|--metadata]   claims prepared on this node
    dra-agent kubelet info|prepare|unprepare|health
    dra-agent cdi validate [PATH...]
    dra-agent doctor [-o text|json]    check this node the way a person would when a pod is stuck
    dra-agent taints [-o table|json]   the device taints the agent holds; `taints clear DEVICE`
    dra-agent sim xid DEVICE XID | lose DEVICE | recover DEVICE | driver unload|load   drive the simulated GPUs
    dra-agent vfio status              what the agent bound to vfio-pci
    dra-agent pool status [-o text|json]   this node's pool as the cluster sees it, beside the node's view
    dra-agent help settings            every setting (flag and environment variable)

Every command accepts the same settings as `run` (flags or environment variables); its `--help`
lists its own options and the settings that matter to it, `dra-agent help settings` all of them.
A usage error is one line and a pointer to `--help`, exit status 2; a reader that goes away (`| head`)
ends a command quietly, with the status a shell gives a command killed by SIGPIPE (141).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from agent import __version__, config
from agent.app.output import EXIT_USAGE

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

# Each command imports what it needs when it runs: `dra-agent kubelet info` and `dra-agent claims`
# are commands a person waits for, and the agent's full set of modules takes most of a second
# to import on a small node.
_LIGHT_COMMANDS = {"run", "devices", "slices", "claims", "kubelet", "cdi", "doctor", "vfio", "pool", "help"}

SIGPIPE_STATUS = 128 + 13  # what a shell reports for a command killed by SIGPIPE

# The settings each command's --help lists (it takes all of them; `dra-agent help settings` lists all).
DISCOVERY = ("nvml", "node_name", "state_dir", "offline", "kubeconfig", "nic_include", "nic_exclude")
KUBELET = ("kubelet_dir", "driver_name", "rolling_update_pod_uid")
SHOWN: dict[str, Collection[str] | None] = {
    "run": None,  # all: they are run's own options
    "devices": DISCOVERY,
    "slices": (*DISCOVERY, "driver_name"),
    "claims": ("state_dir",),
    "vfio status": ("state_dir", "nvml"),
    "kubelet info": KUBELET,
    "kubelet health": KUBELET,
    "kubelet prepare": (*KUBELET, "offline", "kubeconfig", "state_dir"),
    "kubelet unprepare": (*KUBELET, "offline", "kubeconfig", "state_dir"),
    "cdi validate": ("cdi_dir", "static_cdi_dir"),
    "doctor": ("kubelet_dir", "state_dir", "cdi_dir", "metrics_address", "offline", "kubeconfig"),
    "pool status": (*DISCOVERY, "driver_name"),
    "taints": ("state_dir", "driver_name"),
    "taints clear": ("state_dir", "nvml", "node_name"),
    "sim": ("nvml", "state_dir"),
}


# -- commands ---------------------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace, settings: config.Settings) -> int:
    from agent.app import process

    return process.main(settings)


def _command(name: str) -> Callable[[argparse.Namespace, config.Settings], int]:
    """A command of `agent.app.commands`, imported when it runs."""
    def run(args: argparse.Namespace, settings: config.Settings) -> int:
        from agent.app import commands

        return int(getattr(commands, name)(args, settings))

    return run


def cmd_help(args: argparse.Namespace, settings: config.Settings) -> int:
    if args.topic == "settings":
        p = argparse.ArgumentParser(prog="dra-agent", usage=argparse.SUPPRESS, add_help=False,
                                    description="Every command takes these settings, each as a flag or an "
                                                "environment variable (the flag wins). Give a command the "
                                                "agent's own, so that it finds what the agent made.")
        config.add_arguments(p)
        print(p.format_help(), end="")
        return 0
    print(args.topics[args.topic].format_help(), end="")
    return 0


# -- parser -----------------------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage error is one line and a pointer to `--help` (argparse prints the
    whole usage, which for the agent's commands is a page)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\nSee '{self.prog} --help'.\n")

    def print_help(self, file: SupportsWrite[str] | None = None) -> None:
        # Written here, not by argparse, which swallows the error of a reader that went away.
        (file or sys.stdout).write(self.format_help())


class _Version(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> NoReturn:
        print(f"dra-agent {__version__}")
        parser.exit()


def parser(words: Sequence[str] | None = None) -> Parser:
    """The full parser; for `words` whose command is one of `_LIGHT_COMMANDS`, the commands defined
    in other modules (taints, sim) are left out, so their imports are not paid for, and only the
    command being run takes the settings as options (argparse spends most of a CLI call's start on
    them: every command takes all of them)."""
    only = words[0] if words else None
    p = Parser(prog="dra-agent", description="Kubernetes DRA node agent",
               epilog=f"Every command takes the agent's settings, as flags or environment variables: "
                      f"{config.SETTINGS_HELP} lists them. COMMAND --help shows a command's own options.")
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    topics: dict[str, argparse.ArgumentParser] = {"": p}

    def wanted(path: str) -> bool:
        if words is None or only == "help" or only not in _LIGHT_COMMANDS:
            return True
        return list(words[:len(path.split())]) == path.split()

    def leaf(where: Any, name: str, help: str, fn: Callable[..., int], path: str | None = None) -> Parser:
        path = path or name
        sp: Parser = where.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn, parser=sp)
        if wanted(path):
            config.add_arguments(sp, SHOWN.get(path, SHOWN.get(path.split()[0])))
        topics[path] = sp
        return sp

    def group(where: Any, name: str, help: str) -> Any:
        """A command of actions (`kubelet prepare`): its own help is a topic too (`help kubelet`)."""
        gp = where.add_parser(name, help=help, description=help)
        topics[name] = gp
        return gp.add_subparsers(dest="action", required=True, metavar="ACTION")

    leaf(sub, "run", "run the agent", cmd_run)
    sp = leaf(sub, "devices", "discover and show this node's devices", _command("cmd_devices"))
    sp.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    sp = leaf(sub, "slices", "show the ResourceSlices that would be published", _command("cmd_slices"))
    sp.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml")
    sp = leaf(sub, "claims", "show the claims prepared on this node", _command("cmd_claims"))
    sp.add_argument("claim", nargs="?", default="", metavar="NAMESPACE/NAME",
                    help="only this claim (exit 1 when it is not prepared here)")
    sp.add_argument("-o", "--output", choices=("table", "json"), default="table")
    sp.add_argument("--files", action="store_true", help="also list each claim's files")
    sp.add_argument("--metadata", action="store_true",
                    help="print only the path of each device metadata file, one a line (`cat $(dra-agent claims "
                         "NAMESPACE/NAME --metadata)`)")

    vsub = group(sub, "vfio", "PCI functions this agent has bound to vfio-pci")
    sp = leaf(vsub, "status", "what the agent has bound to vfio-pci and for which claim (from the claim records), "
              "with each function's driver now; exit 1 when one is not bound as its record says",
              _command("cmd_vfio"), "vfio status")
    sp.add_argument("-o", "--output", choices=("table", "json"), default="table")

    psub = group(sub, "pool", "this node's pool")
    sp = leaf(psub, "status", "this node's pool as the cluster sees it (a ResourcePoolStatusRequest) beside the "
              "node's own view (prepared claims, taints, free devices); exit 1 without a cluster view",
              _command("cmd_pool"), "pool status")
    sp.add_argument("-o", "--output", choices=("text", "json"), default="text")
    sp.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                    help="how long to wait for the cluster's answer (default: 30)")

    ksub = group(sub, "kubelet", "call the running agent like the kubelet does")
    for action, help in (("info", "GetInfo on the registration socket (1 s timeout)"),
                         ("prepare", "NodePrepareResources for one claim"),
                         ("unprepare", "NodeUnprepareResources for one claim"),
                         ("health", "follow the device health stream")):
        ap = leaf(ksub, action, help, _command("cmd_kubelet"), f"kubelet {action}")
        if action in ("prepare", "unprepare"):
            ap.add_argument("claim", metavar="NAMESPACE/NAME")
            ap.add_argument("--uid", default="", help="claim UID (default: read from the claim source)")
            ap.add_argument("--api", choices=("v1", "v1beta1"), default="v1")
        if action == "health":
            ap.add_argument("--api", choices=("v1", "v1alpha1"), default="v1",
                            help="the version of the DRAResourceHealth service to call, as a kubelet would: v1 (what "
                                 "the kubelet of 1.37 picks, the newest the agent registers) or v1alpha1 (the one "
                                 "earlier kubelets call); the agent serves both with the same devices (default: v1)")
            ap.add_argument("--once", action="store_true", help="print the first list and exit")
            ap.add_argument("-o", "--output", choices=("table", "json"), default="table",
                            help="a table of the devices and their health (default), or each answer of the "
                                 "stream whole, as JSON")

    csub = group(sub, "cdi", "CDI spec tools")
    vp = leaf(csub, "validate", "strictly check CDI specs: the spec files in each directory PATH, or a spec file "
              "PATH (default: the CDI directories); exit 1 on any problem, and for a PATH that holds no spec",
              _command("cmd_cdi"), "cdi validate")
    vp.add_argument("paths", nargs="*", metavar="PATH")

    sp = leaf(sub, "doctor", "check this node: kubelet, sockets, runtime CDI support, CDI dirs, NVML, IOMMU and "
              "vfio-pci, state, the API server and RBAC; exit 1 when something blocks the agent",
              _command("cmd_doctor"))
    sp.add_argument("-o", "--output", choices=("text", "json"), default="text")
    sp.add_argument("--host-root", default="/", metavar="DIR",
                    help="the host's / (its /etc holds the container runtime's configuration), when doctor runs "
                         "in a container with it mounted (default: /)")

    hp = sub.add_parser("help", help=f"show the help of a command, or every setting ({config.SETTINGS_HELP})",
                        description="show the help of a command, or every setting")
    hp.set_defaults(fn=cmd_help, parser=hp, topics=topics)
    hp.add_argument("topic", nargs="?", default="", metavar="TOPIC", help="settings, or a command (`kubelet "
                    "prepare`, `taints clear`)")
    if only in _LIGHT_COMMANDS and only != "help":
        return p
    from agent.app import simctl
    from agent.app import taints as taintctl

    def settings_of(group: str) -> Callable[[argparse.ArgumentParser], None]:
        def add(parser: argparse.ArgumentParser) -> None:
            path = parser.prog.removeprefix("dra-agent ")
            parser.set_defaults(parser=parser)
            config.add_arguments(parser, SHOWN.get(path, SHOWN[group]))
            topics[path] = parser
        return add

    taintctl.add_parser(sub, settings_of("taints"))
    simctl.add_sim_parser(sub, settings_of("sim"))
    topics.setdefault("sim", sub.choices["sim"])  # `help sim`, as `help kubelet`
    return p


def _parse(words: list[str]) -> argparse.Namespace:
    p = parser(words)
    if words[:1] == ["help"] and len(words) > 2:  # `dra-agent help kubelet prepare`
        words = ["help", " ".join(words[1:])]
    args, extra = p.parse_known_args(words)
    if args.command == "help" and args.topic not in ("settings", *args.topics):
        args.parser.error(f"no help on {args.topic!r}: settings, or a command "
                          f"({', '.join(t for t in args.topics if t)})")
    if extra:  # said by the command's own parser, so that the pointer is to its --help
        getattr(args, "parser", p).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _main(list(sys.argv[1:] if argv is None else argv))
        finally:
            sys.stdout.flush()  # here, where a reader that went away is still an exception to catch
    except BrokenPipeError:
        # The reader went away (`dra-agent claims -o json | head -1`): stop quietly, as a Unix tool
        # does. What is still buffered goes nowhere, so that the interpreter's exit does not complain.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return SIGPIPE_STATUS


def _main(words: list[str]) -> int:
    args = _parse(words)
    try:
        settings = config.settings_from(args)
    except config.ConfigError as exc:
        print(f"dra-agent: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "run":
        from agent import log

        log.setup(settings.log_format, settings.log_level)
    else:
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.fn(args, settings) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        # Discovery cannot work as configured (--nvml real without NVML, say): one line, no traceback.
        # Only a command that ran discovery imported agent.inventory, and only it can raise that.
        inventory = sys.modules.get("agent.inventory")
        if inventory is not None and isinstance(exc, inventory.DiscoveryError):
            print(f"dra-agent: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
