"""Per-request sampling parameters, named as in vLLM so its users recognise them."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    logprobs: int | None = None  # top-n logprobs per generated token (plus the sampled token's)

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
        """Raises ValueError naming the offending field."""
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0")
        _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
               f"<= max_tokens ({self.max_tokens})")
        _check(self.temperature >= 0.0, "temperature", self.temperature, ">= 0")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", self.top_k, "-1, 0 (off) or >= 1")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty, "> 0")
        _check(self.seed is None or isinstance(self.seed, int), "seed", self.seed, "an int or None")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
               "logprobs", self.logprobs, "None or >= 0")
        _check(all(isinstance(s, str) and s for s in self.stop_strings), "stop", self.stop,
               "a non-empty string or a list of them")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "a list of token ids >= 0")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}")
