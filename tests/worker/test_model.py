"""Which model a worker loads, and how Settings map onto the engine's configuration."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conveyor.engine.config import EngineConfig
from conveyor.engine.cpu_threads import ThreadChoice
from conveyor.worker.model import engine_config, engine_fields, resolve_model


def choice(threads: int) -> ThreadChoice:
    return ThreadChoice(threads, "fastest", {1: 3.1, 2: 5.4}, 2, 2, None)


def test_a_preset_is_built_once_into_the_model_cache_and_announced_as_random(
    make_settings: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(model="preset:tiny")
    with caplog.at_level(logging.WARNING, logger="conveyor.worker.model"):
        path = resolve_model(settings)
    assert path == str(settings.data_dir / "models" / "presets" / "tiny")
    assert "RANDOM WEIGHTS" in caplog.text and settings.served_model_id() == "tiny"
    config_file = Path(path) / "config.json"
    built_at = config_file.stat().st_mtime_ns

    assert resolve_model(settings) == path
    assert config_file.stat().st_mtime_ns == built_at  # reused, not rebuilt


def test_a_configured_folder_is_used_as_is(make_settings: Callable[..., Any], demo_model_dir: Path) -> None:
    assert resolve_model(make_settings(model=str(demo_model_dir))) == str(demo_model_dir)


def test_a_missing_folder_is_named(make_settings: Callable[..., Any], tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"model folder .*nowhere does not exist"):
        resolve_model(make_settings(model=str(tmp_path / "nowhere")))


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


def test_every_engine_knob_is_a_setting_of_the_same_name_that_defaults_to_the_engine_default(
    make_settings: Callable[..., Any]
) -> None:
    settings = make_settings(model=None)
    fields = engine_fields()
    assert {"max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold"} <= set(fields)
    missing = [name for name in fields if name not in type(settings).model_fields]
    assert not missing, f"EngineConfig fields without a setting: {missing}"
    assert all(getattr(settings, name) is None for name in fields), "defaults live in EngineConfig only"

    derived = engine_config(settings, "/models/m", choose_threads=lambda hidden: choice(2))
    engine_defaults = EngineConfig(model="/models/m")
    for name in fields:
        if name != "num_threads":  # measured on CPU when unset: see the tests below
            assert getattr(derived, name) == getattr(engine_defaults, name), name


def test_on_cpu_an_unset_thread_count_is_measured_once_with_the_model_hidden_size(
    make_settings: Callable[..., Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 96}')
    asked: list[int] = []

    def chooser(hidden: int) -> ThreadChoice:
        asked.append(hidden)
        return choice(1)

    with caplog.at_level(logging.INFO, logger="conveyor.worker.model"):
        config = engine_config(make_settings(device="cpu"), str(tmp_path), choose_threads=chooser)
    assert asked == [96] and config.num_threads == 1
    assert "torch threads: 1 of 2 CPUs (1: 3.10 ms, 2: 5.40 ms per step-sized matmul; fastest)" in caplog.text


def test_an_explicit_thread_count_or_a_gpu_is_not_measured(make_settings: Callable[..., Any]) -> None:
    def chooser(hidden: int) -> ThreadChoice:
        raise AssertionError("measured although not asked to")

    explicit = engine_config(make_settings(device="cpu", num_threads=3), "/models/m", choose_threads=chooser)
    assert explicit.num_threads == 3
    on_gpu = engine_config(make_settings(device="cuda"), "/models/m", choose_threads=chooser)
    assert on_gpu.num_threads is None  # torch's default: intra-op threads hardly matter next to the GPU


def test_the_start_line_counts_a_windowed_models_sequences_by_the_blocks_they_hold(
    tiny_model_dir: Callable[..., Path],
) -> None:
    """Mistral with a 16-token window: a 1024-token sequence holds at most 1 + ceil((15 + 63) / 16) = 6
    blocks at once (chunks of 64), so 12 blocks fit 2 such sequences, not 0."""
    from types import SimpleNamespace

    from conveyor.engine.model_runner import ModelRunner
    from conveyor.worker.model import describe_engine

    path = tiny_model_dir("MistralForCausalLM", sliding_window=16)
    config = EngineConfig(model=str(path), num_kv_blocks=12, max_model_len=1024, max_num_batched_tokens=64)
    host = SimpleNamespace(engine=SimpleNamespace(runner=ModelRunner(config)), config=config)
    assert "fits 2 sequences of max_model_len=1024" in describe_engine(host, str(path))  # type: ignore[arg-type]


def test_the_speculative_setting_reaches_the_engine_and_a_bad_field_stops_the_start(
    make_settings: Callable[..., Any]
) -> None:
    """The form is judged with the settings; the fields' values by the engine, when the worker derives its
    EngineConfig (before any weight is loaded), naming the field."""
    from conveyor.engine.speculation.config import SpeculativeConfig
    from conveyor.worker.model import describe_speculation

    given = make_settings(speculative={"method": "suffix", "num_tokens": 6}, num_threads=1)
    config = engine_config(given, "/models/m")
    assert config.speculative == SpeculativeConfig(method="suffix", num_tokens=6)
    assert describe_speculation(config) == "speculative suffix (up to 6 drafts per step)"
    off = engine_config(make_settings(speculative="none", num_threads=1), "/models/m")
    assert off.speculative is None and describe_speculation(off) == "speculative off"
    with pytest.raises(ValueError, match=r"speculative\.num_tokens must be"):
        engine_config(make_settings(speculative={"method": "ngram", "num_tokens": 99}, num_threads=1), "/m")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['tokens'\]"):
        engine_config(make_settings(speculative={"method": "ngram", "tokens": 4}, num_threads=1), "/m")
