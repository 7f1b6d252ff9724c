"""Settings: defaults, CONVEYOR_ environment variables, TOML file, per-queue partial overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from core.settings import Settings, default_queues, load_settings


def test_defaults(tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path)
    assert (s.host, s.port, s.broker_url, s.embedded) == ("127.0.0.1", 8000, None, True)
    assert s.database_url == f"sqlite:///{tmp_path.resolve() / 'conveyor.db'}"
    assert s.queues["interactive"].priority < s.queues["documents"].priority
    assert s.queues["documents"].max_prompt_tokens > s.queues["interactive"].max_prompt_tokens


def test_environment_and_partial_queue_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_BROKER_URL", "redis://127.0.0.1:6379/3")
    monkeypatch.setenv("CONVEYOR_QUEUES__DOCUMENTS__MAX_RUNNING", "1")
    monkeypatch.setenv("CONVEYOR_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("CONVEYOR_WORKER_SHUTDOWN_GRACE_S", "4.5")
    s = Settings()
    assert s.broker_url == "redis://127.0.0.1:6379/3" and not s.embedded and s.max_num_seqs == 8
    assert s.worker_shutdown_grace_s == 4.5
    assert s.queues["documents"].max_running == 1
    assert s.queues["documents"].max_prompt_tokens == Settings().queues["documents"].max_prompt_tokens
    assert s.queues["interactive"] == Settings().queues["interactive"]


def test_toml_file_under_environment_under_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "conveyor.toml"
    config.write_text('port = 9000\nmodel = "/models/x"\n[queues.interactive]\nmax_queued = 5\n')
    s = load_settings(config)
    assert (s.port, s.model, s.queues["interactive"].max_queued) == (9000, "/models/x", 5)
    monkeypatch.setenv("CONVEYOR_PORT", "9100")
    assert load_settings(config).port == 9100
    assert load_settings(config, port=9200).port == 9200
    monkeypatch.setenv("CONVEYOR_CONFIG_FILE", str(config))
    assert load_settings().model == "/models/x"
    with pytest.raises(ValueError, match=r"config file: .* does not exist"):
        load_settings(tmp_path / "missing.toml")


def test_invalid_values_name_the_field() -> None:
    with pytest.raises(ValidationError, match="max_running"):
        Settings(queues={"documents": {"max_running": 0}})
    with pytest.raises(ValidationError, match="port"):
        Settings(port=0)
    with pytest.raises(ValidationError, match="worker_shutdown_grace_s"):
        Settings(worker_shutdown_grace_s=0)
    with pytest.raises(ValidationError, match="batch_s3_allowlist"):
        Settings(batch_s3_allowlist=["s3:///prefix"])


@pytest.mark.parametrize("name", ["default_ttl_s", "default_deadline_s"])
@pytest.mark.parametrize("seconds", [1e12, float("inf")])
def test_a_queue_time_beyond_a_year_or_infinite_is_refused(name: str, seconds: float) -> None:
    with pytest.raises(ValueError, match=name):
        Settings(queues={"interactive": {name: seconds}})


def test_the_former_name_of_the_default_ttl_is_read_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        settings = Settings(queues={"interactive": {"deadline_s": 30}})
    queue = settings.queue("interactive")
    assert queue is not None and queue.default_ttl_s == 30 and queue.default_deadline_s is None
    assert "default_ttl_s" in caplog.text
    with pytest.raises(ValueError, match="deadline_s"):
        Settings(queues={"interactive": {"deadline_s": 30, "default_ttl_s": 60}})


def test_worker_queues_from_the_environment_choose_what_a_worker_consumes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_WORKER_QUEUES", " documents ,")
    settings = Settings(broker_url="redis://127.0.0.1:6379/0")
    assert settings.worker_queues == ["documents"]
    assert list(settings.consumed_queues()) == ["documents"]
    assert settings.consumed_queues()["documents"].max_running == settings.queues["documents"].max_running


def test_worker_queues_unset_or_embedded_means_every_queue() -> None:
    assert list(Settings(broker_url="redis://x").consumed_queues()) == list(default_queues())
    assert list(Settings(worker_queues="documents").consumed_queues()) == list(default_queues())  # embedded


def test_worker_queues_naming_an_unknown_queue_is_refused() -> None:
    with pytest.raises(ValueError, match=r"worker_queues: unknown queue\(s\) \['batch'\]"):
        Settings(worker_queues="interactive,batch")
