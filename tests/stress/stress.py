"""`make stress`: the crash suite and the fuzzer that prove the claim bookkeeping.

Crash rounds. A pool of claims (GPUs, a NIC, a CPU; plain and template claims; a VM's passthrough
GPU and a NIC VF with VfioConfig, bound to vfio-pci on the simulated machine by its kernel emulator;
MIG devices, whose GPU and compute instances prepare makes through the simulated NVML; vGPUs,
mediated devices prepare creates through sysfs) is prepared, unprepared and refreshed (the NIC's
addresses change) in random concurrent batches by an agent process (the prepare engine over the real
roots, forked from this one), which dies by SIGKILL at a random side-effect step (`failpoints`,
`*@N=kill`). The next process is the restart: start-up recovery, then this process checks the whole
disk (every record's files exist and match it; no agent file without a record; no temp file left;
every prepare that returned success is prepared; every unprepare that returned success left nothing;
no record left mid-bind or mid-restore; each PCI function bound to exactly the driver the records
say: vfio-pci for a prepared passthrough device, else its own; each NIC VF with the MAC and VLAN its
prepared record set, else the ones a previous tenant left on it before the first round; each GPU
instance in the simulated hardware's persisted MIG state a prepared record's, and each recorded one
there; MIG mode off on a GPU without instances; each mediated device a prepared record's, and each
recorded one there), then the next round runs in it, and so on. A few rounds kill the real
`dra-agent run` daemon, driven over its sockets by a kubelet stand-in.

Forced unprepares. In some rounds the MIG GPU (gpu-4) falls off the bus once the agent has
recovered (simulated NVML: every call about it fails): its MIG claims' unprepares cannot destroy
their instances, and must succeed all the same, keeping what is left in the left-undone ledger
(`<state>/leftovers`, `agent.claims.leftovers`); prepares of its devices are refused meanwhile
(those errors are expected). Kills land in that path too (`unprepare-after-leftover`). The GPU is
back in the next process (a reset): its recovery undoes what was left, so after every restart the
ledger is empty, each entry was readable, and no claim with an entry has a record.

Fuzzing (hypothesis). Claim objects, opaque configuration, names and UIDs go
through the engine; lists of claims through the real gRPC socket. No input may
give an internal error, leave a file of a claim that was refused or unprepared,
or write anything outside the agent's roots. Claim records rewritten to say what
the agent never writes, checksum valid, go through a restart (`recordfuzz.py`).

Figures go to `.stress/results.json`: kills, inconsistencies, fuzz_inputs,
fuzz_failures, seconds (and the details).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import select
import shutil
import signal
import sys
import tempfile
import time
import uuid as uuid_mod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
sys.path[:0] = [str(ROOT), str(TESTS)]

import agentkit  # noqa: E402

from agent import failpoints  # noqa: E402
from agent.app.assembly import PublishedForm, vf_links  # noqa: E402
from agent.claims import filenames, metadata  # noqa: E402
from agent.claims.leftovers import Leftover, LeftoverError, leftovers_dir  # noqa: E402
from agent.claims.records import ClaimRecord, FileRole, PartitionKind  # noqa: E402
from agent.claims.sources import DirectoryClaimSource  # noqa: E402
from agent.claims.store import ClaimStore  # noqa: E402
from agent.config import Settings  # noqa: E402
from agent.engine.prepare import PrepareEngine  # noqa: E402
from agent.engine.recovery import recover  # noqa: E402
from agent.fsutil import is_temp_name  # noqa: E402
from agent.host.mdev import sysfs as mdev  # noqa: E402
from agent.host.vfio.host import VfioHost  # noqa: E402
from agent.host.vfio.sriov import VfLink, pf_interface, vf_position  # noqa: E402
from agent.inventory import Inventory  # noqa: E402
from agent.inventory.gpus import GpuSource  # noqa: E402
from agent.inventory.passthrough import NicVariants  # noqa: E402
from agent.model import Device  # noqa: E402
from agent.names import ClaimRef  # noqa: E402
from agent.sim.hardware import reboot, sim_functions  # noqa: E402
from agent.sim.kernel.emulator import KernelEmulator  # noqa: E402
from agent.sim.kernel.tree import SimTree  # noqa: E402
from agent.sim.migstate import STATE_FILE as MIG_STATE_FILE  # noqa: E402
from agent.sim.nvmlopen import open_sim_nvml  # noqa: E402
from agent.sim.profiles import load_profile  # noqa: E402
from agent.sim.vflinks import SimVfLinks  # noqa: E402

NIC = "nic-0000-3b-00-0"
PROFILE = "dgx-h100"
NATIVE_GPUS = 4  # native claims take gpu-0..3; gpu-4 is cut into MIG devices, gpu-5 into vGPUs
VM_GPU = "gpu-0000-ba-00-0-vfio"  # gpu-6's passthrough form
VM_VF = "nic-0000-4b-00-1-vfio"  # the ConnectX-7's VF 0
VM_CLAIMS = {4: VM_GPU, 5: VM_VF}
# Claims of one GPU partition each: placements of gpu-4 that never overlap (slices 0, 2-3, 4-7), so all
# can be prepared at once, and two vGPUs of one type on gpu-5 and on gpu-7 (a GPU hosts one type at a
# time). Claims 1 and 2 are among the daemon rounds' six too.
PARTITION_CLAIMS = {1: "gpu-4-mig-1g10gb-0", 2: "gpu-5-vgpu-nvidia-1022-0", 6: "gpu-4-mig-2g20gb-2",
                    7: "gpu-4-mig-3g40gb-4", 8: "gpu-5-vgpu-nvidia-1022-1",
                    # gpu-7 lists its vGPU types on its SR-IOV VFs: each vGPU is made on a VF of its own.
                    9: "gpu-7-vgpu-nvidia-1023-0", 10: "gpu-7-vgpu-nvidia-1023-1"}
# What a previous tenant left on the NIC's VFs (its PF's driver keeps it): unprepare puts it back.
TENANT_VF_LINKS = {("ens75f0np0", 0): VfLink("02:00:00:00:0f:00", 77, 3)}
NIC_VARIANTS: tuple[tuple[str, ...], ...] = ((), ("10.0.0.5/24",), ("10.0.0.6/24", "fd00::6/64"))
REBOOTS = 0.15  # the share of crash rounds that begin with a reboot of the simulated machine
LOST_GPUS = 0.2  # the share of crash rounds in which the MIG GPU falls off the bus (forced unprepares)
LOST_GPU = 4  # its NVML index (gpu-4)


def claim_uid(i: int) -> str:
    return f"c0000000-0000-4000-8000-{i:012d}"


def partition_of(uid: str) -> str | None:
    """The MIG or vGPU device of a partition claim, by its UID."""
    return PARTITION_CLAIMS.get(int(uid[-12:]))


# -- the disk as it must be after a restart ----------------------------------------------------------------

def check_disk(settings: Settings, expect: dict[str, str]) -> list[str]:
    """Problems with the state on disk; `expect` maps a UID to `prepared` or `absent`."""
    problems: list[str] = []
    store = ClaimStore(settings.claims_state_dir)
    records, unreadable = store.load_all()
    problems += [f"unreadable record {name}: {why}" for name, why in unreadable]
    for root in (settings.claims_state_dir, settings.cdi_dir, settings.metadata_dir, leftovers_dir(settings.state_dir)):
        for parent, _dirs, files in os.walk(root):
            for name in files:
                if is_temp_name(name) or name.endswith(".corrupt"):
                    problems.append(f"left behind: {os.path.join(parent, name)}")
    owned: set[str] = set()
    for uid, record in records.items():
        for f in record.files:
            owned.add(f.path)
            try:
                ok = Path(f.path).read_bytes() == f.content
            except OSError:
                ok = False
            if not ok:
                problems.append(f"claim {uid}: {f.path} is missing or differs from the record")
    for name in sorted(os.listdir(settings.cdi_dir)) if settings.cdi_dir.exists() else []:
        uid = filenames.claim_uid_of_spec(name, settings.cdi_vendor)
        if uid is not None and str(settings.cdi_dir / name) not in owned:
            problems.append(f"orphan CDI spec {name}")
    for name in sorted(os.listdir(settings.metadata_dir)) if settings.metadata_dir.exists() else []:
        if name not in records:
            problems.append(f"orphan metadata directory {name}")
            continue
        for parent, _dirs, files in os.walk(settings.metadata_dir / name):
            problems += [f"orphan metadata file {os.path.join(parent, f)}" for f in files
                         if os.path.join(parent, f) not in owned]
    problems += check_bindings(settings, records)
    problems += check_vf_links(settings, records)
    problems += check_partitions(settings, records)
    problems += check_leftovers(settings, records)
    for uid, state in sorted(expect.items()):
        if state == "prepared" and uid not in records:
            problems.append(f"claim {uid}: its prepare returned success, but it is not prepared")
        if state == "absent" and uid in records:
            problems.append(f"claim {uid}: its unprepare returned success, but it is prepared")
    return problems


def check_leftovers(settings: Settings, records: dict[str, ClaimRecord]) -> list[str]:
    """The left-undone ledger after a restart whose hardware is all there: each entry readable, no entry
    of a claim that has a record, and none left at all (recovery undid them: the lost GPU answers again)."""
    problems = []
    directory = leftovers_dir(settings.state_dir)
    for name in sorted(os.listdir(directory)) if directory.exists() else []:
        if is_temp_name(name):
            continue  # reported with the other roots' temp files
        try:
            lo = Leftover.from_wire((directory / name).read_bytes())
        except (OSError, LeftoverError) as exc:
            problems.append(f"unreadable left-undone entry {name}: {exc}")
            continue
        if lo.uid in records:
            problems.append(f"claim {lo.uid}: it has a record and a left-undone entry ({lo.reason})")
        problems.append(f"claim {lo.uid}: its host changes on {', '.join(lo.devices)} are still left undone after "
                        f"a restart with the hardware back ({lo.reason})")
    return problems


def check_bindings(settings: Settings, records: dict[str, ClaimRecord]) -> list[str]:
    """Each function of the simulated machine bound to exactly the driver the records say: vfio-pci
    (with the override) for a prepared passthrough device, else its own driver and no override; and the
    claim's CDI spec naming the VFIO device file the function has now (iommufd files are numbered in
    bind order: a reboot renumbers them)."""
    problems = []
    tree = SimTree(VfioHost.of(settings).sysfs.parent)
    want: dict[str, tuple[str, str | None]] = {}
    for uid, record in records.items():
        if not record.prepared:
            problems.append(f"claim {uid}: its record is left in state {record.state} after recovery")
        for b in record.bindings:
            for f in b.plan.functions:
                want[f.bdf] = (b.plan.driver, b.plan.driver)
            cdev = tree.vfio_cdev_of(b.plan.target)
            named = _spec_nodes(record, b.device)
            if b.iommu == "iommufd" and f"/dev/vfio/devices/{cdev}" not in named:
                problems.append(f"claim {uid}: its CDI spec names {named} for {b.device}, whose device file is "
                                f"{cdev}")
    for fn in sim_functions(load_profile(PROFILE), tree):
        driver, override = want.get(fn.bdf, (fn.driver, None))
        now = (tree.driver_of(fn.bdf), tree.override_of(fn.bdf))
        if now != (driver, override):
            problems.append(f"PCI function {fn.bdf} is bound to {now[0]} (override {now[1]}), the records say "
                            f"{driver} (override {override})")
    return problems


def check_vf_links(settings: Settings, records: dict[str, ClaimRecord]) -> list[str]:
    """Each VF of the simulated NIC with the MAC and VLAN a prepared record set on it, over what it had
    before; a VF no record sets back to what the previous tenant left (`TENANT_VF_LINKS`)."""
    root = VfioHost.of(settings).sysfs.parent
    want = dict(TENANT_VF_LINKS)
    for uid, record in records.items():
        for b in record.bindings:
            if b.sets_vf and b.previous is not None:
                pf, n = vf_position(root / "sys", b.plan.target)
                if b.previous != want.get((pf_interface(root / "sys", pf), n), VfLink()):
                    problems = [f"claim {uid}: its record says VF {b.plan.target} had {b.previous} before, "
                                "not what the previous tenant left"]
                    return problems
                want[(pf_interface(root / "sys", pf), n)] = b.previous.changed(b.mac, b.vlan)
    now = SimVfLinks(root).all()
    return [f"VF {n} of {pf} has {now.get((pf, n), VfLink())}, the records say {link}"
            for (pf, n), link in sorted(want.items()) if now.get((pf, n), VfLink()) != link] + [
            f"VF {n} of {pf} has {link}, which no record set" for (pf, n), link in sorted(now.items())
            if (pf, n) not in want]


def check_partitions(settings: Settings, records: dict[str, ClaimRecord]) -> list[str]:
    """Each GPU instance in the simulated hardware's persisted MIG state a prepared record's MIG partition
    (same parent GPU, GPU instance id, placement, compute instance) and each recorded one there; MIG mode
    off on a GPU without instances (only the agent turns it on here); each mediated device of the
    simulated machine a prepared record's mdev partition (its UUID, parent and type) and each recorded
    one there; and each partition's device in the claim's metadata carrying the partition's UUID (MIG:
    `uuid`, vGPU: `mdevUUID`), at prepare and after every refresh."""
    problems: list[str] = []
    mig: dict[tuple[str, int], tuple[str, int, int]] = {}  # (parent UUID, GI id) -> (uid, start, CI id)
    mdevs: dict[str, tuple[str, str, str]] = {}  # mdev UUID -> (uid, parent bus ID, type)
    for uid, record in records.items():
        for p in record.partitions:
            if p.kind is PartitionKind.MIG:
                mig[(p.parent, p.gpu_instance)] = (uid, p.start, p.compute_instance)
            elif p.kind is PartitionKind.MDEV:
                mdevs[p.uuid] = (uid, p.parent, p.profile)
        problems += _partition_metadata(settings, uid, record)
    root = settings.sim_root
    gpus = load_profile(PROFILE).gpus
    try:
        state = orjson.loads((root / MIG_STATE_FILE).read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        state = {"gpus": [{"mode": 0, "gis": []}] * len(gpus)}
        if mig:
            problems.append(f"the simulated MIG state is not readable ({exc}), but records have MIG partitions")
    seen: set[tuple[str, int]] = set()
    for gpu, gpu_state in zip(gpus, state["gpus"], strict=True):
        if gpu_state is None:
            continue
        if not gpu_state["gis"] and gpu_state["mode"] != 0:
            problems.append(f"GPU {gpu.uuid} has no GPU instance left, but its MIG mode is still on")
        for gi in gpu_state["gis"]:
            key = (gpu.uuid, int(gi["id"]))
            seen.add(key)
            owner = mig.get(key)
            if owner is None:
                problems.append(f"orphan GPU instance {gi['id']} (start {gi['start']}) on GPU {gpu.uuid}")
            elif gi["start"] != owner[1] or list(gi["cis"]) != [str(owner[2])]:
                problems.append(f"claim {owner[0]}: GPU instance {gi['id']} of GPU {gpu.uuid} is at {gi['start']} "
                                f"with compute instances {sorted(gi['cis'])}; the record says {owner[1]} with "
                                f"compute instance {owner[2]}")
    problems += [f"claim {uid}: its GPU instance {gi} of GPU {parent} is not in the hardware"
                 for (parent, gi), (uid, _start, _ci) in sorted(mig.items()) if (parent, gi) not in seen]
    sysfs = root / "sys"
    present = {u: (parent, type_id) for parent in mdev.parents(sysfs)
               for u, type_id in mdev.mdevs_of(sysfs, parent).items()}
    for u, (parent, type_id) in sorted(present.items()):
        owner_of = mdevs.get(u)
        if owner_of is None:
            problems.append(f"orphan mediated device {u} ({type_id} on {parent})")
        elif owner_of[1:] != (parent, type_id):
            problems.append(f"claim {owner_of[0]}: mediated device {u} is {type_id} on {parent}, the record says "
                            f"{owner_of[2]} on {owner_of[1]}")
    problems += [f"claim {uid}: its mediated device {u} ({type_id} on {parent}) is not on the machine"
                 for u, (uid, parent, type_id) in sorted(mdevs.items()) if u not in present]
    return problems


def _spec_nodes(record: ClaimRecord, device: str) -> list[str]:
    """The container paths of the device nodes the claim's CDI spec gives `device`."""
    for f in record.files:
        if f.role is FileRole.CLAIM_SPEC:
            for d in orjson.loads(f.content)["devices"]:
                if d["name"] == f"{record.uid}-{device}":
                    return [n["path"] for n in d["containerEdits"].get("deviceNodes", [])]
    return []


def _partition_metadata(settings: Settings, uid: str, record: ClaimRecord) -> list[str]:
    """The claim's metadata files give each partition device its partition's UUID."""
    want = {p.device: ("uuid" if p.kind is PartitionKind.MIG else "mdevUUID", p.uuid) for p in record.partitions}
    problems = []
    for f in record.files:
        if not f.path.startswith(f"{settings.metadata_dir}/"):
            continue
        for obj in metadata.parse_stream(f.content):
            for request in obj.get("requests", []):
                for dev in request.get("devices", []):
                    if dev.get("name") in want:
                        attr, value = want[dev["name"]]
                        if dev.get("attributes", {}).get(attr) != {"string": value}:
                            problems.append(f"claim {uid}: metadata {f.path} (generation {record.generation}) gives "
                                            f"{dev['name']} {attr}={dev.get('attributes', {}).get(attr)}, the "
                                            f"partition's is {value}")
    return list(dict.fromkeys(problems))  # once per file, not per API version in it


# -- crash rounds --------------------------------------------------------------------------------------------

@dataclass
class CrashReport:
    kills: int = 0
    daemon_kills: int = 0
    reboots: int = 0  # rounds that began with a reboot of the simulated machine
    rounds: int = 0
    completed_rounds: int = 0  # rounds whose agent finished its operations before the drawn step
    inconsistencies: int = 0
    problems: list[str] = field(default_factory=list)
    steps_reached: dict[str, int] = field(default_factory=dict)  # where the forked agents were killed
    # Prepares of the MIG and vGPU claims that returned success (the partitions were made, or found made).
    partition_prepares: dict[str, int] = field(default_factory=dict)
    lost_gpu_rounds: int = 0  # rounds in which the MIG GPU fell off the bus
    left_undone: int = 0  # the ledger's entries at the end of the rounds that ran to their end (summed)
    refused_lost: int = 0  # operations on the lost GPU's claims that failed, as they may


def _claims(rng: random.Random, count: int) -> list[dict[str, Any]]:
    out = []
    for i in range(count):
        if i in VM_CLAIMS:  # a VM's claim: one passthrough device (the GPU on iommufd, a VF with its MAC and VLAN)
            params: dict[str, Any] = {"iommu": "iommufd"} if VM_CLAIMS[i] == VM_GPU else {
                "mac": f"02:00:00:00:01:{i:02x}", "vlan": 10 + i}
            config = [{"requests": ["vm"], "opaque": {"driver": agentkit.DRIVER, "parameters": {
                "apiVersion": f"{agentkit.DRIVER}/v1alpha1", "kind": "VfioConfig", **params}}}]
            out.append(agentkit.claim(f"claim-{i}", claim_uid(i), [agentkit.result(VM_CLAIMS[i], "vm")],
                                      config=config))
            continue
        if i in PARTITION_CLAIMS:  # a MIG device or a vGPU, and sometimes the NIC (refreshed with it)
            results = [agentkit.result(PARTITION_CLAIMS[i], "part")]
            if rng.random() < 0.5:
                results.append(agentkit.result(NIC, "net"))
            out.append(agentkit.claim(f"claim-{i}", claim_uid(i), results))
            continue
        results = [agentkit.result(f"gpu-{rng.randrange(NATIVE_GPUS)}", "a")]
        if rng.random() < 0.5:
            results.append(agentkit.result(NIC, "net"))
        if rng.random() < 0.3:
            results.append(agentkit.result("cpu-numa0", "b"))
        if rng.random() < 0.3:
            results.append(agentkit.result(f"gpu-{rng.randrange(NATIVE_GPUS)}", "a/sub"))
        annotations = {"resource.kubernetes.io/pod-claim-name": f"pc{i}"} if i % 3 == 0 else None
        out.append(agentkit.claim(f"claim-{i}", claim_uid(i), results, annotations=annotations))
    return out


def crash_settings(work: Path) -> Settings:
    # With compatibility groups every vGPU type is published (without, none on a GPU with MIG placements).
    return agentkit.roots(work, compatibility_groups=True)


class _Agent:
    """The agent process of one round (runs in the forked child), or the last restart. Its GPUs come
    from a real GPU source over the simulated NVML, which the MIG partitioner finds in the inventory
    (`agent.hostprep.mig.nvml_of`); scanned once per process (the NIC refreshes scan the NIC source only)."""

    def __init__(self, settings: Settings, nic_variant: int) -> None:
        self.settings = settings
        self.gpus = GpuSource(settings, opener=open_sim_nvml)
        self.vfs: list[Device] = []
        self.nics = agentkit.StaticSource("nic", [])
        self.nic_variant = nic_variant
        self.inventory = Inventory([self.gpus, self.nics, agentkit.StaticSource("cpu", [agentkit.cpu()])],
                                   refine=PublishedForm())
        assert settings.offline is not None
        self.engine = PrepareEngine(settings, self.inventory, DirectoryClaimSource(settings.offline),
                                    ClaimStore(settings.claims_state_dir), vf_links=vf_links(settings))

    def open(self) -> KernelEmulator:
        """Open NVML (which writes the simulated machine, keeping what its kernel changed since), then
        start this process's simulated kernel (the last one died with its agent), as the daemon does:
        before recovery, which binds and removes mediated devices. The caller scans."""
        self.inventory.open()
        self.vfs = [d for d in NicVariants().apply(VfioHost.of(self.settings).sysfs, []) if d.kind == "vfio"]
        self.nics.devices = [agentkit.nic(ips=NIC_VARIANTS[self.nic_variant]), *self.vfs]
        kernel = KernelEmulator(load_profile(PROFILE), VfioHost.of(self.settings).sysfs.parent)
        kernel.start()
        return kernel


def power_cycle(settings: Settings) -> None:
    """The node reboots between two agent processes: the machine forgets its bindings, MIG instances and
    mediated devices and renumbers what it hands out in order; the tmpfs CDI and kubelet directories
    come back empty. The next agent (killed anywhere in its recovery too) must make every prepared claim
    whole again, its files naming what the devices are in the new boot."""
    reboot(load_profile(PROFILE), settings.sim_root)
    # The PF forgets every VF's MAC and VLAN; the host's own network configuration sets the previous
    # tenant's again at boot (what `check_vf_links` expects of a VF no record sets). A record's are the
    # recovery's to set again.
    for (pf, n), link in TENANT_VF_LINKS.items():
        SimVfLinks(VfioHost.of(settings).sysfs.parent).set(pf, n, link)
    for tmpfs in (settings.cdi_dir, settings.kubelet_dir):
        shutil.rmtree(tmpfs, ignore_errors=True)
        tmpfs.mkdir(parents=True)


def _child(settings: Settings, uids: list[str], seed: int, kill_at: int, lose_gpu: bool, out_fd: int,
           in_fd: int, log_path: Path) -> None:
    rng = random.Random(seed)
    # The round's agent logs to a file of its own (kept with the work directory: `--work`), so that an
    # inconsistency can be traced to what the agent did and why.
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.root.handlers[:] = [handler]
    logging.root.setLevel(logging.INFO)
    out = os.fdopen(out_fd, "w", buffering=1)

    def say(*words: str) -> None:
        out.write(" ".join(words) + "\n")

    async def op(kind: str, uid: str, agent: _Agent) -> None:
        say("S", kind, uid)
        ref = ClaimRef("default", f"claim-{int(uid[-12:])}", uid)
        if kind == "prepare":
            res = (await agent.engine.prepare([ref]))[uid]
            say("D", kind, uid, "ok" if not res.error else "err", orjson.dumps(res.error).decode())
        else:
            err = (await agent.engine.unprepare([ref]))[uid]
            say("D", kind, uid, "ok" if not err else "err", orjson.dumps(err).decode())

    async def refresh(agent: _Agent) -> None:
        agent.nics.devices = [agentkit.nic(ips=NIC_VARIANTS[rng.randrange(len(NIC_VARIANTS))]), *agent.vfs]
        if await agent.inventory.scan(["nic"]):
            await agent.engine.refresh_devices({NIC})

    async def main() -> None:
        agent = _Agent(settings, rng.randrange(len(NIC_VARIANTS)))
        agent.open()
        await agent.inventory.scan()
        failpoints.before_kill = lambda step: say("K", step)
        # Killed in recovery too (after a reboot it makes partitions and bindings again, and rewrites files).
        failpoints.configure(f"*@{kill_at}=kill")
        report = await asyncio.to_thread(recover, agent.engine)
        say("R", str(len(report.records)))
        os.read(in_fd, 1)  # the parent has checked the disk after this restart
        if lose_gpu:  # the MIG GPU falls off the bus: its claims' unprepares are forced
            assert agent.gpus.nvml is not None
            agent.gpus.nvml.lose(LOST_GPU)
            say("L")
        await agent.engine.refresh_claims(sorted(agent.engine.records))  # as the daemon does at start
        for _ in range(rng.randint(2, 6)):
            batch: list[Any] = []
            for uid in rng.sample(uids, rng.randint(1, 4)):
                batch.append(op(rng.choice(("prepare", "prepare", "unprepare")), uid, agent))
            if rng.random() < 0.3:
                batch.append(refresh(agent))
            await asyncio.gather(*batch)
        say("F", str(len(os.listdir(leftovers_dir(settings.state_dir)))) if leftovers_dir(settings.state_dir).exists()
            else "0")
        say("E")

    asyncio.run(main())


def _read_lines(fd: int, pid: int) -> Iterable[str]:
    buf = b""
    poller = select.poll()  # not select(): in a long test run the pipe's descriptor may be above 1023
    poller.register(fd, select.POLLIN)
    while True:
        ready = poller.poll(60_000)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            raise RuntimeError("agent process hung for 60 s")
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode()


def crash_rounds(work: Path, kills: int, seed: int, deadline: float, daemon_kills: int = 0,
                 log: Callable[[str], None] = print) -> CrashReport:
    rng = random.Random(seed)
    settings = crash_settings(work)
    assert settings.offline is not None
    claims = _claims(rng, 12)
    for (pf, n), link in TENANT_VF_LINKS.items():
        SimVfLinks(VfioHost.of(settings).sysfs.parent).set(pf, n, link)
    for obj in claims:
        agentkit.write_claim(settings.offline / "resourceclaims", obj)
    uids = [c["metadata"]["uid"] for c in claims]
    report = CrashReport()
    logs = work / "logs"  # each round's agent log: round-<N>.log
    logs.mkdir(parents=True, exist_ok=True)
    expect: dict[str, str] = {}
    failpoints.configure("")
    while report.kills < kills and time.monotonic() < deadline:
        report.rounds += 1
        kill_at = rng.randint(1, 36)
        lose_gpu = rng.random() < LOST_GPUS
        if rng.random() < REBOOTS:
            power_cycle(settings)
            report.reboots += 1
        out_r, out_w = os.pipe()
        in_r, in_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the agent process of this round
            try:
                os.close(out_r)
                os.close(in_w)
                _child(settings, uids, rng.randrange(2**32), kill_at, lose_gpu, out_w, in_r,
                       logs / f"round-{report.rounds}.log")
                os._exit(0)
            except BaseException:
                import traceback

                traceback.print_exc()
                os._exit(3)
        os.close(out_w)
        os.close(in_r)
        in_flight: dict[str, int] = {}
        lost = False
        try:
            for line in _read_lines(out_r, pid):
                kind, *rest = line.split(" ", 3)
                if kind == "R":
                    problems = check_disk(settings, expect)
                    if problems:
                        report.inconsistencies += len(problems)
                        report.problems += [f"round {report.rounds}: {p}" for p in problems[:5]]
                        report.problems.append(f"round {report.rounds}: the agents' logs are {logs}/round-"
                                               f"{report.rounds - 1}.log and round-{report.rounds}.log")
                    os.write(in_w, b"g")
                elif kind == "L":
                    lost = True
                    report.lost_gpu_rounds += 1
                elif kind == "F":
                    report.left_undone += int(rest[0])
                elif kind == "K":
                    report.steps_reached[rest[0]] = report.steps_reached.get(rest[0], 0) + 1
                elif kind == "S":
                    in_flight[rest[1]] = in_flight.get(rest[1], 0) + 1
                elif kind == "D":
                    op, uid, outcome = rest[0], rest[1], rest[2].split(" ", 1)[0]
                    in_flight[uid] -= 1
                    if (outcome == "err" and op == "prepare" and lost
                            and (partition_of(uid) or "").startswith(f"gpu-{LOST_GPU}-")):
                        # A prepare of the lost GPU's device (or of one it left changes on) may fail; an
                        # unprepare never may.
                        report.refused_lost += 1
                        expect[uid] = "unknown"
                    elif outcome == "err":
                        report.problems.append(f"round {report.rounds}: {op} {uid} failed: {rest[2]}")
                        report.inconsistencies += 1
                        expect[uid] = "unknown"
                    elif in_flight[uid] == 0:
                        expect[uid] = "prepared" if op == "prepare" else "absent"
                    else:
                        expect[uid] = "unknown"
                    if outcome == "ok" and op == "prepare" and (part := partition_of(uid)):
                        kind = "mig" if "-mig-" in part else "vgpu"
                        report.partition_prepares[kind] = report.partition_prepares.get(kind, 0) + 1
        finally:
            os.close(out_r)
            os.close(in_w)
        _, status = os.waitpid(pid, 0)
        for uid, n in in_flight.items():
            if n:
                expect[uid] = "unknown"  # cut off mid-call: either outcome is allowed, not half of one
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            report.kills += 1
        elif os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            report.completed_rounds += 1
        else:
            report.inconsistencies += 1
            report.problems.append(f"round {report.rounds}: the agent process failed ({status})")
        if report.kills and report.kills % 100 == 0 and os.WIFSIGNALED(status):
            log(f"  {report.kills} kills, {report.inconsistencies} inconsistencies")
    # The last restart, and its check.
    last = _Agent(settings, 0)
    kernel = last.open()
    try:
        asyncio.run(last.inventory.scan())
        recover(last.engine)
        problems = check_disk(settings, expect)
    finally:
        kernel.stop()
        last.inventory.close()
    report.inconsistencies += len(problems)
    report.problems += [f"final: {p}" for p in problems]
    if daemon_kills:
        _daemon_rounds(work / "daemon", daemon_kills, rng, report)
    return report


# -- the real daemon, killed ------------------------------------------------------------------------------

def _daemon_rounds(work: Path, rounds: int, rng: random.Random, report: CrashReport) -> None:
    import subprocess

    import grpc

    from agent.kubelet import client as kc

    work.mkdir(parents=True, exist_ok=True)
    short = Path(tempfile.mkdtemp(prefix="dra-st-", dir="/tmp"))  # socket paths stay short
    settings = crash_settings(short)
    assert settings.offline is not None
    claims = _claims(rng, 6)
    for (pf, n), link in TENANT_VF_LINKS.items():
        SimVfLinks(VfioHost.of(settings).sysfs.parent).set(pf, n, link)
    for obj in claims:
        agentkit.write_claim(settings.offline / "resourceclaims", obj)
    refs = [ClaimRef("default", c["metadata"]["name"], c["metadata"]["uid"]) for c in claims]
    expect: dict[str, str] = {}
    args = [sys.executable, "-m", "agent.app.cli", "run", "--nvml", "sim", "--node-name", agentkit.NODE,
            "--offline", str(settings.offline), "--kubelet-dir", str(settings.kubelet_dir),
            "--cdi-dir", str(settings.cdi_dir), "--static-cdi-dir", str(settings.static_cdi_dir),
            "--state-dir", str(settings.state_dir), "--nic-exclude", "*", "--rescan-interval", "3600",
            "--compatibility-groups", "true",
            "--log-format", "json", "--metrics-address", ""]

    async def ready(proc: subprocess.Popen[bytes]) -> None:
        """Until the new process answers on both sockets (the registration socket opens after the DRA socket): a
        socket file left by a killed agent says nothing."""
        for _ in range(300):
            if proc.poll() is not None:
                raise RuntimeError(f"the agent exited with {proc.returncode} before it was ready")
            try:
                await kc.get_info(settings.registration_socket, timeout=0.5)
                await kc.empty_prepare(settings.dra_socket, timeout=0.5)
                return
            except Exception:
                await asyncio.sleep(0.05)
        raise RuntimeError("the agent did not answer on its sockets within 15 s")

    def recoveries() -> int:
        """Start-up recoveries finished so far, by the daemon's log (its summary line)."""
        log_path = work / "daemon.log"
        return log_path.read_bytes().count(b'"msg":"state: ') if log_path.exists() else 0

    async def recovered(proc: subprocess.Popen[bytes], before: int) -> None:
        """Until the new process has checked every record and removed orphans (in the background,
        after its sockets opened)."""
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"the agent exited with {proc.returncode} before recovery ended")
            if recoveries() > before:
                return
            await asyncio.sleep(0.05)
        raise RuntimeError("the agent did not finish its recovery within 30 s")

    async def drive(proc: subprocess.Popen[bytes]) -> None:
        await ready(proc)
        async with kc.DRAClient(settings.dra_socket) as client:
            for _ in range(12):
                chosen = rng.sample(refs, rng.randint(1, 3))
                unprepare = rng.random() < 0.35
                for r in chosen:
                    expect[r.uid] = "unknown"
                try:
                    if unprepare:
                        reply = await client.unprepare(chosen, timeout=10)
                        for r in chosen:
                            if reply.claims[r.uid].error == "":
                                expect[r.uid] = "absent"
                    else:
                        reply = await client.prepare(chosen, timeout=10)
                        for r in chosen:
                            if reply.claims[r.uid].error == "":
                                expect[r.uid] = "prepared"
                except grpc.aio.AioRpcError as exc:
                    if proc.poll() is None and exc.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    return  # the agent died mid-call

    attempts = 0
    while report.daemon_kills < rounds and attempts < 4 * rounds:
        attempts += 1
        env = dict(os.environ, DRA_AGENT_FAILPOINTS=f"*@{rng.randint(1, 24)}=kill", PYTHONPATH=str(ROOT))
        with open(work / "daemon.log", "ab") as logf:
            proc = subprocess.Popen(args, env=env, stdout=logf, stderr=logf, cwd=ROOT)
            try:
                asyncio.run(drive(proc))
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if proc.returncode == -signal.SIGKILL:
            report.kills += 1
            report.daemon_kills += 1
        elif proc.returncode != 0:
            report.inconsistencies += 1
            report.problems.append(f"daemon round: the agent exited with {proc.returncode} (see {work}/daemon.log)")
        # The restart: a daemon start runs recovery before its sockets; then the disk is checked.
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        before = recoveries()
        with open(work / "daemon.log", "ab") as logf:
            proc = subprocess.Popen(args, env=env, stdout=logf, stderr=logf, cwd=ROOT)
        try:
            asyncio.run(ready(proc))
            asyncio.run(recovered(proc, before))  # every record checked, orphans removed: the disk is settled
            problems = check_disk(settings, expect)
        except RuntimeError as exc:
            problems = [f"the restarted agent did not come up: {exc} (see {work / 'daemon.log'})"]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        report.inconsistencies += len(problems)
        report.problems += [f"daemon round: {p}" for p in problems]
    shutil.rmtree(short, ignore_errors=True)


# -- fuzzing ------------------------------------------------------------------------------------------------

@dataclass
class FuzzReport:
    inputs: int = 0
    records: int = 0  # of the inputs, claim records rewritten and recovered (`recordfuzz`)
    failures: int = 0
    problems: list[str] = field(default_factory=list)


def _tree(root: Path, skip: Iterable[Path]) -> dict[str, tuple[int, int]]:
    skipped = [str(s) for s in skip]
    out: dict[str, tuple[int, int]] = {}
    for parent, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if os.path.join(parent, d) not in skipped]
        for name in files:
            st = os.lstat(os.path.join(parent, name))
            out[os.path.join(parent, name)] = (st.st_size, st.st_mtime_ns)
    return out


class _MemoryClaims:
    """A local claim source holding the claims the fuzzer made (the engine's claim source protocol)."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], Any] = {}

    async def get(self, namespace: str, name: str) -> Any:
        return self.read(namespace, name)

    def read(self, namespace: str, name: str) -> Any:
        from agent.claims.sources import ClaimNotFound

        try:
            return self.claims[(namespace, name)]
        except KeyError:
            raise ClaimNotFound(f"ResourceClaim {namespace}/{name} not found") from None


def fuzz(work: Path, engine_inputs: int, grpc_inputs: int, seed: int, record_inputs: int = 0) -> FuzzReport:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    report = FuzzReport()
    node = asyncio.run(agentkit.make_node(work))
    kernel = KernelEmulator(load_profile(PROFILE), VfioHost.of(node.settings).sysfs.parent)
    kernel.start()  # fuzzed claims name passthrough devices too: they are bound and unbound
    source = _MemoryClaims()
    node.engine.claims = source
    s = node.settings
    roots = [s.cdi_dir, s.plugin_dir, s.claims_state_dir]
    outside_before = _tree(work, [*roots, s.state_dir / "nvml-sim", s.offline or work])
    loop = asyncio.new_event_loop()
    devices = [d.name for d in node.inventory.devices()]

    label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)
    text = st.text(max_size=80)
    names = st.one_of(label, text, st.sampled_from(["..", ".", "a/b", "x" * 300, "ns\n", ""]))
    uids = st.one_of(st.uuids().map(str), text, st.uuids().map(lambda u: str(u).upper()))
    json_value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text,
                              lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                              max_leaves=8)
    result = st.fixed_dictionaries({
        "request": st.one_of(label, names, st.tuples(label, label).map("/".join)),
        "driver": st.sampled_from([s.driver_name, "other.example.com"]),
        "pool": st.sampled_from([s.node_name, "other-node"]),
        "device": st.one_of(st.sampled_from(devices), names),
    }, optional={"shareID": st.one_of(label, text), "adminAccess": st.booleans()})
    opaque = st.fixed_dictionaries({
        "apiVersion": st.sampled_from([f"{s.driver_name}/v1alpha1", "v1", ""]),
        "kind": st.sampled_from(["DeviceConfig", "VfioConfig", "Other"]),
    }, optional={"iommu": st.one_of(st.sampled_from(["legacy", "iommufd"]), json_value),
                 "mac": st.one_of(st.sampled_from(["02:00:00:00:00:09", "03:00:00:00:00:01"]), json_value),
                 "vlan": st.one_of(st.integers(-1, 5000), json_value),
                 "env": st.dictionaries(st.one_of(label.map(str.upper), text, st.sampled_from(RESERVED_NAMES)),
                                        st.one_of(text, json_value, st.sampled_from(TENANT_VALUES)), max_size=3),
                 "extra": json_value})
    config = st.fixed_dictionaries({
        "opaque": st.fixed_dictionaries({"driver": st.sampled_from([s.driver_name, "x.example.com"]),
                                         "parameters": st.one_of(opaque, json_value)}),
    }, optional={"requests": st.lists(label, max_size=2), "source": st.sampled_from(["FromClass", "FromClaim"])})
    claim_case = st.tuples(names, names, uids, st.lists(result, max_size=4), st.lists(config, max_size=2),
                           st.one_of(st.none(), st.tuples(st.lists(st.sampled_from(
                               ["metadata", "status", "allocation", "devices", "results", "config", 0, "name"]),
                               min_size=1, max_size=4), json_value)),
                           st.one_of(st.none(), names))

    def files_of(uid: str) -> list[str]:
        return [p for p in agentkit.written_files(s) if uid and uid in p]

    @settings(max_examples=engine_inputs, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(claim_case)
    def one_claim(case: Any) -> None:
        namespace, name, uid, results, configs, splice, pod_claim = case
        report.inputs += 1
        obj = agentkit.claim(name, uid, results, namespace=namespace, config=configs,
                             annotations={"resource.kubernetes.io/pod-claim-name": pod_claim} if pod_claim else None)
        if splice is not None:
            path, value = splice
            target: Any = obj
            for key in path[:-1]:
                nxt = target.get(key) if isinstance(target, dict) else (
                    target[key] if isinstance(target, list) and isinstance(key, int) and key < len(target) else None)
                if nxt is None:
                    break
                target = nxt
            if isinstance(target, dict):
                target[path[-1]] = value
        source.claims[(namespace, name)] = obj
        ref = ClaimRef(namespace, name, uid)
        res = loop.run_until_complete(node.engine.prepare([ref]))[uid]
        assert "internal error" not in res.error, res.error
        if res.error:
            assert files_of(uid) == [], (res.error, files_of(uid))
        else:
            found = node.engine.store.read(uid)
            assert found is not None
            for f in found[0].files:
                assert Path(f.path).read_bytes() == f.content
            # Nothing reserved that a configuration set ever reaches a spec (the MPS limits only lower).
            spec_env = {e for f in found[0].files if f.role is FileRole.CLAIM_SPEC
                        for d in orjson.loads(f.content)["devices"] for e in d["containerEdits"].get("env", [])}
            assert not {e for e in _configured_env(configs) if e in spec_env and _reserved(e.split("=", 1)[0])}, \
                spec_env
        err = loop.run_until_complete(node.engine.unprepare([ref]))[uid]
        assert "internal error" not in err, err
        if not err:
            assert files_of(uid) == [], files_of(uid)

    # A tenant's environment on claims that are otherwise valid (most drawn above fail before their
    # configuration counts): a GPU, a share or a MIG device, with variables a tenant would try.
    plain = [d.name for d in node.inventory.devices() if d.kind in ("gpu", "mig") or d.kind.shared]
    tenant_env = st.dictionaries(st.one_of(st.sampled_from(RESERVED_NAMES), label.map(str.upper)),
                                 st.one_of(st.sampled_from(TENANT_VALUES), text), min_size=1, max_size=3)
    tenant_case = st.tuples(label, st.uuids().map(str), st.sampled_from(plain), st.sampled_from(["4Gi", "1Gi"]),
                            st.lists(st.tuples(st.sampled_from(["FromClass", "FromClaim"]), tenant_env), min_size=1,
                                     max_size=2))

    @settings(max_examples=max(engine_inputs // 4, 1), derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(tenant_case)
    def tenant_claim(case: Any) -> None:
        name, uid, device, memory, envs = case
        report.inputs += 1
        extra = {"shareID": str(uuid_mod.uuid4()), "consumedCapacity": {"memory": memory}} \
            if device.endswith("-shared") else {}
        configs = [{"source": source, "opaque": {"driver": s.driver_name, "parameters": {
            "apiVersion": f"{s.driver_name}/v1alpha1", "kind": "DeviceConfig", "env": env}}} for source, env in envs]
        source.claims[("default", name)] = agentkit.claim(name, uid, [agentkit.result(device, "gpu", **extra)],
                                                          config=configs)
        ref = ClaimRef("default", name, uid)
        res = loop.run_until_complete(node.engine.prepare([ref]))[uid]
        assert "internal error" not in res.error, res.error
        if not res.error:
            found = node.engine.store.read(uid)
            assert found is not None
            spec_env = {e for f in found[0].files if f.role is FileRole.CLAIM_SPEC
                        for d in orjson.loads(f.content)["devices"] for e in d["containerEdits"].get("env", [])}
            assert not {e for e in _configured_env(configs) if e in spec_env and _reserved(e.split("=", 1)[0])}, \
                spec_env
            # Only a share gets MPS limits, and never more memory than it consumed (docs/claims.md).
            limits = [dict(entry.split("=", 1) for entry in e.split("=", 1)[1].split(","))
                      for e in spec_env if e.startswith("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=")]
            if device.endswith("-shared"):
                share_mib = int(memory.removesuffix("Gi")) << 10
                assert limits and all(int(lim["0"].removesuffix("M")) <= share_mib for lim in limits), spec_env
            else:
                assert not [e for e in spec_env if e.startswith("CUDA_MPS_")], spec_env
        else:
            assert files_of(uid) == [], (res.error, files_of(uid))
        assert "internal error" not in loop.run_until_complete(node.engine.unprepare([ref]))[uid]

    try:
        if engine_inputs:  # (`--fuzz 0`: the crash rounds alone)
            one_claim()
            tenant_claim()
    except Exception as exc:
        report.failures += 1
        report.problems.append(f"engine: {exc!r}"[:2000])
    if record_inputs:
        import recordfuzz

        try:
            recordfuzz.fuzz_records(node, source, loop, record_inputs, report, work)
        except Exception as exc:
            report.failures += 1
            report.problems.append(f"records: {exc!r}"[:2000])
    if grpc_inputs:
        try:
            _fuzz_grpc(node, grpc_inputs, names, uids, report, loop)
        except Exception as exc:
            report.failures += 1
            report.problems.append(f"grpc: {exc!r}"[:2000])
    loop.close()
    kernel.stop()
    outside_after = _tree(work, [*roots, s.state_dir / "nvml-sim", s.offline or work])
    if outside_after != outside_before:
        report.failures += 1
        changed = sorted(set(outside_after.items()) ^ set(outside_before.items()))
        report.problems.append(f"written outside the roots: {changed[:5]}")
    return report


# Environment a tenant's configuration tries (tests/test_reserved_env.py has each family by hand).
RESERVED_NAMES = ["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "LD_PRELOAD",
                  "LD_LIBRARY_PATH", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
                  "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "DRA_GPU_0_UUID", "GLIBC_TUNABLES", "GCONV_PATH",
                  "CUDA_INJECTION64_PATH", "NVTX_INJECTION64_PATH"]
TENANT_VALUES = ["all", "0=999999M", "0=999999999G", "0=1M", "/tmp/x.so", "50", "150", "void"]


def _reserved(name: str) -> bool:
    """The agent's variables and those that load code into every process, as docs/claims.md lists them, but
    for the MPS limits a configuration may lower (the oracle is the page, not the agent's own predicate)."""
    limits = ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    return name not in limits and (name in ("CUDA_VISIBLE_DEVICES", "GLIBC_TUNABLES", "GCONV_PATH") or name.startswith(
        ("NVIDIA_", "CUDA_MPS_", "LD_", "DRA_", "CUDA_INJECTION", "NVTX_INJECTION")))


def _configured_env(configs: list[Any]) -> set[str]:
    """`NAME=value` for every string variable any drawn configuration sets."""
    out = set()
    for c in configs:
        params = (c.get("opaque") or {}).get("parameters") if isinstance(c, dict) else None
        env = params.get("env") if isinstance(params, dict) else None
        if isinstance(env, dict):
            out |= {f"{k}={v}" for k, v in env.items() if isinstance(k, str) and isinstance(v, str)}
    return out


def _fuzz_grpc(node: Any, n: int, names: Any, uids: Any, report: FuzzReport, loop: asyncio.AbstractEventLoop) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from agent.kubelet import client as kc
    from agent.kubelet.health import HealthTracker
    from agent.kubelet.server import Servers

    short = Path(tempfile.mkdtemp(prefix="dra-fz-", dir="/tmp"))
    import dataclasses

    asyncio.set_event_loop(loop)  # the gRPC channel binds to the current loop

    s = dataclasses.replace(node.settings, kubelet_dir=short / "kubelet")
    servers = Servers(s, node.engine, HealthTracker(pool=s.node_name))
    loop.run_until_complete(servers.start_dra())
    client = kc.DRAClient(s.dra_socket)
    valid = [ClaimRef("default", f"c{i}", claim_uid(900 + i)) for i in range(3)]
    for r in valid:
        node.engine.claims.claims[(r.namespace, r.name)] = agentkit.claim(
            r.name, r.uid, [agentkit.result("gpu-0", "a")])

    refs = st.lists(st.one_of(st.sampled_from(valid), st.builds(ClaimRef, names, names, uids)), max_size=5)

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(refs, st.sampled_from(["v1", "v1beta1"]))
    def one_call(claims: list[ClaimRef], api: str) -> None:
        report.inputs += 1
        client.api = api
        reply = loop.run_until_complete(client.prepare(claims, timeout=20))
        assert set(reply.claims) == {c.uid for c in claims}
        for _uid, entry in reply.claims.items():
            assert "internal error" not in entry.error, entry.error
        reply = loop.run_until_complete(client.unprepare(claims, timeout=20))
        assert set(reply.claims) == {c.uid for c in claims}
        assert all("internal error" not in e.error for e in reply.claims.values())
        assert not any(c.uid in p for c in claims if c.uid for p in agentkit.written_files(node.settings))

    try:
        one_call()
    finally:
        loop.run_until_complete(client.close())
        loop.run_until_complete(servers.stop(0))
        shutil.rmtree(short, ignore_errors=True)


# -- main ---------------------------------------------------------------------------------------------------

def run(kills: int, daemon_kills: int, engine_inputs: int, grpc_inputs: int, seed: int,
        max_seconds: float, work: Path | None = None, log: Callable[[str], None] = print,
        record_inputs: int = 0) -> dict[str, Any]:
    started = time.monotonic()
    own = work is None
    base = Path(tempfile.mkdtemp(prefix="dra-stress-")) if work is None else work
    try:
        log(f"crash rounds: {kills} kills wanted ({daemon_kills} of the real daemon)")
        crash = crash_rounds(base / "crash", kills - daemon_kills, seed, started + max_seconds * 0.75,
                             daemon_kills=daemon_kills, log=log)
        crash_seconds = time.monotonic() - started
        log(f"fuzzing: {engine_inputs} claims through the engine, {grpc_inputs} calls over the socket, "
            f"{record_inputs} records rewritten")
        fz = fuzz(base / "fuzz", engine_inputs, grpc_inputs, seed, record_inputs)
    finally:
        if own:
            shutil.rmtree(base, ignore_errors=True)
    return {
        "kills": crash.kills,
        "daemon_kills": crash.daemon_kills,
        "rounds": crash.rounds,
        "rounds_without_kill": crash.completed_rounds,
        "reboots": crash.reboots,
        "kills_by_step": dict(sorted(crash.steps_reached.items())),
        "partition_prepares": dict(sorted(crash.partition_prepares.items())),
        "lost_gpu_rounds": crash.lost_gpu_rounds,
        "left_undone": crash.left_undone,
        "refused_lost": crash.refused_lost,
        "inconsistencies": crash.inconsistencies,
        "fuzz_inputs": fz.inputs,
        "fuzz_records": fz.records,
        "fuzz_failures": fz.failures,
        "crash_seconds": round(crash_seconds, 1),
        "seconds": round(time.monotonic() - started, 1),
        "problems": (crash.problems + fz.problems)[:50],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=1000)
    ap.add_argument("--daemon-kills", type=int, default=20)
    ap.add_argument("--fuzz", type=int, default=8000, help="claims through the engine")
    ap.add_argument("--fuzz-grpc", type=int, default=2000, help="calls over the DRA socket")
    ap.add_argument("--fuzz-records", type=int, default=1000, help="claim records rewritten, then recovered")
    ap.add_argument("--seed", type=int, default=20261202)
    ap.add_argument("--max-seconds", type=float, default=1100.0)
    ap.add_argument("--out", type=Path, default=ROOT / ".stress" / "results.json")
    ap.add_argument("--work", type=Path, help="keep the work directory here (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)  # refused inputs log warnings by the thousand
    results = run(args.kills, args.daemon_kills, args.fuzz, args.fuzz_grpc, args.seed, args.max_seconds,
                  work=args.work, record_inputs=args.fuzz_records)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    for key, value in results.items():
        if key != "problems":
            print(f"{key:>22}: {value}")
    for p in results["problems"]:
        print("  problem:", p)
    print(f"written to {args.out}")
    ok = results["inconsistencies"] == 0 and results["fuzz_failures"] == 0 and results["kills"] >= args.kills
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
