"""The requests of the text profiles, `quoting` and `chat`: real text in the model's chat template.

Per request, from one generator seeded with the spec's seed, in this order: its arrival (Poisson at its
group's rate, else t=0), whether it is cancelled (`cancel_share`), its max_tokens (its group's output range),
then its message. `quoting` (the long group) takes the task kinds in turn (copy_prompts.KINDS), each
document's tokens drawn from `long_prompt` or else the kind's own range (DOCUMENT_TOKENS); `chat` (the short
group) draws one question per request. Prompt and answer fit the context: a document is cut to leave room for
max_tokens, and max_tokens to what the rendered prompt leaves.
"""

from __future__ import annotations

import random

from conveyor.bench.chat_format import ChatFormat
from conveyor.bench.chat_prompts import chat_message
from conveyor.bench.copy_prompts import KINDS, copy_task
from conveyor.bench.workload import TEXT_PROFILES, BenchRequest, Range, WorkloadSpec

# Document tokens per quoting task kind (without --long-prompt): an order of a few dozen lines, a paragraph
# of a few hundred tokens, notes of a few paragraphs.
DOCUMENT_TOKENS = {"invoice": Range(300, 600), "rewrite": Range(150, 250), "summary": Range(300, 500)}
INSTRUCTION_TOKENS = 64  # kept for a task's instruction when a document is cut to fit the context


def text_requests(spec: WorkloadSpec, fmt: ChatFormat, max_model_len: int) -> list[BenchRequest]:
    """The spec's requests, their prompts rendered by `fmt`, each within `max_model_len` with its answer."""
    if spec.profile not in TEXT_PROFILES:
        raise ValueError(f"profile must be one of {TEXT_PROFILES} here, got {spec.profile!r}")
    rng = random.Random(spec.seed)
    group = spec.long_group if spec.profile == "quoting" else spec.short_group
    rate, clock = spec.rates.get(group, 0.0), 0.0
    template_tokens = fmt.prompt_tokens(fmt.render(""))  # the chat template's own tokens around a message
    requests = []
    for i in range(spec.num_requests):
        if rate > 0:
            clock += rng.expovariate(rate)
        cancelled = rng.random() < spec.cancel_share
        # At most half the context: a small context still leaves the other half to the document.
        max_tokens = min(spec.output_range(group).draw(rng), max(1, max_model_len // 2))
        room = max_model_len - max_tokens - template_tokens - INSTRUCTION_TOKENS
        prompt = fmt.render(message(spec, i, rng, fmt, room))
        max_tokens = fit_answer(max_tokens, fmt.prompt_tokens(prompt), max_model_len)
        requests.append(
            BenchRequest(
                request_id=f"bench-{i:05d}",
                group=group,
                arrival_s=round(clock, 6),
                max_tokens=max_tokens,
                prompt=prompt,
                cancel_after_tokens=max(1, max_tokens // 2) if cancelled else None,
            )
        )
    return requests


def message(spec: WorkloadSpec, i: int, rng: random.Random, fmt: ChatFormat, room: int) -> str:
    """The i-th request's user message; a quoting document holds at most `room` tokens (at least one line)."""
    if spec.profile == "chat":
        return chat_message(rng)
    kind = KINDS[i % len(KINDS)]
    wanted = (spec.long_prompt or DOCUMENT_TOKENS[kind]).draw(rng)
    return copy_task(kind, rng, max(1, min(wanted, room)), fmt.count).message


def fit_answer(max_tokens: int, prompt_tokens: int, max_model_len: int) -> int:
    """max_tokens cut to what the prompt leaves of the context."""
    left = max_model_len - prompt_tokens
    if left < 1:
        raise ValueError(
            f"max_model_len: {max_model_len} tokens leave no room to answer a prompt of {prompt_tokens} "
            "tokens; raise it (--set max_model_len=N) or shorten the documents (--long-prompt)"
        )
    return min(max_tokens, left)
