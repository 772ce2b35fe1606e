"""Per-claim records: round trip, durability format, and refusing damaged files."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import stat
import threading
from typing import Any

import orjson
import pytest

from agent.claims.book import ClaimBook
from agent.claims.dirsync import DirectorySync
from agent.claims.records import (
    ClaimRecord,
    DeviceBinding,
    DevicePartition,
    FileRecord,
    FileRole,
    PartitionKind,
    PreparedDevice,
    RecordError,
    RecordState,
    decode,
    encode,
    role_of,
)
from agent.claims.store import ClaimStore
from agent.host.vfio.bind import BindPlan, BindStep, FunctionBinding, StepKind
from agent.host.vfio.sriov import VfLink

UID = "7d9c9b4e-0d6f-4f34-9a0e-3f5b8f1b2c3d"


def framed(body: bytes, version: int) -> bytes:
    """A record file as the agent frames a body: header with version, checksum and length."""
    return b"DRAREC %d %s %d\n" % (version, hashlib.sha256(body).hexdigest().encode(), len(body)) + body


def assert_refused(body: dict[str, Any], version: int) -> None:
    """A correctly framed record whose body breaks the format is refused."""
    with pytest.raises(RecordError):
        decode(framed(orjson.dumps(body), version))


def record(uid: str = UID) -> ClaimRecord:
    return ClaimRecord(
        uid=uid, namespace="ns", name="claim", pod_claim_name="gpu",
        devices=[PreparedDevice(request="gpu", pool="node-a", device="gpu-0",
                                cdi_device_ids=("dra.example.com/claim=x-gpu-0",), share_id="s1")],
        files=[FileRecord("/tmp/x.json", b'{"a": 1}\n', 0o644)], dirs=["/tmp/d"], prepared_at=12.5)


def test_round_trip_keeps_every_field():
    rec = record()
    back = decode(encode(rec))
    assert back == rec


CLAIM_DIR = f"/var/lib/kubelet/plugins/dra.example.com/dra-device-metadata/{UID}"
ROLES = [  # a prepared claim's three kinds of file, as the agent names them
    (f"/var/run/cdi/dra.example.com-claim_{UID}.json", FileRole.CLAIM_SPEC, ""),
    (f"{CLAIM_DIR}/gpu-a/metadata.json", FileRole.METADATA_FILE, "gpu-a"),
    (f"/var/run/cdi/dra.example.com_metadata_{UID}_gpu-a.json", FileRole.METADATA_SPEC, "gpu-a"),
]


def test_files_keep_their_role_and_request_through_the_record():
    rec = dataclasses.replace(record(), files=[
        FileRecord(path, b"{}\n", 0o644, role, request) for path, role, request in ROLES])
    body = orjson.loads(rec.to_json())
    assert [(f["role"], f["request"]) for f in body["files"]] == [("claimSpec", ""), ("metadataFile", "gpu-a"),
                                                                   ("metadataSpec", "gpu-a")]
    assert decode(encode(rec)) == rec


def test_a_record_written_before_files_had_roles_reads_back_with_roles_from_their_names():
    body = orjson.loads(record().to_json())
    body["files"] = [{"path": path, "mode": 0o644, "content": "{}\n"} for path, _, _ in ROLES]
    back = decode(framed(orjson.dumps(body), 1))
    assert [(f.path, f.role, f.request) for f in back.files] == ROLES
    # Whatever directories they lie in: the names say what they are.
    assert role_of(f"/elsewhere/{UID}/nic/metadata.json") == (FileRole.METADATA_FILE, "nic")


@pytest.mark.parametrize("damage", [("role", "spec"), ("role", 1), ("request", 7)])
def test_a_file_with_a_malformed_role_is_refused(damage):
    key, value = damage
    body = orjson.loads(record().to_json())
    body["files"][0][key] = value
    assert_refused(body, 1)


def test_header_names_format_version_checksum_and_length():
    data = encode(record())
    header = data.split(b"\n", 1)[0].split(b" ")
    assert header[0] == b"DRAREC" and header[1] == b"1"
    assert int(header[3]) == len(data.split(b"\n", 1)[1])


@pytest.mark.parametrize("damage", ["truncate", "flip", "version", "garbage", "empty"])
def test_damaged_records_are_refused(damage):
    data = encode(record())
    if damage == "truncate":
        data = data[:-5]
    elif damage == "flip":
        i = len(data) - 10
        data = data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]
    elif damage == "version":
        data = data.replace(b"DRAREC 1 ", b"DRAREC 9 ", 1)
    elif damage == "garbage":
        data = b"hello world\n{}"
    else:
        data = b""
    with pytest.raises(RecordError):
        decode(data)


def test_store_writes_0600_and_loads_back(tmp_path):
    store = ClaimStore(tmp_path / "claims")
    store.ensure()
    store.write(record())
    path = store.path(UID)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(store.directory).st_mode) == 0o700
    records, problems = store.load_all()
    assert problems == [] and records[UID] == record()
    assert store.delete(UID) is True and store.delete(UID) is False


def test_the_book_deletes_a_record_durably_and_forgets_the_claim(tmp_path, monkeypatch):
    store = ClaimStore(tmp_path / "claims")
    book = ClaimBook(store)
    book.write(record())
    assert book.record_of(UID) is not None and book.claims_holding({"gpu-0"}) == [UID]
    assert book.delete(UID) is True
    assert store.stamp(UID) is None and book.record_of(UID) is None and book.claims_holding({"gpu-0"}) == []
    assert book.delete(UID) is False

    book.write(record())

    def unlink_fails(path, durable=False):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(store.root, "unlink", unlink_fails)
    with pytest.raises(OSError):
        book.delete(UID)
    assert book.record_of(UID) is not None  # the caller was told: the claim is still known
    # Best effort (a failed prepare's record): forgotten all the same; the file is read again when asked for.
    assert book.delete(UID, best_effort=True) is False
    assert book.record_of(UID) is None and store.stamp(UID) is not None
    assert book.current(UID) == record() and book.record_of(UID) is not None


def test_load_reports_damaged_records_and_ignores_temp_files(tmp_path):
    store = ClaimStore(tmp_path)
    store.ensure()
    store.write(record())
    other = "11111111-2222-4333-8444-555555555555"
    (tmp_path / f"{other}.rec").write_bytes(encode(record(other))[:-3])
    (tmp_path / f".{UID}.rec.tmp-abcd").write_bytes(b"half")
    (tmp_path / "not-a-uid.rec").write_bytes(encode(record()))
    records, problems = store.load_all()
    assert (tmp_path / f".{UID}.rec.tmp-abcd").exists()  # a reader beside a running agent touches nothing
    assert list(records) == [UID]
    assert sorted(name for name, _ in problems) == sorted([f"{other}.rec", "not-a-uid.rec"])
    assert store.temp_files() == [f".{UID}.rec.tmp-abcd"]
    moved = store.quarantine(f"{other}.rec")
    assert moved.name.endswith(".corrupt") and not (tmp_path / f"{other}.rec").exists()


def test_record_named_for_another_uid_is_refused(tmp_path):
    store = ClaimStore(tmp_path)
    store.ensure()
    other = "11111111-2222-4333-8444-555555555555"
    (tmp_path / f"{other}.rec").write_bytes(encode(record(UID)))
    records, problems = store.load_all()
    assert records == {} and "names UID" in problems[0][1]


@pytest.mark.parametrize("uid", ["../../etc/passwd", "", "A" * 36, UID.upper(), UID + "\x00"])
def test_store_refuses_paths_from_bad_uids(tmp_path, uid):
    with pytest.raises(ValueError):
        ClaimStore(tmp_path).path(uid)


def test_concurrent_directory_syncs_share_fsyncs_and_each_waits_for_one_that_began_after_it(tmp_path, monkeypatch):
    """Group commit: 16 writers cost a few fsyncs, and none returns before an fsync that started
    after it asked (so its rename is covered)."""
    sync = DirectorySync(tmp_path)
    order = itertools.count()  # one order for every step of every thread
    order_lock = threading.Lock()

    def now() -> int:
        with order_lock:
            return next(order)

    fsyncs: list[tuple[int, int]] = []  # (began, ended)
    real_fsync = os.fsync
    asked_all = threading.Semaphore(0)

    def held_fsync(fd: int) -> None:
        if not fsyncs:  # the first fsync waits until every writer has asked: the rest arrive while it runs
            for _ in range(16):
                assert asked_all.acquire(timeout=30)
        began = now()
        real_fsync(fd)
        fsyncs.append((began, now()))

    monkeypatch.setattr(os, "fsync", held_fsync)
    calls: list[tuple[int, int]] = []
    gate = threading.Barrier(16)

    def writer() -> None:
        gate.wait()
        asked = now()
        asked_all.release()
        sync.sync()
        calls.append((asked, now()))

    threads = [threading.Thread(target=writer) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 16
    assert sync.fsyncs == len(fsyncs) < 16
    for asked, returned in calls:
        assert any(asked < began and ended < returned for began, ended in fsyncs), (asked, returned, fsyncs)


def test_a_failed_directory_sync_raises_and_the_next_caller_syncs_again(tmp_path, monkeypatch):
    sync = DirectorySync(tmp_path)
    real_fsync = os.fsync
    failures = [OSError(5, "Input/output error")]

    def flaky(fd: int) -> None:
        if failures:
            raise failures.pop()
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", flaky)
    with pytest.raises(OSError, match="Input/output"):
        sync.sync()
    sync.sync()
    assert sync.fsyncs == 1


# -- version 2: records with PCI functions bound to vfio-pci -----------------------------------------------

def bound_record(state: RecordState = RecordState.PREPARED) -> ClaimRecord:
    plan = BindPlan("vfio-pci", 100, (FunctionBinding("0000:18:00.0", "nvidia"),),
                    (BindStep(StepKind.SET_OVERRIDE, "0000:18:00.0", "vfio-pci"),
                     BindStep(StepKind.UNBIND, "0000:18:00.0", "nvidia"),
                     BindStep(StepKind.BIND, "0000:18:00.0", "vfio-pci")))
    return dataclasses.replace(record(), state=state, bindings=[
        DeviceBinding("gpu-0000-18-00-0-vfio", plan, 2, "boot-1", "iommufd", "02:00:00:00:00:01", 7)])


@pytest.mark.parametrize("state", list(RecordState))
def test_bindings_round_trip_in_version_2(state):
    rec = bound_record(state)
    data = encode(rec)
    assert data.startswith(b"DRAREC 2 ")
    assert decode(data) == rec


def test_records_without_bindings_stay_version_1_and_version_1_stays_strict():
    assert encode(record()).startswith(b"DRAREC 1 ")
    # A version-1 header over a body with bindings or another state is refused, not half read.
    for body in (bound_record().to_json(), bound_record(RecordState.BINDING).to_json()):
        data = framed(body, 1)
        with pytest.raises(RecordError, match="incomplete"):
            decode(data)


@pytest.mark.parametrize("vlan", [0, None, 42])
def test_a_vfs_previous_settings_and_a_cleared_vlan_round_trip(vlan):
    """A VLAN of 0 asked for (cleared) stays apart from one not asked for (left), with what the VF had before."""
    rec = bound_record()
    rec = dataclasses.replace(rec, bindings=[dataclasses.replace(
        rec.bindings[0], vlan=vlan, previous=VfLink("02:00:00:00:0e:01", 100, 2))])
    assert decode(encode(rec)) == rec


def test_a_binding_written_before_previous_settings_reads_as_before():
    """A record an agent wrote before it kept a VF's previous settings: its `vlan: 0` was never applied."""
    body = orjson.loads(bound_record().to_json())
    body["bindings"][0]["vlan"] = 0
    (b,) = decode(framed(orjson.dumps(body), 2)).bindings
    assert (b.vlan, b.previous, b.sets_vf) == (None, None, True)
    body["bindings"][0]["mac"] = ""
    (b,) = decode(framed(orjson.dumps(body), 2)).bindings
    assert not b.sets_vf
    # And a binding that sets nothing on a VF is written as such a record is.
    assert "previous" not in orjson.loads(dataclasses.replace(bound_record(), bindings=[dataclasses.replace(
        b, vlan=None)]).to_json())["bindings"][0]


@pytest.mark.parametrize("damage", [
    ("vlan", None), ("previous", {"mac": "x", "vlan": "1", "qos": 0}), ("previous", None),
    ("state", "half-bound"), ("step", -1), ("step", True), ("iommu", "vfio"), ("extra", 1), ("plan", {}),
])
def test_a_malformed_binding_is_refused(damage):
    key, value = damage
    body = orjson.loads(bound_record().to_json())
    if key == "state":
        body["state"] = value
    else:
        body["bindings"][0][key] = value
    assert_refused(body, 2)


# -- version 3: records with GPU partitions created for the claim -------------------------------------------

def partitioned_record(state: RecordState = RecordState.PREPARED, bindings: bool = False) -> ClaimRecord:
    base = bound_record(state) if bindings else dataclasses.replace(record(), state=state)
    return dataclasses.replace(base, partitions=[
        DevicePartition("gpu-3-mig-1g10gb-4", PartitionKind.MIG, "GPU-0b4c", "1g.10gb", 4, 3, "MIG-5e1f", 7, 0,
                        True, "boot-1"),
        DevicePartition("gpu-3-vgpu-nvidia-1021", PartitionKind.MDEV, "0000:18:00.0", "nvidia-1021",
                        uuid="7d9c9b4e-0000-4f34-9a0e-3f5b8f1b2c3d")])


@pytest.mark.parametrize("state", list(RecordState))
@pytest.mark.parametrize("bindings", [False, True])
def test_partitions_round_trip_in_version_3(state, bindings):
    rec = partitioned_record(state, bindings)
    data = encode(rec)
    assert data.startswith(b"DRAREC 3 ")
    back = decode(data)
    assert back == rec and back.partitions[0].kind is PartitionKind.MIG and back.partitions[0].mode_changed


def test_records_without_partitions_keep_versions_1_and_2():
    assert encode(record()).startswith(b"DRAREC 1 ")
    assert encode(bound_record()).startswith(b"DRAREC 2 ")
    assert encode(dataclasses.replace(record(), state=RecordState.BINDING)).startswith(b"DRAREC 2 ")


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_header_over_a_body_with_partitions_is_refused(version):
    body = partitioned_record().to_json()
    if version == 2:
        assert b'"bindings"' in body  # a version-2 reader would find its fields, and must still refuse
    data = b"DRAREC %d %s %d\n" % (version, hashlib.sha256(body).hexdigest().encode(), len(body)) + body
    with pytest.raises(RecordError, match="incomplete"):
        decode(data)


def test_an_agent_that_reads_only_versions_1_and_2_refuses_a_version_3_record_by_version(monkeypatch):
    """What an agent from before partitions does with a record of this one: refuse it by name."""
    import agent.claims.records as state_module
    monkeypatch.setattr(state_module, "READABLE_VERSIONS", (1, 2))
    with pytest.raises(RecordError, match="format version 3 is not supported"):
        decode(encode(partitioned_record()))


@pytest.mark.parametrize("damage", [
    ("kind", "vgpu"), ("step", -1), ("start", True), ("gpuInstance", -2), ("modeChanged", 1), ("uuid", None),
    ("extra", 1), ("partitions", []), ("partitions", {}),
])
def test_a_malformed_partition_is_refused(damage):
    key, value = damage
    body = orjson.loads(partitioned_record().to_json())
    if key == "partitions":
        body["partitions"] = value
    else:
        body["partitions"][0][key] = value
    assert_refused(body, 3)
