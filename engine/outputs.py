"""What the engine hands back to callers: one RequestOutput per request per step it changed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from conveyor.engine.sequence import Sequence

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request's life, plus how often it was preempted."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated tokens so far
    text: str  # detokenised generated text (truncated before a matched stop string)
    finish_reason: FinishReason | None  # None while running
    metrics: RequestMetrics
    # Per generated token: {token id: logprob} with the top-n tokens and the sampled one.
    logprobs: list[dict[int, float]] | None = None
    # SamplingParams.prompt_logprobs: per prompt token, None for the first (nothing precedes it), then
    # {token id: logprob} with the top-k tokens and the prompt token itself. None until the whole prompt is
    # prefilled (and without prompt_logprobs); complete, the engine never changes it, so outputs share it.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_new_tokens: int = 0  # tokens added by the step that produced this output
    prompt: str | None = None
    # Prompt tokens whose K/V came from the prefix cache when the request was first scheduled (vLLM's name);
    # 0 before that, and always 0 with prefix caching off.
    num_cached_tokens: int = 0
    # A pooling request's vector (fp32 values, PoolingParams.dimensions of them when set), on its final
    # output; None for generation requests. prompt_token_ids are then the tokens embedded (after truncate).
    embedding: list[float] | None = None
    lora: str | None = None  # the LoRA adapter it ran with; None: the base model
    # Speculation: draft tokens proposed for it so far, and those accepted (part of token_ids).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def request_output(seq: Sequence, num_new_tokens: int, embedding: list[float] | None = None) -> RequestOutput:
    """A snapshot of seq for its caller (copies: the engine goes on changing seq); `embedding`: the vector
    of a pooling request that finished."""
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=list(seq.output_token_ids),
        text=seq.text,
        finish_reason=seq.finish_reason,
        metrics=RequestMetrics(**vars(seq.metrics)),
        logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
        prompt_logprobs=seq.prompt_logprobs if not seq.needs_prompt_logprobs else None,
        num_new_tokens=num_new_tokens,
        prompt=seq.prompt,
        num_cached_tokens=seq.num_cached_tokens or 0,
        embedding=embedding,
        lora=seq.lora,
        num_draft_tokens=seq.num_draft_tokens,
        num_accepted_tokens=seq.num_accepted_tokens,
    )
