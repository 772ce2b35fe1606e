"""The commands that read this node (`devices`, `slices`, `claims`, `vfio status`, `cdi validate`,
`doctor`) and call the running agent as the kubelet does (`kubelet ...`). `agent.app.cli` builds
the parser and runs them; each imports what it needs when it runs."""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import difflib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent import config
from agent.app.output import EXIT_FAILED, EXIT_NO_AGENT, EXIT_NOT_FOUND, dump, table


def cmd_devices(args: argparse.Namespace, settings: config.Settings) -> int:
    from agent.app import oneshot
    from agent.facts import NicFacts

    devices, not_published = asyncio.run(oneshot.discover_once(settings))
    functions = _pci_functions(settings, devices)
    # Why a NIC is the node's uplink (`agent.inventory.uplinks`): its `uplink` attribute says only that it is.
    uplinks = {d.name: d.node.uplink_reason for d in devices if isinstance(d.node, NicFacts) and d.node.uplink}
    if args.output == "table":
        rows = []
        for d in devices:
            attrs = d.attributes
            summary = ", ".join([f"{k}={attrs[k]}" for k in ("productName", "ifName", "ipv4", "socket") if k in attrs]
                                + ([f"uplink: {uplinks[d.name]}"] if d.name in uplinks else []))
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
            if d.name in uplinks:
                shown["uplinkReason"] = uplinks[d.name]
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
    from agent.app.vfiostatus import bound_functions, left_undone
    from agent.claims.leftovers import Leftovers, leftovers_dir
    from agent.claims.store import ClaimStore
    from agent.host.vfio.host import VfioHost

    records, problems = ClaimStore(settings.claims_state_dir).load_all()
    sysfs = VfioHost.of(settings).sysfs
    bound = bound_functions(sysfs, list(records.values()))
    left = left_undone(sysfs, Leftovers(leftovers_dir(settings.state_dir)).all())
    if args.output == "json":
        print(dump([b.wire() for b in bound] + [lo.wire() for lo in left], "json"))
    else:
        rows = [(b.claim, str(b.state), b.device, b.function, b.role, "" if b.group is None else str(b.group),
                 b.iommu, b.original, b.now + ("" if b.consistent else f" (record says {b.expected})")) for b in bound]
        rows += [(lo.claim, "left undone", lo.device, lo.function, lo.role, "", "", lo.original, lo.now)
                 for lo in left]
        print(table(rows, ("CLAIM", "STATE", "DEVICE", "FUNCTION", "ROLE", "IOMMU GROUP", "IOMMU INTERFACE",
                            "HOST DRIVER", "DRIVER NOW")))
        for lo in left:
            print(f"left undone: {lo.why}", file=sys.stderr)
    for name, why in problems:
        print(f"unreadable record {name}: {why}", file=sys.stderr)
    return 1 if problems or left or not all(b.consistent for b in bound) else 0


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
    from agent.claims.records import FileRole
    from agent.claims.store import ClaimStore

    records, problems = ClaimStore(settings.claims_state_dir).load_all()
    ordered = sorted(records.values(), key=lambda r: (r.namespace, r.name))
    if args.claim:
        namespace, name = _parse_claim(args)
        ordered = [r for r in ordered if (r.namespace, r.name) == (namespace, name)]
        if not ordered:
            print(f"dra-agent claims: {args.claim} is not prepared on this node (records in "
                  f"{settings.claims_state_dir})", file=sys.stderr)
            return 1
    if args.metadata:
        for r in ordered:
            for f in r.files:
                if f.role is FileRole.METADATA_FILE:
                    print(f.path)
    elif args.output == "json":
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


def _parse_claim(args: argparse.Namespace) -> tuple[str, str]:
    """NAMESPACE/NAME of `args.claim`, or a usage error (exit 2)."""
    namespace, sep, name = args.claim.partition("/")
    if not sep or not namespace or not name:
        guess = f" (default/{args.claim}?)" if args.claim and "/" not in args.claim else ""
        args.parser.error(f"the claim must be NAMESPACE/NAME, not {args.claim!r}{guess}")
    return namespace, name


class _NoClaim(Exception):
    """The claim's UID could not be read from the claim source: `status` says whether it is not there
    (EXIT_NOT_FOUND) or the source could not be read (EXIT_FAILED)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def cmd_kubelet(args: argparse.Namespace, settings: config.Settings) -> int:
    import grpc

    from agent.kubelet import client as kc

    ref: tuple[str, str] | None = None
    if args.action in ("prepare", "unprepare"):
        ref = _parse_claim(args)
    try:
        return asyncio.run(_kubelet(args, settings, kc, ref))
    except grpc.aio.AioRpcError as exc:
        socket = settings.registration_socket if args.action == "info" else settings.dra_socket
        print(f"dra-agent kubelet {args.action}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            print(f"  is the agent running (dra-agent run, or its pod), and is --kubelet-dir / $DRA_KUBELET_DIR "
                  f"({settings.kubelet_dir}) the agent's? It listens on {socket}. `dra-agent doctor` with the "
                  "agent's settings checks both.", file=sys.stderr)
            return EXIT_NO_AGENT
        return EXIT_FAILED
    except _NoClaim as exc:
        print(f"dra-agent kubelet {args.action}: {exc}", file=sys.stderr)
        return exc.status


async def _kubelet(args: argparse.Namespace, settings: config.Settings, kc: Any, ref: tuple[str, str] | None) -> int:
    """`ref`: the claim of a prepare or unprepare; None for info and health."""
    if ref is None and args.action == "info":
        info = await kc.get_info(settings.registration_socket)
        print(f"type:      {info.type}\nname:      {info.name}\nendpoint:  {info.endpoint}\n"
              f"versions:  {', '.join(info.supported_versions)}")
        return 0
    if ref is None:
        first = True
        async for response in kc.watch_health(settings.dra_socket, args.api or "v1"):
            if args.output == "json":
                print(dump(kc.to_dict(response), "json"), flush=True)
            else:
                print(("" if first else "\n") + health_table(response), flush=True)
            first = False
            if args.once:
                break
        return 0
    claim = await _claim_ref(args, settings, *ref)
    async with kc.DRAClient(settings.dra_socket, args.api or "v1") as client:
        call = client.prepare if args.action == "prepare" else client.unprepare
        response = await call([claim])
    out = kc.to_dict(response)
    print(dump(out, "json"))
    return 1 if any(c.get("error") for c in out.get("claims", {}).values()) else 0


def health_table(response: Any) -> str:
    """One answer of the health stream (a NodeWatchResourcesResponse of either version) for a person: a line
    of counts, then a row a device with its health, when the agent last updated it, the timeout the kubelet
    is given, and the message (`-o json` prints the answer whole: some 7 lines a device)."""
    counts: collections.Counter[str] = collections.Counter()
    pools: set[str] = set()
    rows = []
    for d in sorted(response.devices, key=lambda d: (d.device.pool_name, d.device.device_name)):
        status = d.DESCRIPTOR.fields_by_name["health"].enum_type.values_by_number[d.health].name
        counts[status] += 1
        pools.add(d.device.pool_name)
        updated = datetime.datetime.fromtimestamp(d.last_updated_time, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ") \
            if d.last_updated_time else ""
        timeout = f"{d.health_check_timeout_seconds}s" if d.health_check_timeout_seconds else "default"
        rows.append((d.device.device_name, status, updated, timeout, d.message))
    said = ", ".join(f"{counts[s]} {s}" for s in ("HEALTHY", "UNHEALTHY", "UNKNOWN") if counts[s])
    where = f" in pool {', '.join(sorted(pools))}" if pools else ""
    head = f"{len(rows)} devices{where}" + (f": {said}" if said else "")
    return (head + "\n" + table(rows, ("DEVICE", "HEALTH", "UPDATED", "TIMEOUT", "MESSAGE"))) if rows else head


async def _claim_ref(args: argparse.Namespace, settings: config.Settings, namespace: str, name: str) -> Any:
    from agent.names import ClaimRef

    uid = args.uid
    if not uid:
        from agent.app import oneshot
        from agent.app.connection import StartupError
        from agent.claims.sources import ClaimNotFound, ClaimSourceError

        try:
            claim = await oneshot.fetch_claim(settings, namespace, name)
        except ClaimNotFound as exc:
            known = await oneshot.claim_names(settings)
            close = difflib.get_close_matches(f"{namespace}/{name}", known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise _NoClaim(f"{exc}{hint} (or give --uid)", EXIT_NOT_FOUND) from exc
        except (ClaimSourceError, StartupError) as exc:
            raise _NoClaim(f"{exc} (give --uid, or the agent's --offline DIR / cluster settings)", EXIT_FAILED) from exc
        uid = (claim.get("metadata") or {}).get("uid", "")
    return ClaimRef(namespace, name, uid)


def cmd_cdi(args: argparse.Namespace, settings: config.Settings) -> int:
    from cdi.validate import format_report, validate_dirs, validate_paths

    # The runtime's directories may be missing (it skips them too); a path named by hand must hold specs.
    report = validate_paths([Path(p) for p in args.paths]) if args.paths else \
        validate_dirs([settings.static_cdi_dir, settings.cdi_dir])
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
