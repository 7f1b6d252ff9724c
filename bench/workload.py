"""Seeded workloads: the `short`, `long`, `mixed`, `deadlines`, `shared-prefix`, `service`, `quoting` and
`chat` profiles; a trace's requests are read by bench/trace_replay.py.

A workload is a list of requests, each with an arrival offset (seconds from the start of the run), a group
(the engine request class / service queue it goes to), a prompt (token ids, or text for a trace that gives
text), `max_tokens`, and optionally the number of output tokens after which the bench cancels it. The workload
names its groups: a profile sends its short requests to `interactive` and its long ones to `documents` (the
service's standard queues, renamable in the spec); a trace may use any group names. The same seed always
gives the same workload, so a baseline and a change see the same input set; `save_trace` writes it out and
its sha256 identifies it in reports.

The `shared-prefix` profile measures prefix caching: every request is one shared prefix (`prefix_tokens`, the
same token ids for all, like a batch's common instructions) followed by its own `suffix_tokens`, with exactly
`output_tokens` to generate; the short group, all at t=0 unless a rate is given.

The `service` profile measures the service rather than the engine: many one-token jobs with short prompts of
plain words (no tokenizer needed), sent to the short group. They arrive at fixed intervals (`submit_rate`,
open loop) or all at t=0, for the HTTP target to send a fixed number at a time (closed loop).

The `quoting` and `chat` profiles are real text for a real chat model, formatted with its chat template
(bench/text_workload.py): `quoting` sends the long group documents whose answers copy spans of their input
(bench/copy_prompts.py), what speculative decoding drafts from; `chat` sends the short group open questions
whose answers copy nothing (bench/chat_prompts.py). A real model ends these answers itself, so their
requests respect EOS unless the run says otherwise (`respects_eos`), and `max_tokens` only caps them.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from conveyor.bench.metrics import ALL
from conveyor.bench.prompt_text import word_prompt

TEXT_PROFILES = ("quoting", "chat")  # prompts of real text in the model's chat template
PROFILES = ("short", "long", "mixed", "deadlines", "shared-prefix", "service", *TEXT_PROFILES)


@dataclass(frozen=True)
class Group:
    """One group of a workload: the engine request class (in-process) or service queue (HTTP) its requests
    go to, the deadline its attainment is measured against (None: not measured) and its request class's
    priority (lower is served first)."""

    name: str
    deadline_s: float | None = None
    priority: int = 0


# The service's standard queues. A profile's short requests are the SHORT group and its long ones the LONG
# group (these names unless the spec renames them); a trace group with one of these names gets its defaults.
SHORT = Group("interactive", deadline_s=10.0, priority=0)
LONG = Group("documents", deadline_s=600.0, priority=1)
# Group names become request classes, queue names, report rows and the GROUP of `GROUP.METRIC` and
# `GROUP.max_running`, so no dots or spaces; `all` is the report's row for every group together.
_GROUP_NAME = re.compile(r"^[\w-]+$")


def check_group_name(name: object, what: str) -> str:
    if not isinstance(name, str) or not _GROUP_NAME.match(name) or name == ALL:
        raise ValueError(f"{what}: a group name is letters, digits, '_' and '-' (not {ALL!r}), got {name!r}")
    return name


def check_known_groups(values: Mapping[str, object], groups: Sequence[Group], what: str) -> None:
    """Per-group settings must name groups the workload has: a typo would otherwise be silently ignored."""
    names = [g.name for g in groups]
    for name in values:
        if name not in names:
            raise ValueError(f"{what}: unknown group {name!r}; this workload's groups: {', '.join(names)}")


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    group: str
    arrival_s: float  # offset from the start of the run
    max_tokens: int
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None  # text prompts come from traces and the text profiles
    cancel_after_tokens: int | None = None  # cancel once this many tokens were generated; None = never
    # Its own deadline (seconds after its arrival) and priority (lower first), as an exported job had them;
    # None: its group's.
    deadline_s: float | None = None
    priority: int | None = None
    # The served model an exported job ran on: over HTTP it is asked for by name (a service of several
    # models would otherwise run it on its default one); the in-process engine is one model.
    model: str | None = None

    def __post_init__(self) -> None:
        if (self.prompt_token_ids is None) == (self.prompt is None):
            raise ValueError(f"request {self.request_id}: give exactly one of prompt_token_ids and prompt")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens must be >= 1, got {self.max_tokens}")
        if self.arrival_s < 0:
            raise ValueError(f"request {self.request_id}: arrival_s must be >= 0, got {self.arrival_s}")
        if self.deadline_s is not None and not (math.isfinite(self.deadline_s) and self.deadline_s > 0):
            raise ValueError(f"request {self.request_id}: deadline_s must be > 0, got {self.deadline_s}")


@dataclass(frozen=True)
class Range:
    """Inclusive integer range drawn uniformly; written `LO:HI` on the command line."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str) -> Range:
        lo, _, hi = text.partition(":")
        r = cls(int(lo), int(hi or lo))
        if not 1 <= r.lo <= r.hi:
            raise ValueError(f"range must be LO:HI with 1 <= LO <= HI, got {text!r}")
        return r

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return f"{self.lo}:{self.hi}"


SERVICE_PROMPT_WORDS = Range(6, 12)  # short, so the service's own overhead dominates each job
# Output ranges when the spec gives none: (short group, long group). The text profiles' answers end at EOS,
# so their max_tokens (for the one group each has) is a cap above a usual answer rather than a length.
OTHER_OUTPUTS = (Range(16, 64), Range(64, 256))
DEFAULT_OUTPUTS = {
    "chat": (Range(128, 128), OTHER_OUTPUTS[1]),
    "quoting": (OTHER_OUTPUTS[0], Range(256, 256)),
}


def respects_eos(profile: str) -> bool:
    """Whether a profile's requests stop at EOS unless told otherwise: only the text profiles' (a real
    model's answers end by themselves; the other profiles' prompts are random tokens)."""
    return profile in TEXT_PROFILES


@dataclass
class WorkloadSpec:
    """Everything that determines a generated workload (recorded in every report as the input set).

    `rates` are Poisson arrival rates in requests/s per group; a missing or 0 rate means the group arrives
    all at once at t=0. `long_prompt` defaults to (context/4 .. context - long_output.hi); in `quoting`, to
    each task kind's own document size. Short requests go to the group `short_group`, long ones to
    `long_group`. The output ranges default to the profile's (DEFAULT_OUTPUTS), filled in at creation.
    """

    profile: str = "mixed"
    num_requests: int = 64
    seed: int = 0
    documents_share: float = 0.25  # mixed only
    rates: dict[str, float] = field(default_factory=dict)
    cancel_share: float = 0.0
    short_prompt: Range = field(default_factory=lambda: Range(16, 96))
    short_output: Range | None = None  # None: the profile's default
    long_prompt: Range | None = None
    long_output: Range | None = None  # None: the profile's default
    short_group: str = SHORT.name
    long_group: str = LONG.name
    submit_rate: float | None = None  # service only: submissions/s at fixed intervals (open loop)
    # shared-prefix only: the common prefix, each request's own suffix, and the tokens it generates.
    prefix_tokens: int = 768
    suffix_tokens: int = 32
    output_tokens: int = 32

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, got {self.profile!r}")
        short, long = DEFAULT_OUTPUTS.get(self.profile, OTHER_OUTPUTS)
        self.short_output = self.short_output or short
        self.long_output = self.long_output or long
        self._check_service()
        self._check_shared_prefix()
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not 0.0 <= self.documents_share <= 1.0:
            raise ValueError(f"documents_share must be in [0, 1], got {self.documents_share}")
        if not 0.0 <= self.cancel_share <= 1.0:
            raise ValueError(f"cancel_share must be in [0, 1], got {self.cancel_share}")
        check_group_name(self.short_group, "short_group (--short-group)")
        check_group_name(self.long_group, "long_group (--long-group)")
        if self.short_group == self.long_group:
            raise ValueError(
                f"short_group, long_group: need two different names, got {self.short_group!r} twice"
            )
        check_known_groups(self.rates, self.groups(), "rates (--rate)")
        for group, rate in self.rates.items():
            if rate < 0:
                raise ValueError(f"rates (--rate): need RATE >= 0, got {group}={rate}")

    def _check_service(self) -> None:
        if self.submit_rate is not None and (self.profile != "service" or self.submit_rate <= 0):
            raise ValueError(
                f"submit_rate (--submit-rate): needs --profile service and a rate > 0, got {self.submit_rate}"
            )
        if self.profile == "service" and self.rates:
            raise ValueError("rates (--rate): the service profile arrives at fixed intervals: --submit-rate")
        if self.profile == "service" and self.cancel_share:
            raise ValueError("cancel_share (--cancel-share): the service profile cancels nothing")

    def _check_shared_prefix(self) -> None:
        for name in ("prefix_tokens", "suffix_tokens", "output_tokens"):
            value = getattr(self, name)
            least = 0 if name != "output_tokens" else 1
            if value < least:
                raise ValueError(f"{name} (--{name.replace('_', '-')}): must be >= {least}, got {value}")
        if self.prefix_tokens + self.suffix_tokens < 1:
            raise ValueError("prefix_tokens, suffix_tokens: a prompt needs at least one token")

    def groups(self) -> list[Group]:
        """The groups this profile sends requests to, with the short and long groups' defaults."""
        short, long = replace(SHORT, name=self.short_group), replace(LONG, name=self.long_group)
        # deadlines: the two groups share one priority, so only their deadlines tell the scheduler apart (as
        # two kinds of job in one queue would be).
        same = [replace(short, priority=0), replace(long, priority=0)]
        by_profile = {"short": [short], "long": [long], "mixed": [short, long], "deadlines": same,
                      "shared-prefix": [short], "service": [short], "quoting": [long], "chat": [short]}
        return by_profile[self.profile]

    def output_range(self, group: str) -> Range:
        """The output range of `group`'s requests (the short group's, else the long group's)."""
        out = self.short_output if group == self.short_group else self.long_output
        assert out is not None, "filled in by __post_init__"
        return out

    def describe(self) -> dict[str, object]:
        d = asdict(self)
        for key in ("short_prompt", "short_output", "long_prompt", "long_output"):
            value = getattr(self, key)
            d[key] = None if value is None else str(value)
        return d


def generate(spec: WorkloadSpec, vocab_ids: Sequence[int], max_model_len: int) -> list[BenchRequest]:
    """Draws the requests of `spec`; prompt token ids are drawn from `vocab_ids` (no special tokens)."""
    if spec.profile == "service":
        return service_requests(spec)
    if spec.profile in TEXT_PROFILES:
        raise ValueError(f"profile {spec.profile}: its text prompts need the model's tokenizer; "
                         "bench/text_workload.py text_requests makes them")
    if not vocab_ids:
        raise ValueError("vocab_ids: need at least one token id to synthesise prompts")
    rng = random.Random(spec.seed)
    if spec.profile == "shared-prefix":
        return shared_prefix_requests(spec, vocab_ids, rng, max_model_len)
    groups = _groups(spec, rng)
    requests = []
    clock = {g.name: 0.0 for g in spec.groups()}
    for i, group in enumerate(groups):
        prompt_len, max_tokens = _lengths(spec, group, rng, max_model_len)
        rate = spec.rates.get(group, 0.0)
        if rate > 0:
            clock[group] += rng.expovariate(rate)
        cancel = None
        if rng.random() < spec.cancel_share:
            cancel = max(1, max_tokens // 2)
        requests.append(
            BenchRequest(
                request_id=f"bench-{i:05d}",
                group=group,
                arrival_s=round(clock[group], 6),
                max_tokens=max_tokens,
                prompt_token_ids=[rng.choice(vocab_ids) for _ in range(prompt_len)],
                cancel_after_tokens=cancel,
            )
        )
    return sorted(requests, key=lambda r: (r.arrival_s, r.request_id))


def service_requests(spec: WorkloadSpec) -> list[BenchRequest]:
    """One-token jobs with plain-word prompts; the i-th arrives at i / submit_rate (all at 0 without it)."""
    rng = random.Random(spec.seed)
    interval = 1.0 / spec.submit_rate if spec.submit_rate else 0.0
    return [
        BenchRequest(
            request_id=f"bench-{i:05d}",
            group=spec.short_group,
            arrival_s=round(i * interval, 6),
            max_tokens=1,
            prompt=word_prompt(rng, SERVICE_PROMPT_WORDS.draw(rng)),
        )
        for i in range(spec.num_requests)
    ]


def shared_prefix_requests(
    spec: WorkloadSpec, vocab_ids: Sequence[int], rng: random.Random, max_model_len: int
) -> list[BenchRequest]:
    """One prefix drawn once, then per request its own suffix; arrivals as the short group's rate says."""
    total = spec.prefix_tokens + spec.suffix_tokens + spec.output_tokens
    if total > max_model_len:
        raise ValueError(
            f"prefix_tokens + suffix_tokens + output_tokens = {total} exceeds the context ({max_model_len})"
        )
    prefix = [rng.choice(vocab_ids) for _ in range(spec.prefix_tokens)]
    rate, clock = spec.rates.get(spec.short_group, 0.0), 0.0
    requests = []
    for i in range(spec.num_requests):
        if rate > 0:
            clock += rng.expovariate(rate)
        suffix = [rng.choice(vocab_ids) for _ in range(spec.suffix_tokens)]
        cancel = max(1, spec.output_tokens // 2) if rng.random() < spec.cancel_share else None
        requests.append(
            BenchRequest(
                request_id=f"bench-{i:05d}",
                group=spec.short_group,
                arrival_s=round(clock, 6),
                max_tokens=spec.output_tokens,
                prompt_token_ids=prefix + suffix,
                cancel_after_tokens=cancel,
            )
        )
    return requests


def _groups(spec: WorkloadSpec, rng: random.Random) -> list[str]:
    if spec.profile == "short":
        return [spec.short_group] * spec.num_requests
    if spec.profile == "long":
        return [spec.long_group] * spec.num_requests
    num_docs = round(spec.num_requests * spec.documents_share)
    groups = [spec.long_group] * num_docs + [spec.short_group] * (spec.num_requests - num_docs)
    rng.shuffle(groups)
    return groups


def _lengths(spec: WorkloadSpec, group: str, rng: random.Random, max_model_len: int) -> tuple[int, int]:
    """(prompt length, max_tokens), clipped so prompt + output fits the model's context."""
    output_range = spec.output_range(group)
    if group == spec.short_group:
        prompt_range = spec.short_prompt
    else:
        prompt_range = spec.long_prompt or Range(
            max(1, max_model_len // 4), max(max_model_len // 4, max_model_len - output_range.hi)
        )
    max_tokens = min(output_range.draw(rng), max_model_len - 1)
    prompt_len = min(prompt_range.draw(rng), max_model_len - max_tokens)
    return prompt_len, max_tokens


def save_trace(requests: Sequence[BenchRequest], path: str | Path) -> str:
    """Writes the requests as a replayable trace; returns its sha256."""
    text = trace_text(requests)
    Path(path).write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


def trace_text(requests: Sequence[BenchRequest]) -> str:
    lines = []
    for r in requests:
        obj = {k: v for k, v in asdict(r).items() if v is not None}
        lines.append(json.dumps(obj, separators=(",", ":")))
    return "\n".join(lines) + "\n"


def trace_sha256(requests: Sequence[BenchRequest]) -> str:
    return hashlib.sha256(trace_text(requests).encode()).hexdigest()


def all_at_once(requests: Sequence[BenchRequest]) -> bool:
    return all(r.arrival_s == 0 for r in requests)
