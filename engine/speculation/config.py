"""What speculation does for one engine (EngineConfig.speculative)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix")
MAX_NUM_TOKENS = 16  # drafts per request per step: each is a logits row, and rarely all are accepted


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" (prompt lookup) or "suffix" (suffix structure with frequencies)
    num_tokens: int = 8  # the most drafts for one request in one step
    # ngram: the lengths of the sequence's last n-gram looked up in its earlier tokens, longest first.
    min_ngram: int = 2
    max_ngram: int = 4
    # suffix: the deepest context matched (the structure holds every span of up to max_depth tokens) and the
    # least estimated probability (count / parent count, multiplied along the draft) a drafted token needs.
    max_depth: int = 24
    min_token_prob: float = 0.1
    # suffix: how many finished outputs per (tenant, prompt head) are kept to draft from for later requests
    # with the same head; 0: a request drafts from its own tokens only. Never shared across cache salts.
    tenant_history: int = 0
    # A request stops drafting once at least min_drafts_to_judge of its drafts were verified and fewer than
    # min_acceptance_rate of them accepted.
    min_acceptance_rate: float = 0.1
    min_drafts_to_judge: int = 32
    # Drafts only when the measured step cost says they raise tokens per second (off when a step is
    # compute-bound); False: always draft (to measure the cost of speculation itself).
    dynamic: bool = True

    def __post_init__(self) -> None:
        _require(self.method in METHODS, "method", self.method, f"one of {METHODS}")
        _require(_is_int(self.num_tokens) and 1 <= self.num_tokens <= MAX_NUM_TOKENS, "num_tokens",
                 self.num_tokens, f"an int in [1, {MAX_NUM_TOKENS}]")
        _require(_is_int(self.min_ngram) and self.min_ngram >= 1, "min_ngram", self.min_ngram, "an int >= 1")
        _require(_is_int(self.max_ngram) and self.max_ngram >= self.min_ngram, "max_ngram", self.max_ngram,
                 f"an int >= min_ngram ({self.min_ngram})")
        _require(_is_int(self.max_depth) and self.max_depth >= 2, "max_depth", self.max_depth, "an int >= 2")
        _require(_is_real(self.min_token_prob) and 0.0 <= self.min_token_prob <= 1.0, "min_token_prob",
                 self.min_token_prob, "in [0, 1]")
        _require(_is_int(self.tenant_history) and self.tenant_history >= 0, "tenant_history",
                 self.tenant_history, "an int >= 0")
        _require(_is_real(self.min_acceptance_rate) and 0.0 <= self.min_acceptance_rate <= 1.0,
                 "min_acceptance_rate", self.min_acceptance_rate, "in [0, 1]")
        _require(_is_int(self.min_drafts_to_judge) and self.min_drafts_to_judge >= 1, "min_drafts_to_judge",
                 self.min_drafts_to_judge, "an int >= 1")
        _require(isinstance(self.dynamic, bool), "dynamic", self.dynamic, "True or False")


def speculative_config(value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """EngineConfig.speculative parsed: a method name, a dict of fields, a config, or None / "none" (off)."""
    if value is None or value == "none":
        return None
    if isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        return SpeculativeConfig(method=value)
    if isinstance(value, dict):
        known = {f.name for f in fields(SpeculativeConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative: unknown field(s) {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ValueError(f"speculative: a dict needs a method, one of {METHODS}")
        return SpeculativeConfig(**value)
    raise ValueError(f"speculative must be None, 'none', one of {METHODS} or a dict of fields, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"speculative.{name} must be {rule}, got {value!r}")
