"""examples/workloads without a cluster: every object valid for 1.37, every class one deploy/ installs,
every claim a pod or VM uses defined in the same file, and the VirtualMachine checked as far as it can be
without KubeVirt: decoded strictly into KubeVirt 1.9's own API types (tests/gocheck, `kubevirt` mode) to
exactly what the manifest says, and its claims referenced the way KubeVirt 1.9 admits them (the cluster has
no KubeVirt CRDs; tests/cluster/test_cluster_workloads.py schedules and prepares the examples for real,
the VM's through the pod virt-launcher would get)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from test_deploy import DEPLOY, K8S_VERSION, kustomize

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "workloads"
FILES = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
VM_FILE = "kubevirt-vm.yaml"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


@pytest.fixture(scope="module")
def classes() -> set[str]:
    """Every DeviceClass deploy/ installs: the base's and the kubevirt overlay's (which holds the base's)."""
    return {o["metadata"]["name"] for o in kustomize(DEPLOY / "overlays" / "kubevirt") if o["kind"] == "DeviceClass"}


def requests_of(template: dict[str, Any]) -> list[dict[str, Any]]:
    return list(template["spec"]["spec"]["devices"]["requests"])


def test_the_promised_examples_are_there() -> None:
    assert FILES == ["extended-resource.yaml", "gpu-share.yaml", "gpu.yaml", "kubevirt-vm.yaml", "mig.yaml",
                     "nic.yaml", "numa.yaml"]


@pytest.mark.parametrize("name", FILES)
def test_every_object_is_valid_and_asks_for_classes_deploy_installs(name: str, classes: set[str]) -> None:
    docs = documents(name)
    templates = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ResourceClaimTemplate"}
    for doc in docs:
        assert "namespace" not in doc["metadata"], "applied into the user's namespace"
        if doc["kind"] == "VirtualMachine":
            continue  # no schema here: test_the_vm_decodes_into_kubevirts_types
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {exc}")
    for template in templates.values():
        for req in requests_of(template):
            assert req["exactly"]["deviceClassName"] in classes, (name, req)
    for pod in (d for d in docs if d["kind"] == "Pod"):
        spec = pod["spec"]
        claims = {c["name"]: c for c in spec.get("resourceClaims") or []}
        assert all(c["resourceClaimTemplateName"] in templates for c in claims.values()), claims
        for container in spec["containers"]:
            used = [c["name"] for c in (container.get("resources") or {}).get("claims") or []]
            assert set(used) <= set(claims), (name, used)
        # Every claim a pod names is used by a container (one that none uses is allocated for nothing).
        assert {u["name"] for c in spec["containers"] for u in (c.get("resources") or {}).get("claims") or []} \
            == set(claims)


def kubevirt_check(checker: Path, path: Path) -> list[dict[str, Any]]:
    done = subprocess.run([str(checker), "kubevirt", str(path)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


def pruned(value: Any) -> Any:
    """Without the empty values Go's encoding adds (`creationTimestamp: null`, `status: {}`)."""
    if isinstance(value, dict):
        out = {k: pruned(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v not in (None, {}, [])}
    if isinstance(value, list):
        return [pruned(v) for v in value]
    return value


def test_the_vm_decodes_into_kubevirts_types(checker: Path) -> None:
    objects = kubevirt_check(checker, EXAMPLES / VM_FILE)
    (vm,) = [d for d in documents(VM_FILE) if d["kind"] == "VirtualMachine"]
    assert [(o["kind"], o["name"]) for o in objects] == [(d["kind"], d["metadata"]["name"])
                                                        for d in documents(VM_FILE)]
    (decoded,) = [o for o in objects if o["kind"] == "VirtualMachine"]
    assert decoded["error"] == ""
    # Exactly the manifest, as KubeVirt's types read it: nothing dropped, nothing read otherwise.
    assert pruned(decoded["decoded"]) == vm


@pytest.mark.parametrize(("change", "says"), [
    (("requestName: vf", "requestNmae: vf"), 'unknown field "requestNmae"'),
    (("memory: 8Gi", "memory: lots"), "quantities must match"),
    (("runStrategy: Always", "runStrategy: Always\n  running: true\n  running: false"), "already set"),
])
def test_a_vm_kubevirt_would_not_read_as_written_is_refused(checker: Path, tmp_path: Path,
                                                            change: tuple[str, str], says: str) -> None:
    # The check above can fail: a misspelt field (inside the VMI spec, whose own decoding ignores unknown
    # fields), a value of the wrong form, a key given twice.
    text = (EXAMPLES / VM_FILE).read_text()
    assert change[0] in text
    bad = tmp_path / VM_FILE
    bad.write_text(text.replace(change[0], change[1]))
    (decoded,) = [o for o in kubevirt_check(checker, bad) if o["kind"] == "VirtualMachine"]
    assert says in decoded["error"], decoded["error"]


def test_the_vm_references_its_claims_as_kubevirt_admits_them() -> None:
    # KubeVirt 1.9's rules for DRA devices: each resourceClaims entry a unique DNS label naming exactly one
    # of a claim or a template; each GPU and host device with a claim names an entry and a request of it,
    # no pair twice, and no device-plugin deviceName beside it; KubeVirt reads one device per request.
    docs = documents(VM_FILE)
    (vm,) = [d for d in docs if d["kind"] == "VirtualMachine"]
    templates = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ResourceClaimTemplate"}
    spec = vm["spec"]["template"]["spec"]
    entries = {c["name"]: c for c in spec["resourceClaims"]}
    assert len(entries) == len(spec["resourceClaims"]) and all(DNS_LABEL.match(n) for n in entries)
    for entry in entries.values():
        assert len({"resourceClaimName", "resourceClaimTemplateName"} & set(entry)) == 1, entry
    devices = spec["domain"]["devices"]
    pairs = []
    for kind in ("gpus", "hostDevices"):
        for dev in devices.get(kind) or []:
            assert "deviceName" not in dev and dev["name"], dev
            entry = entries[dev["claimName"]]
            (req,) = [r for r in requests_of(templates[entry["resourceClaimTemplateName"]])
                      if r["name"] == dev["requestName"]]
            assert req["exactly"].get("count", 1) == 1 and req["exactly"].get("allocationMode", "ExactCount") \
                == "ExactCount", req
            pairs.append((dev["claimName"], dev["requestName"]))
    assert len(pairs) == len(set(pairs)) == 2
    assert {p[0] for p in pairs} == set(entries)  # every claim the VM asks for is handed to it
