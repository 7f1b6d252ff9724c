"""Output processing after a step: what the step's results do to their sequences, and the RequestOutputs that
report them.

Each sampled token is appended (with its logprobs and its text) and the stop rules checked
(engine/stop_rules.py); a chunk's prompt logprobs join its sequence's. A request that is done (stopped,
scored its prompt, embedded its input) finishes in the scheduler, which frees its blocks: the engine calls
these only after the step's computed blocks are in the prefix cache. The engine's totals count each token
and each finished request.
"""

from __future__ import annotations

import time

from conveyor.engine.outputs import FinishReason, RequestOutput, request_output
from conveyor.engine.scheduler import Scheduler, SchedulerOutput
from conveyor.engine.sequence import Sequence
from conveyor.engine.speculation.verification import TokenLogprobs
from conveyor.engine.stats import EngineTotals
from conveyor.engine.step_isolation import Failures, PromptLogprobs
from conveyor.engine.stop_rules import stop_reason, truncate_at_stop_string


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, totals: EngineTotals, eos_token_ids: frozenset[int]) -> None:
        self._scheduler = scheduler
        self._totals = totals
        self._eos_token_ids = eos_token_ids

    def append_tokens(self, seqs: list[Sequence], runs: list[list[int]], logprobs: list[list[TokenLogprobs]],
                      failures: Failures) -> list[RequestOutput]:
        """Appends its tokens (one, or with speculation its accepted drafts and the token after them) to each
        sequence not in `failures`, stopping where a stop rule ends it; an output for each."""
        now = time.time()
        outputs = []
        for seq, run, run_logprobs in zip(seqs, runs, logprobs, strict=True):
            if seq in failures:
                continue
            appended = 0
            for token, token_logprobs in zip(run, run_logprobs, strict=True):
                self._append_token(seq, token, token_logprobs, now)
                appended += 1
                if seq.is_finished:
                    break
            outputs.append(request_output(seq, num_new_tokens=appended))
        return outputs

    def finish_scored_prompts(self, sched: SchedulerOutput, failures: Failures) -> list[RequestOutput]:
        """Finishes ("length") the requests with max_tokens=0 whose prompt this step completed: they only
        wanted its logprobs."""
        outputs = []
        for seq in sched.seqs:
            if seq.params.max_tokens == 0 and seq not in failures and seq.num_uncomputed_tokens == 0:
                self._scheduler.finish(seq, "length")
                self._totals.finished_requests += 1
                outputs.append(request_output(seq, num_new_tokens=0))
        return outputs

    def finish_embedded(self, done: list[Sequence], vectors: list[list[float]]) -> list[RequestOutput]:
        """Finishes ("stop") the pooling requests whose input this step completed, each with its vector."""
        outputs = []
        for seq, vector in zip(done, vectors, strict=True):
            self._scheduler.finish(seq, "stop")
            seq.pooled = None
            outputs.append(request_output(seq, num_new_tokens=0, embedding=vector))
        self._totals.finished_requests += len(done)
        self._totals.embedded_requests += len(done)
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None, now: float) -> None:
        seq.output_token_ids.append(token)
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
        assert seq.detokenizer is not None
        delta = seq.detokenizer.step(seq.output_token_ids)
        seq.text += delta
        reason = stop_reason(seq, token, delta, self._eos_token_ids)
        if reason is not None:
            self._scheduler.finish(seq, _with_held_back_text(seq, reason))
            self._totals.finished_requests += 1
        self._totals.generated_tokens += 1


def _with_held_back_text(seq: Sequence, reason: FinishReason) -> FinishReason:
    """The sequence's last text, held back while it ended inside a character, added as a full decode writes
    it; a stop string in it still stops (and cuts) the text. (A stop string found earlier left nothing held
    back: it is looked for only in text already released.)"""
    assert seq.detokenizer is not None
    tail = seq.detokenizer.flush(seq.output_token_ids)
    seq.text += tail
    if tail and truncate_at_stop_string(seq, len(tail)):
        return "stop"
    return reason


def add_prompt_logprobs(prompt_logprobs: PromptLogprobs) -> None:
    """Appends each chunk's prompt logprobs to its sequence (the chunks follow on from what it has)."""
    for seq, chunk_logprobs in prompt_logprobs.items():
        assert seq.prompt_logprobs is not None
        seq.prompt_logprobs.extend(chunk_logprobs.entries())
        assert len(seq.prompt_logprobs) <= seq.num_prompt_tokens, seq.request_id
