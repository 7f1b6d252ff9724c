"""Which model a worker loads, and how Settings map onto the engine's configuration."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from worker.model import engine_config, resolve_model


def test_without_a_model_the_demo_model_is_built_once_and_announced_as_random(
    make_settings: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(model=None)
    with caplog.at_level(logging.WARNING, logger="worker.model"):
        path = resolve_model(settings)
    assert path == str(settings.data_dir / "demo-model")
    assert "RANDOM WEIGHTS" in caplog.text
    config_file = settings.data_dir / "demo-model" / "config.json"
    built_at = config_file.stat().st_mtime_ns

    assert resolve_model(settings) == path
    assert config_file.stat().st_mtime_ns == built_at  # reused, not rebuilt


def test_a_configured_model_is_used_as_is(make_settings: Callable[..., Any]) -> None:
    assert resolve_model(make_settings(model="/models/some-model")) == "/models/some-model"


def test_each_queue_becomes_an_engine_request_class_with_its_limit_and_priority(
    make_settings: Callable[..., Any]
) -> None:
    settings = make_settings(max_num_seqs=32, max_num_batched_tokens=1024, block_size=32, dtype="float32",
                             num_threads=2, queues={"documents": {"max_running": 3}})

    config = engine_config(settings, "/models/m")

    assert config.model == "/models/m" and config.max_num_seqs == 32 and config.block_size == 32
    assert config.max_num_batched_tokens == 1024 and config.dtype == "float32" and config.num_threads == 2
    classes = {c.name: (c.max_running, c.priority) for c in config.request_classes}
    assert classes == {"interactive": (settings.queues["interactive"].max_running, 0), "documents": (3, 1)}
