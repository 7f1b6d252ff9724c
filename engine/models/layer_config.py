"""What config.json says about each layer: its attention window and, where it varies, its rotary settings.

Checkpoints spell per-layer attention several ways over the years (Mistral's one `sliding_window` for every
layer; Qwen2's `use_sliding_window` with `max_window_layers`; Gemma 2's alternation; Gemma 3's
`sliding_window_pattern` and `rope_local_base_freq`; transformers 5's `layer_types` and per-type
`rope_parameters`). transformers' own config class for the checkpoint's `model_type` normalises them all into
`layer_types` and `rope_parameters`; the engine reads those, never re-deriving the older spellings itself.
"""

from __future__ import annotations

from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"


def normalised_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json as transformers' config class for its `model_type` reads it (legacy keys resolved);
    `cfg` itself when it names no model_type transformers knows."""
    from transformers import CONFIG_MAPPING

    model_type = cfg.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return cfg
    return CONFIG_MAPPING[model_type](**cfg).to_dict()


def layer_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (keys at positions p - window < k <= p), None for full attention.

    `cfg` normalised (`normalised_config`): with `layer_types`, the sliding layers use `sliding_window`;
    without them, a `sliding_window` applies to every layer (Mistral, Mixtral, Phi-3), unless
    `use_sliding_window` is false.
    """
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return (None,) * num_layers
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"config.json: sliding_window must be a positive integer, got {window!r}")
    types = cfg.get("layer_types")
    if not types:
        return (window,) * num_layers
    if len(types) != num_layers:
        raise ValueError(f"config.json: layer_types lists {len(types)} layers, the model has {num_layers}")
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"config.json: layer_types {unknown} are not supported; "
                         f"supported: {[SLIDING, FULL]}")
    return tuple(window if kind == SLIDING else None for kind in types)


def uniform_window(windows: tuple[int | None, ...]) -> int | None:
    """The window every layer shares, or None when any layer attends to the whole context: only then can a
    sequence's blocks before the window be released (no layer reads them again)."""
    distinct = set(windows)
    if len(distinct) == 1 and None not in distinct:
        return next(iter(distinct))
    return None
