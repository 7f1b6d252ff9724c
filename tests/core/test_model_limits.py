"""core/protocol/model_limits.py: the model's context length read from config.json as the engine resolves it,
and queue limits clamped to it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conveyor.core.protocol.model_limits import (
    clamp_queue_limits,
    limits_beyond_model,
    model_context_length,
    served_max_model_len,
)
from conveyor.core.settings import default_queues
from conveyor.engine.model_runner import resolve_max_model_len


@pytest.mark.parametrize(
    "config",
    [
        {"max_position_embeddings": 4096},
        {"max_position_embeddings": 4096, "sliding_window": 1024},
        {"max_position_embeddings": 4096, "sliding_window": 1024, "use_sliding_window": False},
        {"max_position_embeddings": 4096, "sliding_window": 1024, "layer_types": ["full_attention"]},
        {"max_position_embeddings": 4096, "sliding_window": 8192},
    ],
)
def test_the_context_length_is_the_one_the_engine_serves(tmp_path: Path, config: dict[str, Any]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_context_length(tmp_path) == resolve_max_model_len(None, config)
    assert model_context_length(tmp_path) == 4096  # sliding windows are attended within, not a cap


def test_a_folder_without_a_config_has_no_known_length(tmp_path: Path) -> None:
    assert model_context_length(tmp_path) is None
    assert served_max_model_len(None, None) is None
    assert served_max_model_len(512, None) == 512 and served_max_model_len(None, 1024) == 1024
    assert served_max_model_len(512, 1024) == 512


def test_queue_limits_are_clamped_and_the_excess_named() -> None:
    queues = default_queues()
    documents = clamp_queue_limits(queues["documents"], 2048)
    assert (documents.max_prompt_tokens, documents.max_output_tokens) == (2047, 2047)
    assert clamp_queue_limits(queues["interactive"], None) == queues["interactive"]
    assert limits_beyond_model(queues, 4096) == [
        "documents.max_prompt_tokens=32768",
        "documents.max_output_tokens=4096",
    ]
    assert limits_beyond_model(queues, 1 << 20) == []
