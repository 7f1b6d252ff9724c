"""Several choices from one prompt (a job's `n`): one engine request per choice, the prompt computed once.

All n requests enter the engine together. The engine's prefix cache computes the prompt once: a request
whose next block another request is computing in the same step waits a step and takes it from the cache
(engine/scheduler.py), so each further choice computes only the prompt's last, partial block. Each choice
samples with its own seed (the job's seed + its index, when the job set one), so choices differ unless
sampling is greedy.

An attempt's choices run as request ids `<attempt's request id>` (choice 0) and `<...>.<index>`; the
attempt is aborted by cancelling them all. The group's future resolves with every choice's output once all
have ended, or with the first error (the others are then cancelled).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import Future

from conveyor.engine.outputs import RequestOutput
from conveyor.engine.sampling_params import MAX_SEED, MIN_SEED, SamplingParams

SubmitChoice = Callable[[int], Future[RequestOutput]]


def choice_request_ids(request_id: str, n: int) -> list[str]:
    return [request_id] + [f"{request_id}.{index}" for index in range(1, n)]


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s sampling: the job's, with its seed moved on by the index (wrapped into the range).
    Only choice 0 scores the prompt (prompt_logprobs): a request that does takes no prefix-cache hits."""
    if index == 0:
        return params
    seed = params.seed
    if seed is not None:
        seed = (seed - MIN_SEED + index) % (MAX_SEED - MIN_SEED + 1) + MIN_SEED
    return dataclasses.replace(params, seed=seed, prompt_logprobs=None)


def gather_choices(n: int, submit: SubmitChoice, cancel_all: Callable[[], None],
                   ) -> Future[list[RequestOutput]]:
    """Submits choices 0..n-1 (`submit(index)`; what a submit raises, the caller gets, once the ones already
    submitted are cancelled) and returns the future of all their outputs, in index order."""
    assert n >= 2, "one choice is a plain request"
    group: Future[list[RequestOutput]] = Future()
    outputs: list[RequestOutput | None] = [None] * n
    lock = threading.Lock()

    def ended(index: int, child: Future[RequestOutput]) -> None:
        error = child.exception()
        with lock:
            if group.done():
                return
            if error is not None:
                group.set_exception(error)
            else:
                outputs[index] = child.result()
                if all(out is not None for out in outputs):
                    group.set_result([out for out in outputs if out is not None])
        if error is not None:
            cancel_all()

    for index in range(n):
        try:
            child = submit(index)
        except Exception:
            cancel_all()
            raise
        child.add_done_callback(lambda done, index=index: ended(index, done))
    return group
