"""Every file format the agent reads back from its state directory, as a release wrote it, read by today's
agent: what an upgrade from that release finds on the node (docs/deployment.md, "Upgrades, downgrades and
the files on the node").

tests/formats/<release>/ holds the files the agent of that release wrote on the simulated machine (`make
run`'s: gpu-one, the VM's passthrough GPU and mig-one prepared, an XID on gpu-3, then stopped), unchanged:
`record-v1.rec`, `-v2`, `-v3` (a claim without host changes, with a GPU bound to vfio-pci, with a MIG
device), `claim-summaries-v1`, `causes-v1.json`, `claim-status-written-v1.json`, `gpus-v1.json`,
`writers-lock`, and `leftover-v1.json` (a host change an unprepare could not undo, made with that release's
own encoder from its version-3 record). A format's version that the agent reads and no release's fixture
holds fails the last test: a new version comes with its fixture, and the old fixtures stay.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import orjson
import pytest

from agent.claims import leftovers, records, summaries
from agent.claims.book import ClaimBook
from agent.claims.leftovers import Leftover
from agent.claims.records import RecordState
from agent.claims.store import ClaimStore, RecordStamp
from agent.claims.writers import WRITERS_LOCK_FILE, RecordWriters
from agent.health import causes, statuswritten
from agent.inventory import gpumemory
from agent.inventory.gpumemory import GpuMemory

FORMATS = Path(__file__).resolve().parent / "formats"
RELEASES = sorted(p.name for p in FORMATS.iterdir() if p.is_dir())

# The claims of the 0.1.0 fixtures (examples/ seeded by examples/seed.py).
GPU_ONE = "0b6c1a3e-5f0d-4c8e-9a51-1f2d3c4b5a01"
VM_GPU = "0b6c1a3e-5f0d-4c8e-9a51-1f2d3c4b5a07"
MIG_ONE = "0b6c1a3e-5f0d-4c8e-9a51-1f2d3c4b5a40"


def state_dir(tmp_path: Path, release: str) -> Path:
    """A state directory laid out as that release's agent left it: its records, summaries and counts."""
    src = FORMATS / release
    state = tmp_path / "state"
    (state / "claims").mkdir(parents=True)
    for version, uid in ((1, GPU_ONE), (2, VM_GPU), (3, MIG_ONE)):
        shutil.copy(src / f"record-v{version}.rec", state / "claims" / f"{uid}.rec")
    shutil.copy(src / "claim-summaries-v1", summaries.path_of(state))
    shutil.copy(src / "claim-status-written-v1.json", statuswritten.path_of(state))
    shutil.copy(src / "writers-lock", state / WRITERS_LOCK_FILE)
    (state / "health").mkdir()
    shutil.copy(src / "causes-v1.json", state / "health" / causes.CAUSES_FILE)
    shutil.copy(src / "gpus-v1.json", state / gpumemory.FILE)
    return state


@pytest.mark.parametrize("release", RELEASES)
def test_records_of_every_version_are_read_with_what_they_hold(tmp_path: Path, release: str) -> None:
    store = ClaimStore(state_dir(tmp_path, release) / "claims")
    loaded, refused = store.load_all()
    assert refused == []
    assert set(loaded) == {GPU_ONE, VM_GPU, MIG_ONE}
    plain, bound, partitioned = loaded[GPU_ONE], loaded[VM_GPU], loaded[MIG_ONE]
    assert (plain.version, plain.name, [d.device for d in plain.devices]) == (1, "gpu-one", ["gpu-0"])
    assert (bound.version, [b.device for b in bound.bindings]) == (2, ["gpu-0000-2a-00-0-vfio"])
    assert bound.bindings[0].plan.functions[0].bdf == "0000:2a:00.0"
    assert (partitioned.version, [p.device for p in partitioned.partitions]) == (3, ["gpu-7-mig-1g10gb-0"])
    for record in loaded.values():
        assert record.state is RecordState.PREPARED and record.files  # every file, to put back as it was


@pytest.mark.parametrize("release", RELEASES)
def test_the_claim_summaries_are_taken_for_the_records_they_summarize(tmp_path: Path, release: str) -> None:
    state = state_dir(tmp_path, release)
    # The summaries hold each record file's identity (inode, mtime, size): copied here, the files are others,
    # and a start reads them again (a cache, never the truth). Taken for files that are still those.
    data = (FORMATS / release / "claim-summaries-v1").read_bytes()
    entries = orjson.loads(data.partition(b"\n")[2])
    stamps = {uid: (ino, mtime, size) for uid, ino, mtime, size, _ in entries}

    class Unchanged(ClaimStore):
        def stamp(self, uid: str) -> RecordStamp | None:
            return stamps.get(uid)

    store = Unchanged(state / "claims")
    book = ClaimBook(store)
    assert summaries.restore(summaries.path_of(state), book, store, store.uids()) == 3
    assert book.claims_holding({"gpu-0"}) == [GPU_ONE]
    assert book.claims_holding({"gpu-7-mig-1g10gb-0"}) == [MIG_ONE]
    # The identities no longer match (another file): nothing taken, the records are read instead.
    plain = ClaimStore(state / "claims")
    assert summaries.restore(summaries.path_of(state), ClaimBook(plain), plain, plain.uids()) == 0


@pytest.mark.parametrize("release", RELEASES)
def test_health_causes_gpu_memory_status_and_leftovers_are_read(tmp_path: Path, release: str) -> None:
    state = state_dir(tmp_path, release)
    saved, saved_at = causes.read_saved(state / "health")
    assert [(c.device, c.kind, c.value, c.effect) for c in saved] == [("gpu-3", "xid", "48", "NoSchedule")]
    assert saved_at is not None

    boot = re.search(rb'"bootId": "([^"]+)"', (state / gpumemory.FILE).read_bytes())
    assert boot is not None
    memory = GpuMemory(state, lambda: boot.group(1).decode())
    memory.load()
    assert len(memory.gpus) == 8 and {g.device.name for g in memory.gpus.values()} == {f"gpu-{i}" for i in range(8)}

    writers = RecordWriters(state / WRITERS_LOCK_FILE)
    writers.open()  # the next agent arrives: the saved count is that release's own, one before
    try:
        written = statuswritten.take(statuswritten.path_of(state), writers)
    finally:
        writers.close()
    assert set(written) == {GPU_ONE, VM_GPU, MIG_ONE}

    left = Leftover.from_wire((FORMATS / release / "leftover-v1.json").read_bytes())
    assert (left.uid, left.claim, left.devices) == (MIG_ONE, "default/mig-one", ("gpu-7-mig-1g10gb-0",))
    assert left.record.state is RecordState.RESTORING and left.record.version == 3


def test_every_version_the_agent_reads_has_a_fixture() -> None:
    held = {p.name for release in RELEASES for p in (FORMATS / release).iterdir()}
    wanted = [f"record-v{v}.rec" for v in records.READABLE_VERSIONS] + [
        f"claim-summaries-v{summaries.VERSION}", f"causes-v{causes.FORMAT_VERSION}.json",
        f"claim-status-written-v{statuswritten.VERSION}.json", f"gpus-v{gpumemory.VERSION}.json",
        f"leftover-v{leftovers.FORMAT_VERSION}.json", "writers-lock"]
    assert [w for w in wanted if w not in held] == []
