"""The models this deployment serves, as the API judges requests for them: each one's settings (its engine
and queue limits: Settings.for_model) and its tokenizer (no weights), by the id clients send as `model`.
A LoRA adapter is served too, under its own id: its base model's settings, tokenizer and lanes, and its
`lora` (core/model_adapters.py); an adapter limited to some tenants does not exist for the others."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.checkpoints.gguf_file import gguf_quantization
from conveyor.core.lanes import lane_of
from conveyor.core.protocol.chat_options import ToolParser, tool_parser_for
from conveyor.core.protocol.embedding_rules import EmbeddingLimits
from conveyor.core.protocol.model_limits import served_max_model_len
from conveyor.core.protocol.model_task import ModelTask, model_task
from conveyor.core.settings import Settings
from conveyor.core.store import lora_adapters


@dataclass(frozen=True)
class ServedModel:
    id: str
    settings: Settings  # the deployment's settings as this model sees them
    tokenizer: PromptTokenizer
    task: ModelTask = field(default_factory=lambda: ModelTask("generate"))  # core/protocol/model_task.py
    lora: str | None = None  # a LoRA adapter's id (= id); None: a base model
    parent: str | None = None  # an adapter's base model
    tenants: frozenset[str] | None = None  # an adapter's permitted tenants; None: every tenant
    quantization: str = "none"  # how its workers hold the weights: none, int8, int4 (an adapter: its base's)

    def serves(self, tenant_id: str | None) -> bool:
        """Whether `tenant_id` may name it (None: not judged, as for the fleet's own calls)."""
        return self.tenants is None or tenant_id is None or tenant_id in self.tenants

    @property
    def tool_parser(self) -> ToolParser:
        """The parser this model's tool calls are read with (the setting, or its template's)."""
        return tool_parser_for(self.settings.tool_call_parser, self.tokenizer.chat_template)

    def max_model_len(self) -> int | None:
        """The max_model_len its workers serve: the configured one, else the model's own (its config.json),
        so a request that can never run is refused at submit rather than failing on a worker. For an
        embedding model, the longest input it embeds."""
        own = self.task.max_input_tokens if self.task.embeds else self.tokenizer.context_length
        return served_max_model_len(self.settings.max_model_len, own)

    def vocab_size(self) -> int | None:
        """The token ids a prompt may hold: an embedding model's vocabulary (its config's), else its
        tokenizer's (as vLLM holds token-id prompts to it)."""
        return self.task.vocab_size or self.tokenizer.vocab_size

    def embedding_limits(self) -> EmbeddingLimits:
        """What its embeddings requests are held to (core/protocol/embedding_rules.py)."""
        return EmbeddingLimits.of_model(self.settings, self.task, self.tokenizer.vocab_size)

    def lane(self, queue: str) -> str:
        """Where its jobs of `queue` wait: an adapter's are its base model's."""
        return lane_of(self.parent or self.id, queue)

    def created(self) -> int:
        """When its folder was last changed (OpenAI's model `created`); 0 when it is not a local folder."""
        path = Path(self.settings.model) if self.settings.model else None
        return int(path.stat().st_mtime) if path is not None and path.exists() else 0


@dataclass(frozen=True)
class RuntimeAdapter:
    """An adapter loaded at run time (core/store/lora_adapters.py), as the API serves it."""

    name: str
    model_id: str
    tenants: list[str] | None


RuntimeAdapters = Callable[[], list[RuntimeAdapter]]  # the store's, read again at most every RUNTIME_TTL_S
RUNTIME_TTL_S = 1.0  # an adapter loaded (or unloaded) at run time is served (or refused) this soon


def store_adapters(session_factory: sessionmaker[Session]) -> RuntimeAdapters:
    """The adapters loaded at run time, as the store holds them."""
    def read() -> list[RuntimeAdapter]:
        with session_factory() as session:
            return [RuntimeAdapter(row.name, row.model_id, row.tenants)
                    for row in lora_adapters.all_adapters(session)]

    return read


class ServedModels:
    """Every served model, the default first, and the LoRA adapters: the configuration's, and those loaded at
    run time (`runtime`, read from the store, cached for RUNTIME_TTL_S)."""

    def __init__(self, settings: Settings, tokenizers: Mapping[str, PromptTokenizer],
                 runtime: RuntimeAdapters | None = None) -> None:
        missing = [model_id for model_id in settings.model_ids() if model_id not in tokenizers]
        if missing:
            raise ValueError(f"tokenizers: none given for model(s) {', '.join(missing)}")
        self._settings = settings
        self._models = {model_id: ServedModel(model_id, model_settings, tokenizers[model_id],
                                              _task_of(model_settings),
                                              quantization=_quantization_of(model_settings))
                        for model_id, model_settings in settings.served().items()}
        self._configured = {adapter.id: adapter for base in list(self._models.values())
                            for adapter in _adapters_of(base)}
        self._models |= self._configured
        self._runtime = runtime
        self._runtime_read: tuple[float, dict[str, ServedModel]] = (-math.inf, {})
        self._lock = threading.Lock()

    @property
    def default(self) -> ServedModel:
        return next(iter(self._models.values()))

    def __iter__(self) -> Iterator[ServedModel]:
        """The base models (each with its lanes), the default first; their adapters share those lanes."""
        return iter([model for model in self._models.values() if model.lora is None])

    def get(self, model_id: str | None, tenant_id: str | None = None) -> ServedModel:
        """The model a request names (Settings.model_id_of), or the adapter. UnknownModelError when it is
        not served, or is an adapter `tenant_id` may not use (said as for a model that does not exist)."""
        adapter = self._adapters().get(model_id) if model_id is not None else None
        if adapter is not None:
            if adapter.serves(tenant_id):
                return adapter
            raise self._settings.unknown_model(adapter.id)
        return self._models[self._settings.model_id_of(model_id)]

    def is_taken(self, name: str) -> bool:
        """Whether `name` is already a model's or an adapter's id."""
        return name in self._models or name in self._runtime_adapters()  # configured adapters are in _models

    def visible_to(self, tenant_id: str | None) -> list[ServedModel]:
        """Every model and adapter `tenant_id` may name, the default first."""
        return [model for model in self._all() if model.serves(tenant_id)]

    def _all(self) -> list[ServedModel]:
        return [*self._models.values(), *self._runtime_adapters().values()]

    def _adapters(self) -> dict[str, ServedModel]:
        return {**self._runtime_adapters(), **self._configured}

    def _runtime_adapters(self) -> dict[str, ServedModel]:
        if self._runtime is None:
            return {}
        with self._lock:
            read_at, adapters = self._runtime_read
            if time.monotonic() - read_at < RUNTIME_TTL_S:
                return adapters
        adapters = {row.name: self._runtime_adapter(row) for row in self._runtime()
                    if row.model_id in self._models and self._models[row.model_id].lora is None}
        with self._lock:
            self._runtime_read = (time.monotonic(), adapters)
        return adapters

    def forget_runtime_adapters(self) -> None:
        """Read the store again at the next lookup (after this API loaded or unloaded one)."""
        with self._lock:
            self._runtime_read = (-math.inf, {})

    def _runtime_adapter(self, row: RuntimeAdapter) -> ServedModel:
        base = self._models[row.model_id]
        tenants = frozenset(row.tenants) if row.tenants is not None else None
        return ServedModel(row.name, base.settings, base.tokenizer, base.task, lora=row.name, parent=base.id,
                           tenants=tenants, quantization=base.quantization)


def _adapters_of(base: ServedModel) -> list[ServedModel]:
    return [ServedModel(name, base.settings, base.tokenizer, base.task, lora=name, parent=base.id,
                        tenants=frozenset(spec.tenants) if spec.tenants is not None else None,
                        quantization=base.quantization)
            for name, spec in base.settings.adapters().items()]


def _quantization_of(settings: Settings) -> str:
    """How its workers hold the weights: the `quantization` setting, "auto" (or unset) resolved as the engine
    resolves it (a GGUF file's own; engine/quantization.py)."""
    if settings.quantization not in (None, "auto"):
        return settings.quantization
    return gguf_quantization(settings.model_folder()) or "none"


def _task_of(settings: Settings) -> ModelTask:
    """What the model serves: its `task` setting, "auto" resolved from its folder."""
    return model_task(settings.model_folder(), settings.task or "auto")
