"""The CLI as a person at the node uses it, and README's walk-through: the agent as a process,
seeded from examples/, driven with `dra-agent kubelet ...` from a second process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import agentkit
import kubernetes_validate
import pytest
import yaml

from agent.config import OPTIONS

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"dra-agent {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def run_env(short_tmp):
    return {
        "DRA_KUBELET_DIR": str(short_tmp / "kubelet"), "DRA_CDI_DIR": str(short_tmp / "cdi"),
        "DRA_STATIC_CDI_DIR": str(short_tmp / "cdi-static"), "DRA_STATE_DIR": str(short_tmp / "state"),
        "DRA_OFFLINE": str(short_tmp / "offline"), "DRA_NVML": "sim", "NODE_NAME": "node-cli",
        "DRA_LOG_FORMAT": "json",
    }


@pytest.fixture
def agent_process(run_env, short_tmp):
    seeded = subprocess.run([sys.executable, str(ROOT / "examples" / "seed.py"), str(short_tmp)],
                            capture_output=True, text=True, env={**os.environ, **run_env}, cwd=ROOT, timeout=60)
    assert seeded.returncode == 0, seeded.stderr
    reg = Path(run_env["DRA_KUBELET_DIR"]) / "plugins_registry" / "dra.example.com-reg.sock"
    with agentkit.agent_process(["run"], run_env, reg, ROOT) as proc:
        yield proc


def test_devices_json_lists_the_simulated_gpus_in_api_form(run_env):
    out = json.loads(cli("devices", "-o", "json", env=run_env).stdout)
    gpus = [d for d in out if d["kind"] == "gpu"]
    assert [g["name"] for g in gpus] == [f"gpu-{i}" for i in range(8)]
    for d in out:
        # PCI functions also show their current driver and IOMMU group; the node's uplink (this machine's
        # NIC, where it is published) why it is one.
        assert set(d) - {"pciFunction", "uplinkReason"} == {"name", "kind", "attributes", "capacity"}
        for value in d["attributes"].values():
            assert len(value) == 1 and next(iter(value)) in ("string", "int", "bool", "version")
    assert gpus[0]["attributes"]["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert gpus[0]["attributes"]["driverVersion"] == {"version": "570.124.6"}
    assert gpus[0]["capacity"]["memory"] == {"value": "81559Mi"}
    assert gpus[0]["pciFunction"] == {"driver": "nvidia", "iommuGroup": 100}
    table = cli("devices", env=run_env).stdout
    assert table.splitlines()[0].split()[:2] == ["NAME", "KIND"] and "gpu-7" in table


def test_slices_are_valid_resourceslices(run_env):
    docs = [d for d in yaml.safe_load_all(cli("slices", env=run_env).stdout) if d]
    assert docs and all(d["apiVersion"] == "resource.k8s.io/v1" and d["kind"] == "ResourceSlice" for d in docs)
    for d in docs:
        kubernetes_validate.validate(d, "1.37.0", strict=True)
        assert d["spec"]["nodeName"] == "node-cli" and d["spec"]["pool"]["name"] == "node-cli"
    names = [dev["name"] for d in docs for dev in d["spec"].get("devices", [])]  # counter slices have none
    assert {f"gpu-{i}" for i in range(8)} <= set(names)
    as_json = json.loads(cli("slices", "-o", "json", env=run_env).stdout)
    assert as_json == docs


def test_quickstart_prepare_inspect_unprepare(agent_process, run_env):
    info = cli("kubelet", "info", env=run_env).stdout
    assert "DRAPlugin" in info and "v1.DRAPlugin, v1beta1.DRAPlugin" in info
    for claim in ("gpu-one", "gpu-eight", "trainer-0-gpu-7x2kq", "cuda-app-extended-resources-9fz4d"):
        out = json.loads(cli("kubelet", "prepare", f"default/{claim}", env=run_env).stdout)
        (entry,) = out["claims"].values()
        assert "error" not in entry and entry["devices"], out
    listed = cli("claims", env=run_env).stdout
    assert "default/gpu-eight" in listed and "gpu-0,gpu-1,gpu-2" in listed
    records = json.loads(cli("claims", "-o", "json", env=run_env).stdout)
    assert {r["name"] for r in records} >= {"gpu-one", "gpu-eight"}
    spec_dir = Path(run_env["DRA_CDI_DIR"])
    assert cli("cdi", "validate", str(spec_dir), env=run_env).returncode == 0
    eight = next(r for r in records if r["name"] == "gpu-eight")
    spec = json.loads((spec_dir / f"dra.example.com-claim_{eight['uid']}.json").read_text())
    assert all("NCCL_DEBUG=INFO" in d["containerEdits"]["env"] for d in spec["devices"])
    v1beta1 = json.loads(cli("kubelet", "unprepare", "default/gpu-one", "--api", "v1beta1", env=run_env).stdout)
    assert all("error" not in e for e in v1beta1["claims"].values())
    health = json.loads(cli("kubelet", "health", "--once", "-o", "json", env=run_env).stdout)
    assert {d["device"]["device_name"] for d in health["devices"]} >= {f"gpu-{i}" for i in range(8)}
    slices = list((Path(run_env["DRA_OFFLINE"]) / "resourceslices").glob("*.yaml"))
    assert slices, "the running agent publishes offline"


def test_kubelet_health_is_a_table_of_devices_and_json_on_request(agent_process, run_env):
    """`kubelet health --once` is a line of counts and a row a device (it printed the stream's JSON, some 7
    lines a device: 1,400 lines on the simulated machine); `-o json` prints the answer whole, and both
    versions of the service tell the same devices."""
    cli("sim", "xid", "gpu-3", "48", env=run_env)  # a double-bit ECC error: gpu-3 unhealthy, with why
    answer = json.loads(cli("kubelet", "health", "--once", "-o", "json", env=run_env).stdout)
    health = {d["device"]["device_name"]: d for d in answer["devices"]}
    assert health["gpu-3"]["health"] == "UNHEALTHY"
    for api in ("v1", "v1alpha1"):
        head, columns, *rows = cli("kubelet", "health", "--once", "--api", api, env=run_env).stdout.splitlines()
        unhealthy = sum(d["health"] == "UNHEALTHY" for d in health.values())
        assert head == (f"{len(health)} devices in pool node-cli: {len(health) - unhealthy} HEALTHY, "
                        f"{unhealthy} UNHEALTHY"), head
        assert columns.split() == ["DEVICE", "HEALTH", "UPDATED", "TIMEOUT", "MESSAGE"]
        shown = {row.split()[0]: row.split()[1] for row in rows}
        assert shown == {name: d["health"] for name, d in health.items()}, rows
        (gpu3,) = [row for row in rows if row.startswith("gpu-3 ")]
        assert health["gpu-3"]["message"] and gpu3.endswith(health["gpu-3"]["message"]), gpu3
    assert "v1alpha1 (the one earlier kubelets call)" in " ".join(cli("kubelet", "health", "--help").stdout.split())


def test_claims_names_one_claim_and_prints_its_metadata_paths(agent_process, run_env):
    """`cat $(dra-agent claims NAMESPACE/NAME --metadata)`: the device metadata file of each request of that
    claim, one path a line and nothing else; a claim not prepared here is exit 1, a bad name a usage error."""
    for claim in ("gpu-one", "trainer-0-gpu-7x2kq"):
        cli("kubelet", "prepare", f"default/{claim}", env=run_env)
    paths = cli("claims", "default/gpu-one", "--metadata", env=run_env).stdout.splitlines()
    (path,) = paths
    first = json.loads(Path(path).read_text().splitlines()[0])
    assert first["metadata"]["name"] == "gpu-one" and first["requests"][0]["name"] == "gpu"
    # A JSON stream, as README and docs/claims.md say where the file is first named: json.load of it whole
    # fails, and the one line they give reads an object per API version, the newest first.
    with pytest.raises(json.JSONDecodeError, match="Extra data"):
        json.loads(Path(path).read_text())
    read = subprocess.run([sys.executable, "-m", "json.tool", "--json-lines", path], capture_output=True, text=True,
                          check=True, timeout=60).stdout
    assert re.findall(r'"apiVersion": "(metadata[^"]+)"', read) == [
        "metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1"]
    (record,) = json.loads(cli("claims", "default/gpu-one", "-o", "json", env=run_env).stdout)
    assert record["name"] == "gpu-one" and path in record["files"]
    assert "trainer" not in cli("claims", "default/gpu-one", env=run_env).stdout
    both = cli("claims", "--metadata", env=run_env).stdout.splitlines()
    assert len(both) == 2 and path in both and all(p.endswith("/metadata.json") for p in both)
    missing = cli("claims", "default/gpu-eight", "--metadata", env=run_env, check=False)
    assert missing.returncode == 1 and not missing.stdout and "not prepared" in missing.stderr
    usage = cli("claims", "gpu-one", env=run_env, check=False)
    assert usage.returncode == 2 and "default/gpu-one?" in usage.stderr


def test_prepare_of_a_missing_claim_says_why(agent_process, run_env):
    proc = cli("kubelet", "prepare", "default/nope", env=run_env, check=False)
    assert proc.returncode == 3 and "not found" in proc.stderr  # docs/cli.md: 3, not found


def test_kubelet_info_without_an_agent_fails_clearly(run_env):
    proc = cli("kubelet", "info", env=run_env, check=False)
    assert proc.returncode == 4 and "UNAVAILABLE" in proc.stderr  # docs/cli.md: 4, no agent answers


def test_bad_settings_are_refused_before_anything_starts(run_env):
    proc = cli("devices", "--driver-name", "Not_A_DNS_Name", env=run_env, check=False)
    assert proc.returncode == 2 and "--driver-name" in proc.stderr
    proc = cli("devices", "--nvml", "fake", env=run_env, check=False)
    assert proc.returncode == 2 and "--nvml" in proc.stderr


def test_docs_document_every_setting_with_its_environment_variable():
    page = (ROOT / "docs" / "configuration.md").read_text()
    for opt in OPTIONS:
        assert re.search(rf"\| `{re.escape(opt.flag)}` \| `{re.escape(opt.env)}` \|", page), opt.flag
    help_text = cli("run", "--help").stdout
    for opt in OPTIONS:
        assert opt.flag in help_text and f"${opt.env}" in help_text
