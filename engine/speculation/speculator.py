"""The scheduler's side of speculation: each decoding request's drafts for the step, cut so the step's
expected output tokens per second is highest.

A request drafts while it allows it (SamplingParams.speculate) and its acceptance has not stayed low
(SpeculativeConfig.min_acceptance_rate). Its draft length adapts: after a fully accepted draft it grows by
two, after a rejection it shrinks to what was accepted plus one. A constrained request's draft is cut at the
first token its grammar refuses.

With `dynamic`, the drafts are then cut by the measured cost of a step (step_cost.py). The j-th token of a
request's draft is kept with chance a^j, a its request's chance that a drafted token is accepted once those
before it were; the step keeps the D most likely draft tokens (each request a prefix of its draft), D chosen
so the expected tokens (one per decoding request, plus those chances) over the seconds a step of that many
tokens takes is highest. A step size not measured lately is run to measure it. When even one draft token per
request at the overall chance would not pay (a large batch: the step is compute-bound), nothing is proposed.
A request's chance is learnt
(starting from the method's overall one) from every verified draft, and from drafts the policy withheld:
their first token is judged against the token the request then got, so it keeps being judged, for free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.speculation.config import SpeculativeConfig
from conveyor.engine.speculation.ngram import NgramDrafter
from conveyor.engine.speculation.step_cost import StepCost
from conveyor.engine.speculation.suffix import SuffixDrafter, TenantHistory

if TYPE_CHECKING:
    import xgrammar

    from conveyor.engine.sequence import Sequence

PRIOR_WEIGHT = 8  # a request's acceptance chance starts as this many judged tokens at the overall chance
PRIOR_CHANCE = 0.5  # the overall chance before any drafted token was judged


class Drafter(Protocol):
    def propose(self, seq: Sequence, max_tokens: int) -> list[int]: ...


@dataclass
class Evidence:
    """Drafted tokens judged (each with all drafts before it accepted), and those accepted."""

    judged: int = 0
    accepted: int = 0

    def add(self, judged: int, accepted: int) -> None:
        self.judged += judged
        self.accepted += accepted

    def chance(self, prior: float) -> float:
        return (self.accepted + PRIOR_WEIGHT * prior) / (self.judged + PRIOR_WEIGHT)


@dataclass
class DraftState:
    """One request's proposer and how long its next draft may be."""

    drafter: Drafter
    max_drafts: int
    stopped: bool = False  # its acceptance stayed below min_acceptance_rate
    evidence: Evidence = field(default_factory=Evidence)
    withheld: tuple[int, int] | None = None  # (position, token): the first of a draft the policy withheld


@dataclass
class DraftCounts:
    drafted: int = 0
    accepted: int = 0

    @property
    def rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


@dataclass
class Speculator:
    config: SpeculativeConfig
    cost: StepCost = field(default_factory=StepCost)
    counts: dict[str, DraftCounts] = field(default_factory=dict)  # per request class
    evidence: Evidence = field(default_factory=Evidence)  # every request's, for the prior
    history: TenantHistory | None = None

    def __post_init__(self) -> None:
        c = self.config
        if c.method == "suffix" and c.tenant_history:
            self.history = TenantHistory(c.tenant_history, c.max_depth)

    # --- the step ------------------------------------------------------------------------------------

    def propose(self, seqs: list[Sequence], limits: list[int], base_tokens: int) -> list[list[int]]:
        """Drafts for each decoding request (at most limits[i] for seqs[i]; [] for none), given a step that
        computes base_tokens tokens without them."""
        if self.config.dynamic and not self._could_pay(len(seqs), base_tokens):
            return [[] for _ in seqs]  # compute-bound: not even worth the proposers' time
        drafts = [self._draft(seq, limit) for seq, limit in zip(seqs, limits, strict=True)]
        if not self.config.dynamic or not any(drafts):
            return drafts
        capped = self._cap_by_cost(seqs, drafts, base_tokens)
        for seq, proposed, kept in zip(seqs, drafts, capped, strict=True):
            if proposed and not kept and seq.drafting is not None:
                seq.drafting.withheld = (seq.num_tokens, proposed[0])
        return capped

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.cost.observe(num_tokens, seconds)

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """The verification of seq's draft: num_accepted of its num_drafted tokens were kept."""
        assert 0 <= num_accepted <= num_drafted, (num_accepted, num_drafted)
        seq.num_draft_tokens += num_drafted
        seq.num_accepted_tokens += num_accepted
        counts = self.counts.setdefault(seq.request_class, DraftCounts())
        counts.drafted += num_drafted
        counts.accepted += num_accepted
        state = seq.drafting
        if state is None:
            return
        # The accepted tokens, and the first rejected one if any, were each judged.
        self._add_evidence(state, num_accepted + (num_accepted < num_drafted), num_accepted)
        if num_accepted == num_drafted:
            state.max_drafts = min(state.max_drafts + 2, self.config.num_tokens)
        else:
            state.max_drafts = max(1, num_accepted + 1)
        judged = seq.num_draft_tokens >= self.config.min_drafts_to_judge
        if judged and seq.num_accepted_tokens < self.config.min_acceptance_rate * seq.num_draft_tokens:
            state.stopped = True

    def on_finish(self, seq: Sequence) -> None:
        if self.history is not None and seq.finish_reason != "abort" and seq.output_token_ids:
            self.history.add_output(seq)
        seq.drafting = None  # releases its proposer's index

    def stats(self) -> dict[str, object]:
        total = self._total()
        return {
            "method": self.config.method,
            "drafted_tokens": total.drafted,
            "accepted_tokens": total.accepted,
            "acceptance_rate": total.rate,
            "per_class": {name: {"drafted_tokens": c.drafted, "accepted_tokens": c.accepted}
                          for name, c in self.counts.items()},
        }

    # --- internals -----------------------------------------------------------------------------------

    def _draft(self, seq: Sequence, limit: int) -> list[int]:
        state = self._state(seq)
        if state is None or state.stopped or limit <= 0:
            return []
        self._judge_withheld(seq, state)
        drafts = state.drafter.propose(seq, min(limit, state.max_drafts))
        return cut_by_grammar(seq.matcher, drafts) if seq.matcher is not None else drafts

    def _state(self, seq: Sequence) -> DraftState | None:
        params = seq.params
        assert isinstance(params, SamplingParams), f"{seq.request_id} generates nothing to draft"
        if seq.drafting is None and params.speculate:
            seq.drafting = DraftState(self._drafter(seq), self.config.num_tokens)
        return seq.drafting

    def _judge_withheld(self, seq: Sequence, state: DraftState) -> None:
        if state.withheld is None or seq.num_tokens <= state.withheld[0]:
            return
        position, token = state.withheld
        state.withheld = None
        self._add_evidence(state, 1, int(seq.token_slice(position, position + 1)[0] == token))

    def _add_evidence(self, state: DraftState, judged: int, accepted: int) -> None:
        state.evidence.add(judged, accepted)
        self.evidence.add(judged, accepted)

    def _drafter(self, seq: Sequence) -> Drafter:
        c = self.config
        if c.method == "ngram":
            return NgramDrafter(c.min_ngram, c.max_ngram)
        history = self.history.trie_for(seq) if self.history is not None else None
        return SuffixDrafter(c.max_depth, c.min_token_prob, history)

    def _could_pay(self, num_seqs: int, base_tokens: int) -> bool:
        """Whether one draft token per request, each kept with the overall chance, would raise the step's
        tokens per second (True while either step size is unmeasured)."""
        curve = self.cost.curve()
        base, drafted = curve.seconds(base_tokens), curve.seconds(base_tokens + num_seqs)
        if base is None or drafted is None:
            return True
        return num_seqs * (1 + self.evidence.chance(PRIOR_CHANCE)) / drafted > num_seqs / base

    def _cap_by_cost(self, seqs: list[Sequence], drafts: list[list[int]], base_tokens: int
                     ) -> list[list[int]]:
        """The drafts cut to the most likely draft tokens, as many as make the step's expected tokens per
        second highest (a size not measured lately is run instead, to measure it)."""
        curve = self.cost.curve()
        base_seconds = curve.seconds(base_tokens)
        if base_seconds is None:
            return [[] for _ in drafts]  # measure the step without drafts first
        prior = self.evidence.chance(PRIOR_CHANCE)
        chances = [seq.drafting.evidence.chance(prior) if seq.drafting is not None else 0.0 for seq in seqs]
        # Each draft token with the chance it is kept (its request's chance to the power of its place);
        # a request's tokens stay in their order, so every request keeps a prefix of its draft.
        tokens = sorted(((a ** (j + 1), i) for i, (a, d) in enumerate(zip(chances, drafts, strict=True))
                         for j in range(len(d))), key=lambda t: -t[0])
        best, best_rate, expected = 0, len(seqs) / base_seconds, float(len(seqs))
        for count, (chance, _) in enumerate(tokens, start=1):
            expected += chance
            seconds = curve.seconds(base_tokens + count)
            if seconds is None:
                best = count  # measure this step size
                break
            if expected / seconds > best_rate:
                best, best_rate = count, expected / seconds
        kept = [0] * len(drafts)
        for _, i in tokens[:best]:
            kept[i] += 1
        return [d[:k] for d, k in zip(drafts, kept, strict=True)]

    def _total(self) -> DraftCounts:
        return DraftCounts(sum(c.drafted for c in self.counts.values()),
                           sum(c.accepted for c in self.counts.values()))


def cut_by_grammar(matcher: xgrammar.GrammarMatcher, drafts: list[int]) -> list[int]:
    """The drafts up to the first one the grammar refuses (the matcher is left as it was)."""
    accepted = 0
    for token in drafts:
        if not matcher.accept_token(token):
            break
        accepted += 1
    if accepted:
        matcher.rollback(accepted)
    return drafts[:accepted]
