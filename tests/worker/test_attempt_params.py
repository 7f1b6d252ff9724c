"""An attempt reads its job's params through JobParams (core/protocol/job_params.py); a row they cannot be
read from still makes an attempt, whose submit then fails it alone as an invalid request naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor.core.model_adapters import LORA_PARAM
from conveyor.core.protocol.job_kinds import EMBEDDING, GENERATION
from conveyor.core.store.tables import Job
from conveyor.worker.attempt import Attempt
from conveyor.worker.sampling import sampling_params_from_json


def _attempt(params: dict[str, Any] | None, kind: str = GENERATION, inputs: list[Any] | None = None,
             ) -> Attempt:
    job = Job(id="job_1", attempts=1, queue="m:interactive", timeout_s=None, params=params, kind=kind,
              inputs=inputs, priority=0, deadline_at=None)
    return Attempt.of(job, lambda: None, "salt", 0.0)


def test_an_attempt_takes_its_choices_logprobs_grammar_and_adapter_from_the_params() -> None:
    attempt = _attempt({"n": 3, "logprobs": 2, "prompt_logprobs": 1, "structured": {"regex": "a+"},
                        LORA_PARAM: "sql-lora"})
    assert (attempt.n, attempt.logprobs, attempt.prompt_logprobs) == (3, 2, 1)
    assert attempt.compiling and attempt.lora == "sql-lora" and len(attempt.request_ids()) == 3
    plain = _attempt({"max_tokens": 4})
    assert (plain.n, plain.logprobs, plain.compiling, plain.lora) == (1, None, False, None)
    embedding = _attempt({"max_tokens": 0}, EMBEDDING, ["a", "b"])
    assert embedding.embeds and embedding.n == 2


def test_params_that_cannot_be_read_make_an_attempt_whose_submit_fails() -> None:
    unreadable = {"n": 3, "logprobs": "all"}
    attempt = _attempt(unreadable)
    assert (attempt.n, attempt.logprobs) == (1, None)
    assert attempt.params_error is not None and attempt.params_error.startswith("logprobs: ")  # its submit's
    assert _attempt({"max_tokens": 4}).params_error is None
    with pytest.raises(ValueError, match=r"^logprobs: "):
        sampling_params_from_json(unreadable)


def test_a_completion_of_several_prompts_runs_n_choices_of_each() -> None:
    attempt = _attempt({"n": 2, "prompt_logprobs": 1}, GENERATION, [[1, 2], "text", [3]])
    assert (attempt.n, attempt.prompts, attempt.choices_per_prompt()) == (6, 3, 2)
    assert len(attempt.request_ids()) == 6 and not attempt.embeds
    one_text = _attempt({"n": 2})
    assert (one_text.n, one_text.prompts, one_text.choices_per_prompt()) == (2, None, 2)
