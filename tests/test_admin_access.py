"""Admin access (an allocation result with `adminAccess: true`, resource.k8s.io/v1): a monitoring claim gets a
device as it is, beside the claims that hold it, through the engine on the simulated DGX H100 with its
kernel emulator: no exclusivity check against the device's other forms (its passthrough variant bound to
vfio-pci, its MIG devices), none made against it for a later claim, and nothing reconfigured (no vfio-pci
binding, no MIG instance); a VfioConfig for such a result is refused by name."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from agentkit import Node, claim, make_node, result, write_claim

from agent.claims.allocation import config_api_version
from agent.claims.records import PreparedDevice
from agent.host.vfio.pci import current_driver
from agent.names import ClaimRef
from agent.sim.kernel.emulator import KernelEmulator
from agent.sim.kernel.tree import SimTree
from agent.sim.migstate import STATE_FILE
from agent.sim.profiles import load_profile

pytestmark = pytest.mark.filterwarnings("ignore:Callback with id:RuntimeWarning")

GPU_BUS = "0000:18:00.0"  # gpu-0 of dgx-h100
GPU_VARIANT = "gpu-0000-18-00-0-vfio"
MIG = "gpu-0-mig-1g10gb-4"
HOLDER = "ad000000-0000-4000-8000-000000000001"
MONITOR = "ad000000-0000-4000-8000-000000000002"
DRIVER = "dra.example.com"


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    node = await make_node(tmp_path, dynamic_mig=True)
    with KernelEmulator(load_profile("dgx-h100"), node.settings.state_dir / "nvml-sim"):
        yield node


def driver_of(node: Node, bdf: str) -> str | None:
    return current_driver(SimTree(node.settings.state_dir / "nvml-sim").sys, bdf)


def mig_state(node: Node) -> dict[str, Any]:
    """GPU 0's MIG mode and GPU instances in the simulated machine's state (kept under the GPU's UUID)."""
    data: dict[str, Any] = orjson.loads((node.settings.state_dir / "nvml-sim" / STATE_FILE).read_bytes())
    return {k: v for k, v in data["gpus"][0].items() if k != "uuid"}


async def prepare(node: Node, name: str, uid: str, device: str, *, admin: bool = False,
                  config: list[dict[str, Any]] | None = None) -> str:
    extra = {"adminAccess": True} if admin else {}
    write_claim(node.claims_dir, claim(name, uid, [result(device, "r", **extra)], config=config or []))
    (res,) = (await node.engine.prepare([ClaimRef("default", name, uid)])).values()
    return str(res.error)


async def unprepare(node: Node, name: str, uid: str) -> str:
    (err,) = (await node.engine.unprepare([ClaimRef("default", name, uid)])).values()
    return str(err)


async def test_a_gpu_passed_through_to_a_vm_is_given_to_a_monitor_as_it_is(node: Node) -> None:
    assert await prepare(node, "vm", HOLDER, GPU_VARIANT) == ""
    assert driver_of(node, GPU_BUS) == "vfio-pci"
    # Its native form, which the VM claim's binding excludes for any other claim, with admin access.
    assert await prepare(node, "monitor", MONITOR, "gpu-0", admin=True) == ""
    record = node.engine.whole_record(MONITOR)
    assert record is not None and record.bindings == [] and record.partitions == []
    assert [(d.device, d.admin_access) for d in record.devices] == [("gpu-0", True)]
    spec = json.loads((node.settings.cdi_dir / f"{DRIVER}-claim_{MONITOR}.json").read_text())
    assert "/dev/nvidia0" in [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert driver_of(node, GPU_BUS) == "vfio-pci"  # untouched
    assert await unprepare(node, "monitor", MONITOR) == ""
    assert driver_of(node, GPU_BUS) == "vfio-pci"
    assert await unprepare(node, "vm", HOLDER) == ""
    assert driver_of(node, GPU_BUS) == "nvidia"


async def test_a_monitored_gpu_can_still_be_passed_through(node: Node) -> None:
    """The scheduler allocates around admin access as if it held nothing; so does prepare."""
    assert await prepare(node, "monitor", MONITOR, "gpu-0", admin=True) == ""
    assert await prepare(node, "vm", HOLDER, GPU_VARIANT) == ""
    assert driver_of(node, GPU_BUS) == "vfio-pci"
    assert await unprepare(node, "vm", HOLDER) == "" and await unprepare(node, "monitor", MONITOR) == ""
    assert driver_of(node, GPU_BUS) == "nvidia"


async def test_a_mig_device_under_admin_access_is_not_made(node: Node) -> None:
    assert await prepare(node, "whole", HOLDER, "gpu-0") == ""
    assert await prepare(node, "monitor", MONITOR, MIG, admin=True) == ""  # no clash with the whole GPU
    assert mig_state(node) == {"mode": 0, "gis": []}  # no MIG mode, no GPU instance
    record = node.engine.whole_record(MONITOR)
    assert record is not None and record.partitions == []
    assert await unprepare(node, "monitor", MONITOR) == "" and await unprepare(node, "whole", HOLDER) == ""
    # And a MIG device prepared for a claim does not stop a monitor of the whole GPU.
    assert await prepare(node, "mig", HOLDER, MIG) == "" and len(mig_state(node)["gis"]) == 1
    assert await prepare(node, "monitor", MONITOR, "gpu-0", admin=True) == ""
    assert await unprepare(node, "monitor", MONITOR) == "" and len(mig_state(node)["gis"]) == 1


async def test_a_passthrough_device_under_admin_access_is_not_bound(node: Node) -> None:
    assert await prepare(node, "monitor", MONITOR, GPU_VARIANT, admin=True) == ""
    assert driver_of(node, GPU_BUS) == "nvidia"
    record = node.engine.whole_record(MONITOR)
    assert record is not None and record.bindings == []
    assert await unprepare(node, "monitor", MONITOR) == ""
    vfio = {"opaque": {"driver": DRIVER, "parameters": {"apiVersion": config_api_version(DRIVER),
                                                         "kind": "VfioConfig", "iommu": "legacy"}}}
    error = await prepare(node, "monitor", MONITOR, GPU_VARIANT, admin=True, config=[vfio])
    assert "status.allocation.devices.config[0].opaque.parameters: a VfioConfig configures" in error, error
    assert "allocated with adminAccess" in error and node.engine.whole_record(MONITOR) is None


def test_admin_access_is_kept_in_the_record_and_read_back() -> None:
    dev = PreparedDevice("r", "node", "gpu-0", ("a=b",), admin_access=True)
    assert dev.to_json()["adminAccess"] is True
    assert PreparedDevice.from_json(dev.to_json()) == dev
    plain = PreparedDevice("r", "node", "gpu-0", ("a=b",))
    assert "adminAccess" not in plain.to_json() and PreparedDevice.from_json(plain.to_json()) == plain
