"""The generated gRPC code matches the wire contract: packages, services, wire paths, field numbers."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor

from agent.pb import (
    dra_v1_pb2,
    dra_v1beta1_pb2,
    health_v1_pb2,
    health_v1alpha1_pb2,
    podresources_v1_pb2,
    registration_pb2,
)

ROOT = Path(__file__).resolve().parent.parent
REPEATED = "repeated"

# (message, field, number, type, label) as the kubelet defines them.
DRA_FIELDS = [
    ("Claim", "namespace", 1, "string", ""), ("Claim", "uid", 2, "string", ""), ("Claim", "name", 3, "string", ""),
    ("NodePrepareResourcesRequest", "claims", 1, "Claim", REPEATED),
    ("NodePrepareResourcesResponse", "claims", 1, "map", REPEATED),
    ("NodePrepareResourceResponse", "devices", 1, "Device", REPEATED),
    ("NodePrepareResourceResponse", "error", 2, "string", ""),
    ("Device", "request_names", 1, "string", REPEATED), ("Device", "pool_name", 2, "string", ""),
    ("Device", "device_name", 3, "string", ""), ("Device", "cdi_device_ids", 4, "string", REPEATED),
    ("NodeUnprepareResourcesRequest", "claims", 1, "Claim", REPEATED),
    ("NodeUnprepareResourcesResponse", "claims", 1, "map", REPEATED),
    ("NodeUnprepareResourceResponse", "error", 1, "string", ""),
]
HEALTH_FIELDS = [
    ("DeviceIdentifier", "pool_name", 1, "string", ""), ("DeviceIdentifier", "device_name", 2, "string", ""),
    ("DeviceHealth", "device", 1, "DeviceIdentifier", ""), ("DeviceHealth", "health", 2, "HealthStatus", ""),
    ("DeviceHealth", "last_updated_time", 3, "int64", ""),
    ("DeviceHealth", "health_check_timeout_seconds", 4, "int64", ""),
    ("DeviceHealth", "message", 5, "string", ""),
    ("NodeWatchResourcesResponse", "devices", 1, "DeviceHealth", REPEATED),
]
REGISTRATION_FIELDS = [
    ("PluginInfo", "type", 1, "string", ""), ("PluginInfo", "name", 2, "string", ""),
    ("PluginInfo", "endpoint", 3, "string", ""), ("PluginInfo", "supported_versions", 4, "string", REPEATED),
    ("RegistrationStatus", "plugin_registered", 1, "bool", ""), ("RegistrationStatus", "error", 2, "string", ""),
]
# The kubelet's pod resources service (k8s.io/kubelet/pkg/apis/podresources/v1), which the agent reads.
POD_RESOURCES_FIELDS = [
    ("ListPodResourcesResponse", "pod_resources", 1, "PodResources", REPEATED),
    ("GetPodResourcesRequest", "pod_name", 1, "string", ""),
    ("GetPodResourcesRequest", "pod_namespace", 2, "string", ""),
    ("GetPodResourcesResponse", "pod_resources", 1, "PodResources", ""),
    ("AllocatableResourcesResponse", "devices", 1, "ContainerDevices", REPEATED),
    ("AllocatableResourcesResponse", "cpu_ids", 2, "int64", REPEATED),
    ("AllocatableResourcesResponse", "memory", 3, "ContainerMemory", REPEATED),
    ("PodResources", "name", 1, "string", ""), ("PodResources", "namespace", 2, "string", ""),
    ("PodResources", "containers", 3, "ContainerResources", REPEATED),
    ("ContainerResources", "name", 1, "string", ""), ("ContainerResources", "devices", 2, "ContainerDevices", REPEATED),
    ("ContainerResources", "cpu_ids", 3, "int64", REPEATED),
    ("ContainerResources", "memory", 4, "ContainerMemory", REPEATED),
    ("ContainerResources", "dynamic_resources", 5, "DynamicResource", REPEATED),
    ("ContainerDevices", "resource_name", 1, "string", ""), ("ContainerDevices", "device_ids", 2, "string", REPEATED),
    ("ContainerDevices", "topology", 3, "TopologyInfo", ""),
    ("ContainerMemory", "memory_type", 1, "string", ""), ("ContainerMemory", "size", 2, "uint64", ""),
    ("ContainerMemory", "topology", 3, "TopologyInfo", ""),
    ("TopologyInfo", "nodes", 1, "NUMANode", REPEATED), ("NUMANode", "ID", 1, "int64", ""),
    ("DynamicResource", "claim_name", 2, "string", ""), ("DynamicResource", "claim_namespace", 3, "string", ""),
    ("DynamicResource", "claim_resources", 4, "ClaimResource", REPEATED),
    ("ClaimResource", "cdi_devices", 1, "CDIDevice", REPEATED), ("ClaimResource", "driver_name", 2, "string", ""),
    ("ClaimResource", "pool_name", 3, "string", ""), ("ClaimResource", "device_name", 4, "string", ""),
    ("CDIDevice", "name", 1, "string", ""),
]
_SCALARS = {FieldDescriptor.TYPE_STRING: "string", FieldDescriptor.TYPE_BOOL: "bool",
            FieldDescriptor.TYPE_INT64: "int64", FieldDescriptor.TYPE_UINT64: "uint64"}


def _type(field: FieldDescriptor) -> str:
    if field.message_type is not None:
        return "map" if field.message_type.GetOptions().map_entry else field.message_type.name
    if field.enum_type is not None:
        return field.enum_type.name
    return _SCALARS[field.type]


def _check_fields(module, expected):
    for message, name, number, type_, label in expected:
        desc = module.DESCRIPTOR.message_types_by_name[message]
        field = desc.fields_by_name[name]
        assert field.number == number, f"{message}.{name}"
        assert _type(field) == type_, f"{message}.{name}"
        assert field.is_repeated == (label == REPEATED), f"{message}.{name}"
    listed = {(m, f) for m, f, *_ in expected}
    for message in {m for m, *_ in expected}:
        for field in module.DESCRIPTOR.message_types_by_name[message].fields:
            if message == "Device" and field.name == "share_id":
                continue
            assert (message, field.name) in listed, f"unexpected field {message}.{field.name}"


def _paths(module):
    return {f"/{s.full_name}/{m.name}" for s in module.DESCRIPTOR.services_by_name.values() for m in s.methods}


@pytest.mark.parametrize("module,package", [(dra_v1_pb2, "k8s.io.kubelet.pkg.apis.dra.v1"),
                                            (dra_v1beta1_pb2, "k8s.io.kubelet.pkg.apis.dra.v1beta1")])
def test_dra_service(module, package):
    assert module.DESCRIPTOR.package == package
    assert _paths(module) == {f"/{package}.DRAPlugin/NodePrepareResources",
                              f"/{package}.DRAPlugin/NodeUnprepareResources"}
    _check_fields(module, DRA_FIELDS)
    entry = module.DESCRIPTOR.message_types_by_name["NodePrepareResourcesResponse"].fields_by_name["claims"]
    assert entry.message_type.fields_by_name["key"].type == FieldDescriptor.TYPE_STRING
    assert entry.message_type.fields_by_name["value"].message_type.name == "NodePrepareResourceResponse"


def test_share_id_only_in_v1_and_optional():
    v1 = dra_v1_pb2.DESCRIPTOR.message_types_by_name["Device"].fields_by_name["share_id"]
    assert v1.number == 5 and v1.has_presence
    assert "share_id" not in dra_v1beta1_pb2.DESCRIPTOR.message_types_by_name["Device"].fields_by_name


@pytest.mark.parametrize("module,package", [(health_v1_pb2, "v1"), (health_v1alpha1_pb2, "v1alpha1")])
def test_health_service(module, package):
    assert module.DESCRIPTOR.package == package
    assert _paths(module) == {f"/{package}.DRAResourceHealth/NodeWatchResources"}
    method = module.DESCRIPTOR.services_by_name["DRAResourceHealth"].methods_by_name["NodeWatchResources"]
    assert method.server_streaming and not method.client_streaming
    _check_fields(module, HEALTH_FIELDS)
    status = module.DESCRIPTOR.enum_types_by_name["HealthStatus"]
    assert {v.name: v.number for v in status.values} == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}


def test_registration_service():
    assert registration_pb2.DESCRIPTOR.package == "pluginregistration"
    assert _paths(registration_pb2) == {"/pluginregistration.Registration/GetInfo",
                                        "/pluginregistration.Registration/NotifyRegistrationStatus"}
    _check_fields(registration_pb2, REGISTRATION_FIELDS)
    assert not registration_pb2.DESCRIPTOR.message_types_by_name["InfoRequest"].fields
    assert not registration_pb2.DESCRIPTOR.message_types_by_name["RegistrationStatusResponse"].fields


def test_pod_resources_service():
    assert podresources_v1_pb2.DESCRIPTOR.package == "v1"
    assert _paths(podresources_v1_pb2) == {"/v1.PodResourcesLister/List", "/v1.PodResourcesLister/Get",
                                            "/v1.PodResourcesLister/GetAllocatableResources"}
    _check_fields(podresources_v1_pb2, POD_RESOURCES_FIELDS)


def test_generated_code_is_current(tmp_path):
    """What is imported is what proto/build.py makes from proto/ now."""
    subprocess.run([sys.executable, str(ROOT / "proto" / "build.py"), str(tmp_path)], check=True,
                   capture_output=True)
    fresh = tmp_path / "agent" / "pb"
    names = sorted(p.name for p in fresh.iterdir() if p.suffix in (".py", ".pyi"))
    assert names
    mismatch = [n for n in names if not filecmp.cmp(fresh / n, ROOT / "agent" / "pb" / n, shallow=False)]
    assert mismatch == []
