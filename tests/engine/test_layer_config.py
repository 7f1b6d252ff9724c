"""engine/models/layer_config.py: each layer's window from every spelling of config.json."""

from __future__ import annotations

import pytest

from conveyor.engine.models.layer_config import layer_windows, normalised_config, uniform_window

MISTRAL = {"max_position_embeddings": 4096, "sliding_window": 1024}


def test_one_window_for_every_layer_unless_switched_off_or_typed_per_layer() -> None:
    assert layer_windows(MISTRAL, 2) == (1024, 1024)
    assert layer_windows({**MISTRAL, "use_sliding_window": False}, 2) == (None, None)
    assert layer_windows({**MISTRAL, "sliding_window": None}, 2) == (None, None)
    typed = {**MISTRAL, "layer_types": ["full_attention", "sliding_attention"]}
    assert layer_windows(typed, 2) == (None, 1024)


def test_legacy_spellings_are_read_through_transformers_config_classes() -> None:
    qwen2 = normalised_config({"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": True,
                               "sliding_window": 64, "max_window_layers": 2})
    assert layer_windows(qwen2, 4) == (None, None, 64, 64)  # the layers from max_window_layers on
    gemma3 = normalised_config({"model_type": "gemma3_text", "num_hidden_layers": 6, "sliding_window": 512,
                                "sliding_window_pattern": 3})
    assert layer_windows(gemma3, 6) == (512, 512, None, 512, 512, None)
    assert normalised_config({"sliding_window": 8}) == {"sliding_window": 8}  # no model_type: as it is


def test_bad_layer_types_or_windows_are_named() -> None:
    with pytest.raises(ValueError, match="lists 1 layers, the model has 2"):
        layer_windows({**MISTRAL, "layer_types": ["sliding_attention"]}, 2)
    with pytest.raises(ValueError, match="chunked_attention"):
        layer_windows({**MISTRAL, "layer_types": ["chunked_attention"] * 2}, 2)
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        layer_windows({"sliding_window": -3}, 2)


def test_blocks_are_released_only_when_every_layer_shares_one_window() -> None:
    assert uniform_window((1024, 1024)) == 1024
    assert uniform_window((None, 1024)) is None and uniform_window((None, None)) is None
    assert uniform_window((512, 1024)) is None
