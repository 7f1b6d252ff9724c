"""Per-request sampling parameters, named as in vLLM so its users recognise them.

The bounds below are what the sampler can handle, exported so the API validates with the same numbers: a
value that passes validate() must never make a step fail (a failing step costs every request in it a retry).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from conveyor.engine.structured_output.constraint import StructuredOutput

MAX_INT32 = 2**31 - 1  # max_tokens, min_tokens, logprobs, prompt_logprobs and stop_token_ids
MAX_TOP_K = MAX_INT32  # larger than the vocabulary means "keep all": the sampler clamps it to V
# torch.Generator.manual_seed takes -2**63 .. 2**64-1 and reduces it mod 2**64. The signed int64 range
# keeps every accepted seed a distinct stream (-1 is 2**64-1, outside it) and fits an int64 column.
MIN_SEED = -(2**63)
MAX_SEED = 2**63 - 1
# Positive temperatures: the sampler divides float32 logits by them. Below ~1e-30 the quotient overflows to
# inf, and from 3.4e38 the temperature itself is inf and masked (-inf) logits become NaN; either way the
# row's probabilities are NaN and it samples token 0.
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 100.0  # already indistinguishable from uniform for any realistic logits
# Seen logits are divided or multiplied by it before the temperature; with these bounds the product stays
# far inside float32 (|logit| * 100 / 1e-6).
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# OpenAI's presence and frequency penalties: subtracted from the logits of tokens already generated
# (frequency_penalty once per occurrence, presence_penalty once). OpenAI's own range.
MIN_OPENAI_PENALTY = -2.0
MAX_OPENAI_PENALTY = 2.0


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # per-request generator: same seed, same tokens, whatever the batch
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0  # over prompt and output tokens, as in transformers
    presence_penalty: float = 0.0  # over output tokens only, as in OpenAI
    frequency_penalty: float = 0.0  # over output tokens only, times each token's count, as in OpenAI
    logprobs: int | None = None  # top-n logprobs per generated token (plus the sampled token's)
    # Top-k logprobs at every prompt position after the first (plus the prompt token's own), from the raw
    # model distribution given the tokens before it. Set, it also allows max_tokens=0: score the prompt only.
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None  # grammar-constrained output (JSON Schema, regex, choice)
    skip_special_tokens: bool = True  # leave special tokens (EOS, chat markers) out of the text, as vLLM
    include_stop_str_in_output: bool = False  # keep a matched stop string at the end of the text
    speculate: bool = True  # False: never draft for this request, even when the engine speculates

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stop_strings(self) -> list[str]:
        assert isinstance(self.stop, list)
        return self.stop

    def validate(self) -> None:
        """Raises ValueError naming the offending field. Checks run in order, so each may rely on the last."""
        self._validate_lengths()
        self._validate_distribution()
        self._validate_outputs()

    def _validate_lengths(self) -> None:
        low = 0 if self.prompt_logprobs is not None else 1  # max_tokens=0 only scores the prompt
        _check(_int_in(self.max_tokens, low, MAX_INT32), "max_tokens", self.max_tokens,
               f"an int in [{low}, {MAX_INT32}]")
        _check(_int_in(self.min_tokens, 0, self.max_tokens), "min_tokens", self.min_tokens,
               f"an int in [0, max_tokens ({self.max_tokens})]")

    def _validate_distribution(self) -> None:
        t = self.temperature
        _check(_is_real(t) and (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE), "temperature", t,
               f"0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]")
        _check(_int_in(self.top_k, -1, MAX_TOP_K), "top_k", self.top_k,
               f"-1 or 0 (off), or an int in [1, {MAX_TOP_K}]")
        _check(_is_real(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(_is_real(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        penalty = self.repetition_penalty
        _check(_is_real(penalty) and MIN_REPETITION_PENALTY <= penalty <= MAX_REPETITION_PENALTY,
               "repetition_penalty", penalty, f"in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_real(value) and MIN_OPENAI_PENALTY <= value <= MAX_OPENAI_PENALTY, name, value,
                   f"in [{MIN_OPENAI_PENALTY}, {MAX_OPENAI_PENALTY}]")

    def _validate_outputs(self) -> None:
        _check(self.seed is None or _int_in(self.seed, MIN_SEED, MAX_SEED), "seed", self.seed,
               f"None or an int in [{MIN_SEED}, {MAX_SEED}]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or _int_in(value, 0, MAX_INT32), name, value,
                   f"None or an int in [0, {MAX_INT32}]")
        _check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop), "stop",
               self.stop, "a non-empty string or a list of them")
        ids = self.stop_token_ids
        _check(isinstance(ids, list) and all(_int_in(t, 0, MAX_INT32) for t in ids), "stop_token_ids", ids,
               f"a list of token ids in [0, {MAX_INT32}]")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "speculate"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "a bool")
        _check(self.structured is None or isinstance(self.structured, StructuredOutput), "structured",
               self.structured, "None or a StructuredOutput")
        if self.structured is not None:
            self.structured.validate()
            # A complete grammar allows only EOS, which min_tokens would mask: no token would be left.
            _check(self.min_tokens == 0, "min_tokens", self.min_tokens, "0 with structured output")


def _int_in(value: object, low: int, high: int) -> bool:
    """A real int (bool is an int subclass, but True is no token count) within [low, high]."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_real(value: object) -> bool:
    """An int or float (not a bool) that is finite; NaN and inf would poison the whole logits row."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}")
