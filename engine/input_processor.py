"""Input processing: a request validated (ValueError naming the field) into a Sequence, before it touches
any engine state, so a bad request disturbs nothing.

NOTE: prompt + max_tokens must fit max_model_len (and the whole KV cache); we reject rather than silently
shorten max_tokens, so a caller never gets a surprise "length" finish.
"""

from __future__ import annotations

import time

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.outputs import RequestMetrics
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, Urgency
from engine.structured_output_manager import check_structured_supported
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


class InputProcessor:
    """Reads the block manager's size only; thread-safe, so callers validate in their own thread."""

    def __init__(
        self, config: EngineConfig, tokenizer: Tokenizer, block_manager: BlockManager, sampler: Sampler,
        max_model_len: int, vocab_size: int,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.block_manager = block_manager
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.default_class = config.request_classes[0].name

    def make_sequence(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
        request_class: str | None = None, *, cache_salt: str | None = None, urgency: Urgency | None = None,
    ) -> Sequence:
        """The request's Sequence, without its grammar state (StructuredOutputManager.attach gives it)."""
        urgency = urgency if urgency is not None else Urgency()
        urgency.validate()
        if self.config.scheduling == "arrival":
            urgency = Urgency()  # ordered by class priority and arrival only
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")
        params = params if params is not None else SamplingParams()
        params.validate()
        self._check_vocab_bounds(params)
        cls = self.config.request_class(request_class if request_class is not None else self.default_class)
        prompt_ids = self._prompt_token_ids(prompt)
        self._check_length(len(prompt_ids), params.max_tokens)
        check_structured_supported(params)
        return Sequence(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            request_class=cls.name,
            priority=cls.priority,
            arrival_order=-1,  # set by LLMEngine.enqueue, in the engine's own order
            metrics=RequestMetrics(arrival_time=time.time()),
            generator=self.sampler.make_generator(params.seed) if params.seed is not None else None,
            prompt=prompt if isinstance(prompt, str) else None,
            cache_salt=cache_salt,
            urgency=urgency,
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )

    def _check_vocab_bounds(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check without the model: a top-n needs n <= vocab size."""
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and n > self.vocab_size:
                raise ValueError(f"{name} must be at most the vocabulary size ({self.vocab_size}), got {n}")

    def _prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list | tuple):
            ids = list(prompt)
            bad = [t for t in ids if not _is_token_id(t, self.vocab_size)]
            if bad:
                raise ValueError(f"prompt: token ids must be ints in [0, {self.vocab_size}), got {bad[:5]}")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt must not be empty")
        return ids

    def _check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt is {num_prompt_tokens} tokens; it must be shorter than max_model_len "
                f"({self.max_model_len}) to leave room for output"
            )
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens ({max_tokens}) + prompt ({num_prompt_tokens} tokens) must be <= max_model_len "
                f"({self.max_model_len})"
            )
        needed = self.block_manager.blocks_for_tokens(num_prompt_tokens + max_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"max_tokens ({max_tokens}) + prompt ({num_prompt_tokens} tokens) need {needed} KV blocks; "
                f"the cache has {self.block_manager.num_blocks}"
            )


def _is_token_id(value: object, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size
