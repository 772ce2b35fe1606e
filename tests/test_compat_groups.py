"""Compatibility groups (KEP-5963, `DRADeviceCompatibilityGroups`): set by device kind at slice building
only when the setting says the cluster has the gate on (MIG placements `mig`, vGPU devices `vgpu`, the
whole-GPU forms none); valid under the 1.37 schema and the API rules; and dropped by the API emulator
while the gate is off, as the API server does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import kubernetes_validate
import pytest
from kubeapi import RESOURCE_SLICES, KubeApi
from kubeapi_rules import COMPATIBILITY_GROUPS_GATE

from agent import apirules, counters
from agent.config import NvmlMode, Settings
from agent.inventory.gpus import GpuSource
from agent.kinds import Kind
from agent.model import CounterConsumption, Device
from agent.publish.slices import build_slices
from agent.sim.nvmlopen import open_sim_nvml

DRIVER = "dra.example.com"
NODE = "node-a"


def scan(tmp_path: Path, profile: str, *, sharing: bool = True, node_allocatable: bool = True) -> list[Device]:
    source = GpuSource(Settings(node_name=NODE, nvml=NvmlMode("sim", profile), state_dir=tmp_path / "state"),
                       dynamic_mig=True, sharing=sharing, opener=open_sim_nvml)
    source.node_allocatable = node_allocatable
    source.open()
    try:
        return source.scan().devices
    finally:
        source.close()


def published(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for o in objs for d in o["spec"].get("devices") or []}


def groups_of(dev: dict[str, Any]) -> set[tuple[str, ...]]:
    return {tuple(c.get("compatibilityGroups") or ()) for c in dev.get("consumesCounters") or []}


def assert_valid(objs: list[dict[str, Any]]) -> None:
    for obj in objs:
        kubernetes_validate.validate(obj, "1.37.0", strict=True)
    assert apirules.pool_errors(objs) == []


@pytest.mark.parametrize("profile", ["dgx-h100", "hgx-16"])
def test_groups_by_kind_only_with_the_setting(tmp_path: Path, profile: str) -> None:
    devices = scan(tmp_path, profile)
    kinds = {d.name: d.kind for d in devices}
    assert {"gpu", "vfio", "mig", "gpushare"} <= set(kinds.values())
    with_groups = build_slices(devices, driver=DRIVER, node=NODE, compatibility_groups=True)
    without = build_slices(devices, driver=DRIVER, node=NODE)
    assert_valid(with_groups)
    assert_valid(without)
    on, off = published(with_groups), published(without)
    assert set(on) == set(off) == set(kinds)  # nothing dropped either way
    for name, dev in on.items():
        want = {"mig": {("mig",)}}.get(kinds[name], {()})
        assert groups_of(dev) == want, name
        assert groups_of(off[name]) == {()}, name
        # Everything but the groups is the same.
        bare = [{k: v for k, v in c.items() if k != "compatibilityGroups"} for c in dev["consumesCounters"]]
        assert bare == off[name]["consumesCounters"]


def test_vgpu_devices_are_in_their_own_group() -> None:
    cs = counters.gpu_counter_set("0000:18:00.0", 80 << 30)
    vgpu = Device(name="gpu-0-vgpu-a", kind=Kind.VGPU, consumes_counters=(CounterConsumption(cs, {"memory": "8Gi"}),))
    full = Device(name="gpu-0", kind=Kind.GPU, consumes_counters=(CounterConsumption.all_of(cs),))
    assert counters.with_compatibility_groups(vgpu).consumes_counters[0].compatibility_groups == ("vgpu",)
    assert counters.with_compatibility_groups(full) is full
    objs = build_slices([vgpu, full], driver=DRIVER, node=NODE, compatibility_groups=True)
    assert_valid(objs)
    assert groups_of(published(objs)["gpu-0-vgpu-a"]) == {("vgpu",)}


@pytest.mark.parametrize("groups, expect", [
    (["mig"], None),
    ([], None),
    (["a", "b", "c"], "more than 2"),
    (["mig", "mig"], "unique"),
    ("mig", "must be a list"),
    (["Mig_1"], "DNS label"),
    ([7], "must be a string"),
])
def test_the_rules_check_the_groups(groups: Any, expect: str | None) -> None:
    consumption = {"counterSet": "gpu-0000-18-00-0-counters", "counters": {"gpu": {"value": "1"}},
                   "compatibilityGroups": groups}
    errs = apirules.consumption_errors(consumption)
    if expect is None:
        assert errs == []
    else:
        assert any(expect in e for e in errs), errs


def test_a_device_with_bad_groups_is_not_published() -> None:
    cs = counters.gpu_counter_set("0000:18:00.0", None)
    bad = CounterConsumption(cs, {"gpu": "1"}, compatibility_groups=("a", "b", "c"))
    objs = build_slices([Device(name="gpu-0", kind=Kind.GPU, consumes_counters=(bad,))], driver=DRIVER, node=NODE)
    assert published(objs) == {}


async def _post(api: KubeApi, obj: dict[str, Any]) -> dict[str, Any]:
    url = f"{api.url}/apis/resource.k8s.io/v1/resourceslices"
    async with aiohttp.ClientSession() as session, session.post(url, json=obj) as resp:
        assert resp.status == 201, await resp.text()
        return dict(await resp.json())


async def _put(api: KubeApi, obj: dict[str, Any]) -> dict[str, Any]:
    url = f"{api.url}/apis/resource.k8s.io/v1/resourceslices/{obj['metadata']['name']}"
    async with aiohttp.ClientSession() as session, session.put(url, json=obj) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())


def _grouped_slices() -> list[dict[str, Any]]:
    cs = counters.gpu_counter_set("0000:18:00.0", 80 << 30)
    mig = Device(name="gpu-0-mig-1g10gb-0", kind=Kind.MIG,
                 consumes_counters=(CounterConsumption(cs, {"memory": "10Gi"}),))
    objs = build_slices([mig], driver=DRIVER, node=NODE, compatibility_groups=True)
    for i, obj in enumerate(objs):
        obj["metadata"]["name"] = f"slice-{i}"
    return objs


async def test_the_emulator_drops_groups_while_the_gate_is_off(kube_api: KubeApi) -> None:
    counter_slice, device_slice = _grouped_slices()
    await _post(kube_api, counter_slice)
    stored = await _post(kube_api, device_slice)
    assert groups_of(stored["spec"]["devices"][0]) == {()}
    # An update keeps the field only when the stored object already had it: here it did not.
    stored["spec"]["devices"][0]["consumesCounters"][0]["compatibilityGroups"] = ["mig"]
    again = await _put(kube_api, stored)
    assert groups_of(again["spec"]["devices"][0]) == {()}
    assert groups_of(kube_api.get(RESOURCE_SLICES, "slice-1")["spec"]["devices"][0]) == {()}


async def test_the_emulator_keeps_groups_with_the_gate_on(kube_api: KubeApi) -> None:
    kube_api.emulator.gates.add(COMPATIBILITY_GROUPS_GATE)
    counter_slice, device_slice = _grouped_slices()
    await _post(kube_api, counter_slice)
    stored = await _post(kube_api, device_slice)
    assert groups_of(stored["spec"]["devices"][0]) == {("mig",)}
    # Turned off later: an object that already has the field keeps it on update (version skew).
    kube_api.emulator.gates.clear()
    again = await _put(kube_api, stored)
    assert groups_of(again["spec"]["devices"][0]) == {("mig",)}
