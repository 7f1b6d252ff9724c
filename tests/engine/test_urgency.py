"""A request's urgency within its class (engine/sequence.py Urgency): priority first, then a deadline that is
still ahead, then arrival, for admission and for the preemption victim; the waiting queue's lazy re-keying
when a deadline passes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine.sequence import MAX_PRIORITY, Urgency
from engine.tokenizer import Tokenizer
from engine.waiting_queue import WaitingQueue
from tests.engine.test_scheduler import drain, greedy, make_engine, prompt


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Tokenizer:
    return Tokenizer(llama_dir)


def run_in_order(tokenizer: Tokenizer, requests: dict[str, Urgency], scheduling: str = "urgency",
                 ) -> list[str]:
    engine = make_engine(tokenizer, max_num_seqs=1, scheduling=scheduling)
    finished: list[str] = []
    for salt, (request_id, urgency) in enumerate(requests.items()):
        engine.add_request(request_id, prompt(8, salt), greedy(2), urgency=urgency)
    while engine.has_unfinished_requests():
        finished += [out.request_id for out in engine.step() if out.finished]
    return finished


def test_admission_takes_priority_then_a_deadline_ahead_then_arrival(tokenizer: Tokenizer) -> None:
    soon, later = time.time() + 600, time.time() + 3600
    order = run_in_order(tokenizer, {
        "plain": Urgency(), "later": Urgency(deadline=later), "soon": Urgency(deadline=soon),
        "urgent": Urgency(priority=-5), "background": Urgency(priority=5, deadline=soon),
        "missed": Urgency(deadline=time.time() - 1),
    })
    # A passed deadline orders by arrival among the requests without one: it jumps nothing.
    assert order == ["urgent", "soon", "later", "plain", "missed", "background"]


def test_scheduling_by_arrival_ignores_urgency(tokenizer: Tokenizer) -> None:
    requests = {"plain": Urgency(), "soon": Urgency(deadline=time.time() + 60),
                "urgent": Urgency(priority=-5)}
    assert run_in_order(tokenizer, requests, scheduling="arrival") == ["plain", "soon", "urgent"]


def test_the_preemption_victim_is_the_least_urgent_running_request(tokenizer: Tokenizer) -> None:
    # 4 blocks of 8 tokens: both start with 2 blocks; the first to grow forces an eviction.
    engine = make_engine(tokenizer, num_kv_blocks=4, block_size=8, max_model_len=32)
    engine.add_request("early", prompt(16), greedy(6))  # arrived first, but no deadline
    engine.add_request("due", prompt(16, 1), greedy(6), urgency=Urgency(deadline=time.time() + 60))
    engine.step()
    engine.step()
    assert engine.scheduler.get("early").metrics.num_preemptions == 1  # without urgency it would be "due"
    assert engine.scheduler.get("due").metrics.num_preemptions == 0
    drain(engine)


def test_the_waiting_queue_re_keys_a_passed_deadline_lazily(tokenizer: Tokenizer) -> None:
    engine = make_engine(tokenizer)
    engine.add_request("first", prompt(4), greedy(1))
    engine.add_request("due", prompt(4, 1), greedy(1), urgency=Urgency(deadline=100.0))
    first, due = engine.scheduler.get("first"), engine.scheduler.get("due")
    assert first is not None and due is not None
    queue = WaitingQueue()
    queue.push(first, now=0.0)
    queue.push(due, now=0.0)
    assert queue.first(50.0) is due  # its deadline is ahead
    assert queue.first(150.0) is first  # passed: back to its arrival's place
    assert list(queue) == [first, due] and len(queue) == 2
    queue.remove(first)
    assert queue.first(150.0) is due and len(queue) == 1


@pytest.mark.parametrize(("urgency", "field"), [
    (Urgency(priority=MAX_PRIORITY + 1), "priority"), (Urgency(priority=True), "priority"),
    (Urgency(deadline=float("nan")), "deadline"), (Urgency(deadline="soon"), "deadline"),  # type: ignore[arg-type]
])
def test_a_bad_urgency_is_refused_naming_the_field(tokenizer: Tokenizer, urgency: Urgency, field: str,
                                                  ) -> None:
    engine = make_engine(tokenizer)
    with pytest.raises(ValueError, match=f"^{field} must be"):
        engine.add_request("x", prompt(4), greedy(1), urgency=urgency)
    assert not engine.has_unfinished_requests()
