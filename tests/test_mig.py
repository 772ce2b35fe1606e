"""Dynamic MIG: the simulated NVML's MIG calls and placement rules, the MIG devices published on each
GPU's counter set (valid under the 1.37 schema and the API's counter rules), and the proof that the
counter model is the hardware's: for every GPU model the simulator knows, the published devices and a
set of them fitting the counters are checked against NVIDIA's published profiles and placements
(tests/mig_facts.py), and the simulated NVML is held to the same facts."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import Any

import mig_facts
import pynvml
import pytest
from agentkit import fits, valid_pool
from hypothesis import given, settings
from hypothesis import strategies as st
from mig_facts import GPUS

from agent import apirules, counters, quantity
from agent.config import ConfigError, NvmlMode, Settings
from agent.facts import GpuFacts, MigPlacement
from agent.inventory import mig
from agent.inventory.gpus import GpuSource
from agent.model import Device
from agent.sim.migprofiles import MIG_TABLES
from agent.sim.nvml import SimulatedNvml
from agent.sim.nvmlopen import open_sim_nvml
from agent.sim.profiles import parse_profile

DRIVER = "dra.example.com"
NODE = "node-a"
H100 = {"name": "NVIDIA H100 80GB HBM3", "memoryTotal": 85520809984, "busId": "0000:18:00.0",
        "architecture": "NVML_DEVICE_ARCH_HOPPER", "computeCapability": [9, 0], "migMode": [0, 0],
        "migProfiles": "h100-80gb", "pciDeviceId": 0x233010DE}
# One simulated GPU of each model the simulator has MIG tables for (what NVML says besides MIG).
_AMPERE = {"architecture": "NVML_DEVICE_ARCH_AMPERE", "computeCapability": [8, 0]}
MACHINES: dict[str, dict[str, Any]] = {
    "a30-24gb": {"name": "NVIDIA A30", "memoryTotal": 25769803776, "pciDeviceId": 0x20B710DE, **_AMPERE},
    "a100-40gb": {"name": "NVIDIA A100-SXM4-40GB", "memoryTotal": 42949672960, "pciDeviceId": 0x20B010DE,
                  **_AMPERE},
    "a100-80gb": {"name": "NVIDIA A100-SXM4-80GB", "memoryTotal": 85899345920, "pciDeviceId": 0x20B210DE,
                  **_AMPERE},
    "h100-80gb": H100,
    "h100-94gb": {**H100, "name": "NVIDIA H100 NVL", "memoryTotal": 100485038080, "pciDeviceId": 0x232110DE},
    "h100-96gb": {**H100, "name": "NVIDIA GH200 96GB HBM3", "memoryTotal": 102625181696, "pciDeviceId": 0x234210DE},
    "h200-141gb": {**H100, "name": "NVIDIA H200", "memoryTotal": 150754820096, "pciDeviceId": 0x233510DE},
}
MODELS = sorted(MIG_TABLES)


def machine(model: str, mode: int = 0) -> dict[str, Any]:
    return {"gpus": [{"busId": "0000:18:00.0", **MACHINES[model], "migMode": [mode, mode], "migProfiles": model}]}


def one_gpu(mode: int = 0, model: str = "h100-80gb") -> SimulatedNvml:
    nvml = SimulatedNvml(parse_profile("one", machine(model, mode)))
    nvml.nvmlInit()
    return nvml


def placement(start: int, size: int) -> Any:
    return pynvml.c_nvmlGpuInstancePlacement_t(start, size)


def code(call: Any, *args: Any) -> int:
    with pytest.raises(pynvml.NVMLError) as err:
        call(*args)
    return int(err.value.value)


def scan(tmp_path: Path, profile: str, dynamic_mig: bool | None = True, mig_profiles: str = "all") -> list[Device]:
    """The GPUs' devices as discovery gives them; every profile's placements unless `mig_profiles` says
    otherwise (the counter model is proved on all of them: a choice publishes a subset of them)."""
    settings = Settings(node_name=NODE, nvml=NvmlMode("sim", profile), state_dir=tmp_path / "state",
                        mig_profiles=mig_profiles)
    source = GpuSource(settings, dynamic_mig=dynamic_mig, opener=open_sim_nvml)
    source.open()
    try:
        return source.scan().devices
    finally:
        source.close()


def text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- the simulated NVML ---------------------------------------------------------------------------------

@pytest.mark.parametrize("model", MODELS)
def test_the_simulated_nvml_answers_nvidias_published_profiles(model: str) -> None:
    """Every profile of the model as the guide tables it: name, compute slices, engines, instances, and
    the placements (start, size); nothing the guide does not list."""
    facts = GPUS[model]
    nvml = one_gpu(model=model)
    gpu = nvml.nvmlDeviceGetHandleByIndex(0)
    seen = {}
    for enum in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu, enum)
        except pynvml.NVMLError as exc:
            assert exc.value == pynvml.NVML_ERROR_NOT_SUPPORTED  # profiles this GPU does not offer
            continue
        count = ctypes.c_uint(0)
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(gpu, info.id, None, ctypes.byref(count))
        small = ctypes.c_uint(count.value - 1)
        assert code(nvml.nvmlDeviceGetGpuInstancePossiblePlacements, gpu, info.id,
                    (pynvml.c_nvmlGpuInstancePlacement_t * 8)(), ctypes.byref(small)) == \
            pynvml.NVML_ERROR_INSUFFICIENT_SIZE and small.value == count.value
        out = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(gpu, info.id, out, ctypes.byref(count))
        (size,) = {p.size for p in out}
        seen[text(info.name).removeprefix("MIG ")] = mig_facts.Profile(
            text(info.name).removeprefix("MIG "), size, info.sliceCount, info.decoderCount, info.jpegCount,
            info.ofaCount, info.copyEngineCount, info.instanceCount, tuple(p.start for p in out))
    assert seen == {p.name: p for p in facts.profiles}
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(gpu) == facts.compute_slices
    assert code(nvml.nvmlDeviceGetGpuInstanceProfileInfo, gpu, pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT) == \
        pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_every_simulated_model_has_published_facts() -> None:
    assert set(MIG_TABLES) <= set(GPUS) and set(MACHINES) == set(GPUS)


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
    per_gpu = sum(len(p.starts) for p in GPUS["h100-80gb"].profiles)
    assert per_gpu == 25 and len(published) == len(devices) == gpus * (2 + per_gpu)  # nothing dropped
    assert [("sharedCounters" in o["spec"]) for o in objs[:counter_slices + 1]] == [True] * counter_slices + [False]
    sets = {s["name"]: s["counters"] for o in objs for s in o["spec"].get("sharedCounters", [])}
    assert len(sets) == gpus and all(len(c) <= apirules.MAX_COUNTERS_PER_SET for c in sets.values())
    migs = [d for d in devices if d.kind == "mig"]
    assert {(d.attributes["profile"], d.attributes["placementStart"]) for d in migs if d.name.startswith("gpu-0-")} \
        == {(p.name, s) for p in GPUS["h100-80gb"].profiles for s in p.starts}
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
    # The full GPU and its variant take the whole GPU: `gpu` and all of `memory`, which every placement
    # takes some of (not the memory slices, engines and instances the placements share out).
    variant = next(d for d in devices if d.kind == "vfio" and d.attributes[
        "resource.kubernetes.io/pciBusID"] == parent.attributes["resource.kubernetes.io/pciBusID"])
    assert parent.consumes_counters[0].counters == variant.consumes_counters[0].counters == {
        "gpu": "1", "memory": whole.counters["memory"]}
    assert all(quantity.parse_int(d.consumes_counters[0].counters["memory"]) > 0 for d in migs)
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


# -- the counter model is NVIDIA's ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def forms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Device]]:
    """gpu-0 of a one-GPU machine of each model, in all its forms: whole, passthrough, every placement."""
    out = {}
    for model in MODELS:
        root = tmp_path_factory.mktemp(model)
        path = root / "one.json"
        path.write_text(json.dumps(machine(model)))
        out[model] = scan(root, str(path))
    return out


def where(dev: Device) -> tuple[str, int]:
    found = dev.node.target if isinstance(dev.node, GpuFacts) else None
    assert isinstance(found, MigPlacement)
    return found.profile, found.start


def facts_allow(model: str, devices: list[Device]) -> bool:
    """Whether NVIDIA's facts allow all of `devices` at once: a whole form of the GPU only alone (MIG
    off), MIG devices as GPU instances at their placements."""
    if any(d.kind != "mig" for d in devices):
        return len(devices) == 1
    return mig_facts.fits(GPUS[model], [where(d) for d in devices])


@pytest.mark.parametrize("model", MODELS)
def test_the_published_mig_devices_are_nvidias_profiles_and_placements(model: str, forms) -> None:
    facts = GPUS[model]
    devices = {d.name: d for d in forms[model]}
    migs = [d for d in devices.values() if d.kind == "mig"]
    assert sorted((*where(d), d.attributes["placementSize"]) for d in migs) == sorted(
        (p.name, s, p.memory_slices) for p in facts.profiles for s in p.starts)
    whole = next(d for d in migs if d.attributes["profile"] == facts.whole.name)
    whole_memory = quantity.parse_int(whole.capacity["memory"].value)
    for dev in migs:
        p = facts.profile(str(dev.attributes["profile"]))
        caps = {k: c.value for k, c in dev.capacity.items()}
        assert (caps["copyEngines"], caps["decoders"], caps["jpegEngines"], caps["ofaEngines"]) == (
            str(p.copy_engines), str(p.decoders), str(p.jpegs), str(p.ofas)), dev.name
        # Its memory: what a real GPU of the model gave where one was read, else the profile's fraction of
        # the whole GPU instance's, to 5%.
        if model in mig_facts.MEASURED_MIB:
            assert quantity.parse_int(caps["memory"]) == mig_facts.MEASURED_MIB[model][p.name] * 2**20, dev.name
        else:
            share = quantity.parse_int(caps["memory"]) / whole_memory
            assert abs(share - p.memory_slices / facts.memory_slices) <= 0.05 * p.memory_slices / facts.memory_slices
        [use] = dev.consumes_counters
        assert {k for k in use.counters if k.startswith("memory-slice-")} == {
            counters.memory_slice(i) for i in range(where(dev)[1], where(dev)[1] + p.memory_slices)}
    parent = devices["gpu-0"].consumes_counters[0].counter_set.counters
    assert {k for k in parent if k.startswith("memory-slice-")} == {
        counters.memory_slice(i) for i in range(facts.memory_slices)}


@pytest.mark.parametrize("model", MODELS)
def test_any_two_forms_fit_the_counters_exactly_when_nvidia_allows_both(model: str, forms) -> None:
    devices = forms[model]
    for a in devices:
        for b in devices:
            if a is not b:
                assert fits([a, b]) == facts_allow(model, [a, b]), (a.name, b.name)
    assert all(fits([d]) and facts_allow(model, [d]) for d in devices)


def test_the_guides_side_by_side_instances_fit_the_counters(forms) -> None:
    by_place = {where(d): d for d in forms["a100-40gb"] if d.kind == "mig"}
    for placed in mig_facts.A100_SIDE_BY_SIDE:
        devices = [by_place[p] for p in placed]
        assert mig_facts.fits(GPUS["a100-40gb"], list(placed)) and fits(devices), placed


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_set_fits_the_counters_exactly_when_nvidia_allows_it(forms, data: st.DataObject) -> None:
    model = data.draw(st.sampled_from(MODELS))
    picked = data.draw(st.lists(st.sampled_from(forms[model]), min_size=1, max_size=8, unique_by=lambda d: d.name))
    assert fits(picked) == facts_allow(model, picked)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_every_full_packing_the_counters_allow_nvidia_allows(forms, data: st.DataObject) -> None:
    # Greedy over a random order: large sets that fit, down to a whole GPU's worth of placements.
    model = data.draw(st.sampled_from(MODELS))
    chosen: list[Device] = []
    for dev in data.draw(st.permutations([d for d in forms[model] if d.kind == "mig"])):
        if fits([*chosen, dev]):
            chosen.append(dev)
    assert facts_allow(model, chosen)
    leftovers = [d for d in forms[model] if d not in chosen]
    assert all(not fits([*chosen, d]) and not facts_allow(model, [*chosen, d]) for d in leftovers)


# -- which profiles are published (--mig-profiles) ---------------------------------------------------------

def test_the_default_publishes_the_plainest_profile_of_the_common_sizes(tmp_path: Path) -> None:
    # What a cluster asks for most (1, 2, 3 and 7 compute slices, no media extensions): 13 placements an
    # H100 instead of 25, each a device the scheduler reads for every pod.
    devices = scan(tmp_path, "dgx-h100", mig_profiles=Settings(node_name=NODE).mig_profiles)
    migs = [d for d in devices if d.kind == "mig"]
    assert {d.attributes["profile"] for d in migs} == {"1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"}
    assert len(migs) == 8 * 13 and len([d for d in migs if d.name.startswith("gpu-0-")]) == 13
    assert len(valid_pool(devices)) == 1 + 2  # a counter slice, then 120 devices in two


@pytest.mark.parametrize(("model", "setting", "wanted"), [
    ("a100-40gb", "1g,2g,3g,7g", {"1g.5gb", "2g.10gb", "3g.20gb", "7g.40gb"}),
    ("a30-24gb", "1g,2g,3g,7g", {"1g.6gb", "2g.12gb"}),
    ("a30-24gb", "1g.6gb+me,4g", {"1g.6gb+me", "4g.24gb"}),
    ("h100-80gb", "1g.20gb,1g", {"1g.20gb", "1g.10gb"}),
    ("h100-80gb", "all", {"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"}),
])
def test_an_operator_chooses_the_profiles_by_name_or_compute_size(tmp_path: Path, model: str, setting: str,
                                                                    wanted: set[str]) -> None:
    path = tmp_path / "one.json"
    path.write_text(json.dumps(machine(model)))
    devices = scan(tmp_path, str(path), mig_profiles=setting)
    migs = [d for d in devices if d.kind == "mig"]
    assert {d.attributes["profile"] for d in migs} == wanted
    assert sorted(where(d) for d in migs) == sorted((p.name, s) for p in GPUS[model].profiles if p.name in wanted
                                                    for s in p.starts)


def test_a_gpu_offering_none_of_the_chosen_profiles_is_published_without_mig_counters(tmp_path: Path) -> None:
    devices = scan(tmp_path, "dgx-h100", mig_profiles="1g.5gb")
    assert [d for d in devices if d.kind == "mig"] == []
    assert all(set(d.consumes_counters[0].counter_set.counters) == {"gpu", "memory"} for d in devices)


@pytest.mark.parametrize("setting", ["", "all,1g", "1g,bogus", "1g.10"])
def test_a_bad_choice_stops_the_start(setting: str) -> None:
    with pytest.raises(ConfigError, match="--mig-profiles"):
        Settings(node_name=NODE, mig_profiles=setting)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_choice_of_profiles_fits_the_counters_exactly_when_nvidia_allows_it(tmp_path_factory, data) -> None:
    # A choice may leave an engine counter without a set that needs it (it is left out then), or keep one
    # that binds (an A30's two media profiles): either way the counters allow exactly what NVIDIA allows.
    model = data.draw(st.sampled_from(MODELS))
    names = data.draw(st.lists(st.sampled_from([p.name for p in GPUS[model].profiles]), min_size=1, unique=True))
    root = tmp_path_factory.mktemp("choice")
    path = root / "one.json"
    path.write_text(json.dumps(machine(model)))
    devices = scan(root, str(path), mig_profiles=",".join(names))
    assert {str(d.attributes["profile"]) for d in devices if d.kind == "mig"} == set(names)
    for a in devices:
        for b in devices:
            if a is not b:
                assert fits([a, b]) == facts_allow(model, [a, b]), (a.name, b.name)
    for _ in range(5):
        picked = data.draw(st.lists(st.sampled_from(devices), min_size=1, max_size=8, unique_by=lambda d: d.name))
        assert fits(picked) == facts_allow(model, picked)


# -- the simulated NVML creates what NVIDIA allows ----------------------------------------------------------

def nvml_accepts(model: str, devices: list[Device]) -> bool:
    """Whether the simulated NVML makes all of `devices`, in this order: MIG devices as a GPU instance at
    their placement and its compute instance."""
    nvml = one_gpu(model=model)
    gpu = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceSetMigMode(gpu, pynvml.NVML_DEVICE_MIG_ENABLE)
    for dev in devices:
        found = dev.node.target
        assert isinstance(found, MigPlacement)
        profile = mig.find_profile(nvml, gpu, found.profile)
        assert profile is not None
        try:
            gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, profile.id, placement(found.start, found.size))
        except pynvml.NVMLError as exc:
            assert exc.value == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
            return False
        ci = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[profile.compute_slices]  # NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE
        nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci)
    return True


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_the_simulated_nvml_creates_a_set_in_any_order_exactly_when_nvidia_allows_it(
        forms, data: st.DataObject) -> None:
    model = data.draw(st.sampled_from(MODELS))
    migs = [d for d in forms[model] if d.kind == "mig"]
    picked = data.draw(st.lists(st.sampled_from(migs), min_size=1, max_size=8, unique_by=lambda d: d.name))
    assert nvml_accepts(model, data.draw(st.permutations(picked))) == facts_allow(model, picked)
