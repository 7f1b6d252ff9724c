"""OpenAI's presence and frequency penalties in the sampler: over output tokens only, logits[t] -=
frequency_penalty * count(t) + presence_penalty * (count(t) > 0); rows without them stay exact."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.engine.outputs import RequestMetrics
from conveyor.engine.sampler import Sampler
from conveyor.engine.sampling_params import MAX_OPENAI_PENALTY, MIN_OPENAI_PENALTY, SamplingParams
from conveyor.engine.sequence import Sequence

VOCAB = 8


def _seq(
    params: SamplingParams, output: list[int], prompt: list[int] | None = None, sampler: Sampler | None = None
) -> Sequence:
    generator = sampler.make_generator(params.seed) if sampler and params.seed is not None else None
    seq = Sequence(
        request_id="r",
        prompt_token_ids=prompt or [1, 1, 1],
        params=params,
        request_class="default",
        priority=0,
        arrival_order=0,
        metrics=RequestMetrics(0.0),
        generator=generator,
    )
    seq.output_token_ids = list(output)
    return seq


def _penalised(logits: list[float], output: list[int], presence: float, frequency: float) -> list[float]:
    """The definition, one token at a time."""
    return [
        value - frequency * output.count(t) - presence * (output.count(t) > 0)
        for t, value in enumerate(logits)
    ]


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize(
    "value", [MAX_OPENAI_PENALTY + 0.01, MIN_OPENAI_PENALTY - 1, math.nan, math.inf, True]
)
def test_out_of_range_penalty_is_a_value_error_naming_it(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})  # type: ignore[arg-type]


def test_bounds_are_accepted() -> None:
    SamplingParams(presence_penalty=MIN_OPENAI_PENALTY, frequency_penalty=MAX_OPENAI_PENALTY)


def test_greedy_choice_follows_the_penalised_logits() -> None:
    # Token 3 leads by 1.0 but was generated twice: frequency 0.4 * 2 + presence 0.5 = 1.3 puts token 5 first.
    logits = [0.0, 0.0, 0.0, 3.0, 0.0, 2.0, 0.0, 0.0]
    output = [3, 3, 4]
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.4)
    expected = _penalised(logits, output, 0.5, 0.4)
    out = Sampler("cpu")(torch.tensor([logits]), [_seq(params, output)], frozenset())
    assert out.token_ids == [max(range(VOCAB), key=expected.__getitem__)] == [5]


def test_prompt_tokens_are_not_penalised() -> None:
    logits = [0.0, 0.0, 0.0, 3.0, 0.0, 2.0, 0.0, 0.0]
    params = SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0)
    out = Sampler("cpu")(torch.tensor([logits]), [_seq(params, [], prompt=[3, 3, 3])], frozenset())
    assert out.token_ids == [3]


def test_sampled_distribution_matches_the_penalised_softmax() -> None:
    logits = [0.5, 1.0, 0.2, 1.5, 0.0, 1.2, 0.3, 0.8]
    output = [3, 3, 5, 1, 3]
    presence, frequency = 0.7, -0.3  # a negative frequency rewards repeats
    rows = 4000
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    sampler = Sampler("cpu", seed=0)
    tokens = sampler(
        torch.tensor([logits]).repeat(rows, 1), [_seq(params, output)] * rows, frozenset()
    ).token_ids
    observed = torch.bincount(torch.tensor(tokens), minlength=VOCAB) / rows
    expected = torch.tensor(_penalised(logits, output, presence, frequency)).softmax(dim=-1)
    unpenalised = torch.tensor(logits).softmax(dim=-1)
    assert torch.allclose(observed, expected, atol=0.03), (observed, expected)
    assert not torch.allclose(observed, unpenalised, atol=0.03)


def test_mixed_batch_leaves_unpenalised_rows_exact() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5))
    outputs = [[2, 2, 7], [1], [2, 2, 7], [4, 4]]
    plain = [SamplingParams(seed=11), SamplingParams(temperature=0)]
    penalised = [
        SamplingParams(seed=12, presence_penalty=1.5, frequency_penalty=1.0),
        SamplingParams(temperature=0, frequency_penalty=-2.0),
    ]

    def run(params: list[SamplingParams], rows: list[int]) -> list[int]:
        sampler = Sampler("cpu", seed=0)
        seqs = [_seq(p, outputs[r], sampler=sampler) for p, r in zip(params, rows, strict=True)]
        return sampler(logits[rows], seqs, frozenset()).token_ids

    alone = run(plain, [0, 1])
    mixed = run([plain[0], penalised[0], plain[1], penalised[1]], [0, 2, 1, 3])
    assert [mixed[0], mixed[2]] == alone
    # The greedy penalised row follows the definition on its own logits.
    expected = _penalised(logits[3].tolist(), outputs[3], 0.0, -2.0)
    assert mixed[3] == max(range(VOCAB), key=expected.__getitem__)


def test_logprobs_stay_those_of_the_model() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, 0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0, presence_penalty=2.0, logprobs=1)
    out = Sampler("cpu")(logits, [_seq(params, [2])], frozenset())
    raw = logits.log_softmax(dim=-1)[0]
    assert out.token_ids == [1]
    assert out.logprobs[0] is not None
    assert out.logprobs[0][2] == pytest.approx(raw[2].item()) and out.logprobs[0][1] == pytest.approx(
        raw[1].item()
    )
