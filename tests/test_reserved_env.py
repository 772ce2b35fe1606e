"""A tenant cannot reach past its claim through the environment: the variables the agent sets, and those
that select devices, their limits or the dynamic loader (CUDA_VISIBLE_DEVICES, NVIDIA_*, CUDA_MPS_*,
LD_*, DRA_*), come from the agent alone. A claim's or a DeviceClass's configuration naming one is
refused at prepare with an error naming it, and nothing is written; the MPS limits are the one
exception, and only ever lower than what the claim's consumed capacity gives."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from agentkit import DRIVER, Node, claim, make_node, result, write_claim

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
                                  "CUDA_MPS_PIPE_DIRECTORY", "LD_PRELOAD", "LD_LIBRARY_PATH", "DRA_GPU_0_UUID"])
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
