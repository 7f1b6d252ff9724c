"""A request's urgency within its class (engine/sequence.py Urgency): priority first, then the slack of a
deadline that is still ahead (engine/pace.py), then arrival, for admission and for the preemption victim; the
waiting queue's lazy re-keying when a deadline passes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conveyor.engine.pace import Pace, PaceMeter
from conveyor.engine.sequence import MAX_PRIORITY, Urgency
from conveyor.engine.stats import StepStats
from conveyor.engine.tokenizer import Tokenizer
from conveyor.engine.waiting_queue import WaitingQueue
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


def test_admission_takes_the_least_slack_not_the_earliest_deadline(tokenizer: Tokenizer) -> None:
    engine = make_engine(tokenizer, max_num_seqs=1)
    engine.pace_meter.observe(StepStats(decode_tokens=1, step_seconds=1.0))  # one second per step
    now = time.time()
    # "long" is due later but needs 40 steps: it must start within 100 s; "short" may wait 300 s.
    engine.add_request("short", prompt(8), greedy(2), urgency=Urgency(deadline=now + 302))
    engine.add_request("long", prompt(8, 1), greedy(40), urgency=Urgency(deadline=now + 140))
    engine.add_request("plain", prompt(8, 2), greedy(2))
    finished = []
    while engine.has_unfinished_requests():
        finished += [out.request_id for out in engine.step() if out.finished]
    assert finished == ["long", "short", "plain"]


def test_a_running_request_gains_slack_as_it_writes(tokenizer: Tokenizer) -> None:
    engine = make_engine(tokenizer)
    engine.pace_meter.observe(StepStats(decode_tokens=1, step_seconds=0.5))
    engine.add_request("r", prompt(8), greedy(10), urgency=Urgency(deadline=time.time() + 60))
    seq = engine.scheduler.get("r")
    assert seq is not None and seq.pace == Pace(step_s=0.5, prefill_token_s=0.0)
    before = seq.order_key(time.time())
    engine.step()
    engine.step()
    assert seq.needed_s == 0.5 * 8  # 2 of its 10 tokens written
    assert seq.order_key(time.time()) > before


def test_the_pace_meter_averages_busy_steps_only() -> None:
    meter = PaceMeter()
    assert meter.pace == Pace()
    meter.observe(StepStats(decode_tokens=4, step_seconds=0.02))
    meter.observe(StepStats(step_seconds=5.0))  # computed nothing: ignored
    assert meter.pace.step_s == pytest.approx(0.02) and meter.pace.prefill_token_s == 0.0
    meter.observe(StepStats(prefill_tokens=90, decode_tokens=10, step_seconds=0.1))
    assert meter.pace.prefill_token_s == pytest.approx(0.001)
    assert 0.02 < meter.pace.step_s < 0.1


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
