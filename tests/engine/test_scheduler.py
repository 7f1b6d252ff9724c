"""Scheduler behaviour through LLMEngine over a FakeRunner (exact chunks, blocks, preemption order)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from conveyor.engine.config import EngineConfig, RequestClassConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.scheduled_chunk import RunnerOutput, ScheduledChunk
from conveyor.engine.tokenizer import Tokenizer
from tests.support.fake_runner import FakeRunner, reference

VOCAB = 64


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Tokenizer:
    return Tokenizer(llama_dir)


def make_engine(
    tokenizer: Tokenizer, *, num_kv_blocks: int = 64, block_size: int = 16, max_model_len: int = 512, **config
) -> LLMEngine:
    runner = FakeRunner(num_kv_blocks, block_size, max_model_len, VOCAB)
    cfg = EngineConfig(model="unused", block_size=block_size, num_kv_blocks=num_kv_blocks, **config)
    return LLMEngine(cfg, runner=runner, tokenizer=tokenizer)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 7 + salt) % (VOCAB - 3) for i in range(n)]


def drain(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    raise AssertionError("requests still unfinished")


def test_running_requests_decode_before_waiting_prefill_and_chunks_respect_the_budget(tokenizer) -> None:
    engine = make_engine(tokenizer, max_num_batched_tokens=32)
    engine.add_request("a", prompt(40), greedy(3))
    engine.step()
    chunks = engine.runner.steps[-1]
    assert [(len(c.token_ids), c.start_pos, c.sample) for c in chunks] == [(32, 0, False)]
    engine.add_request("b", prompt(50, 1), greedy(3))
    engine.step()  # a: remaining 8 prompt tokens; b: 24 of its 50
    chunks = engine.runner.steps[-1]
    assert [(len(c.token_ids), c.start_pos, c.sample) for c in chunks] == [(8, 32, True), (24, 0, False)]
    engine.step()  # a decodes first, then b continues
    chunks = engine.runner.steps[-1]
    assert [(len(c.token_ids), c.start_pos, c.sample) for c in chunks] == [(1, 40, True), (26, 24, True)]
    assert engine.stats()["last_step"]["decode_tokens"] == 1
    assert engine.stats()["last_step"]["prefill_tokens"] == 26
    assert drain(engine) == {"a": reference(prompt(40), 3, VOCAB), "b": reference(prompt(50, 1), 3, VOCAB)}


def test_long_prefill_token_threshold_caps_each_chunk(tokenizer) -> None:
    engine = make_engine(tokenizer, max_num_batched_tokens=100, long_prefill_token_threshold=16)
    engine.add_request("a", prompt(40), greedy(2))
    engine.add_request("b", prompt(20, 3), greedy(2))
    engine.step()
    assert [len(c.token_ids) for c in engine.runner.steps[-1]] == [16, 16]
    assert drain(engine) == {"a": reference(prompt(40), 2, VOCAB), "b": reference(prompt(20, 3), 2, VOCAB)}


def test_max_num_seqs_caps_the_running_set(tokenizer) -> None:
    engine = make_engine(tokenizer, max_num_seqs=3)
    for i in range(5):
        engine.add_request(f"r{i}", prompt(5, i), greedy(4))
    engine.step()
    assert engine.stats()["num_running"] == 3 and engine.stats()["num_waiting"] == 2
    while engine.has_unfinished_requests():
        engine.step()
        assert engine.stats()["num_running"] <= 3


def test_blocks_come_from_the_free_list_in_order(tokenizer) -> None:
    engine = make_engine(tokenizer, num_kv_blocks=8, block_size=16)
    engine.add_request("a", prompt(20), greedy(2))
    engine.add_request("b", prompt(16, 1), greedy(2))
    engine.step()
    assert [c.block_table for c in engine.runner.steps[-1]] == [[0, 1], [2]]
    engine.step()  # b's second token starts a new block
    assert [c.block_table for c in engine.runner.steps[-1]] == [[0, 1], [2, 3]]


def test_preemption_evicts_the_lowest_priority_latest_request_and_recomputes_it(tokenizer) -> None:
    # 4 blocks of 8 tokens: a and b each start with 2 blocks; the first one to grow forces an eviction.
    engine = make_engine(tokenizer, num_kv_blocks=4, block_size=8, max_model_len=32)
    engine.add_request("a", prompt(16), greedy(6))
    engine.add_request("b", prompt(16, 1), greedy(6))
    engine.step()  # both prefilled and sampled their first token: 16 tokens each in 2 blocks
    engine.step()  # a needs a 3rd block: b (latest) is preempted
    assert engine.scheduler.get("b").metrics.num_preemptions == 1
    assert engine.stats()["preemptions_total"] == 1
    assert [c.block_table for c in engine.runner.steps[-1]] == [[0, 1, 3]]
    result = drain(engine)
    assert result == {"a": reference(prompt(16), 6, VOCAB), "b": reference(prompt(16, 1), 6, VOCAB)}
    assert engine.block_manager.num_free_blocks == 4


def test_preempted_request_goes_to_the_head_of_its_class_queue(tokenizer) -> None:
    engine = make_engine(tokenizer, num_kv_blocks=4, block_size=8, max_model_len=32, max_num_seqs=2)
    engine.add_request("a", prompt(16), greedy(6))
    engine.add_request("b", prompt(16, 1), greedy(6))
    engine.add_request("c", prompt(8, 2), greedy(2))
    engine.step()
    engine.step()
    assert [s.request_id for s in engine.scheduler.waiting["default"]] == ["b", "c"]


def test_a_higher_priority_class_preempts_a_lower_one(tokenizer) -> None:
    classes = [RequestClassConfig("interactive", 4, priority=0),
               RequestClassConfig("documents", 4, priority=1)]
    engine = make_engine(tokenizer, num_kv_blocks=4, block_size=8, max_model_len=32, request_classes=classes)
    engine.add_request("doc", prompt(16), greedy(6), request_class="documents")
    engine.add_request("chat", prompt(16, 1), greedy(6), request_class="interactive")
    engine.step()
    engine.step()  # chat (higher priority, though later) grows; doc is the victim
    assert engine.scheduler.get("doc").metrics.num_preemptions == 1
    assert engine.scheduler.get("chat").metrics.num_preemptions == 0


def test_abort_frees_blocks_at_once_for_running_and_waiting_requests(tokenizer) -> None:
    engine = make_engine(tokenizer, num_kv_blocks=8, max_num_seqs=1)
    engine.add_request("run", prompt(40), greedy(8))
    engine.add_request("wait", prompt(10, 1), greedy(8))
    engine.step()
    assert engine.block_manager.num_used_blocks == 3
    assert engine.abort_request("run")
    assert engine.block_manager.num_used_blocks == 0
    assert engine.abort_request("wait")
    assert not engine.abort_request("wait")
    outs = engine.step()
    assert {o.request_id: o.finish_reason for o in outs} == {"run": "abort", "wait": "abort"}
    assert not engine.has_unfinished_requests()


def test_class_limits_documents_never_block_interactive(tokenizer) -> None:
    classes = [RequestClassConfig("interactive", 8, priority=0),
               RequestClassConfig("documents", 2, priority=1)]
    engine = make_engine(
        tokenizer, num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=256,
        long_prefill_token_threshold=64, request_classes=classes,
    )
    for i in range(20):
        engine.add_request(f"doc{i}", prompt(200, i), greedy(4), request_class="documents")
    interactive_due: dict[str, int] = {}
    for step in range(400):
        if step in (1, 3, 6):
            rid = f"chat{step}"
            engine.add_request(rid, prompt(10, step), greedy(3), request_class="interactive")
            interactive_due[rid] = step
        if not engine.has_unfinished_requests():
            break
        engine.step()
        running = engine.scheduler.running
        assert sum(s.request_class == "documents" for s in running) <= 2
        for rid, arrived in interactive_due.items():
            if arrived == step:
                seq = engine.scheduler.get(rid)
                assert seq is None or seq.metrics.first_scheduled_time is not None, f"{rid} did not run"
                assert any(len(c.token_ids) == 10 for c in engine.runner.steps[-1])
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == 256


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomised_add_abort_step_keeps_block_accounting_exact(tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    total = 24
    engine = make_engine(
        tokenizer, num_kv_blocks=total, block_size=8, max_model_len=96, max_num_seqs=6,
        max_num_batched_tokens=rng.choice([16, 48, 128]),
    )
    expected: dict[str, list[int]] = {}
    finished: dict[str, list[int]] = {}
    aborted: set[str] = set()
    for i in range(60):
        if rng.random() < 0.5:
            rid = f"r{i}"
            n, max_tokens = rng.randint(1, 60), rng.randint(1, 30)
            engine.add_request(rid, prompt(n, i), greedy(max_tokens))
            expected[rid] = reference(prompt(n, i), max_tokens, VOCAB)
        if rng.random() < 0.15 and expected:
            rid = rng.choice(sorted(expected))
            if engine.abort_request(rid):
                aborted.add(rid)
        for out in engine.step():
            if out.finished and out.finish_reason != "abort":
                finished[out.request_id] = out.token_ids
        assert_block_accounting(engine, total)
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished and out.finish_reason != "abort":
                finished[out.request_id] = out.token_ids
        assert_block_accounting(engine, total)
    assert not engine.has_unfinished_requests(), "a request waited forever"
    assert engine.block_manager.num_free_blocks == total
    assert sorted(engine.block_manager.free_block_ids()) == list(range(total))
    assert finished == {rid: toks for rid, toks in expected.items() if rid not in aborted}
    assert engine.stats()["preemptions_total"] > 0 and aborted, "the sequence should exercise both paths"


def assert_block_accounting(engine: LLMEngine, total: int) -> None:
    bm = engine.block_manager
    held = [b for s in engine.scheduler.running for b in s.block_table]
    assert len(held) == len(set(held)), "a block is held twice"
    assert not set(held) & set(bm.free_block_ids()), "a held block is on the free list"
    assert bm.num_free_blocks + len(held) == total
    assert all(not s.block_table for q in engine.scheduler.waiting.values() for s in q)
    for seq in engine.scheduler.running:  # only the last block has unused slots
        assert len(seq.block_table) == -(-seq.num_computed_tokens // bm.block_size)


class EosRunner(FakeRunner):
    """Always prefers EOS (id 2); the next best token is 7."""

    def execute(self, chunks: list[ScheduledChunk]) -> RunnerOutput:
        out = super().execute(chunks)
        out.logits[:] = 0.0
        out.logits[:, 2], out.logits[:, 7] = 10.0, 5.0
        return out


def test_eos_stops_after_min_tokens_unless_ignored(tokenizer) -> None:
    assert 2 in tokenizer.eos_token_ids
    cfg = EngineConfig(model="unused", num_kv_blocks=16)
    engine = LLMEngine(cfg, runner=EosRunner(16, 16, 512, VOCAB), tokenizer=tokenizer)
    engine.add_request("eos", [5, 6], SamplingParams(max_tokens=8, temperature=0))
    engine.add_request("min", [5, 6], SamplingParams(max_tokens=8, temperature=0, min_tokens=3))
    engine.add_request("ignore", [5, 6], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert (outs["eos"].token_ids, outs["eos"].finish_reason) == ([2], "stop")
    assert (outs["min"].token_ids, outs["min"].finish_reason) == ([7, 7, 7, 2], "stop")
    assert (outs["ignore"].token_ids, outs["ignore"].finish_reason) == ([2] * 8, "length")


def test_waiting_requests_are_admitted_by_class_priority_then_arrival(tokenizer) -> None:
    classes = [RequestClassConfig("documents", 4, priority=1),
               RequestClassConfig("interactive", 4, priority=0)]
    engine = make_engine(tokenizer, max_num_seqs=1, request_classes=classes)
    engine.add_request("doc1", prompt(4), greedy(1), request_class="documents")
    engine.add_request("chat1", prompt(4, 1), greedy(1), request_class="interactive")
    engine.add_request("chat2", prompt(4, 2), greedy(1), request_class="interactive")
    engine.add_request("doc2", prompt(4, 3), greedy(1))  # the first configured class is the default
    order = [o.request_id for _ in range(4) for o in engine.step()]
    assert order == ["chat1", "chat2", "doc1", "doc2"]
