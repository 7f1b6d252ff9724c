"""Which model a worker loads, and the engine configuration the service's Settings derive.

One configuration: every Settings field named like an EngineConfig field is passed to the engine when set,
and left to the engine's own default when None, so defaults live in one place (EngineConfig) and no field is
copied by hand. Each queue becomes an engine request class of the same name, limit and priority. The one
exception is num_threads on CPU: unset, it is measured here at start (engine/cpu_threads.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from conveyor.checkpoints.sources import PACKAGE_PREFIX, SourceKind, parse_source
from conveyor.core.settings import DEFAULT_MODEL, Settings
from conveyor.engine.block_manager import max_blocks_held, max_chunk_tokens
from conveyor.engine.config import EngineConfig, RequestClassConfig
from conveyor.engine.cpu_threads import ThreadChoice, choose_cpu_threads, hidden_size_of, runs_on_cpu
from conveyor.engine.host import EngineHost
from conveyor.engine.model_source import model_folder
from conveyor.engine.speculation.config import speculative_config

log = logging.getLogger(__name__)

# EngineConfig fields the service does not take from Settings: the model (and its cache under data_dir) comes
# from resolve_model, the request classes from the queues, and the engine's base seed stays its own (jobs
# carry their own `seed`).
NOT_FROM_SETTINGS = frozenset({"model", "model_cache_dir", "request_classes", "seed"})


def resolve_model(settings: Settings) -> str:
    """The local folder of the model the workers load (engine/model_source.py): `model` converted,
    downloaded or built on first use, or the default model (SmolLM2-135M-Instruct) when none is set."""
    source = parse_source(settings.model_source())
    if not settings.model:
        log.info("no model configured: serving %s from the %s package (set CONVEYOR_MODEL to serve another)",
                 source.served_name(), DEFAULT_MODEL.removeprefix(PACKAGE_PREFIX))
    if source.kind is SourceKind.PRESET:
        log.warning("model %s has RANDOM WEIGHTS and writes gibberish: it is for tests and benchmarks",
                    source.text)
    return str(model_folder(source, cache_dir=settings.model_cache_dir(), revision=settings.revision))


def engine_fields() -> list[str]:
    """The EngineConfig fields Settings carries under the same name."""
    return [f.name for f in dataclasses.fields(EngineConfig) if f.name not in NOT_FROM_SETTINGS]


def engine_config(settings: Settings, model_path: str,
                  choose_threads: Callable[[int], ThreadChoice] = choose_cpu_threads) -> EngineConfig:
    """The engine's configuration: the fields Settings sets, one request class per queue, the model path;
    on CPU without a num_threads setting, the thread count `choose_threads(hidden size)` measures."""
    given: dict[str, Any] = {}
    for name in engine_fields():
        value = getattr(settings, name)
        if value is not None:
            given[name] = value
    given["max_loras"] = settings.lora_slots()  # unset: as many as the model's adapters, within a cap
    if settings.chat_template is not None:  # the setting names a template (a file, a shipped name): its text
        given["chat_template"] = settings.chat_template_text()
    classes = [RequestClassConfig(name=name, max_running=queue.max_running, priority=queue.priority)
               for name, queue in settings.queues.items()]
    config = EngineConfig(model=model_path, request_classes=classes, **given)
    # The engine applies only an explicit count (the same configuration runs the same everywhere); the
    # service measures one here, once, since on shared vCPUs torch's default (every core) can be slower.
    if config.num_threads is None and runs_on_cpu(config.device):
        choice = choose_threads(hidden_size_of(model_path))
        log.info("torch threads: %s", choice.describe())
        config = dataclasses.replace(config, num_threads=choice.threads)
    return config


def describe_engine(host: EngineHost, source: str) -> str:
    """The model (as configured, and its folder), the device and dtype, its weights (quantization, bytes as
    held), speculation and the KV cache's capacity, for a start-up line."""
    runner = host.engine.runner
    model = source if source == host.config.model else f"{source} ({host.config.model})"
    kv_bytes = sum(t.numel() * t.element_size() for pair in getattr(runner, "kv_caches", []) for t in pair)
    tokens = runner.num_kv_blocks * runner.block_size
    # A windowed model holds only its window's and one chunk's blocks per sequence (engine/block_manager).
    window = getattr(runner, "kv_sliding_window", None)
    held = max_blocks_held(runner.max_model_len, runner.block_size, window, max_chunk_tokens(host.config))
    fits = runner.num_kv_blocks // held
    dtype = str(getattr(runner, "dtype", "")).removeprefix("torch.")
    quantization, held = getattr(runner, "quantization", "none"), getattr(runner, "weight_bytes", 0)
    weights = f"weights {quantization} {held / 2**20:.1f} MiB"
    return (f"{model} on {runner.device} {dtype}; {weights}; {describe_speculation(host.config)}; "
            f"KV cache {runner.num_kv_blocks} blocks x "
            f"{runner.block_size} = {tokens} tokens, {kv_bytes / 2**20:.1f} MiB, fits {fits} sequences of "
            f"max_model_len={runner.max_model_len}")


def describe_speculation(config: EngineConfig) -> str:
    """`speculative off`, or its method and most drafts per request per step."""
    speculation = speculative_config(config.speculative)
    if speculation is None:
        return "speculative off"
    return f"speculative {speculation.method} (up to {speculation.num_tokens} drafts per step)"
