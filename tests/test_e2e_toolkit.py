"""A stock CUDA image runs on every GPU form: with the NVIDIA Container Toolkit's CDI spec on the node,
a container given a whole GPU, a MIG device or a share of a GPU gets the toolkit's device (the driver's
libraries: here one file standing in for them) and `CUDA_VISIBLE_DEVICES` naming exactly its device.
Through the prepare engine on the simulated machine (GPU UUIDs of this run's own, so no other spec in
the runtime's CDI directory names them), podman applying the claim's CDI IDs and runc running the
container (tests/runtime.py)."""

from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path

import pytest
import runtime
from agentkit import make_node
from test_toolkit import FORMS, FORMS_UID, gpu_uuids, prepare_forms, toolkit_spec

from agent.names import ClaimRef
from agent.sim.profiles import BUILTIN

pytestmark = pytest.mark.filterwarnings("ignore:Callback with id:RuntimeWarning")


async def test_a_container_of_every_gpu_form_gets_the_driver_libraries_and_only_its_device(tmp_path: Path) -> None:
    runtime.need_runtime()
    vendor = runtime.unique_vendor()
    raw = copy.deepcopy(BUILTIN["dgx-h100"])
    for gpu in raw["gpus"]:
        gpu["uuid"] = f"GPU-{uuid.uuid4()}"
    profile = tmp_path / "machine.json"
    profile.write_text(json.dumps(raw))
    node = await make_node(tmp_path, nvml=f"sim:{profile}", driver_name=vendor, cdi_dir=runtime.CDI_DIR,
                           dynamic_mig=True, gpu_sharing=True)
    library = tmp_path / "libcuda.so.1"
    library.write_text("the driver's CUDA library\n")
    uuids = gpu_uuids(node)
    toolkit = runtime.CDI_DIR / f"nvidia-{vendor}.json"  # not named as the agent's own specs are
    toolkit.write_bytes(toolkit_spec(list(uuids.values()), library))
    node.engine.toolkit.min_interval = 0
    try:
        prepared = await prepare_forms(node)
        parents = {"whole": uuids["gpu-0"], "mig": uuids["gpu-1"], "shared": uuids["gpu-2"]}
        for form, (ids, env) in prepared.items():
            rc, out, err = runtime.run_container(ids, "env && echo --- && cat /usr/lib/libcuda.so.1 && echo --- && "
                                                      "(ls /dev/nvidia-caps 2>/dev/null || true)")
            assert rc == 0, f"{form}: {err}"
            env_text, lib, caps = out.split("---\n")
            seen = dict(line.split("=", 1) for line in env_text.splitlines() if "=" in line)
            assert lib == "the driver's CUDA library\n", form  # the toolkit's device was applied
            assert seen["TOOLKIT_GPU"] == parents[form], form  # the GPU's own (a MIG device's parent's)
            assert seen["CUDA_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"], form
            if form == "mig":
                assert seen["CUDA_VISIBLE_DEVICES"].startswith("MIG-") and len(caps.split()) == 2
            else:
                assert seen["CUDA_VISIBLE_DEVICES"] == parents[form] and caps.split() == []
    finally:
        for form in FORMS:
            uid = FORMS_UID[form]
            await node.engine.unprepare([ClaimRef("default", form, uid)])
        toolkit.unlink(missing_ok=True)
        node.inventory.close()
    assert not list(runtime.CDI_DIR.glob(f"*{vendor}*"))
