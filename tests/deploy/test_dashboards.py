"""The Grafana dashboard (deploy/grafana) and the Prometheus alert rules (deploy/prometheus) against the code.

Every query is parsed (brackets balanced, strings closed) and every metric name in it must be one the code
exports, derived from the registries themselves: a worker's WorkerMetrics and an API's Metrics, collected
once (cli/reference/metrics_page.py, which renders the metrics reference). Renaming a metric without its
dashboards fails here. The metric table of docs/operations/metrics.md must list exactly what the registries
export. When `promtool` is installed it checks the rules file too.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from conveyor.cli.reference.metrics_page import exported_metrics
from tests.support.metrics import documented_metrics, family_name

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "conveyor.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yaml"

SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
}
KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}
PAIRS = {")": "(", "]": "[", "}": "{"}


@pytest.fixture(scope="module")
def exported() -> dict[str, str]:
    """Family name -> type, of everything a worker and an API export (the registries, collected once)."""
    return {metric.name: metric.type for metric in exported_metrics()}


def exported_series(exported: dict[str, str]) -> set[str]:
    """The names PromQL may use: a counter's `_total`, a histogram's `_bucket`, `_sum`, `_count`."""
    return {name + suffix for name, kind in exported.items() for suffix in SUFFIXES[kind]}


def metric_names(expr: str) -> list[str]:
    """The metric names a PromQL expression selects. Raises ValueError when it does not parse as far as
    this check goes: unclosed strings, unbalanced brackets, an empty selector."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    if '"' in text.replace('""', ""):
        raise ValueError(f"unclosed string in {expr!r}")
    _check_brackets(text, expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\[\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)
    names = []
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        token = match.group(0)
        if token.lower() in KEYWORDS or token in AGGREGATIONS or text[match.end() :].lstrip().startswith("("):
            continue  # an operator, or a function or aggregation called here
        names.append(token)
    if not names:
        raise ValueError(f"no metric selected in {expr!r}")
    return names


def _check_brackets(text: str, expr: str) -> None:
    stack: list[str] = []
    for char in text:
        if char in "([{":
            stack.append(char)
        elif char in PAIRS and (not stack or stack.pop() != PAIRS[char]):
            raise ValueError(f"unbalanced {char!r} in {expr!r}")
    if stack:
        raise ValueError(f"unclosed {stack[-1]!r} in {expr!r}")


def dashboard_queries() -> list[str]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        definition = variable.get("definition", "")
        queries += re.findall(r"label_values\(([^,()]+),", definition)  # label_values(metric, label)
    return queries


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_the_checker_finds_names_and_refuses_broken_queries() -> None:
    expr = 'max by (queue) (rate(a_total{queue=~"x(y"}[5m])) > on (queue) group_left b / c:d_bucket'
    assert metric_names(expr) == ["a_total", "b", "c:d_bucket"]
    for broken in ("sum(rate(a[5m])", 'a{queue="x}', "max(", "a]"):
        with pytest.raises(ValueError):
            metric_names(broken)


def test_dashboard_queries_name_only_exported_metrics(exported: dict[str, str]) -> None:
    queries = dashboard_queries()
    assert len(queries) > 20
    used = {name for q in queries for name in metric_names(q)}
    assert used <= exported_series(exported), sorted(used - exported_series(exported))


def test_dashboard_covers_what_the_issue_asks() -> None:
    text = " ".join(dashboard_queries())
    for needed in (
        "conveyor_job_outcomes_total",
        "conveyor_job_deadlines_total",
        "conveyor_job_e2e_seconds_bucket",
        "conveyor_queue_depth",
        "conveyor_queue_oldest_age_seconds",
        "conveyor:kv_cache_usage_perc",
        "conveyor:num_preemptions_total",
        "conveyor:spec_decode_num_accepted_tokens_total",
        "conveyor:spec_decode_num_draft_tokens_total",
        "conveyor_webhook_deliveries_total",
    ):
        assert needed in text, needed


def test_goodput_is_read_per_tier_before_tiers_are_added() -> None:
    """conveyor_job_deadlines_total has a series per queue, tier and outcome; every query takes max() over API
    replicas keeping `tier` (max by (queue) alone would pick one tier instead of adding them), and the
    dashboard shows goodput per tier too."""
    assert set(_labels_of("conveyor_job_deadlines_total")) == {"model", "queue", "tier", "outcome"}
    alert = next(r for r in alert_rules() if r["alert"] == "ConveyorOnTimeRatioLow")
    queries = [*dashboard_queries(), alert["expr"]]
    goodput = [q for q in queries if "conveyor_job_deadlines_total" in q]
    assert len(goodput) >= 4
    for query in goodput:
        grouped = re.findall(r"max by \(([^()]*)\) \(rate\(conveyor_job_deadlines_total", query)
        assert grouped and all("tier" in labels.replace(" ", "").split(",") for labels in grouped), query
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    per_tier = [t for p in dashboard["panels"] for t in p.get("targets", [])
                if "conveyor_job_deadlines_total" in t["expr"] and "{{tier}}" in t["legendFormat"]]
    assert any("/" in t["expr"] for t in per_tier), "no on-time share per tier"
    assert any("/" not in t["expr"] and 'outcome="on_time"' in t["expr"] for t in per_tier), "no on time/s"


def _labels_of(name: str) -> frozenset[str]:
    return next(doc.labels for doc in documented_metrics() if doc.name == name)


def test_alert_expressions_name_only_exported_metrics(exported: dict[str, str]) -> None:
    rules = alert_rules()
    assert {r["alert"] for r in rules} == {
        "ConveyorQueuedJobPastTtl",
        "ConveyorBacklogWithoutWorkers",
        "ConveyorOnTimeRatioLow",
        "ConveyorPreemptionRateHigh",
        "ConveyorWebhookFailureRateHigh",
        "ConveyorWorkerHeartbeatLost",
    }
    for rule in rules:
        used = set(metric_names(rule["expr"]))
        assert used <= exported_series(exported), (rule["alert"], sorted(used - exported_series(exported)))
        assert rule["labels"]["severity"] and rule["annotations"]["summary"], rule["alert"]


def test_promtool_accepts_the_rules_and_queries_when_installed(tmp_path: Path) -> None:
    """Prometheus' own parser, where installed (apt's `prometheus` package): the rules file, and every
    dashboard query as a recording rule (Grafana's variables replaced by values)."""
    promtool = shutil.which("promtool")
    if promtool is None:  # the name check above runs everywhere; promtool adds Prometheus' parser
        pytest.skip("promtool is not installed (Debian: apt install prometheus)")
    queries = [q.replace("$__rate_interval", "5m").replace("$queue", ".*") for q in dashboard_queries()]
    recording = [{"record": f"dashboard:query{i}", "expr": q} for i, q in enumerate(queries)]
    dashboard_rules = tmp_path / "dashboard_rules.yaml"
    dashboard_rules.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": recording}]}))
    for path in (ALERTS, dashboard_rules):
        done = subprocess.run(
            [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_readme_documents_exactly_what_is_exported(exported: dict[str, str]) -> None:
    documented = {family_name(doc): doc.type for doc in documented_metrics()}
    assert documented == exported
