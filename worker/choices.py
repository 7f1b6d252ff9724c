"""Several choices from one prompt (a job's `n`): one engine request per choice, the prompt computed once.

Choice 0 goes in first, alone. When its first output comes back its prompt has been prefilled, and the
prefix cache holds its full blocks (under the attempt's cache salt): only then do choices 1..n-1 go in, so
they find those blocks and compute only the prompt's last, partial block. Each choice samples with its own
seed (the job's seed + its index, when the job set one), so choices differ unless sampling is greedy.

An attempt's choices run as request ids `<attempt's request id>` (choice 0) and `<...>.<index>`; the
attempt is aborted by cancelling them all. The group's future resolves with every choice's output once
all have ended, or with the first error (the others are then cancelled).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import Future

from engine.outputs import RequestOutput
from engine.sampling_params import MAX_SEED, MIN_SEED, SamplingParams

SubmitChoice = Callable[[int, Callable[[RequestOutput], None]], Future[RequestOutput]]


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


class ChoiceGroup:
    """The n engine requests of one attempt. `submit(index, on_update)` hands choice `index` to the engine
    (ValueError if the engine refuses it); `held()` says whether the rest may still start (False once the
    attempt is aborted); `cancel_all()` aborts every choice in the engine (after an error)."""

    def __init__(self, n: int, submit: SubmitChoice, held: Callable[[], bool],
                 cancel_all: Callable[[], None]) -> None:
        assert n >= 2, "one choice is a plain request"
        self.future: Future[list[RequestOutput]] = Future()
        self._n, self._submit, self._held, self._cancel_all = n, submit, held, cancel_all
        self._outputs: list[RequestOutput | None] = [None] * n
        self._lock = threading.Lock()
        self._rest_started = False
        self._on_update: Callable[[int, RequestOutput], None] = lambda _index, _out: None

    def start(self, on_update: Callable[[int, RequestOutput], None]) -> None:
        """Submits choice 0 (raises what its submit raises); the rest follow its first output."""
        self._on_update = on_update
        self._submit(0, self._first_update).add_done_callback(lambda done: self._ended(0, done))

    def _first_update(self, out: RequestOutput) -> None:
        self._on_update(0, out)
        if out.token_ids and not out.finished:
            self._start_rest()

    def _start_rest(self) -> None:
        with self._lock:
            if self._rest_started or self.future.done() or not self._held():
                return
            self._rest_started = True
        for index in range(1, self._n):
            try:
                child = self._submit(index, lambda out, index=index: self._on_update(index, out))
            except Exception as exc:
                self._settle_error(exc)
                return
            child.add_done_callback(lambda done, index=index: self._ended(index, done))

    def _ended(self, index: int, child: Future[RequestOutput]) -> None:
        error = child.exception()
        if error is not None:
            self._settle_error(error)
            return
        out = child.result()
        if index == 0 and out.finish_reason != "abort":
            self._start_rest()  # a no-op once started; else choice 0 ended with its first token
        with self._lock:
            self._outputs[index] = out
            outputs = self._outputs
            if not self._rest_started:  # choice 0 ended and the rest never will start (the attempt aborted)
                never = dataclasses.replace(out, token_ids=[], text="", finish_reason="abort", logprobs=None)
                outputs = [out, *[never] * (self._n - 1)]
            if all(o is not None for o in outputs) and not self.future.done():
                self.future.set_result([o for o in outputs if o is not None])

    def _settle_error(self, error: BaseException) -> None:
        with self._lock:
            if self.future.done():
                return
            self.future.set_exception(error)
        self._cancel_all()
