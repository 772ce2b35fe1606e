"""GPU partitions and shares end to end (issue 9): a running agent (`dra-agent run --nvml sim`, its
simulated kernel applying mediated-device writes, MIG on the simulated NVML) prepares, over its real
DRA socket, a claim for a MIG placement, one for a vGPU, and two claims sharing one GPU; podman applies
each claim's CDI specs and runc runs a container that reads the claim's metadata file and its
environment: the MIG device's UUID, the mdev's UUID, each share's ID and memory limit. Unprepare leaves
the host as it was: no GPU instance in the simulated hardware's persisted state, MIG mode off, no mdev.
Across claims, the forms of one GPU that cannot coexist are refused over the socket: a share while the
whole GPU is prepared for another claim, a MIG placement while a share of its GPU is prepared."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import runtime
from agentkit import NODE, Quickstart, agent_process, claim, result, roots, write_claim

from agent.claims import metadata
from agent.claims.records import PartitionKind
from agent.claims.store import ClaimStore
from agent.config import Settings
from agent.host.mdev import sysfs as mdev
from agent.kubelet import client as kc
from agent.names import ClaimRef
from agent.sim.migstate import STATE_FILE

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
# dgx-h100: gpu-<minor> at these bus IDs; MIG mode off at start.
BUS = {0: "0000:18:00.0", 2: "0000:3a:00.0", 3: "0000:5d:00.0", 4: "0000:9a:00.0"}
MIG = "gpu-0-mig-1g10gb-4"  # a 1g.10gb GPU instance at memory slice 4 of GPU 0
VGPU, VGPU_TYPE = "gpu-2-vgpu-nvidia-1022-0", "nvidia-1022"
SHARED = "gpu-3-shared"
SHARES = {"a": ("0b7e1f3a-0000-4000-8000-0000000000a1", "4Gi", 4 * GIB),
          "b": ("0b7e1f3a-0000-4000-8000-0000000000a2", "6Gi", 6 * GIB)}


def uid(n: int) -> str:
    return f"7c2e9a00-0000-4000-8000-{n:012x}"


def agent_args(s: Settings) -> list[str]:
    """The daemon on the simulated DGX H100: MIG placements (on by default), every vGPU type (compatibility
    groups keep them apart from MIG), and each GPU's shared form."""
    assert s.offline is not None
    return ["run", "--nvml", "sim", "--node-name", NODE, "--driver-name", s.driver_name, "--offline", str(s.offline),
            "--kubelet-dir", str(s.kubelet_dir), "--cdi-dir", str(s.cdi_dir), "--static-cdi-dir",
            str(s.static_cdi_dir), "--state-dir", str(s.state_dir), "--nic-exclude", "*", "--metrics-address", "",
            "--gpu-sharing", "true", "--compatibility-groups", "true"]


def mig_state(s: Settings) -> list[dict[str, Any]]:
    """Each GPU's MIG mode and instances as the simulated hardware persisted them (what outlives the agent)."""
    gpus: list[dict[str, Any]] = orjson.loads((s.state_dir / "nvml-sim" / STATE_FILE).read_bytes())["gpus"]
    return gpus


def mdevs(s: Settings) -> dict[str, str]:
    """Every mediated device on the simulated machine (uuid -> type)."""
    sysfs = s.state_dir / "nvml-sim" / "sys"
    return {u: t for parent in mdev.parents(sysfs) for u, t in mdev.mdevs_of(sysfs, parent).items()}


@dataclass(frozen=True)
class Seen:
    """What a container with one claim's CDI devices sees."""

    env: dict[str, str]  # its DRA_* and CUDA_* variables
    device: dict[str, Any]  # the one device of the request's metadata file
    nodes: list[str]  # /dev/nvidia-caps/* and /dev/vfio/*


def in_container(ids: list[str], claim_name: str, request: str, driver: str) -> Seen:
    """Run a container with the claim's CDI devices applied (podman + runc) and read what it sees."""
    path = f"{metadata.CONTAINER_ROOT}/resourceclaims/{claim_name}/{request}/{driver}-metadata.json"
    rc, out, err = runtime.run_container(ids, f"env && echo --- && cat {path} && echo --- && "
                                              "(ls -d /dev/nvidia-caps/* /dev/vfio/* 2>/dev/null || true)")
    assert rc == 0, err
    env_text, stream, nodes = out.split("---\n")
    env = dict(line.split("=", 1) for line in env_text.splitlines() if line.startswith(("DRA_", "CUDA_")))
    (req,) = metadata.parse_stream(stream.encode())[0]["requests"]
    (dev,) = req["devices"]
    return Seen(env, dict(dev), sorted(nodes.split()))


def ids_of(entry: Any) -> list[str]:
    return [i for d in entry.devices for i in d.cdi_device_ids]


async def test_mig_vgpu_and_shares_prepared_over_the_dra_socket_and_seen_in_a_container(short_tmp: Path) -> None:
    runtime.need_runtime()
    driver = runtime.unique_vendor()
    s = roots(short_tmp, driver_name=driver, cdi_dir=runtime.CDI_DIR)
    assert s.offline is not None
    claims = s.offline / "resourceclaims"
    refs = {"mig": ClaimRef("default", "mig", uid(1)), "vgpu": ClaimRef("default", "vgpu", uid(2)),
            "a": ClaimRef("default", "share-a", uid(3)), "b": ClaimRef("default", "share-b", uid(4))}
    write_claim(claims, claim("mig", uid(1), [result(MIG, "gpu", driver=driver)]))
    write_claim(claims, claim("vgpu", uid(2), [result(VGPU, "vm", driver=driver)]))
    for key in ("a", "b"):
        share_id, memory, _ = SHARES[key]
        write_claim(claims, claim(refs[key].name, refs[key].uid, [result(
            SHARED, "gpu", driver=driver, shareID=share_id, consumedCapacity={"memory": memory})]))

    with agent_process(agent_args(s), {}, s.registration_socket, ROOT):
        assert all(g["mode"] == 0 and g["gis"] == [] for g in mig_state(s)) and mdevs(s) == {}
        async with kc.DRAClient(s.dra_socket) as client:
            reply = await client.prepare(list(refs.values()), timeout=120)
            try:
                errors = {k: reply.claims[r.uid].error for k, r in refs.items()}
                assert errors == dict.fromkeys(refs, ""), errors
                entries = {k: reply.claims[r.uid] for k, r in refs.items()}

                # MIG: the GPU instance is on the hardware, and the container gets its MIG UUID.
                gpu0 = mig_state(s)[0]
                assert gpu0["mode"] == 1 and [(g["start"], g["cis"]) for g in gpu0["gis"]] == [(4, {"0": 1})]
                record = ClaimStore(s.claims_state_dir).read(uid(1))
                assert record is not None
                (part,) = record[0].partitions
                assert part.kind is PartitionKind.MIG and part.uuid.startswith("MIG-")
                seen = in_container(ids_of(entries["mig"]), "mig", "gpu", driver)
                assert seen.device["name"] == MIG and seen.device["attributes"]["uuid"] == {"string": part.uuid}
                assert seen.env["DRA_GPU_0_MIG_1G10GB_4_UUID"] == part.uuid
                # The access caps of its GPU instance and compute instance.
                assert len(seen.nodes) == 2 and all(n.startswith("/dev/nvidia-caps/nvidia-cap") for n in seen.nodes)

                # vGPU: one mdev of the type on its GPU, named in the metadata as KubeVirt reads it.
                (mdev_uuid,) = mdevs(s)
                assert mdevs(s) == {mdev_uuid: VGPU_TYPE}
                assert mdev.parent_of(s.state_dir / "nvml-sim" / "sys", mdev_uuid) == BUS[2]
                seen = in_container(ids_of(entries["vgpu"]), "vgpu", "vm", driver)
                assert seen.device["name"] == VGPU and seen.device["attributes"]["mdevUUID"] == {"string": mdev_uuid}
                group = mdev.iommu_group(s.state_dir / "nvml-sim" / "sys", mdev_uuid)
                assert seen.nodes == [f"/dev/vfio/{group}", "/dev/vfio/vfio"]

                # Shares: each claim its own share ID and memory limit on the same GPU.
                for key in ("a", "b"):
                    share_id, memory, limit = SHARES[key]
                    assert [d.share_id for d in entries[key].devices] == [share_id]
                    seen = in_container(ids_of(entries[key]), refs[key].name, "gpu", driver)
                    assert seen.device["name"] == SHARED and seen.device["shareID"] == share_id
                    assert seen.device["consumedCapacity"] == {"memory": memory}
                    assert seen.env["DRA_GPU_3_SHARED_MEMORY_LIMIT"] == str(limit)
                    assert seen.env["DRA_GPU_3_SHARED_SHARE_ID"] == share_id
                    assert seen.nodes == []
            finally:
                reply = await client.unprepare(list(refs.values()), timeout=120)
                assert {k: reply.claims[r.uid].error for k, r in refs.items()} == dict.fromkeys(refs, "")
        # The host as it was: no GPU instance, MIG mode back off (the full GPU is free), no mdev.
        assert all(g["mode"] == 0 and g["gis"] == [] for g in mig_state(s)), mig_state(s)
        assert mdevs(s) == {}
        assert not list(s.claims_state_dir.glob("*.rec"))
    assert not list(runtime.CDI_DIR.glob(f"{driver}*"))


async def test_forms_of_one_gpu_that_cannot_coexist_are_refused_across_claims(short_tmp: Path) -> None:
    """No container needed: the kubelet's calls alone. A share of GPU 4 while `gpu-4` is prepared for another
    claim; a MIG placement on GPU 3 while a share of GPU 3 is prepared (and no GPU instance made); a vGPU of
    GPU 3 while a MIG instance of it is prepared (and no mdev made)."""
    s = roots(short_tmp)
    assert s.offline is not None
    claims = s.offline / "resourceclaims"
    whole, share4 = ClaimRef("default", "whole", uid(11)), ClaimRef("default", "share4", uid(12))
    share3, mig3 = ClaimRef("default", "share3", uid(13)), ClaimRef("default", "mig3", uid(14))
    write_claim(claims, claim(whole.name, whole.uid, [result("gpu-4", "gpu")]))
    write_claim(claims, claim(share4.name, share4.uid, [result(
        "gpu-4-shared", "gpu", shareID=SHARES["a"][0], consumedCapacity={"memory": "4Gi"})]))
    write_claim(claims, claim(share3.name, share3.uid, [result(
        SHARED, "gpu", shareID=SHARES["b"][0], consumedCapacity={"memory": "4Gi"})]))
    write_claim(claims, claim(mig3.name, mig3.uid, [result("gpu-3-mig-1g10gb-0", "gpu")]))
    vgpu3 = ClaimRef("default", "vgpu3", uid(15))
    write_claim(claims, claim(vgpu3.name, vgpu3.uid, [result("gpu-3-vgpu-nvidia-1022-0", "vm")]))

    with agent_process(agent_args(s), {}, s.registration_socket, ROOT):
        async with kc.DRAClient(s.dra_socket) as client:
            assert (await client.prepare([whole], timeout=60)).claims[whole.uid].error == ""
            error = (await client.prepare([share4], timeout=60)).claims[share4.uid].error
            assert f"GPU {BUS[4]} is prepared as gpu-4 for claim default/whole" in error, error
            assert (await client.unprepare([whole], timeout=60)).claims[whole.uid].error == ""
            # Once the whole GPU is free, the share goes.
            assert (await client.prepare([share4], timeout=60)).claims[share4.uid].error == ""

            assert (await client.prepare([share3], timeout=60)).claims[share3.uid].error == ""
            error = (await client.prepare([mig3], timeout=60)).claims[mig3.uid].error
            assert f"GPU {BUS[3]} is prepared as {SHARED} for claim default/share3" in error, error
            assert mig_state(s)[3] == {"mode": 0, "gis": []}  # refused before any change
            for ref in (share3, share4):
                assert (await client.unprepare([ref], timeout=60)).claims[ref.uid].error == ""
            assert (await client.prepare([mig3], timeout=60)).claims[mig3.uid].error == ""
            assert [g["start"] for g in mig_state(s)[3]["gis"]] == [0]
            # MIG and vGPU never share a GPU (the driver takes it into one mode or the other).
            error = (await client.prepare([vgpu3], timeout=60)).claims[vgpu3.uid].error
            assert f"GPU {BUS[3]} is prepared as gpu-3-mig-1g10gb-0 for claim default/mig3" in error, error
            assert mdevs(s) == {}
            assert (await client.unprepare([mig3], timeout=60)).claims[mig3.uid].error == ""
        assert all(g["mode"] == 0 and g["gis"] == [] for g in mig_state(s)), mig_state(s)


def test_make_run_prepares_the_mig_example(short_tmp: Path) -> None:
    """README's walk-through with the MIG example: seeded from examples/ as `make run` does (the simulated
    machine's last GPU, the smallest profile at its first placement), prepared with `dra-agent kubelet
    prepare` (MIG mode on, one GPU instance), unprepared (none, MIG mode off)."""
    s = roots(short_tmp, node_name="node-mig")
    quick = Quickstart.seeded(short_tmp, "node-mig")
    cli = quick.cli
    assert "device: gpu-7-mig-1g10gb-0" in quick.example("mig-one")
    with quick.agent():
        prepared = cli("kubelet", "prepare", "default/mig-one")
        assert prepared.returncode == 0, prepared.stderr
        (entry,) = json.loads(prepared.stdout)["claims"].values()
        assert "error" not in entry and [d["device_name"] for d in entry["devices"]] == ["gpu-7-mig-1g10gb-0"]
        gpu7 = mig_state(s)[7]
        assert gpu7["mode"] == 1 and [g["start"] for g in gpu7["gis"]] == [0]
        assert "default/mig-one" in cli("claims").stdout
        unprepared = cli("kubelet", "unprepare", "default/mig-one")
        assert unprepared.returncode == 0, unprepared.stderr
        assert mig_state(s)[7] == {"mode": 0, "gis": []}
