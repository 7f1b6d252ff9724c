"""Input processing: a request validated (ValueError naming the field) into a Sequence, before it touches
any engine state, so a bad request disturbs nothing.

NOTE: prompt + max_tokens must fit max_model_len, and the KV cache must hold the most blocks the sequence
ever holds at once (conveyor.engine.block_manager.max_blocks_held: all of them, or with a sliding window only
those of the window and one step's chunk); we reject rather than silently shorten max_tokens, so a caller
never gets a surprise "length" finish.

An embedding engine takes PoolingParams requests only, and a generation engine SamplingParams only. Its text
inputs are tokenized as sentence-transformers does (its default prompt first, lower-cased when its config
says so, the tokenizer's special tokens added); an input may fill max_model_len (nothing is generated), and
a longer one is refused, or cut to it with PoolingParams.truncate (its end cut, the special tokens kept).
"""

from __future__ import annotations

import time

from conveyor.engine.block_manager import BlockManager, max_blocks_held, max_chunk_tokens
from conveyor.engine.config import EngineConfig
from conveyor.engine.lora.manager import LoRAManager
from conveyor.engine.outputs import RequestMetrics
from conveyor.engine.pooling import PoolingConfig
from conveyor.engine.pooling_params import PoolingParams
from conveyor.engine.sampler import Sampler
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.sequence import Sequence, Urgency
from conveyor.engine.structured_output.manager import check_structured_supported
from conveyor.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class InputProcessor:
    """Reads the block manager's size only; thread-safe, so callers validate in their own thread."""

    def __init__(
        self, config: EngineConfig, tokenizer: Tokenizer, block_manager: BlockManager, sampler: Sampler,
        max_model_len: int, vocab_size: int, *, pooling: PoolingConfig | None = None,
        embedding_size: int | None = None, lora: LoRAManager | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.block_manager = block_manager
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.pooling = pooling  # None: a generation engine
        self.embedding_size = embedding_size
        self.default_class = config.request_classes[0].name
        self.lora = lora  # the adapters a request may name; None: LoRA off

    def make_sequence(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams | None = None,
        request_class: str | None = None, *, cache_salt: str | None = None, urgency: Urgency | None = None,
        lora: str | None = None,
    ) -> Sequence:
        """The request's Sequence, without its grammar state (StructuredOutputManager.attach gives it).
        `lora`: the name of a loaded adapter to run it with (None: the base model)."""
        urgency = urgency if urgency is not None else Urgency()
        urgency.validate()
        if self.config.scheduling == "arrival":
            urgency = Urgency()  # ordered by class priority and arrival only
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")
        params = self._params_of_kind(params)
        params.validate()
        cls = self.config.request_class(request_class if request_class is not None else self.default_class)
        lora_key = self._lora_key(lora)  # an embedding engine has no adapters: refused there too
        if isinstance(params, PoolingParams):
            return self._pooling_sequence(request_id, prompt, params, cls.name, cls.priority, cache_salt,
                                          urgency)
        self._check_vocab_bounds(params)
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
            lora=lora,
            lora_key=lora_key,
            urgency=urgency,
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )

    def _lora_key(self, lora: str | None) -> str | None:
        if lora is None:
            return None
        if self.lora is None:
            raise ValueError(f"lora: this engine serves no LoRA adapters (max_loras is 0), got {lora!r}")
        return self.lora.key_of(lora)

    def _params_of_kind(self, params: SamplingParams | PoolingParams | None
                        ) -> SamplingParams | PoolingParams:
        """The request's params (the engine's kind of default when None); ValueError for the other kind."""
        if self.pooling is None:
            if isinstance(params, PoolingParams):
                raise ValueError("params: this model generates text and serves no embeddings; PoolingParams "
                                 "need an embedding model")
            params = params if params is not None else SamplingParams()
            if not isinstance(params, SamplingParams):
                raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
            return params
        if isinstance(params, SamplingParams):
            raise ValueError("params: this model serves embeddings and generates no text; send PoolingParams")
        params = params if params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError(f"params must be PoolingParams, got {type(params).__name__}")
        return params

    def _pooling_sequence(
        self, request_id: str, prompt: str | list[int], params: PoolingParams, request_class: str,
        priority: int, cache_salt: str | None, urgency: Urgency,
    ) -> Sequence:
        """An embedding request: prefill only, no sampling state."""
        assert self.pooling is not None and self.embedding_size is not None
        size = self.embedding_size
        if params.dimensions is not None and params.dimensions > size:
            raise ValueError(f"dimensions must be at most the model's embedding size ({size}), got "
                             f"{params.dimensions}")
        ids = self._embedding_token_ids(prompt, params.truncate)
        self._check_blocks(len(ids), f"input ({len(ids)} tokens) needs")
        return Sequence(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            request_class=request_class,
            priority=priority,
            arrival_order=-1,  # set by LLMEngine.enqueue, in the engine's own order
            metrics=RequestMetrics(arrival_time=time.time()),
            prompt=prompt if isinstance(prompt, str) else None,
            cache_salt=cache_salt,
            urgency=urgency,
            pools_every_token=self.pooling.reads_every_token,
        )

    def _embedding_token_ids(self, prompt: str | list[int], truncate: bool) -> list[int]:
        """The tokens embedded, at most max_model_len of them (cut when `truncate`, else ValueError)."""
        assert self.pooling is not None
        limit = self.max_model_len
        if isinstance(prompt, str):
            text = self.pooling.prompt + prompt
            text = text.lower() if self.pooling.lowercase else text
            ids = self._prompt_token_ids(text)
            if len(ids) > limit and truncate:
                ids = self._truncated_text_ids(text, ids, limit)
        else:
            ids = self._prompt_token_ids(prompt)
            if len(ids) > limit and truncate:
                ids = ids[:limit]
        if len(ids) > limit:
            raise ValueError(f"input is {len(ids)} tokens; the model embeds at most {limit} (max_model_len); "
                             "set truncate to cut it")
        return ids

    def _truncated_text_ids(self, text: str, ids: list[int], limit: int) -> list[int]:
        """ids (text's tokens with the tokenizer's special tokens) cut to `limit` as transformers truncates:
        the text's tokens lose their end, the special tokens around them stay."""
        body = self.tokenizer.encode(text, add_special_tokens=False)
        num_special = len(ids) - len(body)
        head = next((n for n in range(num_special + 1) if ids[n : n + len(body)] == body), None)
        if head is None or num_special >= limit:  # special tokens not simply around the text: keep the start
            return ids[:limit]
        return ids[:head] + body[: limit - num_special] + ids[head + len(body) :]

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
        self._check_blocks(num_prompt_tokens + max_tokens,
                           f"max_tokens ({max_tokens}) + prompt ({num_prompt_tokens} tokens) need")

    def _check_blocks(self, num_tokens: int, subject: str) -> None:
        """ValueError unless the cache holds the most blocks a sequence of num_tokens holds at once: else it
        could never run, even alone (one that fits always can: alone, it finds every block free).
        `subject`: the message's start, up to its verb."""
        bm = self.block_manager
        window, step = bm.sliding_window, max_chunk_tokens(self.config)
        needed = max_blocks_held(num_tokens, bm.block_size, window, step)
        if needed <= bm.num_blocks:
            return
        at_once = "" if window is None else f" at once (sliding window {window}, chunks up to {step} tokens)"
        raise ValueError(f"{subject} {needed} KV blocks{at_once}; the cache has {bm.num_blocks}")


def _is_token_id(value: object, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size
