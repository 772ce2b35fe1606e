"""deploy/helm/dra-agent with the real Helm (v4, built from its Go module by tests/helm/build.py):

- one source of truth: the chart's default render is `kubectl kustomize deploy/base`, object for object,
  and each overlay of deploy/overlays has a values file in the chart's ci/ whose render is that overlay's;
- `helm lint --strict` passes with the defaults and every values file;
- values.schema.json refuses a misspelt or mistyped value, naming it;
- every agent setting (agent/options.py) is either a value of `settings`, whose environment variable the
  agent itself reads back as given, or set by the chart from its own values (MANAGED, with why);
- the chart's version and appVersion are the agent's; docs/helm.md lists every value.

What the API server makes of the chart (install, upgrade, uninstall) is tests/cluster/test_cluster_helm.py.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from test_deploy import DEPLOY, kustomizations, kustomize

import agent
from agent.config import OPTIONS, settings_from

REPO = Path(__file__).resolve().parents[1]
CHART = DEPLOY / "helm" / "dra-agent"
NAMESPACE = "dra-agent"  # deploy/base/namespace.yaml: the release's namespace renders it
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
# The agent settings the chart sets from its own values or the pod, never from `settings`, and why.
MANAGED = {
    "driver_name": "driverName",
    "node_name": "the pod's spec.nodeName",
    "driver_root": "driverRoot, mounted at /driver-root",
    "kubelet_dir": "kubeletDir, mounted at its own path",
    "cdi_dir": "cdiDir, mounted at its own path",
    "static_cdi_dir": "staticCdiDir, mounted at its own path",
    "state_dir": "stateDir, mounted at its own path",
    "sysfs_root": "the host's /sys, mounted at /sys",
    "dev_root": "the host's /dev, mounted at /dev",
    "kubeconfig": "in the pod: its service account (in-cluster)",
    "offline": "a DaemonSet talks to its cluster",
    "offline_fallback": "a DaemonSet talks to its cluster",
    "node_ips": "the pod's status.hostIPs",
    "rolling_update_pod_uid": "the pod's UID",
    "kubevirt_cpu": "kubevirt.enabled",
    "binding_conditions": "bindingConditions.kinds (with the role they need)",
    "metrics_address": "metrics.enabled and metrics.port, on the node's address",
    "probe_address": "probePort, on the loopback",
    "probe_socket": "the pod's own emptyDir, for the kubelet's exec probes",
    "stop_with_parent": "`make run` only",
    "taint_policy": "taintPolicy, a ConfigMap mounted as the file",
}


@pytest.fixture(scope="session")
def helm() -> Path:
    """Helm, built or reused once (tests/helm/build.py)."""
    from helm import build

    return Path(build.HELM.for_test("helm"))


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # HOME-independent: no repository configuration or cache of the user's is read.
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120, check=False)


def render(helm: Path, *values: Path, sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """`helm template` of the chart in the release namespace dra-agent."""
    args = ["template", "dra-agent", str(CHART), "--namespace", NAMESPACE]
    for v in values:
        args += ["--values", str(v)]
    for s in sets:
        args += ["--set", s]
    done = run_helm(helm, *args)
    assert done.returncode == 0, f"helm {' '.join(args)}:\n{done.stderr}"
    return [o for o in yaml.safe_load_all(done.stdout) if o]


@functools.cache
def _kustomized(which: str) -> tuple[dict[str, Any], ...]:
    # driver.yaml and extended-resources.yaml are local configuration, never applied.
    return tuple(o for o in kustomize(DEPLOY / which) if o["kind"] != "ConfigMap")


def by_identity(objs: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    out = {}
    for o in objs:
        key = (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])
        assert key not in out, f"{key} rendered twice"
        out[key] = o
    return out


# Lists whose order means nothing to the kubelet, keyed by `name`. Kustomize's strategic merge puts the
# element an overlay patches first (deploy/overlays/kubevirt's DRA_KUBEVIRT_CPU becomes the first
# variable, its /sys the first mount), where the chart writes it in its place; an overlay is compared
# with these lists as maps. The one order that counts, a $(VAR) after VAR, is checked on the chart alone
# (test_env_references_come_after_their_variables).
UNORDERED = ("env", "volumeMounts", "volumes")


def unordered(obj: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    if obj["kind"] == "DaemonSet":
        pod = obj["spec"]["template"]["spec"]
        for container in pod["containers"]:
            for key in ("env", "volumeMounts"):
                container[key] = {e["name"]: e for e in container.get(key, [])}
        pod["volumes"] = {v["name"]: v for v in pod.get("volumes", [])}
    return obj


def values_file(which: str) -> Path:
    return CHART / "ci" / f"{which.removeprefix('overlays/')}-values.yaml"


def differences(mine: Any, theirs: Any, where: str = "") -> list[str]:
    """Where two parsed objects differ, by path."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        return [d for k in sorted(set(mine) | set(theirs), key=str)
                for d in differences(mine.get(k), theirs.get(k), f"{where}.{k}")]
    if isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
        pairs = enumerate(zip(mine, theirs, strict=True))
        return [d for i, (m, t) in pairs for d in differences(m, t, f"{where}[{i}]")]
    return [] if mine == theirs else [f"{where}: chart {mine!r}, kustomize {theirs!r}"]


def assert_same_objects(chart: list[dict[str, Any]], kustomized: list[dict[str, Any]], which: str) -> None:
    mine, theirs = by_identity(chart), by_identity(kustomized)
    assert sorted(mine) == sorted(theirs), f"{which}: the chart renders other objects than kustomize"
    for key, obj in theirs.items():
        # Parsed YAML: dicts compare whatever their key order; lists in order.
        assert mine[key] == obj, f"{which}: {key} differs: {differences(mine[key], obj)}"


def test_default_render_is_deploy_base_object_for_object(helm: Path) -> None:
    assert_same_objects(render(helm), list(_kustomized("base")), "base")


OVERLAYS = [k for k in kustomizations() if k != "base"]


def test_every_overlay_has_a_values_file_and_no_file_is_left_over() -> None:
    assert sorted(p.name for p in (CHART / "ci").glob("*-values.yaml")) == sorted(
        values_file(o).name for o in OVERLAYS)


@pytest.mark.parametrize("which", OVERLAYS)
def test_each_overlay_is_its_values_file(helm: Path, which: str) -> None:
    chart = render(helm, values_file(which))
    kustomized = list(_kustomized(which))
    assert_same_objects([unordered(o) for o in chart], [unordered(o) for o in kustomized], which)
    # And the values file changes something: the overlay is not the base.
    assert by_identity([unordered(o) for o in kustomized]) != by_identity(
        [unordered(o) for o in _kustomized("base")])


@pytest.mark.parametrize("values", [None, *(values_file(o) for o in OVERLAYS)], ids=lambda v: v and v.stem)
def test_env_references_come_after_their_variables(helm: Path, values: Path | None) -> None:
    (daemonset,) = [o for o in render(helm, *(v for v in [values] if v)) if o["kind"] == "DaemonSet"]
    defined: set[str] = set()
    for env in daemonset["spec"]["template"]["spec"]["containers"][0]["env"]:
        for ref in re.findall(r"\$\((\w+)\)", env.get("value", "")):
            assert ref in defined, f"{env['name']} refers to $({ref}) before it is defined"
        defined.add(env["name"])


@pytest.mark.parametrize("values", [None, *(values_file(o) for o in OVERLAYS)], ids=lambda v: v and v.stem)
def test_lint_strict_passes(helm: Path, values: Path | None) -> None:
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE, *(["--values", str(values)] if values else [])]
    done = run_helm(helm, *args)
    assert done.returncode == 0, f"helm {' '.join(args)}:\n{done.stdout}{done.stderr}"
    assert "0 chart(s) failed" in done.stdout


@pytest.mark.parametrize(("value", "named"), [
    ("kubeletPlugin.tolerance[0].key=x", "tolerance"),  # tolerations, misspelt
    ("settings.logLvel=debug", "logLvel"),
    ("image.pullPolcy=Always", "pullPolcy"),
    ("deviceClasses.gpu.extendedResource=nvidia.com/gpu", "extendedResource"),
    ("kubeletPlugin.affinity.nodeAfinity.x=y", "nodeAfinity"),
    ("taintPolicy.gpuLost.efect=NoExecute", "efect"),
])
def test_a_misspelt_value_is_refused_naming_it(helm: Path, value: str, named: str) -> None:
    done = run_helm(helm, "template", "dra-agent", str(CHART), "--namespace", NAMESPACE, "--set", value)
    assert done.returncode != 0, f"--set {value} was taken:\n{done.stdout[:2000]}"
    assert "values don't meet the specifications of the schema" in done.stderr, done.stderr
    assert re.search(rf"additional propert(y|ies) '?{named}'? (is|are) not allowed|'{named}'", done.stderr), done.stderr


@pytest.mark.parametrize(("value", "named"), [
    ("settings.gpuSharing=maybe", "gpuSharing"),
    ("settings.logLevel=verbose", "logLevel"),
    ("bindingConditions.kinds={gpu}", "kinds"),
    ("driverName=Not_A_Subdomain", "driverName"),
    ("metrics.port=0", "port"),
])
def test_a_mistyped_value_is_refused_naming_it(helm: Path, value: str, named: str) -> None:
    done = run_helm(helm, "template", "dra-agent", str(CHART), "--namespace", NAMESPACE, "--set", value)
    assert done.returncode != 0, f"--set {value} was taken"
    assert named in done.stderr, done.stderr


# -- the agent's settings ----------------------------------------------------------------------------


def camel(dest: str) -> str:
    first, *rest = dest.split("_")
    return first + "".join(word.capitalize() for word in rest)


SETTINGS = SCHEMA["properties"]["settings"]["properties"]


def test_every_agent_setting_is_a_value_or_set_by_the_chart() -> None:
    offered = {o.dest for o in OPTIONS if camel(o.dest) in SETTINGS}
    assert {o.dest for o in OPTIONS} - offered == set(MANAGED), "a setting is neither in `settings` nor MANAGED"
    assert not offered & set(MANAGED)
    assert set(SETTINGS) == {camel(d) for d in offered}, "a `settings` value names no agent setting"
    kinds: dict[Any, str] = {bool: "boolean", int: "integer", float: "number"}
    for opt in OPTIONS:
        if opt.dest in offered:
            prop = SETTINGS[camel(opt.dest)]
            assert prop["type"] == [kinds.get(opt.kind, "string"), "null"], opt.dest
            assert prop["description"] == f"{opt.help} (${opt.env})", f"{opt.dest}: the help of agent/options.py"


# A value other than the default for each setting the chart offers, and what the agent makes of it.
SAMPLES: dict[str, tuple[str, Any]] = {
    "nvml": ("sim:dgx-a100", "sim:dgx-a100"),
    "nic_include": ("eth*,ib*", ("eth*", "ib*")),
    "nic_exclude": ("docker*", ("docker*",)),
    "nic_passthrough": ("ens1f*", ("ens1f*",)),
    "rescan_interval": ("30.5", 30.5),
    "netlink_debounce": ("2", 2.0),
    "allow_unsafe_roots": ("true", True),
    "claim_fetch_concurrency": ("4", 4),
    "api_timeout": ("20", 20.0),
    "gc_grace_period": ("86400", 86400.0),
    "device_plugin_resources": ("", ""),  # empty is a value: no device plugin looked for
    "dynamic_mig": ("false", False),
    "mig_profiles": ("all", "all"),
    "vgpu_types": ("none", "none"),
    "gpu_sharing": ("true", True),
    "gpu_compute_shares": ("off", "off"),
    "compatibility_groups": ("true", True),
    "numa_node_list": ("false", "false"),
    "partition_type_attribute": ("true", True),
    "skip_node_operations": ("cpu,memory", ("cpu", "memory")),
    "gpu_host_memory_overhead": ("1Gi", 2**30),
    "gpu_probe_interval": ("0.25", 0.25),
    "log_format": ("text", "text"),
    "log_level": ("debug", "debug"),
}


def test_each_setting_reaches_the_agent_as_given(helm: Path, tmp_path: Path) -> None:
    """Every `settings` value set at once; the agent's own parser (agent.config.settings_from) reads the
    rendered container's environment back to the values given."""
    assert set(SAMPLES) == {o.dest for o in OPTIONS if camel(o.dest) in SETTINGS}
    values = tmp_path / "settings.yaml"
    # Typed as the schema types them (a YAML true, a number), as a user writes them.
    values.write_text(yaml.safe_dump({"settings": {
        camel(dest): raw if SETTINGS[camel(dest)]["type"][0] == "string" else yaml.safe_load(raw)
        for dest, (raw, _) in SAMPLES.items()}}))
    (daemonset,) = [o for o in render(helm, values) if o["kind"] == "DaemonSet"]
    env = {e["name"]: e["value"] for e in daemonset["spec"]["template"]["spec"]["containers"][0]["env"] if "value" in e}
    names = [e["name"] for e in daemonset["spec"]["template"]["spec"]["containers"][0]["env"]]
    assert len(names) == len(set(names)), "a variable set twice"
    env["NODE_NAME"] = "node-a"
    settings = settings_from(env={k: v for k, v in env.items() if "$(" not in v})
    for dest, (_, wanted) in SAMPLES.items():
        got = getattr(settings, dest)
        assert (str(got) if dest == "nvml" else got) == wanted, f"{dest}: {got!r}"


def test_the_taint_policy_reaches_the_agent_and_a_change_rolls_the_pods(helm: Path, tmp_path: Path) -> None:
    """taintPolicy: the ConfigMap's file, at the path the container's DRA_TAINT_POLICY names, is read by
    the agent's own loader (agent.health.policy.load_policy) into the rules given."""
    from agent.health.policy import load_policy

    policy = {"xid": {"13": {"effect": "ignore"}, "43": {"effect": "None", "clearAfter": 60}},
              "gpuLost": {"effect": "NoExecute"}, "linkDown": {"effect": "NoSchedule", "upHold": 10}}
    values = tmp_path / "policy-values.yaml"
    values.write_text(yaml.safe_dump({"taintPolicy": policy}))
    objs = render(helm, values)
    (config,) = [o for o in objs if o["kind"] == "ConfigMap"]
    (daemonset,) = [o for o in objs if o["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    path = Path(next(e["value"] for e in container["env"] if e["name"] == "DRA_TAINT_POLICY"))
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(path.parent)]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == config["metadata"]["name"] and mount["readOnly"] is True
    (tmp_path / path.name).write_text(config["data"][path.name])
    loaded = load_policy(tmp_path / path.name)
    assert (loaded.xid[13].effect, loaded.xid[43].effect, loaded.xid[43].clear_after) == ("ignore", "None", 60.0)
    assert (loaded.gpu_lost.effect, loaded.link_down.effect) == ("NoExecute", "NoSchedule")
    assert loaded.link_down.up_hold == 10
    # Another policy, another pod template: the DaemonSet rolls.
    changed = render(helm, values, sets=("taintPolicy.gpuLost.effect=NoSchedule",))
    (again,) = [o for o in changed if o["kind"] == "DaemonSet"]
    assert again["spec"]["template"]["metadata"] != daemonset["spec"]["template"]["metadata"]


@pytest.mark.parametrize("sets", [
    ("metrics.enabled=false", "admissionPolicy.enabled=false", "namespace.create=false"),
    ("kubevirt.enabled=true", "nodeAllocatable.enabled=true", "bindingConditions.kinds={vfio,mig,vgpu}",
     "settings.nvml=sim:hgx-16", "deviceClasses.gpu.extendedResourceName=null", "deviceClasses.nic.enabled=false"),
    ("image.tag=", "imagePullSecrets[0].name=registry", "kubeletPlugin.nodeSelector.gpu=yes",
     "kubeletPlugin.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight=1",
     "kubeletPlugin.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].preference"
     ".matchExpressions[0].key=a", "kubeletPlugin.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution"
     "[0].preference.matchExpressions[0].operator=Exists", "kubeletDir=/var/lib/k0s/kubelet",
     "driverRoot=/run/nvidia/driver", "taintPolicy.nvmlLost.effect=NoSchedule"),
], ids=["off", "on", "placed"])
def test_other_values_render_valid_1_37_objects(helm: Path, sets: tuple[str, ...]) -> None:
    from test_deploy import K8S_VERSION

    objs = render(helm, sets=sets)
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {exc}")
    (daemonset,) = [o for o in objs if o["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    if "metrics.enabled=false" in sets:
        assert env["DRA_METRICS_ADDRESS"] == "" and "NODE_IP" not in env
        assert not {"Namespace", "ValidatingAdmissionPolicy"} & {o["kind"] for o in objs}
    if "kubeletDir=/var/lib/k0s/kubelet" in sets:
        assert env["DRA_KUBELET_DIR"] == "/var/lib/k0s/kubelet"
        assert {"/var/lib/k0s/kubelet/plugins/dra.example.com", "/var/lib/k0s/kubelet/plugins_registry"} <= mounts
        assert pod["containers"][0]["image"] == f"dra-agent:{agent.__version__}"  # image.tag empty: appVersion
        assert pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 1


def test_one_edit_renames_the_driver_everywhere(helm: Path) -> None:
    objs = render(helm, *(values_file(o) for o in ("kubevirt", "device-plugin-migration", "binding-conditions")),
                  sets=("driverName=gpu.acme.example",))
    text = json.dumps(objs)
    assert "dra.example.com" not in text
    classes = {o["metadata"]["name"] for o in objs if o["kind"] == "DeviceClass"}
    assert "gpu.gpu.acme.example" in classes and "mig-1g10gbme.gpu.acme.example" in classes and "dra.cpu" in classes


def test_the_chart_is_the_agents_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["version"] == chart["appVersion"] == agent.__version__


# Values documented as a whole (Kubernetes' own types, one row per class), not field by field.
WHOLE = ("kubeletPlugin.updateStrategy", "kubeletPlugin.resources", "kubeletPlugin.affinity", "deviceClasses.",
         "taintPolicy")


def documented_names(schema: dict[str, Any], prefix: str = "") -> set[str]:
    """Each value of the schema a row of docs/helm.md must name: the leaves, and WHOLE as a whole."""
    out = set()
    for key, sub in schema.get("properties", {}).items():
        name = f"{prefix}{key}"
        if "properties" in sub and key != "settings" and not name.startswith(WHOLE):
            out |= documented_names(sub, f"{name}.")
        else:
            out.add(name)
    return out


def test_docs_list_every_value_and_setting() -> None:
    docs = (REPO / "docs" / "helm.md").read_text()
    missing = sorted(n for n in documented_names(SCHEMA) if f"`{n}`" not in docs)
    assert missing == [], f"docs/helm.md does not name {missing}"
    missing = sorted(n for n in SETTINGS if f"`settings.{n}`" not in docs)
    assert missing == [], f"docs/helm.md does not name {missing}"
