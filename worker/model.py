"""Which model a worker loads, and the engine configuration the service's Settings map onto."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from api.settings import Settings
from engine.config import EngineConfig, RequestClassConfig

log = logging.getLogger(__name__)

DEMO_MODEL_DIR = "demo-model"


def resolve_model(settings: Settings) -> str:
    """settings.model, or (when unset or empty) a tiny random-weight demo model built once under
    data_dir/demo-model."""
    if settings.model:
        return settings.model
    path = Path(settings.data_dir) / DEMO_MODEL_DIR
    if not (path / "config.json").is_file():
        _build_demo_model(path)
    log.warning(
        "NO MODEL CONFIGURED: using the demo model at %s, which has RANDOM WEIGHTS and writes gibberish. "
        "Set CONVEYOR_MODEL to a Hugging Face model folder for real output.", path,
    )
    return str(path)


def engine_config(settings: Settings, model_path: str) -> EngineConfig:
    """Settings' engine parameters, with one engine request class per queue (same name, limit, priority)."""
    return EngineConfig(
        model=model_path,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len,
        block_size=settings.block_size,
        num_kv_blocks=settings.num_kv_blocks,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        long_prefill_token_threshold=settings.long_prefill_token_threshold,
        dtype=settings.dtype,
        device=settings.device,
        attention_backend=settings.attention_backend,
        num_threads=settings.num_threads,
        request_classes=[
            RequestClassConfig(name=name, max_running=queue.max_running, priority=queue.priority)
            for name, queue in settings.queues.items()
        ],
    )


def _build_demo_model(path: Path) -> None:
    """Builds in a private folder, then renames it into place: no process ever sees half a model."""
    from engine.demo import build_tiny_model

    staging = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    build_tiny_model(staging)
    try:
        staging.rename(path)
    except OSError:  # another process won the race; its copy is identical (the build is seeded)
        shutil.rmtree(staging, ignore_errors=True)
