"""EngineHost: submit/cancel/shutdown from other threads, callbacks, and failures inside a step."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

from conveyor.engine import EngineConfig, EngineHost, LLMEngine, RequestOutput, SamplingParams
from conveyor.engine.config import RequestClassConfig
from conveyor.engine.host import EngineShutdownError
from conveyor.engine.sequence import Sequence
from conveyor.engine.tokenizer import Tokenizer
from tests.support.fake_runner import FailingRunner, FakeRunner, reference
from tests.support.poison_runner import PoisonRunner

VOCAB = 64
MARKER = 60  # the first prompt token of a request PoisonRunner fails


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Tokenizer:
    return Tokenizer(llama_dir)


def make_host(tokenizer: Tokenizer, runner: FakeRunner | None = None) -> EngineHost:
    runner = runner or FakeRunner(num_kv_blocks=32, vocab_size=VOCAB)
    config = EngineConfig(model="unused", num_kv_blocks=runner.num_kv_blocks)
    return EngineHost(LLMEngine(config, runner=runner, tokenizer=tokenizer))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def test_submit_resolves_futures_and_streams_updates(tokenizer) -> None:
    host = make_host(tokenizer)
    updates: list[RequestOutput] = []
    futures = {
        f"r{i}": host.submit(f"r{i}", [5 + i] * (i + 1), greedy(3 + i), on_update=updates.append)
        for i in range(4)
    }
    results = {rid: f.result(timeout=30) for rid, f in futures.items()}
    for i in range(4):
        assert results[f"r{i}"].token_ids == reference([5 + i] * (i + 1), 3 + i, VOCAB)
        assert results[f"r{i}"].finish_reason == "length"
    r3 = [len(u.token_ids) for u in updates if u.request_id == "r3"]
    assert r3 == [1, 2, 3, 4, 5, 6]
    steps = host.engine.totals.steps
    threading.Event().wait(0.05)
    assert host.engine.totals.steps == steps, "an idle host must sleep, not step"
    assert host.stats()["kv_blocks_used"] == 0
    host.shutdown()


def test_invalid_input_raises_in_the_caller(tokenizer) -> None:
    host = make_host(tokenizer)
    bad_temperature = greedy(2)
    bad_temperature.temperature = -1
    with pytest.raises(ValueError, match="temperature"):
        host.submit("a", [5], bad_temperature)
    with pytest.raises(ValueError, match="request_class"):
        host.submit("a", [5], greedy(2), request_class="nope")
    with pytest.raises(ValueError, match="prompt"):
        host.submit("a", [], greedy(2))
    first = host.submit("a", [5], greedy(50))
    with pytest.raises(ValueError, match="request_id"):
        host.submit("a", [6], greedy(2))
    assert len(first.result(timeout=30).token_ids) == 50
    host.shutdown()


def test_cancel_aborts_frees_blocks_and_resolves_with_abort(tokenizer) -> None:
    host = make_host(tokenizer)
    cancelled: list[bool] = []

    def cancel_on_first_token(out: RequestOutput) -> None:
        if len(out.token_ids) == 1 and not out.finished:
            cancelled.append(host.cancel(out.request_id))

    future = host.submit("long", [5] * 40, greedy(400), on_update=cancel_on_first_token)
    out = future.result(timeout=30)
    assert cancelled == [True]
    assert out.finish_reason == "abort" and len(out.token_ids) < 400
    assert host.engine.block_manager.num_free_blocks == 32
    assert not host.cancel("long") and not host.cancel("never-submitted")
    host.shutdown()


def test_a_transient_step_failure_is_retried_and_fails_no_future(tokenizer) -> None:
    host = make_host(tokenizer, FailingRunner(fail_on={1}, num_kv_blocks=32, vocab_size=VOCAB))
    gate = threading.Event()
    first = host.submit("a", [5, 6], greedy(5), on_update=lambda _: gate.wait(5))
    second = host.submit("b", [7, 8], greedy(5))
    gate.set()
    assert first.result(timeout=30).token_ids == reference([5, 6], 5, VOCAB)
    assert second.result(timeout=30).token_ids == reference([7, 8], 5, VOCAB)
    assert host.stats()["totals"]["failed_requests"] == 0
    host.shutdown()


def test_a_failing_request_fails_only_its_future_and_the_host_keeps_serving(tokenizer) -> None:
    host = make_host(tokenizer, PoisonRunner(MARKER, fail_from=4, num_kv_blocks=32, vocab_size=VOCAB))
    updates: list[RequestOutput] = []
    gate = threading.Event()
    first = host.submit("a", [5, 6], greedy(8), on_update=lambda _: gate.wait(5))
    poison = host.submit("poison", [MARKER, 6], greedy(8), on_update=updates.append)
    second = host.submit("b", [7, 8], greedy(8))
    gate.set()
    with pytest.raises(RuntimeError, match="poisoned forward"):
        poison.result(timeout=30)
    assert first.result(timeout=30).token_ids == reference([5, 6], 8, VOCAB)
    assert second.result(timeout=30).token_ids == reference([7, 8], 8, VOCAB)
    assert [len(u.token_ids) for u in updates] == [1, 2], "streamed until it failed; no abort update"
    assert host.stats()["totals"]["failed_requests"] == 1
    assert host.engine.block_manager.num_free_blocks == 32
    host.shutdown()


def test_a_broken_device_fails_every_future_and_the_host_serves_once_it_recovers(tokenizer) -> None:
    runner = PoisonRunner(MARKER, num_kv_blocks=32, vocab_size=VOCAB)
    runner.broken = True
    host = make_host(tokenizer, runner)
    futures = [host.submit(f"r{i}", [5 + i, 6], greedy(5)) for i in range(3)]
    for future in futures:
        with pytest.raises(RuntimeError, match="poisoned forward"):
            future.result(timeout=30)
    assert host.engine.block_manager.num_free_blocks == 32
    runner.broken = False
    later = host.submit("c", [9, 10], greedy(4)).result(timeout=30)
    assert later.token_ids == reference([9, 10], 4, VOCAB)
    assert host.stats()["totals"]["failed_requests"] == 3
    host.shutdown()


def test_shutdown_fails_outstanding_futures_and_refuses_new_work(tokenizer) -> None:
    host = make_host(tokenizer)

    def stop_on_second_token(out: RequestOutput) -> None:
        if len(out.token_ids) == 2:
            host.shutdown(wait=False)

    future: Future[RequestOutput] = host.submit("a", [5], greedy(400), on_update=stop_on_second_token)
    with pytest.raises(EngineShutdownError):
        future.result(timeout=30)
    host.shutdown()
    assert not host._thread.is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        host.submit("b", [5], greedy(2))


async def test_generate_is_awaitable(tokenizer) -> None:
    host = make_host(tokenizer)
    outs = await asyncio.gather(host.generate("x", [5, 6], greedy(3)), host.generate("y", [8], greedy(2)))
    assert [o.token_ids for o in outs] == [reference([5, 6], 3, VOCAB), reference([8], 2, VOCAB)]
    host.shutdown()


async def test_a_request_without_a_class_joins_the_engines_first_class(tokenizer, monkeypatch) -> None:
    # No class named "default" here: the host must defer to the engine's default, as LLMEngine does.
    classes = [RequestClassConfig("interactive", 4), RequestClassConfig("documents", 4, priority=1)]
    config = EngineConfig(model="unused", num_kv_blocks=32, request_classes=classes)
    engine = LLMEngine(config, runner=FakeRunner(num_kv_blocks=32, vocab_size=VOCAB), tokenizer=tokenizer)
    enqueued: list[str] = []
    enqueue = engine.enqueue

    def recording_enqueue(seq: Sequence) -> None:
        enqueued.append(seq.request_class)
        enqueue(seq)

    monkeypatch.setattr(engine, "enqueue", recording_enqueue)
    host = EngineHost(engine)
    submitted = host.submit("a", [5, 6], greedy(3)).result(timeout=30)
    generated = await host.generate("b", [8], greedy(2))
    assert submitted.token_ids == reference([5, 6], 3, VOCAB)
    assert generated.token_ids == reference([8], 2, VOCAB)
    assert enqueued == ["interactive", "interactive"]
    host.shutdown()


def test_from_config_runs_the_real_model(llama_dir: Path) -> None:
    host = EngineHost.from_config(EngineConfig(model=str(llama_dir), num_kv_blocks=32, max_model_len=128))
    out = host.submit("real", "Good morning", greedy(4)).result(timeout=60)
    assert len(out.token_ids) == 4 and out.prompt_token_ids == host.tokenizer.encode("Good morning")
    assert host.config.num_kv_blocks == 32
    host.shutdown()


def test_finish_listeners_hear_each_request_once_with_its_class(tokenizer) -> None:
    runner = FakeRunner(num_kv_blocks=32, vocab_size=VOCAB)
    classes = [RequestClassConfig(name="chat", max_running=4), RequestClassConfig(name="docs", max_running=4)]
    config = EngineConfig(model="unused", num_kv_blocks=runner.num_kv_blocks, request_classes=classes)
    host = EngineHost(LLMEngine(config, runner=runner, tokenizer=tokenizer))
    heard: list[tuple[str, str, str | None]] = []
    host.on_request_finished(lambda cls, out: heard.append((cls, out.request_id, out.finish_reason)))
    host.on_request_finished(lambda cls, out: 1 / 0)  # a failing observer must not stop the engine
    done = host.submit("a", [5, 6], greedy(3), request_class="chat")
    long = host.submit("b", [7], greedy(200), request_class="docs")
    assert host.cancel("b")  # before its 200 steps
    done.result(timeout=30)
    assert long.result(timeout=30).finish_reason == "abort"
    assert sorted(heard) == [("chat", "a", "length"), ("docs", "b", "abort")]
    host.shutdown()
