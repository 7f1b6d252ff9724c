from __future__ import annotations

import pytest
import torch

from conveyor.engine.outputs import RequestMetrics
from conveyor.engine.sampler import Sampler
from conveyor.engine.sampling_params import (
    MAX_INT32,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    MIN_SEED,
    MIN_TEMPERATURE,
    SamplingParams,
)
from conveyor.engine.sequence import Sequence

# The operator's job: schema-valid, and it failed the 12 requests stepping with it (2**70).
OVERFLOWING_TOP_K = 1180591620717411303424


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_values_raise_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation() -> None:
    params = SamplingParams(stop="###")
    assert params.max_tokens == 16 and params.temperature == 1.0 and not params.greedy
    assert params.stop == ["###"]
    assert SamplingParams(temperature=0).greedy


def test_validate_catches_later_mutation() -> None:
    params = SamplingParams()
    params.top_p = 2.0
    with pytest.raises(ValueError, match="top_p"):
        params.validate()


def test_the_operators_top_k_is_rejected_naming_top_k() -> None:
    with pytest.raises(ValueError, match=r"^top_k must be .*, got 1180591620717411303424$"):
        SamplingParams(top_k=OVERFLOWING_TOP_K, temperature=1.0)
    params = SamplingParams(temperature=1.0)
    params.top_k = OVERFLOWING_TOP_K
    with pytest.raises(ValueError, match=r"^top_k"):
        params.validate()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", MAX_INT32 + 1), ("max_tokens", True), ("max_tokens", 4.0), ("max_tokens", "4"),
        ("min_tokens", -1), ("min_tokens", 1.0), ("min_tokens", True),
        ("top_k", MAX_TOP_K + 1), ("top_k", OVERFLOWING_TOP_K), ("top_k", -2), ("top_k", False),
        ("top_k", 5.0),
        ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -float("inf")),
        ("temperature", MAX_TEMPERATURE * 1.01), ("temperature", MIN_TEMPERATURE / 2), ("temperature", 1e-40),
        ("temperature", 10**400), ("temperature", True), ("temperature", "1"), ("temperature", None),
        ("top_p", float("nan")), ("top_p", True), ("top_p", "0.5"),
        ("min_p", float("nan")), ("min_p", -0.01), ("min_p", False),
        ("repetition_penalty", float("inf")), ("repetition_penalty", float("nan")),
        ("repetition_penalty", MIN_REPETITION_PENALTY / 2), ("repetition_penalty", True),
        ("repetition_penalty", MAX_REPETITION_PENALTY * 2),
        ("seed", MAX_SEED + 1), ("seed", MIN_SEED - 1), ("seed", 2**64), ("seed", True), ("seed", 1.0),
        ("logprobs", MAX_INT32 + 1), ("logprobs", True), ("logprobs", 2.0),
        ("prompt_logprobs", MAX_INT32 + 1), ("prompt_logprobs", -1), ("prompt_logprobs", False),
        ("stop_token_ids", [MAX_INT32 + 1]), ("stop_token_ids", [True]), ("stop_token_ids", [2.0]),
        ("stop_token_ids", (1, 2)),
        ("stop", "eos"), ("stop", [None]),
        ("ignore_eos", 1), ("ignore_eos", "yes"), ("ignore_eos", None),
    ],
)
def test_every_field_is_bounded_and_typed(field: str, value: object) -> None:
    # Set after construction, so __post_init__'s normalisation (stop as a string) hides nothing from validate.
    params = SamplingParams()
    setattr(params, field, value)
    with pytest.raises(ValueError, match=f"^{field} must be"):
        params.validate()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": -1}, {"top_k": 0}, {"top_k": 1}, {"top_k": MAX_TOP_K},
        {"seed": MIN_SEED}, {"seed": -1}, {"seed": 0}, {"seed": MAX_SEED},
        {"temperature": 0}, {"temperature": 1}, {"temperature": MIN_TEMPERATURE},
        {"temperature": MAX_TEMPERATURE},
        {"repetition_penalty": MIN_REPETITION_PENALTY}, {"repetition_penalty": MAX_REPETITION_PENALTY},
        {"max_tokens": MAX_INT32, "min_tokens": MAX_INT32}, {"logprobs": 0}, {"logprobs": MAX_INT32},
        {"prompt_logprobs": 0, "max_tokens": 0}, {"prompt_logprobs": MAX_INT32},
        {"stop_token_ids": [0, MAX_INT32]}, {"top_p": 1}, {"min_p": 0},
    ],
)
def test_values_on_the_bounds_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs).validate()


EXTREMES = [
    SamplingParams(temperature=MIN_TEMPERATURE, top_k=MAX_TOP_K, seed=MAX_SEED),
    SamplingParams(temperature=MAX_TEMPERATURE, top_k=MAX_TOP_K, seed=MIN_SEED),
    SamplingParams(temperature=MIN_TEMPERATURE, repetition_penalty=MIN_REPETITION_PENALTY, seed=-1),
    SamplingParams(temperature=MAX_TEMPERATURE, repetition_penalty=MAX_REPETITION_PENALTY, top_p=1e-9),
    SamplingParams(temperature=MIN_TEMPERATURE, repetition_penalty=MAX_REPETITION_PENALTY, min_p=1.0),
    SamplingParams(temperature=MAX_TEMPERATURE, repetition_penalty=MIN_REPETITION_PENALTY, top_k=1),
]


def test_the_sampler_handles_every_combination_of_extremes_in_one_batch() -> None:
    """Tokens 0 and 2 are masked (min_tokens), yet a NaN row samples token 0: that is what a temperature or
    penalty beyond the bounds gives. A top_k beyond int64 would raise instead."""
    sampler = Sampler("cpu", seed=0)
    prompt = list(range(3, 40))  # repetition penalty applies to these
    seqs = [
        Sequence(request_id=f"r{i}", prompt_token_ids=prompt, params=_masking(p), request_class="default",
                 priority=0, arrival_order=i, metrics=RequestMetrics(0.0),
                 generator=sampler.make_generator(p.seed) if p.seed is not None else None)
        for i, p in enumerate(EXTREMES)
    ]
    logits = torch.randn(len(seqs), 64, generator=torch.Generator().manual_seed(0)) * 30  # [B, V]
    for _ in range(10):
        tokens = sampler(logits, seqs, frozenset({2})).token_ids
        assert all(0 < t < 64 and t != 2 for t in tokens), tokens


def test_seeds_at_both_ends_give_distinct_streams() -> None:
    sampler = Sampler("cpu")
    draws = [sampler.make_generator(seed).initial_seed() for seed in (MIN_SEED, -1, 0, MAX_SEED)]
    assert len(set(draws)) == 4, "no two accepted seeds may alias (torch reduces seeds mod 2**64)"


def _masking(params: SamplingParams) -> SamplingParams:
    params.min_tokens, params.max_tokens, params.stop_token_ids = 1, 4, [0]
    params.validate()
    return params
