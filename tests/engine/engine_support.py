"""Shared by the engine tests: stepping an engine until every request has finished."""

from __future__ import annotations

from engine import LLMEngine, RequestOutput


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
