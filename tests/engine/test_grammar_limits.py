"""Grammar compiles are bounded and off the submitting thread: a costly schema fails alone, in its own time.

A schema of many optional properties is the costly case the probe found (1,500 integer properties: seconds
to minutes, growing faster than linearly); the demo model's small vocabulary keeps the others fast.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from conveyor.engine import EngineConfig, EngineHost, LLMEngine, SamplingParams, StructuredOutput
from conveyor.engine.sequence import Sequence
from conveyor.engine.structured_output.constraint import GrammarLimitError
from conveyor.engine.structured_output.grammar import GrammarCompiler

SMALL = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def costly_schema(num_properties: int = 1500) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(num_properties)}}


def constrained(schema: dict[str, Any], max_tokens: int = 40) -> SamplingParams:
    structured = StructuredOutput(json_schema=schema)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=structured)


def plain(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture()
def compiler(demo_model_dir: Path) -> GrammarCompiler:
    engine = LLMEngine(EngineConfig(model=str(demo_model_dir), num_kv_blocks=64, max_model_len=256,
                                    grammar_compile_timeout_s=0.3))
    compiler = engine.grammar_compiler
    yield compiler
    compiler.close()


def test_a_schema_past_the_deadline_is_refused_naming_the_limit_and_stays_refused(compiler) -> None:
    costly = StructuredOutput(json_schema=costly_schema())
    limit = r"did not compile within 0.3 s \(grammar_compile_timeout_s\)"
    with pytest.raises(GrammarLimitError, match=limit):
        compiler.compile(costly)
    assert compiler._probe is not None and compiler._probe.num_kills == 1  # killed, not left running
    with pytest.raises(GrammarLimitError):
        compiler.cached(costly)  # refused at once, without a second compile
    assert compiler._probe.num_kills == 1
    assert compiler.compile(StructuredOutput(json_schema=SMALL)) is not None  # a fresh probe took over
    assert compiler.num_compiles == 1


def test_a_schema_past_the_memory_cap_is_refused_naming_the_limit(demo_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(demo_model_dir), num_kv_blocks=64, max_model_len=256,
                                    grammar_compile_timeout_s=60.0, grammar_compile_memory_bytes=8 * 2**20))
    limit = r"could not be compiled within 8 MiB \(grammar_compile_memory_bytes\)"
    with pytest.raises(GrammarLimitError, match=limit):
        engine.grammar_compiler.compile(StructuredOutput(json_schema=costly_schema(600)))
    assert engine.grammar_compiler.compile(StructuredOutput(json_schema=SMALL)) is not None
    engine.close()


def test_a_probe_process_that_died_between_compiles_is_replaced(compiler) -> None:
    assert compiler._probe is not None
    compiler.compile(StructuredOutput(json_schema=SMALL))
    child = compiler._probe._child
    assert child is not None
    child.kill()  # as the kernel's OOM killer would
    assert compiler.compile(StructuredOutput(regex="[0-9]+")) is not None
    assert compiler._probe._child is not child


def test_a_grammar_xgrammar_rejects_is_a_value_error_naming_the_field(compiler) -> None:
    with pytest.raises(ValueError, match=r"structured.regex cannot be compiled"):
        compiler.compile(StructuredOutput(regex="("))


def test_the_cache_is_bounded_by_the_bytes_its_grammars_hold(compiler) -> None:
    grammars = [StructuredOutput(json_schema={**SMALL, "properties": {f"k{i}": {"type": "integer"}}})
                for i in range(6)]
    one = compiler.compile(grammars[0]).memory_size_bytes
    compiler.cache_bytes = 3 * one
    for structured in grammars[1:]:
        compiler.compile(structured)
    assert 0 < compiler.num_cached_bytes <= 3 * one
    assert compiler.cached(grammars[0]) is None, "the least recently used grammar was evicted"
    assert compiler.cached(grammars[-1]) is not None


def _host(demo_model_dir: Path, timeout_s: float | None = 30.0) -> EngineHost:
    config = EngineConfig(model=str(demo_model_dir), num_kv_blocks=64, max_model_len=256,
                          grammar_compile_timeout_s=timeout_s)
    return EngineHost(LLMEngine(config))


def _block_compiles(host: EngineHost) -> threading.Event:
    """Holds every compile of `host` until the returned event is set (a schema that takes its time)."""
    release = threading.Event()
    compile_now = host._grammars._compile

    def slow(seq: Sequence) -> None:
        assert release.wait(60)
        compile_now(seq)

    host._grammars._compile = slow
    return release


def test_a_compile_in_flight_delays_no_other_request(demo_model_dir: Path) -> None:
    host = _host(demo_model_dir)
    release = _block_compiles(host)
    admitted = threading.Event()
    slow = host.submit("slow", "The queue holds", constrained(SMALL), cache_salt="tenant-a",
                       on_admitted=admitted.set)  # returns at once: submit never compiles
    others = [host.submit(f"r{i}", "A block table", plain(), cache_salt="tenant-b") for i in range(20)]
    assert all(f.result(timeout=60).finish_reason == "length" for f in others)
    assert not slow.done() and not admitted.is_set()
    assert host.stats()["running"] == {"default": 0}, "a request waiting for its grammar holds no slot"
    release.set()
    assert slow.result(timeout=60).finish_reason in ("stop", "length")
    assert admitted.is_set()
    host.shutdown()


def test_a_request_cancelled_while_compiling_resolves_as_an_abort(demo_model_dir: Path) -> None:
    host = _host(demo_model_dir)
    release = _block_compiles(host)
    future = host.submit("c", "The queue holds", constrained(SMALL))
    assert host.cancel("c")
    release.set()
    out = future.result(timeout=60)
    assert out.finish_reason == "abort" and out.token_ids == []
    host.shutdown()


def test_a_costly_schema_fails_its_request_alone(demo_model_dir: Path) -> None:
    host = _host(demo_model_dir, timeout_s=0.3)
    costly = host.submit("costly", "The queue holds", constrained(costly_schema()))
    fine = host.submit("fine", "The queue holds", constrained(SMALL))
    with pytest.raises(GrammarLimitError, match="grammar_compile_timeout_s"):
        costly.result(timeout=60)
    assert fine.result(timeout=60).finish_reason in ("stop", "length")
    with pytest.raises(GrammarLimitError):  # the same schema again: refused in the caller, at once
        host.submit("again", "The queue holds", constrained(costly_schema()))
    host.shutdown()


def test_owners_take_turns_at_the_compile_thread(demo_model_dir: Path) -> None:
    host = _host(demo_model_dir)
    release, started = threading.Event(), threading.Event()
    order: list[str] = []
    compile_now = host._grammars._compile

    def recorded(seq: Sequence) -> None:
        order.append(seq.request_id)
        started.set()
        assert release.wait(60)
        compile_now(seq)

    host._grammars._compile = recorded
    schemas = [{**SMALL, "properties": {f"k{i}": {"type": "integer"}}} for i in range(5)]
    futures = [host.submit("blocker", "x y", constrained(schemas[4]), cache_salt="z")]
    assert started.wait(60)  # the compile thread is busy: what follows waits in line
    futures += [host.submit(rid, "x y", constrained(schemas[i]), cache_salt=rid[0])
                for i, rid in enumerate(["a0", "a1", "a2", "b0"])]
    release.set()
    for future in futures:
        future.result(timeout=60)
    assert order == ["blocker", "a0", "b0", "a1", "a2"]  # b's one compile waits for one of a's, not three
    host.shutdown()
