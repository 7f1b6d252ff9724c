"""Offline batch generation and embedding, shaped like vLLM's `LLM`."""

from __future__ import annotations

import itertools
from typing import Any

from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.pooling_params import PoolingParams
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.sequence import Sequence
from conveyor.engine.tokenizer import Tokenizer

Prompt = str | list[int]
Messages = list[dict[str, str]]


class LLM:
    def __init__(self, model: str, **config: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        request_class: str | None = None,
        cache_salt: str | None = None,
        lora: str | list[str | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order.

        cache_salt: these prompts reuse prefix-cache blocks only of earlier requests under the same salt.
        lora: the adapter (`add_lora`) of every prompt, or one per prompt (None: the base model).
        """
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        adapters = _as_lora_list(lora, len(prompts))
        # Validate every request before queueing any, so a bad one leaves nothing half-submitted.
        seqs = [
            self.engine.make_sequence(f"llm-{next(self._ids)}", p, sp, request_class, cache_salt=cache_salt,
                                      lora=adapter)
            for p, sp, adapter in zip(prompts, params, adapters, strict=True)
        ]
        return self._run_all(seqs, use_tqdm)

    def add_lora(self, name: str, path: str) -> None:
        """Loads a PEFT adapter folder as `name` (the engine needs max_loras >= 1)."""
        self.engine.add_lora(name, path)

    def embed(
        self,
        inputs: Prompt | list[Prompt],
        params: PoolingParams | None = None,
        *,
        request_class: str | None = None,
        cache_salt: str | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Embeds every input (texts or token-id lists) with an embedding model; outputs come back in input
        order, each with its `embedding`. ValueError for a model that generates text."""
        inputs = _as_prompt_list(inputs)
        params = params if params is not None else PoolingParams()
        make = self.engine.make_sequence
        # Every input validated before any is queued, as in generate.
        seqs = [make(f"llm-{next(self._ids)}", p, params, request_class, cache_salt=cache_salt)
                for p in inputs]
        return self._run_all(seqs, use_tqdm)

    def chat(
        self,
        messages: Messages | list[Messages],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = [self.engine.tokenizer.apply_chat_template(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, **kwargs)

    def _run_all(self, seqs: list[Sequence], use_tqdm: bool) -> list[RequestOutput]:
        for seq in seqs:
            self.engine.enqueue(seq)
        finished = self._run_to_completion(len(seqs), use_tqdm)
        return [finished[seq.request_id] for seq in seqs]

    def _run_to_completion(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = _progress(total) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return finished


def _as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # type: ignore[list-item]  # one token-id prompt
    return list(prompts)  # type: ignore[arg-type]


def _as_params_list(params: SamplingParams | list[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"sampling_params: got {len(params)} for {n} prompts")
    return list(params)


def _as_lora_list(lora: str | list[str | None] | None, n: int) -> list[str | None]:
    if lora is None or isinstance(lora, str):
        return [lora] * n
    if len(lora) != n:
        raise ValueError(f"lora: got {len(lora)} adapters for {n} prompts")
    return list(lora)


def _progress(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req")
