"""The speculation parts on their own: the n-gram and suffix proposers, the tenant history (never across
salts), the config's validation, the measured step cost, and the policy that caps drafts by it."""

from __future__ import annotations

import pytest

from conveyor.engine.config import EngineConfig
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.speculation.config import SpeculativeConfig, speculative_config
from conveyor.engine.speculation.ngram import NgramDrafter
from conveyor.engine.speculation.speculator import Speculator
from conveyor.engine.speculation.step_cost import STALE_AFTER_STEPS, StepCost
from conveyor.engine.speculation.suffix import SuffixDrafter, SuffixTrie, TenantHistory
from tests.support.engine import make_seq


def grow(tokens: list[int], *more: int):
    seq = make_seq("r", tokens)
    seq.output_token_ids.extend(more)
    return seq


def test_ngram_proposes_what_followed_the_longest_recent_match() -> None:
    drafter = NgramDrafter(min_n=2, max_n=3)
    # "7 8 9" occurred followed by 1 2 3; "8 9" also occurred later, followed by 5 6: the 3-gram wins.
    seq = grow([7, 8, 9, 1, 2, 3, 0, 8, 9, 5, 6, 4, 7, 8, 9])
    assert drafter.propose(seq, 3) == [1, 2, 3]
    assert NgramDrafter(2, 3).propose(grow([1, 2, 3, 4, 5, 1, 2]), 2) == [3, 4]


def test_ngram_uses_the_latest_occurrence_unless_too_recent_for_a_whole_draft() -> None:
    latest = NgramDrafter(2, 2)
    assert latest.propose(grow([1, 2, 5, 5, 1, 2, 6, 6, 6, 1, 2]), 2) == [6, 6]
    run = NgramDrafter(2, 2)
    # Inside a run the latest "0 0" ends just before the end: the first one has a whole draft after it.
    assert run.propose(grow([3, 0, 0, 0, 0, 0]), 3) == [0, 0, 0]


def test_ngram_grows_with_the_sequence_and_finds_nothing_without_repeats() -> None:
    drafter = NgramDrafter(2, 4)
    seq = grow([1, 2, 3, 4])
    assert drafter.propose(seq, 4) == []
    seq.output_token_ids += [9, 1, 2]
    assert drafter.propose(seq, 4) == [3, 4, 9, 1]


def test_suffix_trie_counts_spans_and_follows_the_most_frequent_continuation() -> None:
    trie = SuffixTrie(max_depth=4)
    trie.extend([1, 2, 3, 1, 2, 3, 1, 2, 4])
    draft, score = trie.draft([5, 1, 2], max_tokens=3, min_prob=0.0)
    assert draft == [3, 1, 2]  # "1 2" was followed by 3 twice and by 4 once
    assert score == pytest.approx(2 / 3 + 2 / 3 + 2 / 3)  # then 3 -> 1 -> 2 always
    assert trie.draft([5, 1, 2], max_tokens=3, min_prob=0.7)[0] == []  # 2/3 is too unlikely


def test_suffix_drafter_reads_its_own_prompt_and_output() -> None:
    drafter = SuffixDrafter(max_depth=8, min_token_prob=0.5)
    seq = grow([10, 11, 12, 13, 14, 20, 10, 11])
    assert drafter.propose(seq, 3) == [12, 13, 14]
    seq.output_token_ids += [12]
    assert drafter.propose(seq, 2) == [13, 14]


def test_tenant_history_drafts_from_the_same_tenants_earlier_answer_only() -> None:
    history = TenantHistory(size=4, max_depth=8)
    prompt = [1, 2, 3]
    done = make_seq("a", prompt, cache_salt="tenant-a")
    done.output_token_ids += [40, 41, 42, 43, 44]
    history.add_output(done)
    same = make_seq("b", prompt, cache_salt="tenant-a")
    same.output_token_ids += [40, 41]
    other = make_seq("c", prompt, cache_salt="tenant-b")
    other.output_token_ids += [40, 41]
    assert SuffixDrafter(8, 0.5, history.trie_for(same)).propose(same, 3) == [42, 43, 44]
    assert SuffixDrafter(8, 0.5, history.trie_for(other)).propose(other, 3) == []


@pytest.mark.parametrize(("value", "error"), [
    ("eagle", "speculative.method must be one of"),
    ({"method": "ngram", "num_tokens": 0}, "speculative.num_tokens"),
    ({"method": "ngram", "min_ngram": 3, "max_ngram": 2}, "speculative.max_ngram"),
    ({"method": "suffix", "min_token_prob": 1.5}, "speculative.min_token_prob"),
    ({"method": "suffix", "depth": 3}, "unknown field"),
    ({"num_tokens": 3}, "needs a method"),
    (5, "speculative must be"),
])
def test_bad_speculative_settings_are_refused_by_name(value: object, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        EngineConfig(model="unused", speculative=value)  # type: ignore[arg-type]


def test_speculative_settings_parse_to_one_config() -> None:
    assert speculative_config("none") is None
    assert speculative_config("suffix") == SpeculativeConfig(method="suffix")
    assert EngineConfig(model="x", speculative={"method": "ngram", "num_tokens": 3}).speculative == (
        SpeculativeConfig(method="ngram", num_tokens=3))
    with pytest.raises(ValueError, match="speculate must be a bool"):
        SamplingParams(speculate="no")  # type: ignore[arg-type]


def test_step_cost_is_unknown_until_measured_and_again_once_stale() -> None:
    cost = StepCost()
    assert cost.seconds(8) is None
    cost.observe(8, 0.010)
    cost.observe(8, 0.020)
    assert cost.seconds(8) == pytest.approx(0.012)  # smoothed towards the newest
    assert cost.seconds(64) is None
    for _ in range(STALE_AFTER_STEPS + 1):
        cost.observe(64, 0.05)
    assert cost.seconds(8) is None and cost.seconds(64) == pytest.approx(0.05)


def test_step_cost_interpolates_between_measured_sizes_so_a_few_drafts_cost_their_share() -> None:
    cost = StepCost()
    cost.observe(32, 0.320)
    cost.observe(64, 0.640)  # compute-bound: 10 ms a token
    assert cost.seconds(34) == pytest.approx(0.340)  # the bucket of 32, and its share of the slope
    assert cost.seconds(68) == pytest.approx(0.680)  # past the last size (its bucket), along the last segment
    assert cost.seconds(24) is None  # its own bucket was never measured


def decoding(n: int, tokens: list[int]):
    seqs = []
    for i in range(n):
        seq = make_seq(f"r{i}", tokens)
        seq.params = SamplingParams(max_tokens=64, temperature=0)
        seq.output_token_ids.append(tokens[0])
        seqs.append(seq)
    return seqs


def test_the_policy_measures_then_drafts_while_steps_are_weight_bound_and_stops_when_compute_bound() -> None:
    repeating = [5, 6, 7, 8] * 4
    spec = Speculator(SpeculativeConfig(method="ngram", num_tokens=4))
    seqs = decoding(2, repeating)
    assert spec.propose(seqs, [8, 8], base_tokens=2) == [[], []]  # the plain step is not measured yet
    spec.observe_step(2, 0.010)
    assert [len(d) for d in spec.propose(seqs, [8, 8], base_tokens=2)] == [1, 0]  # measure one draft more
    for tokens in range(3, 11):
        spec.observe_step(tokens, 0.010 + 0.0001 * tokens)  # nearly free: bound by reading the weights
    assert [len(d) for d in spec.propose(seqs, [8, 8], base_tokens=2)] == [4, 4]

    bound = Speculator(SpeculativeConfig(method="ngram", num_tokens=4))
    for tokens in range(2, 11):  # every step size measured, each token costing the same
        bound.observe_step(tokens, 0.005 * tokens)
    seqs = decoding(2, repeating)
    assert bound.propose(seqs, [8, 8], base_tokens=2) == [[], []]
    assert all(seq.drafting is None for seq in seqs)  # not even proposed: the proposers' time is saved


def test_a_request_whose_drafts_are_usually_right_gets_the_longer_draft() -> None:
    spec = Speculator(SpeculativeConfig(method="ngram", num_tokens=4))
    for tokens in range(2, 11):
        spec.observe_step(tokens, 0.010 + 0.002 * tokens)  # each draft token costs a fifth of a plain step
    right, wrong = decoding(2, [5, 6, 7, 8] * 4)
    # Before any evidence both have the overall chance (one half): a draft token each pays, a second not.
    assert [len(d) for d in spec.propose([right, wrong], [8, 8], base_tokens=2)] == [1, 1]
    assert right.drafting is not None and wrong.drafting is not None
    right.drafting.evidence.add(judged=100, accepted=95)
    wrong.drafting.evidence.add(judged=100, accepted=20)
    assert [len(d) for d in spec.propose([right, wrong], [8, 8], base_tokens=2)] == [4, 0]


def test_withheld_drafts_are_judged_by_the_token_the_request_then_got() -> None:
    spec = Speculator(SpeculativeConfig(method="ngram", num_tokens=4))
    for tokens in range(1, 6):
        spec.observe_step(tokens, 0.010 + 0.004 * tokens)  # a draft token pays if kept half the time
    seq = decoding(1, [5, 6, 7, 8] * 3)[0]
    assert spec.propose([seq], [8], 1) != [[]]
    assert seq.drafting is not None
    seq.drafting.evidence.add(judged=100, accepted=5)  # this request's drafts are nearly always wrong
    assert spec.propose([seq], [8], 1) == [[]]
    assert seq.drafting.withheld == (seq.num_tokens, 6)
    seq.output_token_ids.append(6)  # what plain decoding gave: the draft's first token was right
    spec.propose([seq], [8], 1)
    assert (seq.drafting.evidence.judged, seq.drafting.evidence.accepted) == (101, 6)


def test_a_request_that_opts_out_or_keeps_missing_gets_no_drafts() -> None:
    spec = Speculator(SpeculativeConfig(method="ngram", num_tokens=4, dynamic=False, min_drafts_to_judge=6))
    seq = decoding(1, [5, 6, 7, 8] * 3)[0]
    seq.params = SamplingParams(max_tokens=64, speculate=False)
    assert spec.propose([seq], [8], 1) == [[]] and seq.drafting is None
    missing = decoding(1, [5, 6, 7, 8] * 3)[0]
    for _ in range(3):  # 4 + 1 + 1 drafts (after a miss: what was accepted plus one), none accepted
        drafts = spec.propose([missing], [8], 1)[0]
        assert drafts
        spec.record(missing, len(drafts), 0)
    assert missing.drafting is not None and missing.drafting.stopped
    assert spec.propose([missing], [8], 1) == [[]]
    assert spec.stats()["acceptance_rate"] == 0.0
