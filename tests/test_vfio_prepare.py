"""Prepare of passthrough (VFIO) devices. They are published (with counters that keep the
scheduler from handing out both forms of a function), but binding to vfio-pci is not wired into
prepare yet: a claim for one gets a precise error and leaves nothing behind, never a "prepared"
device still bound to its host driver."""

from __future__ import annotations

from agentkit import claim, make_node, result, write_claim, written_files

from agent.names import ClaimRef

UID = "2f1a0000-0000-4000-8000-000000000001"


async def test_a_passthrough_device_is_refused_and_leaves_nothing(tmp_path) -> None:
    node = await make_node(tmp_path)
    variant = next(d for d in node.inventory.devices() if d.kind == "vfio" and d.attributes.get("nativeType") == "gpu")
    before = written_files(node.settings)
    write_claim(node.claims_dir, claim("vm-gpu", UID, [result(variant.name, "gpu")]))
    (res,) = (await node.engine.prepare([ClaimRef("default", "vm-gpu", UID)])).values()
    assert "passthrough (VFIO)" in res.error and variant.name in res.error and "not built" in res.error
    assert res.devices == []
    assert written_files(node.settings) == before
    assert UID not in node.engine.records
