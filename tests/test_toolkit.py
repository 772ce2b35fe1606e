"""The NVIDIA toolkit's CDI specs, read from directories other software writes to: a broken
file there is skipped with one warning per version of it, never a failed prepare (issue 6,
item 8). Through the real prepare engine, with simulated GPUs."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import orjson
import pytest
from agentkit import DRIVER, Node, claim, make_node, result, write_claim

from agent.claims import toolkit
from agent.claims.toolkit import ToolkitSpecs
from agent.names import ClaimRef

UIDS = [f"7d1e0c4a-0000-4000-8000-{i:012d}" for i in range(1, 6)]

BAD_SPECS: dict[str, tuple[bytes, str]] = {
    # file name: (content, the problem the warning names)
    "devices-number.json": (b'{"cdiVersion":"0.5.0","kind":"nvidia.com/gpu","devices":5}',
                            "devices must be a list, not int"),
    "devices-object.yaml": (b"cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: {GPU-x: {}}\n",
                            "devices must be a list, not object"),
    "name-number.yaml": (b"cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: [{name: 4}]\n",
                         "devices[0].name must be a string, not int"),
    "name-missing.json": (b'{"kind":"nvidia.com/gpu","devices":[{"name":"0"},{"containerEdits":{}}]}',
                          "devices[1].name must be a string, not null"),
    "device-string.yaml": (b"kind: nvidia.com/gpu\ndevices: [GPU-x]\n",
                           "devices[0] must be an object, not str"),
    "list.yaml": (b"- kind: nvidia.com/gpu\n", "the document must be an object, not list"),
    "empty.yaml": (b"", "the document must be an object, not null"),
    "not-utf8.yaml": (b"kind: nvidia.com/gpu\ndevices: [{name: \"\xff\xfe\"}]\n", "not valid YAML"),
    "not-utf8.json": (b'{"kind":"nvidia.com/gpu","devices":[{"name":"\xff"}]}', "not valid JSON"),
    "broken.json": (b'{"kind": "nvidia.com/gpu", "devices": [', "not valid JSON"),
    "deep.yaml": (b"[" * 5000, "not valid YAML"),
}


def good_spec(uuid: str) -> bytes:
    return orjson.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [
        {"name": uuid, "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}]})


async def gpu_node(tmp_path: Path) -> Node:
    node = await make_node(tmp_path)
    for d in (node.settings.static_cdi_dir, node.settings.cdi_dir):
        d.mkdir(parents=True, exist_ok=True)
    # Re-read the directories on every prepare, so that "warned once" is not just "read once".
    node.engine.toolkit.min_interval = 0
    return node


async def prepare_gpu(node: Node, n: int, device: str = "gpu-0") -> list[str]:
    """Prepare a fresh claim for one GPU; its CDI IDs (the prepare must succeed)."""
    name = f"c{n}"
    write_claim(node.claims_dir, claim(name, UIDS[n], [result(device, "gpu")]))
    res = (await node.engine.prepare([ClaimRef("default", name, UIDS[n])]))[UIDS[n]]
    assert res.error == "", res.error
    return list(res.devices[0].cdi_device_ids)


def warnings_about(caplog: pytest.LogCaptureFixture, path: Path) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == toolkit.__name__ and r.levelno == logging.WARNING and str(path) in r.getMessage()]


@pytest.mark.parametrize("where", ["static", "dynamic"])
@pytest.mark.parametrize("filename", sorted(BAD_SPECS))
async def test_a_broken_spec_is_skipped_with_one_warning_and_the_good_one_is_used(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, filename: str, where: str) -> None:
    caplog.set_level(logging.WARNING, logger=toolkit.__name__)
    node = await gpu_node(tmp_path)
    content, problem = BAD_SPECS[filename]
    bad_dir, good_dir = node.settings.static_cdi_dir, node.settings.cdi_dir
    if where == "dynamic":
        bad_dir, good_dir = good_dir, bad_dir
    bad = bad_dir / filename
    bad.write_bytes(content)
    uuid = node.inventory.get("gpu-0").node.gpu.uuid
    (good_dir / "nvidia-toolkit.json").write_bytes(good_spec(uuid))

    assert f"nvidia.com/gpu={uuid}" in await prepare_gpu(node, 0)
    assert f"nvidia.com/gpu={uuid}" in await prepare_gpu(node, 1)  # directories re-read, file not
    (warning,) = warnings_about(caplog, bad)
    assert problem in warning, warning

    # A new version of the file (another size) is read again, and warned about again.
    bad.write_bytes(content + b" ")
    os.utime(bad.parent)  # in case the rewrite kept the directory's mtime
    assert f"nvidia.com/gpu={uuid}" in await prepare_gpu(node, 2)
    assert len(warnings_about(caplog, bad)) == 2


async def test_a_broken_spec_alone_only_loses_the_toolkit_id(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=toolkit.__name__)
    node = await gpu_node(tmp_path)
    bad = node.settings.static_cdi_dir / "nvidia.json"
    bad.write_bytes(BAD_SPECS["devices-number.json"][0])
    assert await prepare_gpu(node, 0) == [f"{DRIVER}/claim={UIDS[0]}-gpu-0", f"{DRIVER}/metadata={UIDS[0]}_gpu"]
    assert len(warnings_about(caplog, bad)) == 1


async def test_a_spec_fixed_in_place_is_used_again(tmp_path: Path) -> None:
    node = await gpu_node(tmp_path)
    spec = node.settings.static_cdi_dir / "nvidia.json"
    spec.write_bytes(BAD_SPECS["devices-number.json"][0])
    uuid = node.inventory.get("gpu-0").node.gpu.uuid
    assert not any(i.startswith("nvidia.com/gpu=") for i in await prepare_gpu(node, 0))
    spec.write_bytes(good_spec(uuid))
    assert f"nvidia.com/gpu={uuid}" in await prepare_gpu(node, 1)


@pytest.mark.parametrize("kind", ["directory", "dangling link", "fifo", "unreadable"])
async def test_what_is_not_a_readable_file_is_skipped_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    caplog.set_level(logging.WARNING, logger=toolkit.__name__)
    node = await gpu_node(tmp_path)
    static = node.settings.static_cdi_dir
    odd = static / "x.json"
    if kind == "directory":
        odd.mkdir()
        problem = "is a directory"
    elif kind == "dangling link":
        odd.symlink_to(tmp_path / "nowhere.json")
        problem = "cannot stat"
    elif kind == "fifo":
        os.mkfifo(odd)  # opened without O_NONBLOCK, this would hang the prepare
        problem = "not a regular file"
    else:
        odd.write_bytes(good_spec("GPU-x"))
        real_open = os.open

        # Tests run as root, which reads a mode-000 file: refuse the open as a permission check would.
        def refusing_open(path: str | os.PathLike[str], flags: int, *args: int, **kw: int) -> int:
            if os.fspath(path) == str(odd):
                raise PermissionError(13, "Permission denied", str(odd))
            return real_open(path, flags, *args, **kw)

        monkeypatch.setattr(toolkit.os, "open", refusing_open)
        problem = "cannot open it: Permission denied"
    uuid = node.inventory.get("gpu-1").node.gpu.uuid
    (static / "nvidia.yaml").write_bytes(good_spec(uuid))
    assert f"nvidia.com/gpu={uuid}" in await prepare_gpu(node, 0, "gpu-1")
    assert f"nvidia.com/gpu={uuid}" in await prepare_gpu(node, 1, "gpu-1")
    (warning,) = warnings_about(caplog, odd)
    assert problem in warning, warning


def test_specs_of_other_kinds_are_not_checked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Another vendor's spec is its runtime's business: only its being a readable object matters here.
    (tmp_path / "other.yaml").write_text("kind: example.com/fpga\ndevices: 5\n")
    (tmp_path / "nvidia.yaml").write_text("kind: nvidia.com/gpu\ndevices: [{name: '3'}]\n")
    specs = ToolkitSpecs([tmp_path], min_interval=0)
    assert specs.device_id("GPU-none", 3) == "nvidia.com/gpu=3"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_our_own_specs_are_never_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / f"{DRIVER}-claim_x.json").write_text("not json")
    specs = ToolkitSpecs([tmp_path], skip_prefixes=(DRIVER,), min_interval=0)
    assert specs.device_id("GPU-x", 0) is None
    assert not caplog.records


def test_a_spec_written_just_after_the_start_is_seen_by_the_first_lookup(tmp_path: Path) -> None:
    # The daemon reads the specs at start (`warm`), so the first prepare need not list a directory of
    # thousands of claim specs; a spec the toolkit writes a moment later (the GPU Operator installing it
    # after the agent) is still seen by that first prepare, not only after the lookups' interval.
    specs = ToolkitSpecs([tmp_path], min_interval=3600)
    specs.warm()
    (tmp_path / "nvidia.yaml").write_text("kind: nvidia.com/gpu\ndevices: [{name: '3'}]\n")
    assert specs.device_id("GPU-none", 3) == "nvidia.com/gpu=3"


# -- every GPU form gets the toolkit's device -----------------------------------------------------

FORMS_UID = {"whole": "7d1e0c4a-0000-4000-8000-0000000000f1", "mig": "7d1e0c4a-0000-4000-8000-0000000000f2",
             "shared": "7d1e0c4a-0000-4000-8000-0000000000f3"}
FORMS: dict[str, tuple[str, dict[str, object]]] = {
    "whole": ("gpu-0", {}), "mig": ("gpu-1-mig-1g10gb-0", {}),
    "shared": ("gpu-2-shared", {"shareID": "3f1c0000-0000-4000-8000-000000000001",
                                "consumedCapacity": {"memory": "4Gi"}})}


def toolkit_spec(uuids: list[str], library: Path | None = None) -> bytes:
    """A toolkit spec as `nvidia-ctk cdi generate --device-name-strategy=uuid` shapes it: a device per GPU,
    and common edits that bring the driver's libraries (here one file standing in for them)."""
    spec: dict[str, object] = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [
        {"name": u, "containerEdits": {"env": [f"TOOLKIT_GPU={u}"]}} for u in uuids]}
    if library is not None:
        spec["containerEdits"] = {"mounts": [{"hostPath": str(library), "containerPath": "/usr/lib/libcuda.so.1",
                                              "options": ["ro", "nosuid", "nodev", "bind"]}]}
    return orjson.dumps(spec)


async def prepare_forms(node: Node) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each form's claim prepared: its CDI IDs, and its GPU device's variables in the claim's spec."""
    out = {}
    for form, (device, extra) in FORMS.items():
        uid = FORMS_UID[form]
        write_claim(node.claims_dir, claim(form, uid, [result(device, "gpu", driver=node.settings.driver_name,
                                                              **extra)]))
        prepared = (await node.engine.prepare([ClaimRef("default", form, uid)]))[uid]
        assert prepared.error == "", prepared.error
        spec = orjson.loads((node.settings.cdi_dir / f"{node.settings.cdi_vendor}-claim_{uid}.json").read_bytes())
        (dev,) = spec["devices"]
        env = dict(e.split("=", 1) for e in dev["containerEdits"]["env"])
        out[form] = (list(prepared.devices[0].cdi_device_ids), env)
    return out


def gpu_uuids(node: Node) -> dict[str, str]:
    return {name: dev.gpu.uuid for name in ("gpu-0", "gpu-1", "gpu-2")
            if (dev := node.inventory.get(name)) is not None and dev.gpu is not None}


async def test_every_gpu_form_gets_the_toolkit_device_and_names_exactly_its_device(tmp_path: Path) -> None:
    node = await make_node(tmp_path, dynamic_mig=True, gpu_sharing=True)
    uuids = gpu_uuids(node)
    node.settings.static_cdi_dir.mkdir(parents=True, exist_ok=True)
    (node.settings.static_cdi_dir / "nvidia.json").write_bytes(toolkit_spec(list(uuids.values())))
    node.engine.toolkit.min_interval = 0
    prepared = await prepare_forms(node)
    ids, env = prepared["whole"]
    assert f"nvidia.com/gpu={uuids['gpu-0']}" in ids and env["CUDA_VISIBLE_DEVICES"] == uuids["gpu-0"]
    # A MIG device: its parent GPU's toolkit device (the libraries), and CUDA told its MIG device.
    ids, env = prepared["mig"]
    mig_uuid = env["DRA_GPU_1_MIG_1G10GB_0_UUID"]
    assert f"nvidia.com/gpu={uuids['gpu-1']}" in ids and env["CUDA_VISIBLE_DEVICES"] == mig_uuid
    assert mig_uuid.startswith("MIG-")
    ids, env = prepared["shared"]
    assert f"nvidia.com/gpu={uuids['gpu-2']}" in ids and env["CUDA_VISIBLE_DEVICES"] == uuids["gpu-2"]
    # The MPS limit is keyed by the device's ordinal in CUDA_VISIBLE_DEVICES (what MPS applies, see
    # docs/partitions.md), with the share's memory.
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"


async def test_without_a_toolkit_spec_the_claims_still_name_their_device(tmp_path: Path) -> None:
    node = await make_node(tmp_path, dynamic_mig=True, gpu_sharing=True)
    for ids, env in (await prepare_forms(node)).values():
        assert not [i for i in ids if i.startswith("nvidia.com/gpu=")] and env["CUDA_VISIBLE_DEVICES"]
