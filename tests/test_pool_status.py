"""`dra-agent pool status`, the node's own view: which devices are free given the claims prepared here and
the taints held, and what the command says and exits with where there is no cluster to ask (the cluster's
view is tested against the real control plane, tests/cluster/test_cluster_gated_fields.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from agentkit import claim, make_node, result, write_claim

from agent.app import cli, poolstatus
from agent.config import build_settings
from agent.inventory.gpus import GpuSource
from agent.names import ClaimRef
from agent.sim.nvmlopen import open_sim_nvml
from agent.sim.profiles import BUILTIN

UID = "3d2c1b0a-0000-4000-8000-000000000001"


def two_gpus(tmp: Path) -> str:
    profile = dict(BUILTIN["dgx-h100"])
    profile["gpus"] = profile["gpus"][:2]
    path = tmp / "two-gpus.json"
    path.write_text(json.dumps(profile))
    return f"sim:{path}"


def test_a_prepared_form_of_a_gpu_leaves_the_forms_that_go_with_it_free(tmp_path: Path) -> None:
    s = build_settings({"node_name": "n", "nvml": two_gpus(tmp_path), "state_dir": tmp_path / "state",
                        "gpu_sharing": True, "vgpu_types": "auto", "compatibility_groups": True})
    source = GpuSource(s, opener=open_sim_nvml)
    source.open()
    try:
        devices = source.scan().devices
    finally:
        source.close()
    names = {d.name for d in devices}
    free = set(poolstatus.free_devices(devices, {"gpu-0-mig-1g10gb-0"}, set()))
    gpu0 = {d.name for d in devices if d.gpu_function == "0000:18:00.0"}
    assert {"gpu-0", "gpu-0-shared", "gpu-0000-18-00-0-vfio", "gpu-0-mig-1g10gb-0"} <= gpu0
    # The other GPU is untouched; on GPU 0 the other MIG placements stay (the counters say which fit),
    # the whole GPU, its passthrough variant, its shared form and its vGPUs do not.
    assert names - gpu0 <= free
    assert {n for n in gpu0 & free} == {n for n in gpu0 if "-mig-" in n} - {"gpu-0-mig-1g10gb-0"}
    # A shared GPU held by one claim is still free for more shares, and keeps its GPU's MIG placements out.
    free = set(poolstatus.free_devices(devices, {"gpu-1-shared"}, set()))
    assert "gpu-1-shared" in free and not {n for n in free if n.startswith("gpu-1-mig")} and "gpu-1" not in free
    assert "gpu-0" in free
    # A tainted device is not free.
    assert "gpu-1" not in poolstatus.free_devices(devices, set(), {"gpu-1"})


async def test_without_a_cluster_the_node_view_is_shown_and_the_status_is_1(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    node = await make_node(tmp_path)
    write_claim(node.claims_dir, claim("gpu-one", UID, [result("gpu-3", "gpu")]))
    assert (await node.engine.prepare([ClaimRef("default", "gpu-one", UID)]))[UID].error == ""
    s = node.settings
    args = ["pool", "status", "-o", "json", "--nvml=sim", f"--state-dir={s.state_dir}", f"--offline={s.offline}",
            f"--node-name={s.node_name}", "--nic-exclude=*"]
    # (The CLI runs its own event loop: in a thread of its own here.)
    assert await asyncio.to_thread(cli.main, args) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["cluster"] is None and out["clusterError"].startswith("offline")
    assert out["node"]["prepared"] == [{"claim": "default/gpu-one", "devices": ["gpu-3"]}]
    assert "gpu-3" not in out["node"]["free"] and "gpu-2" in out["node"]["free"]
    assert "gpu-3-mig-1g10gb-0" not in out["node"]["free"]  # a MIG placement of the prepared GPU
    assert await asyncio.to_thread(cli.main, args[:2] + args[4:]) == 1
    text = capsys.readouterr().out
    assert "no cluster view: offline" in text and "default/gpu-one" in text and "1 prepared (1 claims)" in text
