"""CDI spec files and directories as runtimes read them, and atomic spec writes."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

import cdi
from cdi import atomic, store


def base_spec(**edits: Any) -> dict[str, Any]:
    return {"cdiVersion": "0.3.0", "kind": "vendor.example.com/gpu",
            "devices": [{"name": "gpu0", "containerEdits": {"env": ["A=1"], **edits}}]}


# -- files and directories ------------------------------------------------------------------------

NVIDIA_LIKE_YAML = """\
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
  - name: "0"
    containerEdits:
      deviceNodes:
        - path: /dev/nvidia0
  - name: GPU-6d1f7c36-1b2a-4c5d-9e8f-0a1b2c3d4e5f
    containerEdits:
      deviceNodes:
        - path: /dev/nvidia0
containerEdits:
  env:
    - NVIDIA_VISIBLE_DEVICES=void
  deviceNodes:
    - path: /dev/nvidiactl
    - path: /dev/nvidia-uvm
  hooks:
    - hookName: createContainer
      path: /usr/bin/nvidia-cdi-hook
      args: [nvidia-cdi-hook, update-ldcache, --folder, /usr/lib/x86_64-linux-gnu]
  mounts:
    - hostPath: /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
      containerPath: /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
      options: [ro, nosuid, nodev, bind]
"""


def test_yaml_and_json_files_validate(tmp_path: Path) -> None:
    yaml_file = tmp_path / "nvidia.yaml"
    yaml_file.write_text(NVIDIA_LIKE_YAML)
    assert cdi.validate_file(yaml_file) == []
    json_file = tmp_path / "vendor.json"
    json_file.write_bytes(orjson.dumps(base_spec()))
    assert cdi.validate_file(json_file) == []


@pytest.mark.parametrize(("name", "content", "fragment"), [
    ("dup.yaml", NVIDIA_LIKE_YAML + "kind: other.com/x\n", "repeated key 'kind'"),
    ("dup.json", '{"cdiVersion": "0.3.0", "cdiVersion": "0.3.0", "kind": "a.b/c", "devices": []}',
     "repeated key 'cdiVersion'"),
    ("bad.json", '{"cdiVersion": ', "not valid JSON"),
    ("bad.yaml", "cdiVersion: [", "not valid YAML"),
    ("nan.json", '{"cdiVersion": NaN}', "NaN is not JSON"),
    ("version.yaml", NVIDIA_LIKE_YAML.replace("cdiVersion: 0.5.0", "cdiVersion: 0.5"),
     "cdiVersion: must be a string, not a number"),
    ("extra.yaml", NVIDIA_LIKE_YAML + "containerRuntime: [podman]\n", "unknown field 'containerRuntime'"),
])
def test_bad_files_are_refused(tmp_path: Path, name: str, content: str, fragment: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    problems = cdi.validate_file(path)
    assert any(fragment in p for p in problems), problems


def test_missing_file_is_a_problem(tmp_path: Path) -> None:
    assert cdi.validate_file(tmp_path / "gone.json")[0].startswith("cannot read")


def _write(path: Path, spec: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(spec))


def test_validate_dirs_reads_only_what_runtimes_read(tmp_path: Path) -> None:
    d = tmp_path / "cdi"
    _write(d / "good.json", base_spec())
    (d / "notes.txt").write_text("not a spec")
    (d / ".good.json.tmp-0a1b2c3d").write_text("{half")
    (d / "sub").mkdir()
    (d / "sub" / "broken.json").write_text("{")
    (d / "dir.json").mkdir()
    report = cdi.validate_dirs([d])
    assert [f.path.name for f in report.files] == ["good.json"]
    assert report.ok
    assert report.devices == ["vendor.example.com/gpu=gpu0"]


def test_validate_dirs_flags_invalid_files_and_conflicts(tmp_path: Path) -> None:
    static, dynamic = tmp_path / "etc-cdi", tmp_path / "run-cdi"
    _write(static / "a.json", base_spec())
    _write(dynamic / "b.json", base_spec())
    report = cdi.validate_dirs([static, dynamic, tmp_path / "nowhere"])
    assert report.ok  # shadowing is how the two directories are meant to work
    assert report.shadowed == [f"vendor.example.com/gpu=gpu0 in {static / 'a.json'} is shadowed by "
                               f"{dynamic / 'b.json'}"]
    assert report.missing == [tmp_path / "nowhere"]

    _write(dynamic / "c.json", base_spec())
    bad = base_spec()
    bad["devices"][0]["bogus"] = True
    _write(dynamic / "d.json", bad)
    report = cdi.validate_dirs([static, dynamic])
    assert not report.ok
    assert report.conflicts == [f"vendor.example.com/gpu=gpu0 is defined in {dynamic / 'b.json'}, "
                                f"{dynamic / 'c.json'} (the same directory): runtimes refuse this device"]
    text = cdi.format_report(report)
    assert f"{dynamic / 'd.json'}: INVALID" in text
    assert "  - devices[0]: unknown field 'bogus'" in text
    assert f"{static / 'a.json'}: ok (kind vendor.example.com/gpu, cdiVersion 0.3.0, 1 device)" in text
    assert text.splitlines()[-1].endswith("FAILED")


def test_report_warns_about_versions_field_runtimes_refuse(tmp_path: Path) -> None:
    spec = base_spec()
    spec.update(cdiVersion="0.6.0", annotations={"a": "b"})
    _write(tmp_path / "new.json", spec)
    report = cdi.validate_dirs([tmp_path])
    assert report.ok
    assert "podman 4.x" in report.files[0].warnings[0]
    assert "warning: cdiVersion 0.6.0" in cdi.format_report(report)


# -- atomic writes --------------------------------------------------------------------------------

def test_write_spec_round_trips_with_mode_0644_whatever_the_umask(tmp_path: Path) -> None:
    spec = base_spec()
    old = os.umask(0o077)
    try:
        path = cdi.write_spec(tmp_path / "new-dir", "vendor-gpu_1.json", spec)
    finally:
        os.umask(old)
    assert path == tmp_path / "new-dir" / "vendor-gpu_1.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert orjson.loads(path.read_bytes()) == spec
    assert os.listdir(path.parent) == [path.name]


def test_no_reader_sees_a_partial_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "vendor-gpu_1.json"
    cdi.write_spec(tmp_path, target.name, base_spec())
    seen: list[tuple[str, list[str], bytes]] = []
    real_rename = os.rename

    def spying_rename(src: Any, dst: Any, **dir_fds: Any) -> None:
        seen.append((os.path.basename(src), sorted(os.listdir(tmp_path)), (tmp_path / dst).read_bytes()))
        real_rename(src, dst, **dir_fds)

    monkeypatch.setattr(atomic.os, "rename", spying_rename)
    new = base_spec(mounts=[{"hostPath": "/a", "containerPath": "/b"}])
    cdi.write_spec(tmp_path, target.name, new)
    temp_name, listing, visible = seen[0]
    assert not temp_name.endswith((".json", ".yaml"))  # a runtime scanning now ignores it
    assert listing == sorted([target.name, temp_name])
    assert orjson.loads(visible) == base_spec()  # the old spec, whole, until the rename
    assert orjson.loads(target.read_bytes()) == new


def test_a_failed_write_leaves_the_old_spec_and_no_temp_file(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    target = cdi.write_spec(tmp_path, "vendor-gpu_1.json", base_spec())

    def failing_write(fd: int, data: Any) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.os, "write", failing_write)
    with pytest.raises(OSError, match="No space"):
        cdi.write_spec(tmp_path, target.name, base_spec(mounts=[{"hostPath": "/a", "containerPath": "/b"}]))
    assert os.listdir(tmp_path) == [target.name]
    assert orjson.loads(target.read_bytes()) == base_spec()


def test_concurrent_reader_only_ever_sees_whole_specs(tmp_path: Path) -> None:
    name = "vendor-gpu_1.json"
    specs = [base_spec(env=[f"N={i}", "PAD=" + "x" * (i * 97 % 5000)]) for i in range(100)]
    cdi.write_spec(tmp_path, name, specs[0])
    done = threading.Event()
    bad: list[bytes] = []
    reads = 0

    def reader() -> None:
        nonlocal reads
        while not done.is_set():
            data = (tmp_path / name).read_bytes()
            reads += 1
            try:
                orjson.loads(data)
            except orjson.JSONDecodeError:
                bad.append(data)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for spec in specs:
            cdi.write_spec(tmp_path, name, spec)
    finally:
        done.set()
        t.join()
    assert reads > 0
    assert bad == []
    assert orjson.loads((tmp_path / name).read_bytes()) == specs[-1]


def test_write_spec_refuses_an_invalid_spec_before_touching_the_dir(tmp_path: Path) -> None:
    spec = base_spec()
    spec["devices"][0]["name"] = "-bad"
    with pytest.raises(cdi.InvalidSpec, match="device name") as e:
        cdi.write_spec(tmp_path, "vendor-gpu_1.json", spec)
    assert e.value.problems
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("filename", ["../escape.json", "a/b.json", "nul\0.json", "a..json", "..", "spec.txt",
                                      ".json", "", "x" * 250 + ".json"])
def test_bad_spec_filenames_are_refused(tmp_path: Path, filename: str) -> None:
    with pytest.raises(cdi.InvalidFilename):
        cdi.write_spec(tmp_path, filename, base_spec())
    assert os.listdir(tmp_path) == []


def test_remove_spec_is_idempotent(tmp_path: Path) -> None:
    path = cdi.write_spec(tmp_path, "vendor-gpu_1.yaml", base_spec())
    assert cdi.validate_file(path) == []  # JSON is YAML: a .yaml name holds the same bytes
    assert cdi.remove_spec(path) is True
    assert cdi.remove_spec(path) is False
    assert not path.exists()


def test_transient_spec_name() -> None:
    uid = "0b6f2c1e-3d4a-4b5c-8d9e-0f1a2b3c4d5e"
    assert cdi.transient_spec_name("dra.example.com", "claim", uid) == f"dra.example.com-claim_{uid}.json"
    for bad in ("../x", "a/b", "", "x y"):
        with pytest.raises(cdi.InvalidFilename):
            cdi.transient_spec_name("dra.example.com", "claim", bad)
    with pytest.raises(cdi.InvalidFilename):
        cdi.transient_spec_name("-bad", "claim", uid)
