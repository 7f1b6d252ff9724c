"""What the served model can run, read from its config.json without torch, and queue limits clamped to it.

A queue's `max_prompt_tokens` and `max_output_tokens` are configured on their own; the engine can only run
prompt + output <= max_model_len, and a prompt shorter than max_model_len (one token at least is left for
output). The API judges each request against the real length at submit, and shows each queue's limits as
the model can honour them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conveyor.core.settings import QueueSettings


def model_context_length(model_folder: Path) -> int | None:
    """The model's own context length: its max_position_embeddings (as engine/model_runner
    resolve_max_model_len; a sliding window does not shorten it). None when the folder has no readable
    config.json (a demo model not built yet)."""
    try:
        config: dict[str, Any] = json.loads((model_folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    limit = config.get("max_position_embeddings")
    return limit if isinstance(limit, int) else None


def served_max_model_len(configured: int | None, model_length: int | None) -> int | None:
    """The max_model_len the workers run: the configured one (never beyond the model's, which the engine
    refuses to start with), else the model's; None when neither is known."""
    known = [n for n in (configured, model_length) if n is not None]
    return min(known) if known else None


def clamp_queue_limits(queue: QueueSettings, max_model_len: int | None) -> QueueSettings:
    """The queue's limits as the model can run them: a prompt of at most max_model_len - 1 tokens, an
    output of at most max_model_len - 1 (each alone; together they must also fit, checked per request)."""
    if max_model_len is None:
        return queue
    longest = max(max_model_len - 1, 1)
    return queue.model_copy(
        update={
            "max_prompt_tokens": min(queue.max_prompt_tokens, longest),
            "max_output_tokens": min(queue.max_output_tokens, longest),
        }
    )


def limits_beyond_model(queues: dict[str, QueueSettings], max_model_len: int) -> list[str]:
    """`queue.field=value` for each configured limit the model cannot run (for one start-up warning)."""
    over = []
    for name, queue in queues.items():
        clamped = clamp_queue_limits(queue, max_model_len)
        for field in ("max_prompt_tokens", "max_output_tokens"):
            if getattr(clamped, field) != getattr(queue, field):
                over.append(f"{name}.{field}={getattr(queue, field)}")
    return over
