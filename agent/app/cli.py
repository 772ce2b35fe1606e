"""`dra-agent`: the daemon and the node debug CLI.

    dra-agent run                      the agent (what the DaemonSet runs)
    dra-agent devices [-o table|json|yaml]
    dra-agent slices [-o yaml|json]    the exact ResourceSlices that would be published
    dra-agent claims [-o table|json]   claims prepared on this node (from the state dir)
    dra-agent kubelet info|prepare|unprepare|health
    dra-agent cdi validate [DIR...]
    dra-agent doctor [-o text|json]    check this node the way a person would when a pod is stuck
    dra-agent taints [-o table|json]   the device taints the agent holds; `taints clear DEVICE`
    dra-agent pool status [-o text|json]   this node's pool as the cluster sees it, beside the node's view
    dra-agent sim xid DEVICE XID | lose DEVICE | recover DEVICE   drive the simulated GPUs

Every command accepts the same settings as `run` (flags or environment variables).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent import config
from agent.app.output import dump, table

# Each command imports what it needs when it runs: `dra-agent kubelet info` and `dra-agent claims`
# are commands a person waits for, and the agent's full set of modules takes most of a second
# to import on a small node.
_LIGHT_COMMANDS = {"run", "devices", "slices", "claims", "kubelet", "cdi", "doctor", "vfio", "pool"}


# -- commands ---------------------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace, settings: config.Settings) -> int:
    from agent.app import daemon

    return asyncio.run(daemon.run(settings))


def cmd_devices(args: argparse.Namespace, settings: config.Settings) -> int:
    from agent.app import oneshot

    devices, not_published = asyncio.run(oneshot.discover_once(settings))
    functions = _pci_functions(settings, devices)
    if args.output == "table":
        rows = []
        for d in devices:
            attrs = d.attributes
            summary = ", ".join(f"{k}={attrs[k]}" for k in ("productName", "ifName", "ipv4", "socket")
                                if k in attrs)
            driver, group = functions.get(d.name, ("", None))
            rows.append((d.name, d.kind, ",".join(f"{k}={c.value}" for k, c in sorted(d.capacity.items())),
                         str(attrs.get("resource.kubernetes.io/pciBusID", "")), driver,
                         "" if group is None else str(group),
                         str(attrs.get("resource.kubernetes.io/numaNode", "")), summary))
        print(table(rows, ("NAME", "KIND", "CAPACITY", "PCI BUS ID", "DRIVER", "IOMMU", "NUMA", "DETAILS")))
        for line in not_published:
            print(f"not published: {line}", file=sys.stderr)
    else:
        out = []
        for d in devices:
            shown = d.summary()
            if d.name in functions:
                shown["pciFunction"] = {"driver": functions[d.name][0], "iommuGroup": functions[d.name][1]}
            out.append(shown)
        print(dump(out, args.output))
    return 0


def _pci_functions(settings: config.Settings, devices: Sequence[Any]) -> dict[str, tuple[str, int | None]]:
    """Device name -> (the driver its PCI function is bound to now, its IOMMU group), read from sysfs (the
    simulated machine's with --nvml sim, which holds its GPUs and NIC; the host's for the rest)."""
    from agent.host.vfio.host import VfioHost
    from agent.host.vfio.pci import current_driver, function_dir, iommu_group

    roots = [VfioHost.of(settings).sysfs, settings.sysfs_root]
    out: dict[str, tuple[str, int | None]] = {}
    for d in devices:
        bus = d.pci_bus_id
        if not bus:
            continue
        sysfs = next((r for r in roots if function_dir(r, bus).exists()), None)
        if sysfs is not None:
            out[d.name] = (current_driver(sysfs, bus) or "none", iommu_group(sysfs, bus))
    return out


def cmd_vfio(args: argparse.Namespace, settings: config.Settings) -> int:
    from agent.app.vfiostatus import bound_functions
    from agent.claims.store import ClaimStore
    from agent.host.vfio.host import VfioHost

    records, problems = ClaimStore(settings.claims_state_dir).load_all()
    bound = bound_functions(VfioHost.of(settings).sysfs, list(records.values()))
    if args.output == "json":
        print(dump([b.wire() for b in bound], "json"))
    else:
        rows = [(b.claim, b.state, b.device, b.function, b.role, "" if b.group is None else str(b.group), b.iommu,
                 b.original, b.now + ("" if b.consistent else f" (record says {b.expected})")) for b in bound]
        print(table(rows, ("CLAIM", "STATE", "DEVICE", "FUNCTION", "ROLE", "IOMMU GROUP", "INTERFACE",
                            "HOST DRIVER", "DRIVER NOW")))
    for name, why in problems:
        print(f"unreadable record {name}: {why}", file=sys.stderr)
    return 1 if problems or not all(b.consistent for b in bound) else 0


def cmd_pool(args: argparse.Namespace, settings: config.Settings) -> int:
    from agent.app import poolstatus

    text, status = poolstatus.run(settings, args.output, args.timeout)
    print(text)
    return status


def cmd_slices(args: argparse.Namespace, settings: config.Settings) -> int:
    from agent.app import oneshot

    print(dump(asyncio.run(oneshot.render_slices(settings)), args.output))
    return 0


def cmd_claims(args: argparse.Namespace, settings: config.Settings) -> int:
    from agent.claims.store import ClaimStore

    records, problems = ClaimStore(settings.claims_state_dir).load_all()
    ordered = sorted(records.values(), key=lambda r: (r.namespace, r.name))
    if args.output == "json":
        print(dump([{
            "namespace": r.namespace, "name": r.name, "uid": r.uid, "podClaimName": r.pod_claim_name,
            "devices": [d.to_json() for d in r.devices], "files": [f.path for f in r.files],
            "preparedAt": r.prepared_at,
        } for r in ordered], "json"))
    else:
        rows = [(f"{r.namespace}/{r.name}", r.uid, ",".join(d.device for d in r.devices),
                 " ".join(i for d in r.devices for i in d.cdi_device_ids)) for r in ordered]
        print(table(rows, ("CLAIM", "UID", "DEVICES", "CDI DEVICE IDS")))
        if args.files:
            for r in ordered:
                print(f"\n{r.namespace}/{r.name}:")
                for f in r.files:
                    print(f"  {f.path}")
    for name, why in problems:
        print(f"unreadable record {name}: {why}", file=sys.stderr)
    return 1 if problems else 0


class _NoClaim(Exception):
    """The claim's UID could not be read from the claim source."""


def cmd_kubelet(args: argparse.Namespace, settings: config.Settings) -> int:
    import grpc

    from agent.kubelet import client as kc

    try:
        return asyncio.run(_kubelet(args, settings, kc))
    except grpc.aio.AioRpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2
    except _NoClaim as exc:
        print(f"error: {exc} (give --uid, or the agent's --offline DIR / cluster settings)", file=sys.stderr)
        return 2


async def _kubelet(args: argparse.Namespace, settings: config.Settings, kc: Any) -> int:
    if args.action == "info":
        info = await kc.get_info(settings.registration_socket)
        print(f"type:      {info.type}\nname:      {info.name}\nendpoint:  {info.endpoint}\n"
              f"versions:  {', '.join(info.supported_versions)}")
        return 0
    if args.action == "health":
        async for response in kc.watch_health(settings.dra_socket, args.api or "v1"):
            print(dump(kc.to_dict(response), "json"), flush=True)
            if args.once:
                break
        return 0
    ref = await _claim_ref(args, settings)
    async with kc.DRAClient(settings.dra_socket, args.api or "v1") as client:
        call = client.prepare if args.action == "prepare" else client.unprepare
        response = await call([ref])
    out = kc.to_dict(response)
    print(dump(out, "json"))
    return 1 if any(c.get("error") for c in out.get("claims", {}).values()) else 0


async def _claim_ref(args: argparse.Namespace, settings: config.Settings) -> Any:
    from agent.names import ClaimRef

    namespace, sep, name = args.claim.partition("/")
    if not sep:
        raise SystemExit("claim must be NAMESPACE/NAME")
    uid = args.uid
    if not uid:
        from agent.app import oneshot
        from agent.app.connection import StartupError
        from agent.claims.sources import ClaimNotFound, ClaimSourceError

        try:
            claim = await oneshot.fetch_claim(settings, namespace, name)
        except (ClaimNotFound, ClaimSourceError, StartupError) as exc:
            raise _NoClaim(str(exc)) from exc
        uid = (claim.get("metadata") or {}).get("uid", "")
    return ClaimRef(namespace, name, uid)


def cmd_cdi(args: argparse.Namespace, settings: config.Settings) -> int:
    from cdi.validate import format_report, validate_dirs

    dirs = [Path(d) for d in args.dirs] or [settings.static_cdi_dir, settings.cdi_dir]
    report = validate_dirs(dirs)
    print(format_report(report))
    return 0 if report.ok else 1


def cmd_doctor(args: argparse.Namespace, settings: config.Settings) -> int:
    from agent.app import doctor

    results = asyncio.run(doctor.run(settings, host_root=Path(args.host_root)))
    if args.output == "json":
        print(dump([r.to_json() for r in results], "json"))
    else:
        encoding = sys.stdout.encoding or "ascii"
        try:
            "✓✗".encode(encoding)
            ascii_only = False
        except UnicodeEncodeError:
            ascii_only = True
        print(doctor.format_text(results, ascii_only=ascii_only))
    return doctor.exit_status(results)


# -- parser -----------------------------------------------------------------------------------------

def parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser; with `only` one of `_LIGHT_COMMANDS`, the commands defined in other
    modules (taints, sim) are left out, so their imports are not paid for."""
    p = argparse.ArgumentParser(prog="dra-agent", description="Kubernetes DRA node agent")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, fn: Any) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        config.add_arguments(sp)
        return sp

    command("run", "run the agent", cmd_run)
    sp = command("devices", "discover and show this node's devices", cmd_devices)
    sp.add_argument("-o", "--output", choices=("table", "json", "yaml"), default="table")
    sp = command("slices", "show the ResourceSlices that would be published", cmd_slices)
    sp.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml")
    sp = command("claims", "show the claims prepared on this node", cmd_claims)
    sp.add_argument("-o", "--output", choices=("table", "json"), default="table")
    sp.add_argument("--files", action="store_true", help="also list each claim's files")

    vfp = sub.add_parser("vfio", help="PCI functions this agent has bound to vfio-pci")
    vsub = vfp.add_subparsers(dest="action", required=True, metavar="ACTION")
    sp = vsub.add_parser("status", help="what the agent has bound to vfio-pci and for which claim (from the claim "
                         "records), with each function's driver now; exit 1 when one is not bound as its record says",
                         description="what the agent has bound to vfio-pci, from the claim records")
    sp.set_defaults(fn=cmd_vfio)
    config.add_arguments(sp)
    sp.add_argument("-o", "--output", choices=("table", "json"), default="table")

    pp = sub.add_parser("pool", help="this node's pool")
    psub = pp.add_subparsers(dest="action", required=True, metavar="ACTION")
    sp = psub.add_parser("status", help="this node's pool as the cluster sees it (a ResourcePoolStatusRequest) beside "
                         "the node's own view (prepared claims, taints, free devices); exit 1 without a cluster view",
                         description="this node's pool as the cluster sees it, beside the node's own view")
    sp.set_defaults(fn=cmd_pool)
    config.add_arguments(sp)
    sp.add_argument("-o", "--output", choices=("text", "json"), default="text")
    sp.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                    help="how long to wait for the cluster's answer (default: 30)")

    kp = sub.add_parser("kubelet", help="call the running agent like the kubelet does")
    ksub = kp.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, help in (("info", "GetInfo on the registration socket (1 s timeout)"),
                         ("prepare", "NodePrepareResources for one claim"),
                         ("unprepare", "NodeUnprepareResources for one claim"),
                         ("health", "follow the device health stream")):
        ap = ksub.add_parser(action, help=help, description=help)
        ap.set_defaults(fn=cmd_kubelet)
        config.add_arguments(ap)
        if action in ("prepare", "unprepare"):
            ap.add_argument("claim", metavar="NAMESPACE/NAME")
            ap.add_argument("--uid", default="", help="claim UID (default: read from the claim source)")
            ap.add_argument("--api", choices=("v1", "v1beta1"), default="v1")
        if action == "health":
            ap.add_argument("--api", choices=("v1", "v1alpha1"), default="v1")
            ap.add_argument("--once", action="store_true", help="print the first list and exit")

    cp = sub.add_parser("cdi", help="CDI spec tools")
    csub = cp.add_subparsers(dest="action", required=True, metavar="ACTION")
    vp = csub.add_parser("validate", help="strictly check the CDI specs in DIRs (default: the CDI dirs)")
    vp.set_defaults(fn=cmd_cdi)
    vp.add_argument("dirs", nargs="*", metavar="DIR")
    config.add_arguments(vp)

    sp = command("doctor", "check this node: kubelet, sockets, runtime CDI support, CDI dirs, NVML, IOMMU and "
                 "vfio-pci, state, the API server and RBAC; exit 1 when something blocks the agent", cmd_doctor)
    sp.add_argument("-o", "--output", choices=("text", "json"), default="text")
    sp.add_argument("--host-root", default="/", metavar="DIR",
                    help="the host's / (its /etc holds the container runtime's configuration), when doctor runs "
                         "in a container with it mounted (default: /)")
    if only in _LIGHT_COMMANDS:
        return p
    from agent.app import simctl
    from agent.app import taints as taintctl

    taintctl.add_parser(sub, config.add_arguments)
    simctl.add_sim_parser(sub, config.add_arguments)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    args = parser(words[0] if words else None).parse_args(words)
    try:
        settings = config.settings_from(args)
    except config.ConfigError as exc:
        print(f"dra-agent: {exc}", file=sys.stderr)
        return 2
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
