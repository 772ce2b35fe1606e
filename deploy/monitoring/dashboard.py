"""Writes grafana-dashboard.json, the Grafana dashboard of the agents' /metrics: one row per node
(the `node` variable, several at once), each with the agent's state, its devices, prepared claims,
prepare latency, device taints, API requests, publishing and discovery.

    python3 deploy/monitoring/dashboard.py            # rewrites deploy/monitoring/grafana-dashboard.json
    python3 deploy/monitoring/dashboard.py --check    # exit 1 when the file is not what this writes

The JSON is generated so that every panel has the same shape and the metric names stay in one place
to read; tests/test_monitoring.py checks that the file is this script's output, that the panels it
promises are there, and that every metric their queries name is one the agent serves. It expects the
agents scraped as prometheus-scrape.yaml scrapes them (job `dra-agent`, a `node` label). Standard
library only.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

OUT = Path(__file__).resolve().parent / "grafana-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
NODE = 'node=~"$node"'  # the repeated row's node
WIDTH = 24  # Grafana's grid


@dataclass
class Query:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass
class Panel:
    title: str
    queries: list[Query]
    kind: str = "timeseries"  # or "stat"
    unit: str = "short"
    width: int = 8
    height: int = 8
    description: str = ""
    mappings: list[dict[str, object]] = field(default_factory=list)
    text_mode: str = "value"  # a stat's: value, name (the legend, e.g. the version)


UP_DOWN = [{"type": "value", "options": {"0": {"text": "down", "color": "red"},
                                         "1": {"text": "up", "color": "green"}}}]
YES_NO = [{"type": "value", "options": {"0": {"text": "no", "color": "red"},
                                        "1": {"text": "yes", "color": "green"}}}]


def node_panels() -> list[Panel]:
    """The panels of one node's row."""
    def rate(metric: str, by: str, labels: str = "") -> str:
        sel = f"{{{NODE}{', ' + labels if labels else ''}}}"
        return f"sum by ({by}) (rate({metric}{sel}[$__rate_interval]))"

    def quantile(q: float, operation: str) -> Query:
        return Query(f"histogram_quantile({q}, sum by (le) (rate(dra_agent_claim_operation_duration_seconds_bucket"
                     f'{{{NODE}, operation="{operation}"}}[$__rate_interval])))', f"{operation} p{round(q * 100)}")

    return [
        Panel("Agent", [Query(f'up{{job="dra-agent", {NODE}}}', instant=True)], kind="stat", width=4, height=4,
              mappings=UP_DOWN, description="Whether Prometheus scrapes the agent (alert DraAgentDown)."),
        Panel("Kubelet registered", [Query(f"dra_agent_kubelet_registered{{{NODE}}}", instant=True)], kind="stat",
              width=4, height=4, mappings=YES_NO,
              description="Whether the kubelet registered the plugin (alert DraAgentNotReady)."),
        Panel("Version", [Query(f"dra_agent_build_info{{{NODE}}}", "{{version}}", instant=True)], kind="stat",
              width=4, height=4, text_mode="name", description="The agent's version (dra-agent --version)."),
        Panel("Publish failures in a row", [Query(f"dra_agent_publish_consecutive_failures{{{NODE}}}", instant=True)],
              kind="stat", width=4, height=4,
              description="Publish attempts failed since the last success (alert DraAgentPublishFailing)."),
        Panel("Records set aside", [Query(f"dra_agent_records_quarantined_total{{{NODE}}}", instant=True)],
              kind="stat", width=4, height=4,
              description="Claim records set aside since the agent started (alert DraAgentRecordsSetAside)."),
        Panel("Discovery sources failing", [Query(f"count(dra_agent_discovery_source_failing{{{NODE}}} == 1) or "
                                                  "vector(0)", instant=True)],
              kind="stat", width=4, height=4,
              description="Kinds whose discovery scans fail now; gpu is NVML (alert DraAgentNvmlLost)."),
        Panel("Devices", [Query(f"sum by (kind, health) (dra_agent_devices{{{NODE}}})", "{{kind}} {{health}}"),
                          Query(f"dra_agent_published_devices{{{NODE}}}", "published")],
              description="Devices by kind and health, as the health stream reports them, and the devices in "
                          "the ResourceSlices last published."),
        Panel("Prepared claims", [Query(f"dra_agent_prepared_claims{{{NODE}}}", "claims"),
                                  Query(f"dra_agent_prepared_devices{{{NODE}}}", "devices"),
                                  Query(f"sum(dra_agent_claim_operations_in_flight{{{NODE}}})", "in flight")],
              description="Claims prepared on the node, their devices, and prepares and unprepares running now."),
        Panel("Prepare latency", [quantile(0.5, "prepare"), quantile(0.99, "prepare"), quantile(0.99, "unprepare")],
              unit="s", description="Time to prepare or unprepare one claim (the kubelet gives up after 45 s)."),
        Panel("Claim operations", [Query(rate("dra_agent_claim_operations_total", "operation, result"),
                                         "{{operation}} {{result}}")],
              unit="ops", description="Prepares and unprepares of claims by result (alert DraAgentPrepareErrors)."),
        Panel("Device taints", [Query(f"sum by (cause, effect) (dra_agent_device_taints{{{NODE}}})",
                                      "{{cause}} {{effect}}")],
              description="Devices tainted now by cause and effect (alert DraAgentDevicesTainted; "
                          "dra-agent taints lists them)."),
        Panel("API requests", [Query(rate("dra_agent_api_requests_total", "verb, resource"), "{{verb}} {{resource}}")],
              unit="reqps", description="Requests the agent sends to the API server, by verb and resource."),
        Panel("Publishing", [Query(rate("dra_agent_publish_syncs_total", "result"), "{{result}}"),
                             Query(rate("dra_agent_slice_writes_total", "action"), "slice {{action}}")],
              unit="ops", description="Publish attempts by result, and ResourceSlice writes."),
        Panel("Discovery scans", [Query(rate("dra_agent_discovery_scans_total", "kind, result"),
                                        "{{kind}} {{result}}")],
              unit="ops", description="Discovery scans by kind (gpu: NVML) and result."),
        Panel("Kubelet calls", [Query(rate("grpc_server_handled_total", "grpc_method, grpc_code"),
                                      "{{grpc_method}} {{grpc_code}}")],
              unit="ops", description="Calls of the kubelet on the DRA socket, by method and status code."),
    ]


def render_panel(panel: Panel, ident: int, x: int, y: int) -> dict[str, object]:
    targets = [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": q.expr, "legendFormat": q.legend,
                "instant": q.instant, "range": not q.instant} for i, q in enumerate(panel.queries)]
    out: dict[str, object] = {
        "id": ident, "type": panel.kind, "title": panel.title, "description": panel.description,
        "datasource": DATASOURCE, "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": panel.unit, "mappings": panel.mappings}, "overrides": []},
    }
    if panel.kind == "stat":
        out["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                          "textMode": panel.text_mode, "colorMode": "value", "graphMode": "none"}
    else:
        out["options"] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                          "tooltip": {"mode": "multi", "sort": "desc"}}
    return out


def dashboard() -> dict[str, object]:
    panels: list[dict[str, object]] = [{
        "id": 1, "type": "row", "title": "Node $node", "repeat": "node", "collapsed": False, "panels": [],
        "gridPos": {"h": 1, "w": WIDTH, "x": 0, "y": 0},
    }]
    x, y, row_height = 0, 1, 0
    for panel in node_panels():
        if x + panel.width > WIDTH:
            x, y, row_height = 0, y + row_height, 0
        panels.append(render_panel(panel, len(panels) + 1, x, y))
        x += panel.width
        row_height = max(row_height, panel.height)
    return {
        "title": "DRA agent",
        "uid": "dra-agent-nodes",
        "description": "The dra-agent DRA driver on each node: devices, claims, prepare latency, taints, API "
                       "requests (deploy/monitoring/dashboard.py writes it)",
        "tags": ["dra-agent", "kubernetes", "dra"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "1m",
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            {"name": "node", "label": "Node", "type": "query", "datasource": DATASOURCE,
             "definition": 'label_values(dra_agent_build_info{job="dra-agent"}, node)',
             "query": {"query": 'label_values(dra_agent_build_info{job="dra-agent"}, node)', "refId": "node"},
             "refresh": 2, "sort": 1, "multi": True, "includeAll": True, "current": {}, "hide": 0},
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }


def text() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        if OUT.read_text() != text():
            print(f"{OUT} is not what {Path(__file__).name} writes: run it", file=sys.stderr)
            return 1
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    OUT.write_text(text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
