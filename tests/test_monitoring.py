"""The alerts and the dashboard of deploy/monitoring: the rules pass Prometheus's own checks (`promtool
check rules`) and their unit tests (`promtool test rules` with tests/promtool/rules_test.yaml: series that
fire each alert and series that do not), each alert names its runbook section, the dashboard is its
generator's output with the panels it promises, and every metric the rules and the dashboard query is
one a running agent serves on /metrics.

promtool and promqlnames (Prometheus's PromQL parser, listing an expression's metric names) are built
from their Go module by tests/promtool/build.py (`make test` builds them first); without Go the tests
that need them skip, unless DRA_TEST_NO_SKIP is set."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pynvml
import pytest
import yaml
from agentkit import claim, result, roots, write_claim
from prometheus_client.parser import text_string_to_metric_families
from test_docs import headings

from agent.app.daemon import Agent
from agent.kubelet import client as kc
from agent.names import ClaimRef

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "deploy" / "monitoring"
RULES = MONITORING / "prometheus-rules.yaml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
UNIT_TESTS = Path(__file__).resolve().parent / "promtool" / "rules_test.yaml"
RUNBOOK = ROOT / "docs" / "runbook.md"
# What the issue asks the alerts to tell (issue 41), each by its alert.
ALERTS = {"DraAgentDown", "DraAgentTargetsMissing", "DraAgentNotReady", "DraAgentDevicesTainted",
          "DraAgentRecordsSetAside", "DraAgentPrepareErrors", "DraAgentPublishFailing", "DraAgentNvmlLost"}
# What the dashboard promises per node (its panel titles).
PANELS = {"Devices", "Prepared claims", "Prepare latency", "Device taints", "API requests", "Agent", "Version"}
# Names the rules query that are not the agent's: Prometheus's own per target.
NOT_THE_AGENTS = {"up": "written by Prometheus for each target it scrapes"}
# A `dra-agent` command in a code span (alone, or run in the pod by kubectl exec).
COMMAND = re.compile(r"`[^`\n]*\bdra-agent (doctor|devices|slices|claims|kubelet|taints|vfio|pool|cdi)\b")
UID_OK = "6a1e0c00-0000-4000-8000-0000000000a1"
UID_MISSING = "6a1e0c00-0000-4000-8000-0000000000a2"


@pytest.fixture(scope="module")
def gobin() -> Callable[[str], Path]:
    from promtool import build

    return build.PROMTOOL.for_test


def rule_object() -> dict[str, Any]:
    obj = yaml.safe_load(RULES.read_text())
    assert (obj["apiVersion"], obj["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    return obj


def rules() -> list[dict[str, Any]]:
    return [rule for group in rule_object()["spec"]["groups"] for rule in group["rules"]]


def write_rules(directory: Path) -> Path:
    """The PrometheusRule's spec as a Prometheus rules file: the one source of both."""
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump(rule_object()["spec"], sort_keys=False))
    return path


def promtool_run(promtool: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(promtool), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_rules(gobin, tmp_path):
    write_rules(tmp_path)
    checked = promtool_run(gobin("promtool"), tmp_path, "check", "rules", "--lint=all", "--lint-fatal", "rules.yaml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in checked.stdout


def test_each_alert_fires_and_does_not_fire_as_its_unit_tests_say(gobin, tmp_path):
    write_rules(tmp_path)
    shutil.copy(UNIT_TESTS, tmp_path / "rules_test.yaml")
    tested = promtool_run(gobin("promtool"), tmp_path, "test", "rules", "rules_test.yaml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # Both cases for each alert: a time it fires, and a time it does not (an empty exp_alerts).
    cases: dict[str, set[bool]] = {}
    for group in yaml.safe_load(UNIT_TESTS.read_text())["tests"]:
        for case in group["alert_rule_test"]:
            cases.setdefault(case["alertname"], set()).add(bool(case.get("exp_alerts")))
    assert {name for name, kinds in cases.items() if kinds == {True, False}} == ALERTS == {r["alert"] for r in rules()}


def test_the_unit_tests_fail_for_a_rule_that_fires_too_soon(gobin, tmp_path):
    """The unit tests can fail: DraAgentDown without its `for` fires while they expect it pending."""
    obj = rule_object()
    for group in obj["spec"]["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "DraAgentDown":
                del rule["for"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(obj["spec"]))
    shutil.copy(UNIT_TESTS, tmp_path / "rules_test.yaml")
    tested = promtool_run(gobin("promtool"), tmp_path, "test", "rules", "rules_test.yaml")
    assert tested.returncode == 1
    assert "DraAgentDown" in tested.stdout + tested.stderr


def runbook_sections() -> dict[str, str]:
    """Each `##` section of the runbook by its anchor."""
    text = RUNBOOK.read_text()
    sections: dict[str, str] = {}
    parts = re.split(r"^## .+$", text, flags=re.M)[1:]
    for (_, _, anchor), body in zip([h for h in headings(text) if h[0] == 2], parts, strict=True):
        sections[anchor] = body
    return sections


def test_each_alert_says_what_and_how_bad_and_links_its_runbook_section():
    sections = runbook_sections()
    for rule in rules():
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        page, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert (page, anchor) == ("docs/runbook.md", name.lower())
        body = sections.get(anchor)
        assert body is not None, f"{name}: no section #{anchor} in docs/runbook.md"
        # What it means, what to check with which command, what to do.
        assert COMMAND.search(body), f"{name}: its runbook section names no dra-agent command"
        for part in ("**What it means.**", "**Check.**", "**Do.**"):
            assert part in body, f"{name}: its runbook section has no {part}"


def dashboard_panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def test_the_dashboard_is_its_generators_output_with_the_panels_it_promises():
    spec = importlib.util.spec_from_file_location("monitoring_dashboard", MONITORING / "dashboard.py")
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = generator  # where its dataclasses look themselves up
    spec.loader.exec_module(generator)
    loaded = json.loads(DASHBOARD.read_text())
    assert loaded == generator.dashboard(), "run python3 deploy/monitoring/dashboard.py"
    [row] = [p for p in loaded["panels"] if p["type"] == "row"]
    assert row["repeat"] == "node"  # a row per node
    variables = {v["name"]: v for v in loaded["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus" and variables["node"]["multi"]
    panels = dashboard_panels()
    assert {p["title"] for p in panels} >= PANELS
    assert len({p["id"] for p in loaded["panels"]}) == len(loaded["panels"])
    for p in panels:
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24, p["title"]
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        for target in p["targets"]:
            assert 'node=~"$node"' in target["expr"], (p["title"], target["expr"])


def queried_expressions() -> dict[str, str]:
    """Every PromQL expression the rules and the dashboard run, by where it is; Grafana's variables
    replaced by what Grafana puts there."""
    exprs = {f"rule {r['alert']}": r["expr"] for r in rules()}
    loaded = json.loads(DASHBOARD.read_text())
    for p in dashboard_panels():
        for t in p["targets"]:
            exprs[f"panel {p['title']} {t['refId']}"] = t["expr"].replace("$__rate_interval", "5m")
    for v in loaded["templating"]["list"]:
        if v["type"] == "query":
            exprs[f"variable {v['name']}"] = re.fullmatch(r"label_values\((.+), \w+\)", v["query"]["query"]).group(1)
    return exprs


def metric_names(promqlnames: Path) -> dict[str, set[str]]:
    """Each metric name the expressions select, with where: parsed by Prometheus's own parser."""
    exprs = queried_expressions()
    out = subprocess.run([str(promqlnames)], input=json.dumps(list(exprs.values())), capture_output=True,
                         text=True, timeout=60, check=True)
    names: dict[str, set[str]] = {}
    for where, parsed in zip(exprs, json.loads(out.stdout), strict=True):
        assert not parsed.get("error"), f"{where}: {parsed['error']}"
        for name in parsed["names"]:
            names.setdefault(name, set()).add(where)
    return names


@dataclass
class Scrape:
    samples: dict[str, list[tuple[dict[str, str], float]]]  # sample name -> (labels, value)
    declared: set[str]  # the sample names each family's TYPE allows, samples or not


def parse_scrape(text: str) -> Scrape:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "summary": ("", "_count", "_sum"),
                "gauge": ("",), "info": ("_info",), "unknown": ("",)}
    scrape = Scrape({}, set())
    for family in text_string_to_metric_families(text):
        scrape.declared.update(family.name + s for s in suffixes[family.type])
        for s in family.samples:
            scrape.samples.setdefault(s.name, []).append((s.labels, s.value))
    return scrape


@pytest.fixture
async def agent(short_tmp) -> AsyncIterator[Agent]:
    running = Agent(roots(short_tmp, rescan_interval=3600.0, metrics_address="127.0.0.1:0"))
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


async def scrape_until(agent: Agent, done: Callable[[Scrape], bool], what: str) -> Scrape:
    assert agent.http is not None
    deadline = time.monotonic() + 30
    async with httpx2.AsyncClient(timeout=10, trust_env=False) as http:
        while True:
            response = await http.get(f"{agent.http.url}/metrics")
            assert response.status_code == 200
            scrape = parse_scrape(response.text)
            if done(scrape):
                return scrape
            if time.monotonic() > deadline:
                pytest.fail(f"/metrics: {what}: not within 30 s")
            await asyncio.sleep(0.05)


def value(scrape: Scrape, name: str, **labels: str) -> float | None:
    return next((v for lb, v in scrape.samples.get(name, []) if labels.items() <= lb.items()), None)


async def test_every_metric_the_rules_and_the_dashboard_name_is_served_by_a_running_agent(gobin, agent):
    """Scraped from a running agent after the events the alerts are about, so that (all but one) have
    samples, not only a declaration: a claim prepared and one that fails, an XID on a GPU (a taint), NVML
    failing (the GPU scans fail). `dra_agent_api_requests_total` is the exception: the agent runs offline
    here, with no API server to send requests to, so it is checked by its declaration (# TYPE) in the same
    scrape; the cluster tests count its requests (tests/cluster)."""
    names = metric_names(gobin("promqlnames"))
    write_claim(agent.settings.offline / "resourceclaims", claim("ok", UID_OK, [result("gpu-0")]))
    async with kc.DRAClient(agent.settings.dra_socket) as client:
        assert (await client.prepare([ClaimRef("default", "ok", UID_OK)])).claims[UID_OK].error == ""
        assert (await client.prepare([ClaimRef("default", "gone", UID_MISSING)])).claims[UID_MISSING].error
    gpus = next(s for s in agent.inventory.sources if s.kind == "gpu")
    gpus.nvml.raise_xid(3, 48)  # NoSchedule (docs/health.md)
    scrape = await scrape_until(agent, lambda s: bool(value(s, "dra_agent_device_taints", cause="xid")),
                                "the XID's taint")
    assert value(scrape, "dra_agent_device_taints", cause="xid", effect="NoSchedule") == 1  # DraAgentDevicesTainted
    # NVML gone from under the agent (the driver unloaded): what DraAgentNvmlLost reads.
    gpus.nvml.inject_error(None, "nvmlDeviceGetCount", pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    await agent.rescan(["gpu"])
    scrape = await scrape_until(agent, lambda s: value(s, "dra_agent_discovery_source_failing", kind="gpu") == 1,
                                "the GPU source failing")
    assert value(scrape, "dra_agent_claim_operations_total", operation="prepare", result="error") == 1
    assert value(scrape, "dra_agent_publish_consecutive_failures") == 0
    assert value(scrape, "dra_agent_kubelet_registered") == 0  # no kubelet here: what DraAgentNotReady reads
    assert value(scrape, "process_start_time_seconds")

    unknown = {n: sorted(w) for n, w in names.items() if n not in scrape.declared and n not in NOT_THE_AGENTS}
    assert not unknown, f"queried but not served by the agent: {unknown}"
    declared_only = {n for n in names if n in scrape.declared and n not in scrape.samples}
    assert declared_only == {"dra_agent_api_requests_total"}
    assert set(names) >= {"up", "dra_agent_device_taints", "dra_agent_discovery_source_failing",
                          "dra_agent_records_quarantined_total", "dra_agent_claim_operations_total",
                          "dra_agent_claim_operation_duration_seconds_bucket"}
