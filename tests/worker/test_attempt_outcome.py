"""What a finished attempt writes: its usage from the engine's final outputs, speculative decoding's drafted
and accepted tokens summed over every choice beside the completion tokens."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest

from conveyor.core.store import jobs
from conveyor.engine.outputs import RequestMetrics, RequestOutput
from conveyor.engine.tokenizer import Tokenizer
from conveyor.worker.attempt import Attempt
from conveyor.worker.attempt_outcome import Ended, outcome


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path) -> Tokenizer:
    return Tokenizer(demo_model_dir)


def final(tokens: int, drafted: int, accepted: int) -> RequestOutput:
    """A choice's final output, as the engine reports it once the request finished."""
    return RequestOutput("job_1#1", [1, 2, 3], list(range(4, 4 + tokens)), "ok", "length",
                         RequestMetrics(arrival_time=1.0, first_token_time=2.0, finished_time=3.0),
                         num_draft_tokens=drafted, num_accepted_tokens=accepted)


def written(outputs: list[RequestOutput], tokenizer: Tokenizer) -> jobs.Outcome | None:
    attempt = Attempt("job_1", 1, "demo:interactive", "job_1#1", None, 0.0, lambda: None, n=len(outputs))
    resolved: Future[list[RequestOutput]] = Future()
    resolved.set_result(outputs)
    return outcome(Ended(attempt, resolved), tokenizer)


def test_a_completion_counts_every_choices_drafted_and_accepted_tokens(tokenizer: Tokenizer) -> None:
    done = written([final(8, drafted=10, accepted=6), final(5, drafted=4, accepted=1)], tokenizer)
    assert isinstance(done, jobs.Completion)
    assert (done.completion_tokens, done.draft_tokens, done.accepted_draft_tokens) == (13, 14, 7)


def test_a_completion_without_drafts_counts_none(tokenizer: Tokenizer) -> None:
    done = written([final(8, drafted=0, accepted=0)], tokenizer)
    assert isinstance(done, jobs.Completion)
    assert (done.draft_tokens, done.accepted_draft_tokens) == (0, 0)
