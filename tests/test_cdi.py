"""The cdi package: minimum versions, the spec builder, names and strict validation."""

from __future__ import annotations

import copy
from typing import Any

import pytest

import cdi
from cdi.spec import ContainerEdits, Device, DeviceNode, Hook, IntelRdt, Mount, NetDevice, Spec


def base_spec(**edits: Any) -> dict[str, Any]:
    return {"cdiVersion": "0.3.0", "kind": "vendor.example.com/gpu",
            "devices": [{"name": "gpu0", "containerEdits": {"env": ["A=1"], **edits}}]}


def edit(**fields: Any) -> Any:
    """A change to the first device's containerEdits, for parametrized cases."""
    return lambda s: s["devices"][0]["containerEdits"].update(fields)


# -- minimum_version ------------------------------------------------------------------------------

@pytest.mark.parametrize(("change", "expected"), [
    (lambda s: None, "0.3.0"),
    (edit(mounts=[{"hostPath": "/a", "containerPath": "/b"}]),
     "0.3.0"),
    (edit(mounts=[{"hostPath": "/a", "containerPath": "/b", "type": "bind"}]), "0.4.0"),
    (lambda s: s.update(containerEdits={"mounts": [{"hostPath": "t", "containerPath": "/t",
                                                     "type": "tmpfs"}]}), "0.4.0"),
    (edit(deviceNodes=[{"path": "/dev/x"}]), "0.3.0"),
    (edit(deviceNodes=[{"path": "/dev/x", "hostPath": "/dev/y"}]),
     "0.5.0"),
    (lambda s: s["devices"][0].update(name="0gpu"), "0.5.0"),
    (lambda s: s["devices"][0].update(name="gpu0"), "0.3.0"),
    (lambda s: s.update(annotations={"a": "b"}), "0.6.0"),
    (lambda s: s.update(annotations={}), "0.3.0"),
    (lambda s: s["devices"][0].update(annotations={"a": "b"}), "0.6.0"),
    (lambda s: s.update(kind="vendor.example.com/gpu.mig"), "0.6.0"),
    (lambda s: s.update(kind="vendor.example.com/gpu-mig"), "0.3.0"),
    (edit(additionalGids=[44]), "0.7.0"),
    (edit(additionalGids=[]), "0.3.0"),
    (edit(intelRdt={"closID": "c"}), "0.7.0"),
    (lambda s: s.update(containerEdits={"intelRdt": {}}), "0.7.0"),
    (edit(intelRdt={"enableMonitoring": True}), "1.1.0"),
    (edit(netDevices=[{"hostInterfaceName": "eth1", "name": "net0"}]), "1.1.0"),
    (edit(deviceNodes=[{"path": "/dev/x", "hostPath": "/dev/y"}], additionalGids=[5]), "0.7.0"),
])
def test_minimum_version_is_the_lowest_the_fields_need(change: Any, expected: str) -> None:
    spec = base_spec()
    change(spec)
    assert cdi.minimum_version(spec) == expected
    spec["cdiVersion"] = expected
    assert cdi.validate_spec(spec) == []


def test_builder_sets_the_minimum_version_and_omits_unset_fields() -> None:
    spec = Spec("vendor.example.com/gpu", [
        Device("gpu0", ContainerEdits(env=["A=1"], device_nodes=[DeviceNode("/dev/nvidia0")],
                                      mounts=[Mount("/host/lib", "/usr/lib/x", ["ro", "bind"])])),
    ]).to_dict()
    assert spec == {
        "cdiVersion": "0.3.0", "kind": "vendor.example.com/gpu",
        "devices": [{"name": "gpu0", "containerEdits": {
            "env": ["A=1"], "deviceNodes": [{"path": "/dev/nvidia0"}],
            "mounts": [{"hostPath": "/host/lib", "containerPath": "/usr/lib/x",
                        "options": ["ro", "bind"]}]}}],
    }


def test_builder_covers_every_edit_and_the_result_validates() -> None:
    edits = ContainerEdits(
        env=cdi.env_list({"B": "2", "A": "1"}),
        device_nodes=[DeviceNode("/dev/x", host_path="/dev/y", type="c", major=195, minor=0, file_mode=0o666,
                                 permissions="rw", uid=0, gid=0)],
        mounts=[Mount("/h", "/c", ["ro"], type="bind")],
        hooks=[Hook("createContainer", "/usr/bin/hook", ["hook", "x"], ["K=V"], timeout=5)],
        additional_gids=[44],
        intel_rdt=IntelRdt(clos_id="gold", schemata=["L3:0=f"]),
        net_devices=[NetDevice("eth1", "net0")],
    )
    spec = Spec("vendor.example.com/nic", [Device("nic0", edits, {"note": "x"})]).to_dict()
    assert spec["cdiVersion"] == "1.1.0"
    got = spec["devices"][0]["containerEdits"]
    assert got["env"] == ["A=1", "B=2"]
    assert got["deviceNodes"][0] == {"path": "/dev/x", "hostPath": "/dev/y", "type": "c", "major": 195,
                                     "minor": 0, "fileMode": 0o666, "permissions": "rw", "uid": 0, "gid": 0}
    assert got["hooks"][0] == {"hookName": "createContainer", "path": "/usr/bin/hook", "args": ["hook", "x"],
                               "env": ["K=V"], "timeout": 5}
    assert got["netDevices"] == [{"hostInterfaceName": "eth1", "name": "net0"}]
    assert got["intelRdt"] == {"closID": "gold", "schemata": ["L3:0=f"]}
    assert cdi.validate_spec(spec) == []


def test_builder_refuses_an_explicit_version_below_the_minimum() -> None:
    device = Device("gpu0", ContainerEdits(device_nodes=[DeviceNode("/dev/x", host_path="/dev/y")]))
    with pytest.raises(ValueError, match=r"0\.5\.0"):
        Spec("vendor.example.com/gpu", [device], cdi_version="0.4.0").to_dict()
    assert Spec("vendor.example.com/gpu", [device], cdi_version="0.6.0").to_dict()["cdiVersion"] == "0.6.0"


# -- names ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("device_id", [
    "nvidia.com/gpu=0", "vendor.example.com/gpu=GPU-1a2b", "a1/b2=x", "v_1-x.y/c.d_e-f=a:b.c_d-e",
    "vendor.com/class=7", "vendor.com/class=a",
])
def test_valid_device_ids_parse_and_format(device_id: str) -> None:
    parsed = cdi.parse_qualified(device_id)
    assert str(parsed) == device_id
    assert cdi.qualified_name(parsed.vendor, parsed.cls, parsed.name) == device_id
    assert cdi.is_qualified(device_id)


@pytest.mark.parametrize("device_id", [
    "", "gpu0", "vendor.com/class", "vendor.com=x", "/class=x", "vendor.com/=x", "vendor.com/class=",
    "a/class=x",  # one-character vendor
    "vendor.com/c=x",  # one-character class
    "1vendor.com/class=x", "vendor.com-/class=x", "vendor.com/class_=x", "vendor.com/cl/ass=x",
    "vendor.com/class=-x", "vendor.com/class=x-", "vendor.com/class=x y", "vendor.com/class=x/y",
    "vendör.com/class=x", "vendor.com/class=x=y",
])
def test_invalid_device_ids_are_refused(device_id: str) -> None:
    assert not cdi.is_qualified(device_id)
    with pytest.raises(cdi.InvalidName):
        cdi.parse_qualified(device_id)


def test_qualified_name_refuses_bad_parts() -> None:
    with pytest.raises(cdi.InvalidName, match="vendor"):
        cdi.qualified_name("-bad", "gpu", "0")
    with pytest.raises(cdi.InvalidName, match="device name"):
        cdi.qualified_name("vendor.com", "gpu", "a:")
    assert cdi.parse_kind("vendor.com/gpu.mig") == ("vendor.com", "gpu.mig")


# -- strict validation ----------------------------------------------------------------------------

@pytest.mark.parametrize(("where", "expected"), [
    (lambda s: s, "unknown field 'extra'"),
    (lambda s: s["devices"][0], "devices[0]: unknown field 'extra'"),
    (lambda s: s["devices"][0]["containerEdits"], "devices[0].containerEdits: unknown field 'extra'"),
])
def test_unknown_fields_fail(where: Any, expected: str) -> None:
    spec = base_spec()
    where(spec)["extra"] = 1
    assert cdi.validate_spec(spec) == [expected]


@pytest.mark.parametrize("edits", [
    {"deviceNodes": [{"path": "/dev/x", "containerPath": "/dev/x"}]},
    {"mounts": [{"hostPath": "/a", "containerPath": "/b", "readonly": True}]},
    {"hooks": [{"hookName": "prestart", "path": "/bin/h", "when": "always"}]},
    {"netDevices": [{"hostInterfaceName": "eth1", "name": "n0", "mac": "x"}]},
    {"intelRdt": {"closID": "c", "cat": 1}},
])
def test_unknown_fields_in_nested_edits_fail(edits: dict[str, Any]) -> None:
    spec = base_spec(**edits)
    spec["cdiVersion"] = cdi.minimum_version(spec)
    problems = cdi.validate_spec(spec)
    assert len(problems) == 1 and "unknown field" in problems[0]


@pytest.mark.parametrize(("mutate", "fragment"), [
    (lambda s: s.pop("cdiVersion"), "cdiVersion: is required"),
    (lambda s: s.pop("kind"), "kind: is required"),
    (lambda s: s.pop("devices"), "devices: is required"),
    (lambda s: s["devices"][0].pop("name"), "devices[0].name: is required"),
    (lambda s: s["devices"][0].pop("containerEdits"), "devices[0].containerEdits: is required"),
    (lambda s: s.update(devices=[]), "at least one device"),
    (lambda s: s["devices"].append(copy.deepcopy(s["devices"][0])), "defined more than once"),
    (lambda s: s["devices"][0].update(containerEdits={}), "devices[0].containerEdits: is empty"),
    (lambda s: s.update(cdiVersion="0.9.0"), "not a known CDI version"),
    (lambda s: s.update(cdiVersion=0.3), "cdiVersion: must be a string"),
    (lambda s: s.update(kind="gpu"), "not of the form vendor/class"),
    (lambda s: s.update(kind="vendor.com/-gpu"), "class '-gpu' is invalid"),
    (lambda s: s["devices"][0].update(name="gpu 0"), "device name 'gpu 0' is invalid"),
    (lambda s: s["devices"][0].update(name=0), "device name must be a string"),
    (edit(env=["NOVALUE"]), "not of the form NAME=VALUE"),
    (edit(env=["=x"]), "not of the form NAME=VALUE"),
    (edit(env="A=1"), "env: must be a list"),
    (edit(deviceNodes=[{"path": "dev/x"}]),
     "deviceNodes[0].path: 'dev/x' is not an absolute path"),
    (edit(deviceNodes=[{"path": "/dev/x", "type": "x"}]),
     "deviceNodes[0].type: 'x' is not one of c, b, u, p"),
    (edit(deviceNodes=[{"path": "/dev/x", "major": "195"}]),
     "deviceNodes[0].major: must be an integer, not a string"),
    (edit(deviceNodes=[{"path": "/dev/x", "minor": True}]),
     "deviceNodes[0].minor: must be an integer, not a boolean"),
    (edit(deviceNodes=[{"path": "/dev/x", "uid": -1}]),
     "deviceNodes[0].uid: -1 is out of range"),
    (edit(deviceNodes=[{"path": "/dev/x", "permissions": "rwx"}]),
     "may only hold the letters r, w and m"),
    (edit(mounts=[{"hostPath": "/a", "containerPath": "b"}]),
     "mounts[0].containerPath: 'b' is not an absolute path"),
    (edit(mounts=[{"containerPath": "/b"}]),
     "mounts[0].hostPath: is required"),
    (edit(mounts=[{"hostPath": "/a", "containerPath": "/b",
                                                                 "options": "ro"}]),
     "mounts[0].options: must be a list"),
    (edit(hooks=[{"hookName": "prestop", "path": "/h"}]),
     "hooks[0].hookName: 'prestop' is not one of"),
    (edit(hooks=[{"hookName": "poststop", "path": "h"}]),
     "hooks[0].path: 'h' is not an absolute path"),
    (edit(hooks=[{"hookName": "poststop", "path": "/h",
                                                                "timeout": 0}]),
     "hooks[0].timeout: must be greater than zero"),
    (edit(hooks=[{"hookName": "poststop", "path": "/h",
                                                                "env": ["X"]}]),
     "hooks[0].env[0]: 'X' is not of the form NAME=VALUE"),
])
def test_invalid_specs_are_refused_with_the_place_named(mutate: Any, fragment: str) -> None:
    spec = base_spec()
    mutate(spec)
    problems = cdi.validate_spec(spec)
    assert any(fragment in p for p in problems), problems


@pytest.mark.parametrize(("edits", "needed"), [
    ({"mounts": [{"hostPath": "/a", "containerPath": "/b", "type": "bind"}]}, "0.4.0"),
    ({"deviceNodes": [{"path": "/dev/x", "hostPath": "/dev/y"}]}, "0.5.0"),
    ({"additionalGids": [1]}, "0.7.0"),
    ({"netDevices": [{"hostInterfaceName": "eth1", "name": "n0"}]}, "1.1.0"),
])
def test_a_version_lower_than_the_fields_need_is_refused(edits: dict[str, Any], needed: str) -> None:
    spec = base_spec(**edits)
    expected = f"cdiVersion: 0.3.0 is lower than {needed}, which the fields used need"
    assert cdi.validate_spec(spec) == [expected]


def test_dot_in_class_needs_0_6_0() -> None:
    spec = base_spec()
    spec["kind"] = "vendor.example.com/gpu.mig"
    assert cdi.validate_spec(spec) == ["cdiVersion: 0.3.0 is lower than 0.6.0, which the fields used need"]


def test_intel_rdt_fields_follow_the_version() -> None:
    old = base_spec(intelRdt={"closID": "c", "enableCMT": True})
    old["cdiVersion"] = "0.7.0"
    assert cdi.validate_spec(old) == []
    new = copy.deepcopy(old)
    new["cdiVersion"] = "1.1.0"
    assert cdi.validate_spec(new) == ["devices[0].containerEdits.intelRdt: unknown field 'enableCMT'"]


@pytest.mark.parametrize(("annotations", "fragment"), [
    ({"Bad Key": "v"}, "invalid key"),
    ({"UPPER.example.com/x": "v"}, "prefix must be a DNS subdomain"),
    ({"example.com/": "v"}, "its name must be"),
    ({"ok": 1}, "must be a string, not an integer"),
    ({"big": "x" * (256 * 1024)}, "exceeds"),
])
def test_annotations_are_checked(annotations: dict[str, Any], fragment: str) -> None:
    spec = base_spec()
    spec.update(cdiVersion="0.6.0", annotations=annotations)
    problems = cdi.validate_spec(spec)
    assert any(fragment in p for p in problems), problems
    spec["annotations"] = {"example.com/owner": "dra", "plain": ""}
    assert cdi.validate_spec(spec) == []


def test_net_device_names_are_interface_names() -> None:
    spec = base_spec(netDevices=[{"hostInterfaceName": "eth1", "name": "a-very-long-name0"}])
    spec["cdiVersion"] = "1.1.0"
    assert cdi.validate_spec(spec) == ["devices[0].containerEdits.netDevices[0].name: 'a-very-long-name0' is "
                                       "not a valid network interface name (at most 15 bytes, no '/', ':' or "
                                       "white space)"]


def test_null_counts_as_absent_but_not_for_required_fields() -> None:
    spec = base_spec(mounts=None)
    spec["annotations"] = None
    assert cdi.validate_spec(spec) == []
    spec["kind"] = None
    assert cdi.validate_spec(spec) == ["kind: is required"]


def test_non_object_spec() -> None:
    assert cdi.validate_spec(["x"]) == ["must be an object, not a list"]
