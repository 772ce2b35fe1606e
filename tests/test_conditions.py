"""Device conditions: the taint policy, causes that come and go, and the outputs that follow them
(taints, health stream, readiness), with a clock the test moves."""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

import orjson
import pytest
from agentkit import roots

from agent.health.conditions import CAUSES_FILE, NONE, DeviceConditions, read_saved
from agent.health.policy import PolicyError, TaintPolicy, load_policy, parse_policy
from agent.health.requests import (
    RESULT_KEEP,
    apply_requests,
    health_dir,
    read_result,
    requests_dir,
    result_path,
    submit_clear,
)
from agent.inventory import DeviceFailure, Snapshot
from agent.kinds import Kind
from agent.kubelet.health import HEALTHY, UNHEALTHY, HealthTracker
from agent.model import Device

DRIVER = "dra.example.com"


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def conditions(clock: Clock, tmp: Path | None = None, policy: TaintPolicy | None = None) -> DeviceConditions:
    return DeviceConditions(DRIVER, policy or TaintPolicy(), tmp, clock=clock)


def wire(c: DeviceConditions, device: str) -> list[dict[str, str]]:
    return [t.wire() for t in c.taints(device)]


# -- the policy ------------------------------------------------------------------------------------

def test_default_policy_follows_the_contract() -> None:
    p = TaintPolicy()
    for xid in (13, 31, 43, 45, 68, 109, 63, 92, 94):  # the GPU keeps working: informational
        assert p.for_xid(xid).effect == "None" and p.for_xid(xid).clear_after == 300
    assert p.for_xid(48).effect == "NoSchedule" and p.for_xid(48).clear_after is None
    for xid in (79, 95, 119, 120):  # the GPU runs nothing until a reset
        assert p.for_xid(xid).effect == "NoExecute" and p.for_xid(xid).clear_after is None
    assert p.gpu_lost.effect == "NoExecute"
    assert p.link_down.effect == "NoSchedule" and p.link_down.up_hold == 10


def documented_policy_table() -> list[tuple[str, str]]:
    """(cause, default effect) of each row of the taint table of docs/health.md."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "health.md").read_text()
    section = text[text.index("## Conditions and the default policy"):]
    lines = section[section.index("| cause |"):].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((cells[0], cells[2].strip("`")))
    return rows


def test_docs_state_the_default_policy() -> None:
    p = TaintPolicy()
    documented: set[int] = set()
    for cause, effect in documented_policy_table():
        numbers = [int(n) for n in re.findall(r"\d+", cause.partition("(")[0])]
        if cause.startswith("XID"):
            assert numbers and all(p.for_xid(x).effect == effect for x in numbers), cause
            documented.update(numbers)
        elif cause.startswith("any other XID"):
            examples = [int(n) for n in re.findall(r"\d+", cause)]
            assert effect == p.default_xid.effect and not set(examples) & set(p.xid), cause
        elif "GPU lost" in cause:
            assert effect == p.gpu_lost.effect
        elif "link down" in cause:
            assert effect == p.link_down.effect
        elif "left undone" in cause:
            assert effect == p.undo_failed.effect
        elif "NVML lost" in cause:
            assert effect == p.nvml_lost.effect
        else:
            raise AssertionError(f"docs/health.md's taint table has a row this test does not know: {cause}")
    assert documented == set(p.xid)  # every XID with a rule of its own is in the table


def test_a_policy_file_is_laid_over_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text('xid:\n  "13": {effect: ignore}\n  94: {effect: NoExecute}\n'
                    "defaultXid: {effect: None, clearAfter: 60}\nlinkDown: {upHold: 0.5}\n")
    p = load_policy(path)
    assert p.for_xid(13).effect == "ignore"
    assert p.for_xid(94).effect == "NoExecute"
    assert p.for_xid(31).effect == "None"  # untouched default
    assert p.for_xid(500).effect == "None" and p.for_xid(500).clear_after == 60
    assert p.link_down.up_hold == 0.5 and p.link_down.effect == "NoSchedule"


@pytest.mark.parametrize(("doc", "message"), [
    ({"xid": {"abc": {"effect": "None"}}}, "is not an XID number"),
    ({"xid": {"2000": {"effect": "None"}}}, "1..999"),
    ({"xid": {"48": {"effect": "PreferNoSchedule"}}}, "effect: must be one of"),
    ({"xid": {"48": {"effect": "None", "after": 3}}}, "unknown field"),
    ({"gpuLost": {"effect": "None", "clearAfter": -1}}, "positive number"),
    ({"linkDown": {"upHold": "soon"}}, "upHold"),
    ({"taints": {}}, "unknown field"),
    (["xid"], "must be a mapping"),
])
def test_bad_policies_are_refused_with_where_and_why(doc: object, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        parse_policy(doc)


def test_an_unreadable_policy_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"--taint-policy .*missing\.yaml"):
        load_policy(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("xid: [\n")
    with pytest.raises(PolicyError, match="not YAML"):
        load_policy(bad)


# -- causes and their taints -----------------------------------------------------------------------

def test_an_xid_taints_until_the_gpu_is_reset(clock: Clock) -> None:
    c = conditions(clock)
    assert c.xid("gpu-3", 48, "gpu-reset")
    assert wire(c, "gpu-3") == [{"key": f"{DRIVER}/xid", "value": "48", "effect": "NoSchedule",
                                 "timeAdded": "2027-01-15T08:00:00Z"}]
    assert c.health("gpu-3") == (False, "XID 48 (double-bit ECC error), recovery action gpu-reset")
    clock.now += 3600
    c.tick()
    assert wire(c, "gpu-3")  # no time limit on a fault
    assert not c.gpu_answering("gpu-3", "gpu-reset")  # still needs its reset
    assert c.gpu_answering("gpu-3", NONE)
    assert c.taints("gpu-3") == [] and c.health("gpu-3") is None


def test_one_xid_taint_per_device_with_the_strongest_effect(clock: Clock) -> None:
    c = conditions(clock)
    c.xid("gpu-0", 13)
    clock.now += 1
    c.xid("gpu-0", 79)
    clock.now += 1
    c.xid("gpu-0", 48)
    (taint,) = c.taints("gpu-0")
    assert (taint.effect, taint.value) == ("NoExecute", "79")
    assert [x.value for x in c.causes("gpu-0")] == ["13", "79", "48"]


def test_an_application_xid_is_informational_and_expires(clock: Clock) -> None:
    c = conditions(clock)
    c.xid("gpu-1", 13, NONE)
    assert wire(c, "gpu-1")[0]["effect"] == "None"
    healthy, message = c.health("gpu-1") or (False, "")
    assert healthy and "application error" in message
    assert c.readiness("gpu-1").ready
    assert c.next_deadline() == clock.now + 300
    clock.now += 299
    assert c.tick() == 0
    clock.now += 1
    assert c.tick() == 1 and c.taints("gpu-1") == []


def test_an_ignored_xid_taints_nothing(clock: Clock) -> None:
    c = conditions(clock, policy=parse_policy({"xid": {"94": {"effect": "ignore"}}}))
    assert not c.xid("gpu-1", 94)
    assert c.taints("gpu-1") == []


def test_a_lost_gpu_is_noexecute_until_it_answers_again(clock: Clock) -> None:
    c = conditions(clock)
    c.xid("gpu-2", 79, "gpu-reset")
    assert c.gpu_lost("gpu-2", "GPU_IS_LOST")
    assert not c.gpu_lost("gpu-2", "GPU_IS_LOST")  # already known: nothing changes
    keys = {t.key: t.effect for t in c.taints("gpu-2")}
    assert keys == {f"{DRIVER}/xid": "NoExecute", f"{DRIVER}/gpu-lost": "NoExecute"}
    assert c.readiness("gpu-2").reason == "GpuLost"
    # Answering again after being lost is a reset, whatever the recovery action says.
    assert c.gpu_answering("gpu-2", "unknown")
    assert c.taints("gpu-2") == [] and c.readiness("gpu-2").ready


def test_a_link_taint_goes_only_after_the_link_stays_up(clock: Clock) -> None:
    c = conditions(clock)
    assert not c.link("nic-a", True)  # up and untainted: nothing to do
    assert c.link("nic-a", False)
    down_since = wire(c, "nic-a")[0]["timeAdded"]
    assert wire(c, "nic-a")[0]["effect"] == "NoSchedule"
    assert c.readiness("nic-a").reason == "LinkDown"
    clock.now += 5
    assert not c.link("nic-a", True)  # up, but not for long enough
    clock.now += 5
    assert not c.link("nic-a", False)  # flapping: the same taint stays, its time too
    assert wire(c, "nic-a")[0]["timeAdded"] == down_since
    clock.now += 1
    c.link("nic-a", True)
    assert c.next_deadline() == clock.now + 10
    clock.now += 9.9
    assert c.tick() == 0 and c.taints("nic-a")
    clock.now += 0.1
    assert c.tick() == 1 and c.taints("nic-a") == []
    assert c.readiness("nic-a").ready


def test_a_zero_hold_clears_a_link_taint_on_the_first_scan_up(clock: Clock) -> None:
    c = conditions(clock, policy=parse_policy({"linkDown": {"upHold": 0}}))
    c.link("nic-a", False)
    assert c.link("nic-a", True) and c.taints("nic-a") == []


def test_an_operator_clears_xid_taints_but_not_observations(clock: Clock) -> None:
    c = conditions(clock)
    c.xid("gpu-4", 48)
    c.gpu_lost("gpu-4", "GPU_IS_LOST")
    gone = c.clear("gpu-4")
    assert [x.value for x in gone] == ["48"]
    assert [t.key for t in c.taints("gpu-4")] == [f"{DRIVER}/gpu-lost"]
    assert c.clear("gpu-4") == []


def test_xid_causes_survive_a_restart_and_observations_do_not(clock: Clock, tmp_path: Path) -> None:
    c = conditions(clock, tmp_path)
    c.xid("gpu-5", 48, "gpu-reset")
    c.link("nic-b", False)
    saved, saved_at = read_saved(tmp_path)
    assert {x.kind for x in saved} == {"xid", "link-down"} and saved_at == clock.now
    again = conditions(clock, tmp_path)
    again.load()
    assert [t.wire() for t in again.taints("gpu-5")] == wire(c, "gpu-5")
    assert again.taints("nic-b") == []


BOOT_A, BOOT_B = "6c1f0b8e-0000-4000-8000-00000000000a", "6c1f0b8e-0000-4000-8000-00000000000b"
UUID_5, UUID_OTHER = "GPU-5d1e0000-0000-0000-0000-000000000005", "GPU-5d1e0000-0000-0000-0000-0000000000ff"


def tainted_gpu5(clock: Clock, tmp_path: Path) -> list[dict[str, str]]:
    """gpu-5 (UUID_5) gets XID 48 in boot A; what it was tainted with."""
    c = conditions(clock, tmp_path)
    c.load(BOOT_A)
    c.baseline("gpu-5", UUID_5, "none")  # its first answer: healthy
    assert c.xid("gpu-5", 48, "gpu-reset")
    [saved] = read_saved(tmp_path)[0]
    assert (saved.boot_id, saved.gpu_uuid) == (BOOT_A, UUID_5)
    return wire(c, "gpu-5")


def restarted(clock: Clock, tmp_path: Path, boot: str) -> DeviceConditions:
    clock.now += 600
    c = conditions(clock, tmp_path)
    c.load(boot)
    return c


def test_an_xid_taint_is_kept_while_the_same_gpu_in_the_same_boot_still_needs_its_reset(
        clock: Clock, tmp_path: Path) -> None:
    before = tainted_gpu5(clock, tmp_path)
    c = restarted(clock, tmp_path, BOOT_A)
    assert wire(c, "gpu-5") == before  # restored, same time added
    assert not c.baseline("gpu-5", UUID_5, "gpu-reset")
    assert wire(c, "gpu-5") == before
    again = restarted(clock, tmp_path, BOOT_A)  # and the next restart too
    again.baseline("gpu-5", UUID_5, "gpu-reset")
    assert wire(again, "gpu-5") == before


def test_a_reboot_clears_xid_taints(clock: Clock, tmp_path: Path) -> None:
    tainted_gpu5(clock, tmp_path)
    c = restarted(clock, tmp_path, BOOT_B)
    assert c.taints("gpu-5") == [] and c.causes() == []


def test_a_gpu_reset_while_no_agent_ran_clears_xid_taints(clock: Clock, tmp_path: Path) -> None:
    tainted_gpu5(clock, tmp_path)
    c = restarted(clock, tmp_path, BOOT_A)
    assert c.taints("gpu-5")  # until the GPU says what it needs
    told: list[set[str]] = []
    c.on_change = told.append
    assert c.baseline("gpu-5", UUID_5, NONE)
    assert c.taints("gpu-5") == [] and told == [{"gpu-5"}]
    assert read_saved(tmp_path)[0] == []


def test_another_gpu_at_the_name_clears_xid_taints(clock: Clock, tmp_path: Path) -> None:
    tainted_gpu5(clock, tmp_path)
    c = restarted(clock, tmp_path, BOOT_A)
    assert c.baseline("gpu-5", UUID_OTHER, "gpu-reset")  # a swapped board, needing a reset of its own
    assert c.taints("gpu-5") == []
    assert c.xid("gpu-5", 79)  # what it says from now on is its own
    assert read_saved(tmp_path)[0][0].gpu_uuid == UUID_OTHER


def test_xid_taints_of_this_run_are_not_checked_against_a_first_answer(clock: Clock, tmp_path: Path) -> None:
    c = conditions(clock, tmp_path)
    c.load(BOOT_A)
    c.xid("gpu-2", 48, "gpu-reset")  # no earlier run: nothing restored
    assert not c.baseline("gpu-2", UUID_OTHER, NONE)
    assert c.taints("gpu-2")


def test_a_causes_file_without_boot_or_gpu_is_read_and_confirmed(clock: Clock, tmp_path: Path) -> None:
    """As an agent before boot IDs and UUIDs were recorded wrote it."""
    (tmp_path / CAUSES_FILE).write_bytes(orjson.dumps({"version": 1, "driver": DRIVER, "savedAt": clock.now,
                                                       "causes": [{
        "device": "gpu-1", "kind": "xid", "effect": "NoSchedule", "value": "48", "since": clock.now - 60,
        "detail": "XID 48 (double-bit ECC error), recovery action gpu-reset", "expires": None}]}))
    [old] = read_saved(tmp_path)[0]
    assert (old.boot_id, old.gpu_uuid) == ("", "")
    c = restarted(clock, tmp_path, BOOT_B)  # an unknown boot does not say it rebooted
    assert [t.value for t in c.taints("gpu-1")] == ["48"]
    c.baseline("gpu-1", UUID_5, "gpu-reset")  # confirmed: from now on it is known
    [confirmed] = read_saved(tmp_path)[0]
    assert (confirmed.boot_id, confirmed.gpu_uuid, confirmed.since) == (BOOT_B, UUID_5, old.since)
    assert restarted(clock, tmp_path, BOOT_A).taints("gpu-1") == []  # and a reboot now clears it
    c = restarted(clock, tmp_path, BOOT_B)
    c.baseline("gpu-1", UUID_5, NONE)
    assert c.taints("gpu-1") == []


def test_an_unreadable_saved_file_is_skipped(clock: Clock, tmp_path: Path) -> None:
    (tmp_path / CAUSES_FILE).write_bytes(b"{not json")
    c = conditions(clock, tmp_path)
    c.load()
    assert c.causes() == []
    (tmp_path / CAUSES_FILE).write_bytes(orjson.dumps({"version": 99, "causes": []}))
    c.load()
    assert c.causes() == []


# -- outputs ---------------------------------------------------------------------------------------

def _snapshot(*devices: Device, failed: tuple[DeviceFailure, ...] = ()) -> Snapshot:
    return Snapshot(devices={d.name: d for d in devices}, failed_devices=list(failed), problems=[],
                    failing_sources=[], unknown={}, taken_at=0.0)


def test_the_health_stream_names_the_cause(clock: Clock) -> None:
    async def run() -> None:
        c = conditions(clock)
        tracker = HealthTracker(pool="node-a")
        gpu, other = Device("gpu-0", Kind.GPU), Device("gpu-1", Kind.GPU)
        await tracker.update(_snapshot(gpu, other), c)
        assert {h.device: h.status for h in tracker.current()} == {"gpu-0": HEALTHY, "gpu-1": HEALTHY}
        c.xid("gpu-0", 48, "gpu-reset")
        assert await tracker.update(_snapshot(gpu, other), c)
        by_name = {h.device: h for h in tracker.current()}
        assert by_name["gpu-0"].status == UNHEALTHY and "XID 48 (double-bit ECC error)" in by_name["gpu-0"].message
        assert by_name["gpu-1"].status == HEALTHY
        # Lost: discovery fails it, and the message carries both.
        c.gpu_lost("gpu-0", "GPU_IS_LOST")
        await tracker.update(_snapshot(other, failed=(DeviceFailure("gpu-0", "nvml: GPU is lost"),)), c)
        message = {h.device: h.message for h in tracker.current()}["gpu-0"]
        assert "GPU lost" in message and "nvml: GPU is lost" in message
        c.gpu_answering("gpu-0", NONE)
        await tracker.update(_snapshot(gpu, other), c)
        assert {h.device: (h.status, h.message) for h in tracker.current()}["gpu-0"] == (HEALTHY, "")

    asyncio.run(run())


def test_clear_requests_are_applied_in_order_and_bad_ones_set_aside(clock: Clock, tmp_path: Path) -> None:
    settings = roots(tmp_path)
    clock.now = time.time()  # the wall clock the requests' names are written with, as the agent's conditions have
    c = conditions(clock, health_dir(settings))
    c.xid("gpu-6", 48)
    c.xid("gpu-7", 63)
    six = submit_clear(settings, "gpu-6")
    nine = submit_clear(settings, "gpu-9")  # nothing to clear: applied, harmless
    (requests_dir(settings) / "00000000000000000001-zz.json").write_bytes(b'{"action": "explode"}')
    assert apply_requests(requests_dir(settings), c) == 2
    assert c.taints("gpu-6") == [] and c.taints("gpu-7")
    # Each applied request leaves what it cleared for the CLI that asked; reading it removes it.
    assert read_result(six) == ["XID 48 (double-bit ECC error)"]
    assert read_result(nine) == []
    left = sorted(p.name for p in requests_dir(settings).iterdir())
    assert left == ["00000000000000000001-zz.json.bad"]


def test_a_clear_takes_the_xids_raised_before_it_was_asked_for(clock: Clock) -> None:
    """An operator's clear, asked for at T: the XIDs raised until T go, also one reported only after the
    clear was applied (the simulated machine applies a command written while no agent ran when one
    starts); an XID raised after T stays."""
    c = conditions(clock)
    asked = clock.now
    c.xid("gpu-1", 48, at=asked - 10)
    clock.now += 1
    c.xid("gpu-1", 79)  # raised after the operator asked: stays
    assert [x.detail for x in c.clear("gpu-1", before=asked)] == ["XID 48 (double-bit ECC error)"]
    assert [t.value for t in c.taints("gpu-1")] == ["79"]
    assert not c.xid("gpu-1", 31, at=asked - 5)  # raised before the clear, reported after it: not taken
    assert [t.value for t in c.taints("gpu-1")] == ["79"]
    assert c.xid("gpu-1", 63, at=asked + 0.5)
    assert {t.value for t in c.taints("gpu-1")} <= {"79", "63"} and len(c.causes("gpu-1")) == 2
    assert c.clear("gpu-1") and c.taints("gpu-1") == []  # by hand with no time: every XID goes


def test_results_no_cli_read_are_removed_after_a_while(clock: Clock, tmp_path: Path) -> None:
    settings = roots(tmp_path)
    c = conditions(clock, health_dir(settings))
    old = submit_clear(settings, "gpu-1")
    assert apply_requests(requests_dir(settings), c) == 1
    stale = time.time() - RESULT_KEEP - 1
    os.utime(result_path(old), (stale, stale))
    new = submit_clear(settings, "gpu-2")
    assert apply_requests(requests_dir(settings), c) == 1
    assert not result_path(old).exists() and read_result(new) == []


def test_a_clear_request_names_a_device() -> None:
    from agent.names import InvalidName

    with pytest.raises(InvalidName):
        submit_clear(roots(Path("/nonexistent")), "../gpu-0")


def test_nvml_lost_taints_every_gpu_until_it_answers_and_its_xids_wait_for_the_gpus_answer(
        clock: Clock, tmp_path: Path) -> None:
    c = conditions(clock, tmp_path)
    c.xid("gpu-1", 48, "gpu-reset")
    c.xid("gpu-2", 48, "gpu-reset")
    assert c.nvml_lost(["gpu-0", "gpu-1"], "Driver Not Loaded")
    assert not c.nvml_lost(["gpu-0", "gpu-1"], "Driver Not Loaded")  # one cause per GPU, as long as it lasts
    assert wire(c, "gpu-0") == [{"key": f"{DRIVER}/nvml-lost", "effect": "NoSchedule",
                                 "timeAdded": "2027-01-15T08:00:00Z"}]
    healthy, message = c.health("gpu-0") or (True, "")
    assert not healthy and message.startswith("NVML lost since 2027-01-15T08:00:00Z: Driver Not Loaded")
    assert c.readiness("gpu-0").reason == "NvmlLost" and not c.readiness("gpu-0").ready
    assert c.taint_counts()[("nvml-lost", "NoSchedule")] == 2
    assert [x.kind for x in read_saved(tmp_path)[0] if x.device == "gpu-0"] == ["nvml-lost"]  # `dra-agent taints`

    assert c.nvml_back()
    assert c.taints("gpu-0") == [] and [t.key for t in c.taints("gpu-1")] == [f"{DRIVER}/xid"]
    # A new session: the driver's load reset the GPUs. Each XID goes at its GPU's answer that says so.
    assert c.baseline("gpu-1", "GPU-1", NONE)
    assert c.taints("gpu-1") == []
    assert not c.baseline("gpu-2", "GPU-2", "gpu-reset")  # still needs its reset
    assert [t.key for t in c.taints("gpu-2")] == [f"{DRIVER}/xid"]


def test_the_policy_may_change_or_ignore_nvml_lost(clock: Clock) -> None:
    assert parse_policy({"nvmlLost": {"effect": "NoExecute"}}).nvml_lost.effect == "NoExecute"
    c = conditions(clock, policy=parse_policy({"nvmlLost": {"effect": "ignore"}}))
    assert not c.nvml_lost(["gpu-0"], "Driver Not Loaded") and c.taints("gpu-0") == []
