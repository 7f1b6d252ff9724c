"""worker/choices.py: a job's n choices as n engine requests gathered into one future."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from conveyor.engine.sampling_params import MAX_SEED, MIN_SEED, SamplingParams
from conveyor.worker.choices import choice_params, choice_request_ids, gather_choices


class Engine:
    """Hands out futures per choice and records cancels."""

    def __init__(self, refuse: int | None = None) -> None:
        self.futures: list[Future[Any]] = []
        self.cancels = 0
        self.refuse = refuse

    def submit(self, index: int) -> Future[Any]:
        if index == self.refuse:
            raise ValueError("refused")
        future: Future[Any] = Future()
        self.futures.append(future)
        return future

    def cancel_all(self) -> None:
        self.cancels += 1


def test_the_group_resolves_with_every_output_in_index_order() -> None:
    engine = Engine()
    group = gather_choices(3, engine.submit, engine.cancel_all)
    for index in (2, 0):
        engine.futures[index].set_result(f"out{index}")
    assert not group.done()
    engine.futures[1].set_result("out1")
    assert group.result() == ["out0", "out1", "out2"] and engine.cancels == 0


def test_a_failing_choice_fails_the_group_and_cancels_the_rest() -> None:
    engine = Engine()
    group = gather_choices(3, engine.submit, engine.cancel_all)
    engine.futures[1].set_exception(RuntimeError("device lost"))
    engine.futures[0].set_result("late")
    with pytest.raises(RuntimeError, match="device lost"):
        group.result()
    assert engine.cancels == 1


def test_a_refused_submit_cancels_what_was_submitted_and_raises() -> None:
    engine = Engine(refuse=1)
    with pytest.raises(ValueError, match="refused"):
        gather_choices(3, engine.submit, engine.cancel_all)
    assert len(engine.futures) == 1 and engine.cancels == 1


def test_each_choice_has_its_own_request_id_and_seed() -> None:
    assert choice_request_ids("job#1", 3) == ["job#1", "job#1.1", "job#1.2"]
    params = SamplingParams(seed=MAX_SEED, prompt_logprobs=2)
    assert choice_params(params, 0) is params
    second = choice_params(params, 1)
    assert second.seed == MIN_SEED and second.prompt_logprobs is None  # wrapped; only choice 0 scores
    assert choice_params(SamplingParams(), 2).seed is None
