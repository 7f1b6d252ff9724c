"""Shared by the engine tests: a bare sequence for the block manager, and stepping an engine until every
request has finished."""

from __future__ import annotations

from conveyor.engine import LLMEngine, RequestOutput, SamplingParams
from conveyor.engine.outputs import RequestMetrics
from conveyor.engine.sequence import Sequence


def make_seq(request_id: str, tokens: list[int], cache_salt: str | None = None) -> Sequence:
    """A sequence of `tokens` as the block manager sees it (default class, default sampling)."""
    return Sequence(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        params=SamplingParams(),
        request_class="default",
        priority=0,
        arrival_order=0,
        metrics=RequestMetrics(arrival_time=0.0),
        cache_salt=cache_salt,
    )


def drain(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Steps until nothing is left; each request's final output, and every KV block free again."""
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, "a finished output is reported once"
                done[out.request_id] = out
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return done


def run_staggered(engine: LLMEngine, requests: list[tuple[str, list[int], int]], *, first: int, then: int
                  ) -> dict[str, list[int]]:
    """Greedy, EOS ignored: adds `first` of (id, prompt ids, max_tokens), then `then` more after every step,
    so new prompts arrive mid-generation; each request's generated ids, all of them ending on length."""
    pending = list(requests)
    done: dict[str, list[int]] = {}

    def add(n: int) -> None:
        for rid, prompt, max_tokens in pending[:n]:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            engine.add_request(rid, prompt, params)
        del pending[:n]

    add(first)
    while engine.has_unfinished_requests() or pending:
        for out in engine.step():
            if out.finished:
                assert out.finish_reason == "length"
                done[out.request_id] = out.token_ids
        add(then)
    return done
