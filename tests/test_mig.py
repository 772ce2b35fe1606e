"""Dynamic MIG: the simulated NVML's MIG calls and placement rules, the MIG devices published on each
GPU's counter set (valid under the 1.37 schema and the API's counter rules), and the proof that the
counter model is the hardware's: a set of devices fits the counters exactly when NVML creates it."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import Any

import pynvml
import pytest
from agentkit import fits, valid_pool
from hypothesis import given, settings
from hypothesis import strategies as st

from agent import apirules, counters
from agent.config import NvmlMode, Settings
from agent.facts import GpuFacts, MigPlacement
from agent.inventory import mig
from agent.inventory.gpus import GpuSource
from agent.model import Device
from agent.sim.nvml import SimulatedNvml
from agent.sim.profiles import parse_profile

DRIVER = "dra.example.com"
NODE = "node-a"
H100 = {"name": "NVIDIA H100 80GB HBM3", "memoryTotal": 85520809984, "busId": "0000:18:00.0",
        "architecture": "NVML_DEVICE_ARCH_HOPPER", "computeCapability": [9, 0], "migMode": [0, 0],
        "migProfiles": "h100-80gb", "pciDeviceId": 0x233010DE}
PROFILES = {"1g.10gb": (19, 7, 1), "1g.10gb+me": (20, 7, 1), "1g.20gb": (15, 4, 2), "2g.20gb": (14, 3, 2),
            "3g.40gb": (9, 2, 4), "4g.40gb": (5, 1, 4), "7g.80gb": (0, 1, 8)}  # id, placements, size


def one_gpu(mode: int = 0) -> SimulatedNvml:
    nvml = SimulatedNvml(parse_profile("one", {"gpus": [dict(H100, migMode=[mode, mode])]}))
    nvml.nvmlInit()
    return nvml


def placement(start: int, size: int) -> Any:
    return pynvml.c_nvmlGpuInstancePlacement_t(start, size)


def code(call: Any, *args: Any) -> int:
    with pytest.raises(pynvml.NVMLError) as err:
        call(*args)
    return int(err.value.value)


def scan(tmp_path: Path, profile: str, dynamic_mig: bool | None = True) -> list[Device]:
    source = GpuSource(Settings(node_name=NODE, nvml=NvmlMode("sim", profile), state_dir=tmp_path / "state"),
                       dynamic_mig=dynamic_mig)
    source.open()
    try:
        return source.scan().devices
    finally:
        source.close()


# -- the simulated NVML ---------------------------------------------------------------------------------

def test_profiles_and_placements_are_the_h100s() -> None:
    nvml = one_gpu()
    gpu = nvml.nvmlDeviceGetHandleByIndex(0)
    seen = {}
    for enum in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu, enum)
        except pynvml.NVMLError as exc:
            assert exc.value == pynvml.NVML_ERROR_NOT_SUPPORTED  # profiles an H100 does not offer
            continue
        count = ctypes.c_uint(0)
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(gpu, info.id, None, ctypes.byref(count))
        small = ctypes.c_uint(count.value - 1)
        assert code(nvml.nvmlDeviceGetGpuInstancePossiblePlacements, gpu, info.id,
                    (pynvml.c_nvmlGpuInstancePlacement_t * 8)(), ctypes.byref(small)) == \
            pynvml.NVML_ERROR_INSUFFICIENT_SIZE and small.value == count.value
        out = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(gpu, info.id, out, ctypes.byref(count))
        seen[mig._text(info.name).removeprefix("MIG ")] = (info.id, len(out), {p.size for p in out}.pop())
    assert seen == PROFILES
    assert code(nvml.nvmlDeviceGetGpuInstanceProfileInfo, gpu, pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT) == \
        pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_creating_instances_follows_nvmls_rules() -> None:
    nvml = one_gpu()
    gpu = nvml.nvmlDeviceGetHandleByIndex(0)
    create = nvml.nvmlDeviceCreateGpuInstanceWithPlacement
    assert code(create, gpu, 9, placement(0, 4)) == pynvml.NVML_ERROR_NOT_SUPPORTED  # MIG off
    assert nvml.nvmlDeviceSetMigMode(gpu, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
    assert nvml.nvmlDeviceGetMigMode(gpu) == [1, 1]  # no reset on the simulated H100
    three = create(gpu, 9, placement(4, 4))
    assert code(create, gpu, 14, placement(4, 2)) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES  # overlap
    assert code(create, gpu, 14, placement(1, 2)) == pynvml.NVML_ERROR_INVALID_ARGUMENT  # not a placement
    assert code(create, gpu, 77, placement(0, 1)) == pynvml.NVML_ERROR_INVALID_ARGUMENT  # no such profile
    me = create(gpu, 20, placement(0, 1))
    assert code(create, gpu, 20, placement(1, 1)) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES  # one +me
    assert nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu, 19) == 3  # slices 1, 2, 3
    info = nvml.nvmlGpuInstanceGetInfo(three)
    assert (info.profileId, info.placement.start, info.placement.size) == (9, 4, 4)

    ci_profile = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        three, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
    assert ci_profile.sliceCount == 3 and ci_profile.multiprocessorCount == 60
    ci = nvml.nvmlGpuInstanceCreateComputeInstance(three, ci_profile.id)
    assert code(nvml.nvmlGpuInstanceCreateComputeInstance, three, ci_profile.id) == \
        pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
    uuid = nvml.nvmlDeviceGetUUID(handle)
    assert uuid.startswith("MIG-") and len(uuid) == 40 and uuid == nvml.nvmlDeviceGetUUID(handle)
    assert nvml.nvmlDeviceGetGpuInstanceId(handle) == info.id and nvml.nvmlDeviceGetComputeInstanceId(handle) == 0
    assert nvml.nvmlDeviceIsMigDeviceHandle(handle) and not nvml.nvmlDeviceIsMigDeviceHandle(gpu)
    assert code(nvml.nvmlDeviceGetMigDeviceHandleByIndex, gpu, 1) == pynvml.NVML_ERROR_NOT_FOUND
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(gpu) == 7

    # Torn down in NVML's order only; MIG off once nothing is left.
    assert code(nvml.nvmlGpuInstanceDestroy, three) == pynvml.NVML_ERROR_IN_USE
    assert code(nvml.nvmlDeviceSetMigMode, gpu, pynvml.NVML_DEVICE_MIG_DISABLE) == pynvml.NVML_ERROR_IN_USE
    nvml.nvmlComputeInstanceDestroy(ci)
    nvml.nvmlGpuInstanceDestroy(three)
    nvml.nvmlGpuInstanceDestroy(me)
    count = ctypes.c_uint(2)
    nvml.nvmlDeviceGetGpuInstances(gpu, 9, (pynvml.c_nvmlGpuInstance_t * 2)(), ctypes.byref(count))
    assert count.value == 0
    nvml.nvmlDeviceSetMigMode(gpu, pynvml.NVML_DEVICE_MIG_DISABLE)
    assert nvml.nvmlDeviceGetMigMode(gpu) == [0, 0]


def test_mig_calls_fail_like_the_gpu() -> None:
    nvml = one_gpu(1)
    gpu = nvml.nvmlDeviceGetHandleByIndex(0)
    gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 0, placement(0, 8))
    nvml.inject_error(0, "nvmlDeviceCreateGpuInstanceWithPlacement", "UNKNOWN")
    assert code(nvml.nvmlDeviceCreateGpuInstanceWithPlacement, gpu, 19, placement(0, 1)) == \
        pynvml.NVML_ERROR_UNKNOWN
    nvml.lose(0)
    assert code(nvml.nvmlGpuInstanceGetInfo, gi) == pynvml.NVML_ERROR_GPU_IS_LOST
    assert code(nvml.nvmlDeviceGetGpuInstanceProfileInfo, gpu, 0) == pynvml.NVML_ERROR_GPU_IS_LOST
    # A GPU that is not MIG capable has no profiles.
    plain = SimulatedNvml(parse_profile("plain", {"gpus": [{k: v for k, v in H100.items() if k != "migMode"}]}))
    plain.nvmlInit()
    assert code(plain.nvmlDeviceGetGpuInstanceProfileInfo, plain.nvmlDeviceGetHandleByIndex(0), 0) == \
        pynvml.NVML_ERROR_NOT_SUPPORTED


# -- published devices ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("profile", "gpus", "counter_slices"), [("dgx-h100", 8, 1), ("hgx-16", 16, 2)])
def test_every_placement_is_published_within_the_api_limits(tmp_path: Path, profile: str, gpus: int,
                                                           counter_slices: int) -> None:
    devices = scan(tmp_path, profile)
    objs = valid_pool(devices)
    published = {d["name"]: d for o in objs for d in o["spec"].get("devices", [])}
    assert len(published) == len(devices) == gpus * (2 + 25)  # nothing dropped
    assert [("sharedCounters" in o["spec"]) for o in objs[:counter_slices + 1]] == [True] * counter_slices + [False]
    sets = {s["name"]: s["counters"] for o in objs for s in o["spec"].get("sharedCounters", [])}
    assert len(sets) == gpus and all(len(c) <= apirules.MAX_COUNTERS_PER_SET for c in sets.values())
    migs = [d for d in devices if d.kind == "mig"]
    assert {(d.attributes["profile"], d.attributes["placementStart"]) for d in migs if
            d.name.startswith("gpu-0-")} == {(p, s) for p, (_, n, size) in PROFILES.items()
                                            for s in range(0, 8, size)[:n] if p != "1g.10gb+me"} | {
        ("1g.10gb+me", s) for s in range(7)}
    gpu0 = {d.name: d for d in devices if d.name == "gpu-0" or d.name.startswith("gpu-0-")}
    parent = gpu0["gpu-0"]
    whole = parent.consumes_counters[0].counter_set
    assert set(whole.counters) >= {"gpu", "memory", *(counters.memory_slice(i) for i in range(8))}
    me = gpu0["gpu-0-mig-1g10gbme-3"]
    assert me.kind == "mig" and me.attributes["parentUUID"] == parent.attributes["uuid"]
    for key in ("productName", "architecture", "driverVersion", "cudaDriverVersion", "resource.kubernetes.io/pciBusID"):
        assert me.attributes[key] == parent.attributes[key]
    assert {k: c.value for k, c in me.capacity.items()} == {
        "multiprocessors": "16", "copyEngines": "1", "decoders": "1", "encoders": "0", "jpegEngines": "1",
        "ofaEngines": "1", "memory": "9984Mi"}
    [use] = me.consumes_counters
    assert use.counter_set == whole and use.counters["memory-slice-3"] == "1"
    assert not any(k.startswith("memory-slice-") and k != "memory-slice-3" for k in use.counters)
    # The full GPU and its variant take the whole set.
    variant = next(d for d in devices if d.kind == "vfio" and d.attributes[
        "resource.kubernetes.io/pciBusID"] == parent.attributes["resource.kubernetes.io/pciBusID"])
    assert parent.consumes_counters[0].counters == variant.consumes_counters[0].counters == whole.counters
    assert all(len(n) <= 63 and not apirules.dns_label_errors(n) for n in published)
    assert me.node == GpuFacts(parent.node.gpu, MigPlacement("1g.10gb+me", 3, 1))
    assert me.node.gpu.uuid == parent.attributes["uuid"]


def test_dynamic_mig_off_publishes_no_placement_and_plain_sets(tmp_path: Path) -> None:
    devices = scan(tmp_path, "dgx-h100", dynamic_mig=False)
    assert [d for d in devices if d.kind == "mig"] == []
    assert all(set(d.consumes_counters[0].counter_set.counters) == {"gpu", "memory"} for d in devices)


def test_a_gpu_offering_no_profile_gets_no_mig_devices(tmp_path: Path) -> None:
    path = tmp_path / "bare.json"
    path.write_text(json.dumps({"gpus": [dict(H100, migProfiles="")]}))
    devices = scan(tmp_path, str(path))
    assert [d.kind for d in devices] == ["gpu", "vfio"]
    assert devices[0].node.target is None


# -- the counter model is the hardware's ------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu0(tmp_path_factory: pytest.TempPathFactory) -> list[Device]:
    """gpu-0 of a one-H100 machine in all its forms: whole, passthrough, 25 placements."""
    root = tmp_path_factory.mktemp("mig")
    path = root / "one.json"
    path.write_text(json.dumps({"gpus": [H100]}))
    return scan(root, str(path))


def nvml_accepts(devices: list[Device]) -> bool:
    """Whether the simulated NVML makes all of `devices`, in this order: a whole form of the GPU only
    alone (MIG off); MIG devices as a GPU instance at their placement and its compute instance."""
    if any(d.kind != "mig" for d in devices):
        return len(devices) == 1
    nvml = one_gpu()
    gpu = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceSetMigMode(gpu, pynvml.NVML_DEVICE_MIG_ENABLE)
    for dev in devices:
        where = dev.node.target
        assert isinstance(where, MigPlacement)
        profile = mig.find_profile(nvml, gpu, where.profile)
        assert profile is not None
        try:
            gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, profile.id, placement(where.start, where.size))
        except pynvml.NVMLError as exc:
            assert exc.value == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
            return False
        ci = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[profile.compute_slices]  # NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE
        nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci)
    return True


def test_any_two_forms_fit_exactly_when_nvml_takes_both(gpu0: list[Device]) -> None:
    for a in gpu0:
        for b in gpu0:
            if a is not b:
                assert fits([a, b]) == nvml_accepts([a, b]), (a.name, b.name)
    assert all(fits([d]) and nvml_accepts([d]) for d in gpu0)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_set_fits_the_counters_exactly_when_nvml_creates_it_in_any_order(gpu0: list[Device],
                                                                           data: st.DataObject) -> None:
    picked = data.draw(st.lists(st.sampled_from(gpu0), min_size=1, max_size=8, unique_by=lambda d: d.name))
    assert fits(picked) == nvml_accepts(data.draw(st.permutations(picked)))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_every_full_packing_the_counters_allow_nvml_creates(gpu0: list[Device], data: st.DataObject) -> None:
    # Greedy over a random order: large sets that fit, down to a whole GPU's worth of placements.
    chosen: list[Device] = []
    for dev in data.draw(st.permutations([d for d in gpu0 if d.kind == "mig"])):
        if fits([*chosen, dev]):
            chosen.append(dev)
    assert nvml_accepts(data.draw(st.permutations(chosen)))
    leftovers = [d for d in gpu0 if d not in chosen]
    assert all(not fits([*chosen, d]) for d in leftovers)  # maximal: NVML has no room left either
    assert all(not nvml_accepts([*chosen, d]) for d in leftovers[:3])
