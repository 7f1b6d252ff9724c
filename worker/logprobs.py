"""The engine's per-token logprobs as a job stores them: token ids decoded to text here, in the worker, so the
API and the batch writer never need the tokenizer."""

from __future__ import annotations

from typing import Any

from conveyor.engine.tokenizer import Tokenizer
from conveyor.worker.storable_text import storable


def job_logprobs(
    token_ids: list[int], logprobs: list[dict[int, float]] | None, top_n: int | None, tokenizer: Tokenizer
) -> list[dict[str, Any]] | None:
    """Per generated token: {token_id, text, logprob, top_logprobs: [{token_id, text, logprob}] (top_n, best
    first)}; None when the job did not ask for logprobs."""
    if logprobs is None or top_n is None:
        return None
    assert len(logprobs) == len(token_ids), "the engine keeps one logprobs entry per generated token"
    texts = _token_texts(token_ids, logprobs, tokenizer)
    out = []
    for token, entry in zip(token_ids, logprobs, strict=True):
        best = sorted(entry.items(), key=lambda item: item[1], reverse=True)[:top_n]
        out.append({**_entry(token, entry[token], texts),
                    "top_logprobs": [_entry(alt, logprob, texts) for alt, logprob in best]})
    return out


def job_prompt_logprobs(
    token_ids: list[int], logprobs: list[dict[int, float] | None] | None, top_n: int | None,
    tokenizer: Tokenizer,
) -> list[dict[str, Any]] | None:
    """Per prompt token, as job_logprobs gives generated ones; the first token's logprob is None (nothing
    precedes it) and it has no alternatives. None when the job did not ask for prompt logprobs."""
    if logprobs is None or top_n is None:
        return None
    assert len(logprobs) == len(token_ids), "the engine keeps one entry per prompt token, the first None"
    scored = job_logprobs(token_ids[1:], [entry or {} for entry in logprobs[1:]], top_n, tokenizer) or []
    first = {"token_id": token_ids[0], "text": _token_texts(token_ids[:1], [], tokenizer)[token_ids[0]],
             "logprob": None, "top_logprobs": []}
    return [first, *scored]


def _entry(token: int, logprob: float, texts: dict[int, str]) -> dict[str, Any]:
    return {"token_id": token, "text": texts[token], "logprob": logprob}


def _token_texts(token_ids: list[int], logprobs: list[dict[int, float]], tokenizer: Tokenizer,
                 ) -> dict[int, str]:
    """Each distinct token decoded alone, special tokens included (they were generated too), storable as the
    result text is."""
    distinct = set(token_ids).union(*(entry.keys() for entry in logprobs))
    return {token: storable(tokenizer.decode([token], skip_special_tokens=False)) for token in distinct}
