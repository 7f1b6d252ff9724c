"""The reference pages rendered from the code (cli/reference/) name every setting, route and command,
with the defaults the code has: a setting, route or command left out, or a setting without a description,
fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conveyor.cli.main import app
from conveyor.cli.reference import pages
from conveyor.cli.reference.cli_page import cli_page, command_paths
from conveyor.cli.reference.http_page import http_page, openapi_document, routes
from conveyor.cli.reference.metrics_page import exported_metrics, metrics_page
from conveyor.cli.reference.settings_page import engine_defaults, settings_page
from conveyor.core.settings import QueueSettings, Settings
from conveyor.worker.model import engine_fields


@pytest.fixture(scope="module")
def document() -> dict:
    return openapi_document()


def _row(page: str, variable: str) -> list[str]:
    match = re.search(rf"^\| `{re.escape(variable)}` \|(.*)\|$", page, re.MULTILINE)
    assert match is not None, f"{variable}: no row in the settings reference"
    return [cell.strip() for cell in match.group(1).split(" | ")]


def test_every_setting_has_a_row_with_its_description() -> None:
    page = settings_page()
    for name, field in Settings.model_fields.items():
        if name == "queues":
            continue
        assert field.description, f"Settings.{name} has no description: the reference would say nothing"
        _, _, meaning = _row(page, f"CONVEYOR_{name.upper()}")
        assert meaning == field.description.replace("|", "\\|")
    for name, field in QueueSettings.model_fields.items():
        assert field.description, f"QueueSettings.{name} has no description"
        _row(page, f"CONVEYOR_QUEUES__<QUEUE>__{name.upper()}")


def test_plain_defaults_are_the_settings_and_engine_defaults_the_engines() -> None:
    page = settings_page()
    assert _row(page, "CONVEYOR_PORT")[1] == "`8000`"
    assert _row(page, "CONVEYOR_BROKER_URL")[1] == "unset"
    assert _row(page, "CONVEYOR_METRICS_TOKEN")[1] == "unset"
    defaults = engine_defaults()
    for name in engine_fields():
        shown = _row(page, f"CONVEYOR_{name.upper()}")[1]
        value = defaults[name]
        expected = "the engine's (unset)" if value is None else f"`{value}` (the engine's)"
        assert shown == expected, (name, shown, value)
    assert "`interactive` (max_queued 1000, max_running 16" in page


def test_every_route_of_the_app_is_listed(document: dict) -> None:
    page = http_page(document)
    listed = set(re.findall(r"^\| (GET|POST|PUT|PATCH|DELETE) \| `([^`]+)` \|", page, re.MULTILINE))
    served = set(routes(document))
    assert served == listed
    assert {("POST", "/v1/jobs"), ("POST", "/v1/chat/completions"), ("GET", "/healthz")} <= served


def test_every_cli_command_has_its_help() -> None:
    page = cli_page(app)
    paths = command_paths(app)
    assert {("conveyor", "serve"), ("conveyor", "worker"), ("conveyor", "keys", "create")} <= set(paths)
    for path in paths:
        command = " ".join(path)
        assert f"## `{command}`" in page
        assert re.search(rf"usage: {re.escape(command)}\b", page, re.IGNORECASE), f"{command}: no help"


def test_pages_are_the_ones_the_navigation_names() -> None:
    nav = (Path(__file__).resolve().parents[2] / "mkdocs.yml").read_text()
    for path in pages(app):
        if path.endswith(".md"):
            assert path in nav, f"{path} is rendered but not in mkdocs.yml's navigation"


def test_every_exported_metric_is_listed_with_its_type_and_help() -> None:
    metrics = exported_metrics()
    page = metrics_page(metrics)
    assert {m.where for m in metrics} == {"worker", "api"}
    assert {"conveyor_jobs_submitted", "conveyor:num_requests_running"} <= {m.name for m in metrics}
    for metric in metrics:
        name = metric.name + ("_total" if metric.type == "counter" else "")
        assert f"| `{name}` | {metric.type} | {metric.where} |" in page, f"{name} is not listed"
        assert metric.help, f"{name} has no help text"
