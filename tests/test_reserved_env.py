"""A tenant cannot reach past its claim through the environment: the variables the agent sets, those
that select devices and their limits (CUDA_VISIBLE_DEVICES, NVIDIA_*, CUDA_MPS_*, DRA_*), and those that
load code into every process (LD_*, GLIBC_TUNABLES, GCONV_PATH, CUDA_INJECTION*, NVTX_INJECTION*), come
from the agent alone. A claim's or a DeviceClass's configuration naming one is refused at prepare with an
error naming it, and nothing is written; the MPS limits are the one exception, only for a share, and only
ever lower than what the claim's consumed capacity gives, in what the container gets: the official CDI
library applies the claim's devices in any order and the limits never rise."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from agentkit import DRIVER, Node, claim, cpu, make_node, result, write_claim
from test_official_readers import env_of, run_checker

from agent.names import ClaimRef

UID = "7e5e0c1d-0000-4000-8000-000000000001"
SHARE = "0b7e1f3a-0000-4000-8000-0000000000b1"
MPS_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"


@pytest.fixture
async def node(tmp_path: Any) -> Node:
    return await make_node(tmp_path, gpu_sharing=True)


def config(env: dict[str, str], source: str = "FromClaim") -> list[dict[str, Any]]:
    return [{"source": source, "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": f"{DRIVER}/v1alpha1", "kind": "DeviceConfig", "env": env}}}]


def one_gib_share(configs: list[dict[str, Any]]) -> dict[str, Any]:
    return claim("a", UID, [result("gpu-0-shared", "gpu", shareID=SHARE, consumedCapacity={"memory": "1Gi"})],
                 config=configs)


async def prepare(node: Node, obj: dict[str, Any]) -> str:
    write_claim(node.claims_dir, obj)
    return (await node.engine.prepare([ClaimRef("default", "a", UID)]))[UID].error


def written(node: Node) -> list[str]:
    """Whatever the claim left: CDI specs, metadata, its record."""
    found = [p.name for p in node.settings.cdi_dir.glob(f"*{UID}*")]
    found += [p.name for p in node.settings.metadata_dir.glob(f"{UID}*")]
    return found + [u for u in node.engine.records if u == UID]


def spec_env(node: Node) -> list[str]:
    spec = orjson.loads((node.settings.cdi_dir / f"{DRIVER}-claim_{UID}.json").read_bytes())
    return [e for d in spec["devices"] for e in d["containerEdits"]["env"]]


# One of each reserved family, and the ones the repro of the defect set: each would widen what the
# NVIDIA runtime exposes, leave the share or load a library of the tenant's choice.
@pytest.mark.parametrize("name", ["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
                                  "CUDA_MPS_PIPE_DIRECTORY", "LD_PRELOAD", "LD_LIBRARY_PATH", "DRA_GPU_0_UUID",
                                  # what loads a library into every process, beside LD_* (docs/security.md)
                                  "GLIBC_TUNABLES", "GCONV_PATH", "CUDA_INJECTION64_PATH", "CUDA_INJECTION32_PATH",
                                  "NVTX_INJECTION64_PATH", "NVTX_INJECTION32_PATH"])
@pytest.mark.parametrize("source", ["FromClaim", "FromClass"])
async def test_a_reserved_variable_in_any_configuration_is_refused_naming_it(node: Node, name: str,
                                                                             source: str) -> None:
    error = await prepare(node, one_gib_share(config({"OMP_NUM_THREADS": "4", name: "all"}, source)))
    assert f"env: '{name}' is reserved" in error, error
    assert written(node) == []


async def test_a_claims_own_variables_are_kept_beside_the_agents(node: Node) -> None:
    assert await prepare(node, one_gib_share(config({"OMP_NUM_THREADS": "4"}))) == ""
    env = spec_env(node)
    assert "OMP_NUM_THREADS=4" in env and f"{MPS_LIMIT}=0=1024M" in env
    assert sum(e.startswith("CUDA_VISIBLE_DEVICES=GPU-") for e in env) == 1


async def test_a_limit_above_the_share_is_refused(node: Node) -> None:
    # The defect's repro: a 1 GiB share whose claim asked for 999999M got it in its CDI spec.
    error = await prepare(node, one_gib_share(config({MPS_LIMIT: "0=999999M"})))
    assert f"{MPS_LIMIT}=0=999999M is above what the claim's shares give (0=1024M" in error, error
    assert written(node) == []


@pytest.mark.parametrize(("class_limit", "claim_limit", "effective"), [
    ("0=512M", None, "0=512M"),  # the administrator's class pins a lower limit
    (None, "0=256M", "0=256M"),  # the tenant lowers its own
    ("0=512M", "0=768M", "0=512M"),  # the claim's comes later, and still cannot raise the class's
    ("0=512M", "0=256M", "0=256M"),
])
async def test_a_configured_limit_only_ever_lowers_the_shares(node: Node, class_limit: str | None,
                                                              claim_limit: str | None, effective: str) -> None:
    configs = [*(config({MPS_LIMIT: class_limit}, "FromClass") if class_limit else []),
               *(config({MPS_LIMIT: claim_limit}) if claim_limit else [])]
    assert await prepare(node, one_gib_share(configs)) == ""
    assert [e for e in spec_env(node) if e.startswith(f"{MPS_LIMIT}=")] == [f"{MPS_LIMIT}={effective}"]


@pytest.mark.parametrize(("env", "message"), [
    ({MPS_LIMIT: "0=lots"}, "must be '<ordinal>=<size>M|G,...'"),
    ({MPS_LIMIT: "0=1M,0=2M"}, "each ordinal once"),
    ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "150"}, "a whole number from 1 to 100"),
])
async def test_a_malformed_limit_is_refused(node: Node, env: dict[str, str], message: str) -> None:
    error = await prepare(node, one_gib_share(config(env)))
    assert message in error, error
    assert written(node) == []


# -- the MPS limits, as the container gets them -----------------------------------------------------------

MPS_THREADS = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
UID2 = "7e5e0c1d-0000-4000-8000-000000000002"
SHARE2 = "0b7e1f3a-0000-4000-8000-0000000000b2"


def share_result(device: str, request: str, share_id: str, memory: str, compute: str) -> dict[str, Any]:
    return result(device, request, shareID=share_id, consumedCapacity={"memory": memory, "compute": compute})


@pytest.mark.parametrize("requests", [["cpu"], []])
async def test_mps_limits_on_a_device_that_is_not_a_share_are_refused(tmp_path: Path, requests: list[str]) -> None:
    # The defect's repro (issue 38, item 3): a 1 GiB share and a CPU device whose configuration set both
    # limits got them in the CPU device's CDI entry, and the container took them from whichever device
    # came last. Named for the CPU device alone, or for every device of the claim: refused either way.
    node = await make_node(tmp_path, cpus=[cpu()], gpu_sharing=True)
    configs = [{**c, "requests": requests} for c in config({MPS_LIMIT: "0=999999999G", MPS_THREADS: "100"})]
    error = await prepare(node, claim("a", UID, [share_result("gpu-0-shared", "gpu", SHARE, "1Gi", "100m"),
                                                 result("cpu-numa0", "cpu")], config=configs))
    assert f"env: {MPS_THREADS}, {MPS_LIMIT}: the MPS limits are a GPU share's; device cpu-numa0 of request " \
           "'cpu' is a cpu device, not a share" in error, error
    assert written(node) == []


async def test_a_limit_far_above_the_share_is_refused_in_plain_words(node: Node) -> None:
    # Before, the value read back after normalising (0=1023999998976M) broke the format, and the refusal
    # said "...: : CUDA_MPS_PINNED_DEVICE_MEM_LIMIT must be ...".
    error = await prepare(node, one_gib_share(config({MPS_LIMIT: "0=999999999G"})))
    assert error.endswith(f"config[0].opaque.parameters.env: {MPS_LIMIT}=0={999999999 * 1024}M is above what "
                          "the claim's shares give (0=1024M; ordinal 0): a configuration may only lower the MPS "
                          "limits"), error
    assert written(node) == []


async def test_a_shared_gpu_with_admin_access_is_not_a_share(node: Node) -> None:
    # The device as it is, for a monitor: no share, so no limits (before, prepare failed with an internal
    # error looking for the share's memory), and no configuration gives it any.
    assert await prepare(node, claim("a", UID, [result("gpu-0-shared", "gpu", adminAccess=True)])) == ""
    assert [e for e in spec_env(node) if e.startswith(("CUDA_MPS_", "CUDA_VISIBLE_DEVICES="))] == [
        f"CUDA_VISIBLE_DEVICES={node.inventory.get('gpu-0').node.gpu.uuid}"]  # type: ignore[union-attr]
    assert await node.engine.unprepare([ClaimRef("default", "a", UID)]) == {UID: ""}
    error = await prepare(node, claim("a", UID, [result("gpu-0-shared", "gpu", adminAccess=True)],
                                      config=config({MPS_THREADS: "50"})))
    assert "device gpu-0-shared of request 'gpu' is allocated with adminAccess, not a share" in error, error


async def prepared_ids(node: Node, claims: list[dict[str, Any]]) -> list[list[str]]:
    """Each prepared device's CDI IDs, as the kubelet gets them, over all the claims."""
    for obj in claims:
        write_claim(node.claims_dir, obj)
    refs = [ClaimRef("default", c["metadata"]["name"], c["metadata"]["uid"]) for c in claims]
    out = await node.engine.prepare(refs)
    assert all(r.error == "" for r in out.values()), out
    return [list(d.cdi_device_ids) for ref in refs for d in out[ref.uid].devices]


def every_order(tmp_path: Path, checker: Path, node: Node, ids: list[list[str]]) -> dict[str, dict[str, str]]:
    """The environment one container gets from the official CDI library (tests/gocheck) for each order of
    the devices: a runtime applies them one after another, and the last that sets a variable wins."""
    orders = {",".join(map(str, p)): [i for k in p for i in ids[k]] for p in itertools.permutations(range(len(ids)))}
    report = run_checker(checker, tmp_path, [node.settings.cdi_dir], orders, [])
    injected = report["cdi"]["claims"]
    assert all(i["error"] == "" and not i["unresolved"] for i in injected.values()), injected
    return {order: env_of(i["spec"]) for order, i in injected.items()}


async def test_every_order_of_a_claims_devices_gives_the_container_the_lowest_limits(
        tmp_path: Path, checker: Path) -> None:
    # The administrator's class pins request a's share lower; before, only a's CDI device said so, and a
    # container that got b's device after it (the tenant orders the requests) got b's higher values.
    node = await make_node(tmp_path / "node", gpu_sharing=True)
    pinned = [{**c, "requests": ["a"]} for c in config({MPS_LIMIT: "0=512M", MPS_THREADS: "10"}, "FromClass")]
    ids = await prepared_ids(node, [claim("a", UID, [share_result("gpu-0-shared", "a", SHARE, "1Gi", "500m"),
                                                     share_result("gpu-1-shared", "b", SHARE2, "2Gi", "500m")],
                                          config=pinned)])
    envs = every_order(tmp_path, checker, node, ids)
    assert len(envs) == 2
    assert {order: (env[MPS_LIMIT], env[MPS_THREADS]) for order, env in envs.items()} == {
        order: ("0=512M,1=2048M", "10") for order in envs}


async def test_a_container_of_two_claims_never_gets_more_than_the_shares_it_sees(tmp_path: Path,
                                                                                checker: Path) -> None:
    # Claim x: a 1 GiB, 10 % share and a whole GPU; claim y: a 40 GiB, 100 % share of another GPU. Whatever
    # order a container gets their devices in (the 1.37.2 kubelet groups a claim's devices and takes a
    # pod's claims in no fixed order; these are every order), the GPUs its CUDA_VISIBLE_DEVICES names never
    # have a limit above their share. Before, x's whole GPU set x's CUDA_VISIBLE_DEVICES without x's limits:
    # after y's share, the 1 GiB share had y's 40 GiB and 100 %.
    node = await make_node(tmp_path / "node", gpu_sharing=True)
    ids = await prepared_ids(node, [
        claim("x", UID, [share_result("gpu-0-shared", "share", SHARE, "1Gi", "100m"), result("gpu-2", "whole")]),
        claim("y", UID2, [share_result("gpu-1-shared", "share", SHARE2, "40Gi", "1")]),
    ])
    uuid = {name: node.inventory.get(name).node.gpu.uuid for name in ("gpu-0", "gpu-1")}  # type: ignore[union-attr]
    shares = {uuid["gpu-0"]: (1024, 10), uuid["gpu-1"]: (40 << 10, 100)}  # MiB, percent
    envs = every_order(tmp_path, checker, node, ids)
    assert len(envs) == 6
    for order, env in envs.items():
        memory = {int(i): int(mib) for i, mib in re.findall(r"(\d+)=(\d+)M", env[MPS_LIMIT])}
        for ordinal, gpu in enumerate(env["CUDA_VISIBLE_DEVICES"].split(",")):
            if gpu in shares:
                assert memory.get(ordinal, 1 << 40) <= shares[gpu][0], (order, env)
                assert int(env[MPS_THREADS]) <= shares[gpu][1], (order, env)
