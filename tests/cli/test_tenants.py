"""`conveyor tenants set|show|list` and `conveyor keys create --admin`: overrides land in the store and take
effect on the next submit; --reset gives a limit back to its setting; bad values name the field."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conveyor.cli.main import app
from tests.support.service import Service

runner = CliRunner()


def test_set_show_reset_and_list(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_DATABASE_URL", service.settings.database_url)
    monkeypatch.setenv("CONVEYOR_TENANT_MAX_RUNNING", "4")
    alice = service.client("alice")

    done = runner.invoke(app, ["tenants", "set", "alice", "--weight", "2.5", "--max-queued", "1",
                               "--tokens-per-minute", "5000"])

    assert done.exit_code == 0, done.output
    shown = json.loads(done.output)
    assert shown["overrides"] == {"weight": 2.5, "max_queued": 1, "max_running": None,
                                  "tokens_per_minute": 5000, "retention_days": None, "min_priority": None,
                                  "max_priority": None, "cache_namespace": None}
    assert shown["effective"]["cache_salt"] == "tenant:alice"
    assert shown["effective"]["max_running"] == 4  # the setting, as no override is set
    assert alice.post("/v1/jobs", json={"prompt": "x"}).status_code == 202
    assert alice.post("/v1/jobs", json={"prompt": "x"}).status_code == 429  # its max_queued, at once

    reset = runner.invoke(app, ["tenants", "set", "alice", "--reset", "max-queued", "--max-running", "1"])
    assert reset.exit_code == 0, reset.output
    assert json.loads(reset.output)["overrides"]["max_queued"] is None
    assert alice.post("/v1/jobs", json={"prompt": "x"}).status_code == 202
    show = json.loads(runner.invoke(app, ["tenants", "show", "alice"]).output)
    assert show["effective"]["max_running"] == 1 and show["effective"]["weight"] == 2.5
    listed = runner.invoke(app, ["tenants", "list"])
    assert listed.exit_code == 0 and "alice" in listed.output and "2.5*" in listed.output


def test_cache_namespace_is_set_shown_listed_and_reset(
    service: Service, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CONVEYOR_DATABASE_URL", service.settings.database_url)
    done = runner.invoke(app, ["tenants", "set", "alice", "--cache-namespace", "acme"])
    assert done.exit_code == 0, done.output
    shown = json.loads(done.output)
    assert shown["overrides"]["cache_namespace"] == "acme"
    assert shown["effective"]["cache_salt"] == "namespace:acme"
    listed = runner.invoke(app, ["tenants", "list"])
    assert listed.exit_code == 0 and "acme" in listed.output, listed.output
    reset = runner.invoke(app, ["tenants", "set", "alice", "--reset", "cache-namespace"])
    assert reset.exit_code == 0, reset.output
    assert json.loads(reset.output)["effective"]["cache_salt"] == "tenant:alice"
    blank = runner.invoke(app, ["tenants", "set", "alice", "--cache-namespace", " acme"])
    assert blank.exit_code == 2 and "cache_namespace" in blank.output


def test_a_priority_range_holds_the_tenants_jobs(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_DATABASE_URL", service.settings.database_url)
    alice = service.client("alice")
    done = runner.invoke(app, ["tenants", "set", "alice", "--min-priority", "2", "--max-priority", "9"])
    assert done.exit_code == 0, done.output
    effective = json.loads(done.output)["effective"]
    assert (effective["min_priority"], effective["max_priority"]) == (2, 9)

    refused = alice.post("/v1/jobs", json={"prompt": "x", "priority": 1})
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["code"] == "priority_not_permitted" and error["field"] == "priority"
    assert "[2, 9]" in error["message"]
    tier = alice.post("/v1/jobs", json={"prompt": "x", "service_tier": "priority"})
    assert tier.status_code == 403 and tier.json()["error"]["field"] == "service_tier"
    assert alice.post("/v1/jobs", json={"prompt": "x", "priority": 9}).json()["priority"] == 9
    assert alice.post("/v1/jobs", json={"prompt": "x"}).json()["priority"] == 2  # 0 brought into the range
    assert alice.post("/v1/jobs", json={"prompt": "x", "service_tier": "flex"}).status_code == 403
    model = service.settings.served_model_id()
    openai = alice.post("/v1/completions", json={"model": model, "prompt": "x", "service_tier": "priority"})
    assert openai.status_code == 403 and openai.json()["error"]["param"] == "service_tier", openai.text

    upside_down = runner.invoke(app, ["tenants", "set", "alice", "--max-priority", "1"])
    assert upside_down.exit_code == 2 and "min_priority" in upside_down.output
    shown = json.loads(runner.invoke(app, ["tenants", "show", "alice"]).output)
    assert shown["overrides"]["max_priority"] == 9


def test_bad_values_and_unknown_tenants_are_refused(
    service: Service, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CONVEYOR_DATABASE_URL", service.settings.database_url)
    bad = runner.invoke(app, ["tenants", "set", "alice", "--max-running", "0"])
    assert bad.exit_code == 2 and "max_running" in bad.output
    nothing = runner.invoke(app, ["tenants", "set", "alice"])
    assert nothing.exit_code == 2 and "nothing to set" in nothing.output
    unknown = runner.invoke(app, ["tenants", "show", "nobody"])
    assert unknown.exit_code == 2 and "no such tenant" in unknown.output


def test_keys_create_admin(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_DATABASE_URL", service.settings.database_url)
    service.client("alice").post("/v1/jobs", json={"prompt": "x"})
    created = runner.invoke(app, ["keys", "create", "--tenant", "ops", "--admin"])
    assert created.exit_code == 0, created.output
    key = json.loads(created.output)
    assert key["admin"] is True
    queues = service.client_with_key(key["key"]).get("/v1/queues").json()
    assert queues["scope"] == "all" and queues["data"][0]["queued"] == 1
