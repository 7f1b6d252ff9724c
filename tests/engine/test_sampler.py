"""Sampler unit tests over hand-made logits (no model)."""

from __future__ import annotations

import math

import torch

from conveyor.engine.outputs import RequestMetrics
from conveyor.engine.sampler import Sampler
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.sequence import Sequence

EOS = frozenset({2})


def seq(params: SamplingParams, prompt: list[int] | None = None, sampler: Sampler | None = None) -> Sequence:
    generator = sampler.make_generator(params.seed) if sampler and params.seed is not None else None
    return Sequence(
        request_id="r", prompt_token_ids=prompt or [5], params=params, request_class="default", priority=0,
        arrival_order=0, metrics=RequestMetrics(0.0), generator=generator,
    )


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0], [5.0, 1.0, 0.0, 0.0]])
    out = Sampler("cpu")(logits, [seq(SamplingParams(temperature=0))] * 2, frozenset())
    assert out.token_ids == [2, 0]
    assert out.logprobs == [None, None]


def test_top_k_1_top_p_tiny_and_min_p_1_all_reduce_to_the_argmax() -> None:
    sampler = Sampler("cpu", seed=0)
    logits = torch.tensor([[0.0, 1.0, 1.5, 0.5, 1.2]]).repeat(3, 1)
    params = [SamplingParams(top_k=1), SamplingParams(top_p=0.01), SamplingParams(min_p=1.0)]
    for _ in range(20):
        assert sampler(logits, [seq(p) for p in params], frozenset()).token_ids == [2, 2, 2]


def test_sampling_follows_the_softmax_distribution() -> None:
    sampler = Sampler("cpu", seed=0)
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]])).repeat(500, 1)
    counts = torch.zeros(4)
    for _ in range(8):
        tokens = sampler(logits, [seq(SamplingParams())] * 500, frozenset()).token_ids
        counts += torch.bincount(torch.tensor(tokens), minlength=4)
    freq = counts / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.03), freq


def test_top_k_keeps_only_the_k_best() -> None:
    sampler = Sampler("cpu", seed=0)
    logits = torch.tensor([[0.0, 0.1, 0.2, 0.3, 0.4]]).repeat(200, 1)
    tokens = sampler(logits, [seq(SamplingParams(top_k=2))] * 200, frozenset()).token_ids
    assert set(tokens) == {3, 4}


def test_temperature_sharpens() -> None:
    sampler = Sampler("cpu", seed=0)
    logits = torch.tensor([[0.0, 1.0]]).repeat(400, 1)
    cold = sampler(logits, [seq(SamplingParams(temperature=0.1))] * 400, frozenset()).token_ids
    assert sum(cold) > 390  # p(1) = 1 / (1 + e^-10)


def test_seeded_row_is_independent_of_the_rest_of_the_batch() -> None:
    vocab = 50
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3))
    alone_sampler = Sampler("cpu", seed=0)
    alone_seq = seq(SamplingParams(seed=42), sampler=alone_sampler)
    alone = [alone_sampler(logits, [alone_seq], frozenset()).token_ids[0] for _ in range(10)]

    batch_sampler = Sampler("cpu", seed=99)
    seeded = seq(SamplingParams(seed=42), sampler=batch_sampler)
    others = [seq(SamplingParams(seed=7), sampler=batch_sampler), seq(SamplingParams()),
              seq(SamplingParams())]
    in_batch = []
    for step in range(10):
        rows = [*others[: step % 4], seeded, *others[step % 4 :]]  # the seeded row moves around
        tokens = batch_sampler(logits.repeat(len(rows), 1), rows, frozenset()).token_ids
        in_batch.append(tokens[rows.index(seeded)])
    assert alone == in_batch
    assert len(set(alone)) > 1


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 1.0]]).repeat(3, 1)
    early = seq(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]))
    done = seq(SamplingParams(temperature=0, min_tokens=1))
    done.output_token_ids = [4]
    ignoring = seq(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True))
    out = Sampler("cpu")(logits, [early, done, ignoring], EOS)
    assert out.token_ids == [4, 2, 2]


def test_repetition_penalty_pushes_seen_tokens_down() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.1]]).repeat(2, 1)
    plain = seq(SamplingParams(temperature=0))
    penalised = seq(SamplingParams(temperature=0, repetition_penalty=1.2), prompt=[0, 2])
    assert Sampler("cpu")(logits, [plain, penalised], frozenset()).token_ids == [0, 1]
    out = Sampler("cpu")(torch.tensor([[2.0, 1.9, -1.0, -1.1]]), [penalised], frozenset())
    assert out.token_ids == [1]


def test_logprobs_hold_top_n_and_the_sampled_token() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]]).repeat(2, 1)
    rows = [seq(SamplingParams(temperature=0, logprobs=2)), seq(SamplingParams(top_k=1, logprobs=0))]
    out = Sampler("cpu")(logits, rows, frozenset())
    expected = torch.log_softmax(logits[0], dim=-1)
    first, second = out.logprobs
    assert first is not None and second is not None
    assert set(first) == {4, 3}
    assert math.isclose(first[3], float(expected[3]), rel_tol=1e-6)
    assert list(second) == [4]
