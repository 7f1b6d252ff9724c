"""The limits a batch's lines are judged by (worker/batches/lines.py LineLimits), per served model they name.

A model's limits come from what does not change while the worker runs (the settings, the model folder's
config.json: its task and context length, its tokenizer and chat template) and from what the runner reads
once per chunk: the batch's tenant's priorities and the LoRA adapters loaded at run time. `ModelLimits`
makes a model's limits once per distinct set of those inputs and keeps them, so a chunk pays for a
lookup, not for reading config.json and building the model's rules again (they were a millisecond a chunk).
A model named for the first time has its tokenizer read from its folder once (the worker's own is given).
"""

from __future__ import annotations

from dataclasses import replace

from conveyor.core.lanes import lane_of
from conveyor.core.protocol.embedding_rules import EmbeddingLimits
from conveyor.core.protocol.model_limits import model_context_length, served_max_model_len
from conveyor.core.protocol.model_task import model_task
from conveyor.core.protocol.openai_request import Served
from conveyor.core.protocol.service_tiers import PriorityRange
from conveyor.core.settings import Settings
from conveyor.core.store.tables import Batch
from conveyor.engine.tokenizer import Tokenizer
from conveyor.worker.batches.lines import LimitsOfModel, LineLimits, LineRejected
from conveyor.worker.batches.prompt_length import ChatTokenizer, embedding_input_counter, prompt_token_counter

RuntimeAdapters = dict[str, tuple[str, list[str] | None]]  # name -> (model id, tenants or None: every one)
MAX_KEPT = 256  # limits kept; past that they are made afresh (a worker serves a handful of models)


class ModelLimits:
    def __init__(self, settings: Settings, tokenizer: ChatTokenizer | None) -> None:
        """`tokenizer`: the worker's own model's (settings.served_model_id()); the other served models' are
        loaded from their folders when a line first names them. None: no line's prompt is counted."""
        self._settings = settings
        self._tokenizers: dict[str, ChatTokenizer | None] = {settings.served_model_id(): tokenizer}
        self._counts_tokens = tokenizer is not None
        self._kept: dict[tuple[object, ...], LineLimits] = {}

    def of_chunk(self, batch: Batch, priorities: PriorityRange, runtime: RuntimeAdapters) -> LimitsOfModel:
        """The limits of each line of one chunk by the model it names (None: the default model);
        UnknownModelError for a model not served or an adapter the tenant may not name."""
        by_name: dict[str | None, LineLimits] = {}  # most lines of a chunk name the same model

        def of_model(asked: str | None) -> LineLimits:
            if asked not in by_name:
                by_name[asked] = self._of_name(batch, asked, priorities, runtime)
            return by_name[asked]

        return of_model

    def _of_name(self, batch: Batch, asked: str | None, priorities: PriorityRange,
                 runtime: RuntimeAdapters) -> LineLimits:
        model_id = runtime[asked][0] if asked in runtime else self._settings.model_id_of(asked)
        limits = self._of_model(batch, model_id, priorities, runtime)
        is_adapter = asked in runtime or (asked is not None and self._settings.adapter_base(asked))
        if is_adapter and asked not in limits.adapters:
            raise self._settings.unknown_model(str(asked))  # an adapter this tenant may not use
        return limits

    def _of_model(self, batch: Batch, model_id: str, priorities: PriorityRange,
                  runtime: RuntimeAdapters) -> LineLimits:
        settings = self._settings.for_model(model_id)
        adapters = _adapters_of(settings, batch.tenant_id, runtime)
        key = (model_id, batch.queue, batch.endpoint, priorities, adapters)
        if key not in self._kept:
            if len(self._kept) >= MAX_KEPT:
                self._kept.clear()
            self._kept[key] = self._made(settings, batch, model_id, priorities, adapters)
        return self._kept[key]

    def _made(self, settings: Settings, batch: Batch, model_id: str, priorities: PriorityRange,
              adapters: frozenset[str]) -> LineLimits:
        queue = settings.queue(batch.queue)
        if queue is None:
            raise LineRejected("unknown_queue", f"model: the model `{model_id}` has no {batch.queue} queue, "
                               "the batch's")
        tokenizer = self._tokenizer_of(model_id, settings)
        counter = prompt_token_counter(tokenizer) if tokenizer is not None else None
        # The engine tokenizer's template decides the chat roles, as the API's does for its routes.
        template = getattr(tokenizer, "chat_template", None)
        task = model_task(settings.model_folder(), settings.task or "auto")
        served = Served.of(settings, template)
        tokenizer_vocab = getattr(tokenizer, "vocab_size", None)
        embedding = EmbeddingLimits.of_model(settings, task, tokenizer_vocab)
        count_input = embedding_input_counter(tokenizer, task) if tokenizer is not None else None
        return LineLimits(endpoint=batch.endpoint, max_prompt_tokens=queue.max_prompt_tokens,
                          count_tokens=counter, max_output_tokens=queue.max_output_tokens,
                          served=replace(served, models=(*served.models, *adapters)),
                          max_model_len=_max_model_len(settings), queue=batch.queue,
                          lane=lane_of(model_id, batch.queue), priorities=priorities, task=task,
                          embedding=embedding, count_input=count_input, adapters=adapters,
                          vocab_size=task.vocab_size or tokenizer_vocab)

    def _tokenizer_of(self, model_id: str, settings: Settings) -> ChatTokenizer | None:
        """The model's tokenizer: this worker's own, or another served model's read from its folder once."""
        if model_id not in self._tokenizers:
            try:
                folder = settings.model_folder()
                self._tokenizers[model_id] = (Tokenizer(folder, settings.chat_template_text())
                                              if self._counts_tokens else None)
            except OSError as exc:  # the folder is not where this worker can read it
                raise LineRejected("model_unavailable", f"model: this worker cannot read the tokenizer of "
                                   f"`{model_id}` from {settings.model_source()} ({exc})") from None
        return self._tokenizers[model_id]


def _adapters_of(settings: Settings, tenant_id: str, runtime: RuntimeAdapters) -> frozenset[str]:
    """The LoRA adapters of the model (`settings` its own) that the tenant may name: the configuration's and
    those loaded at run time."""
    specs = [(name, spec.tenants) for name, spec in settings.adapters().items()]
    specs += [(name, tenants) for name, (model_id, tenants) in runtime.items()
              if model_id == settings.served_model_id()]
    return frozenset(name for name, tenants in specs if tenants is None or tenant_id in tenants)


def _max_model_len(settings: Settings) -> int | None:
    """What the model's engine serves (the configured max_model_len within the model's), read from its
    config.json: a line whose prompt + max_tokens exceed it is a line error, as at the sync routes."""
    return served_max_model_len(settings.max_model_len, model_context_length(settings.model_folder()))
