"""LLMEngine and LLM over the tiny random Llama: validation, stop rules, logprobs, seeds, metrics, stats."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.engine import LLM, EngineConfig, LLMEngine, RequestOutput, SamplingParams, input_processor
from conveyor.engine.tokenizer import Tokenizer
from tests.support.engine import drain


@pytest.fixture(scope="module")
def engine(llama_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=128, max_model_len=256))


Requests = dict[str, tuple[str | list[int], SamplingParams]]


def run(engine: LLMEngine, requests: Requests) -> dict[str, RequestOutput]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    return drain(engine)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


@pytest.mark.parametrize(
    ("prompt", "params", "request_class", "field"),
    [
        (list(range(3, 300)), None, None, "prompt"),
        ([], None, None, "prompt"),
        ([5, 100_000], None, None, "prompt"),
        (list(range(3, 250)), SamplingParams(max_tokens=16), None, "max_tokens"),
        ("hello", "max_tokens", None, "max_tokens"),
        ("hello", "temperature", None, "temperature"),
        ("hello", "top_p_zero", None, "top_p"),
        ("hello", "top_p_big", None, "top_p"),
        ("hello", None, "batch", "request_class"),
    ],
)
def test_bad_input_raises_naming_the_field_and_others_keep_running(
    engine: LLMEngine, prompt, params, request_class, field: str
) -> None:
    mutated = {"max_tokens": ("max_tokens", 0), "temperature": ("temperature", -1.0),
               "top_p_zero": ("top_p", 0.0), "top_p_big": ("top_p", 1.5)}
    if isinstance(params, str):  # SamplingParams validates on construction: break one after the fact
        name, value = mutated[params]
        params = SamplingParams()
        setattr(params, name, value)
    engine.add_request("good", [5, 6, 7], greedy(5))
    engine.step()
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", prompt, params, request_class=request_class)
    done = drain(engine)
    assert list(done) == ["good"] and len(done["good"].token_ids) == 5


def test_duplicate_request_id_is_rejected(engine: LLMEngine) -> None:
    engine.add_request("dup", [5, 6], greedy(3))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", [7, 8], greedy(3))
    assert len(drain(engine)["dup"].token_ids) == 3


def test_stop_string_truncates_the_text(engine: LLMEngine) -> None:
    full = run(engine, {"full": ("The queue holds jobs", greedy(24))})["full"]
    stop = full.text[6:9]
    assert len(stop) == 3 and full.text.find(stop) >= 1
    cut = run(engine, {"cut": ("The queue holds jobs", greedy(24, stop=[stop, "never-appears"]))})["cut"]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < 24


def test_include_stop_str_in_output_keeps_the_matched_stop_string(engine: LLMEngine) -> None:
    full = run(engine, {"full": ("The queue holds jobs", greedy(24))})["full"]
    stop = full.text[6:9]
    kept = run(engine, {"kept": ("The queue holds jobs",
                                 greedy(24, stop=[stop], include_stop_str_in_output=True))})["kept"]
    assert kept.finish_reason == "stop"
    assert kept.text == full.text[: full.text.find(stop) + len(stop)]


def test_skip_special_tokens_reaches_the_request_detokenizer(engine: LLMEngine,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[bool] = []

    class Recording(input_processor.IncrementalDetokenizer):
        def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
            made.append(skip_special_tokens)
            super().__init__(tokenizer, skip_special_tokens)

    monkeypatch.setattr(input_processor, "IncrementalDetokenizer", Recording)
    run(engine, {"kept": ([9, 10], greedy(2, skip_special_tokens=False)), "skipped": ([9, 10], greedy(2))})
    assert sorted(made) == [False, True]


def test_stop_token_ids_and_min_tokens(engine: LLMEngine) -> None:
    full = run(engine, {"full": ([9, 10, 11], greedy(12))})["full"].token_ids
    target = full[2]
    first = full.index(target)
    stopped = run(engine, {"s": ([9, 10, 11], greedy(12, stop_token_ids=[target]))})["s"]
    assert stopped.finish_reason == "stop" and stopped.token_ids == full[: first + 1]
    held = run(engine, {"m": ([9, 10, 11], greedy(12, stop_token_ids=[full[0]], min_tokens=4))})["m"]
    assert len(held.token_ids) >= 4 and full[0] not in held.token_ids[:4]


def test_logprobs_shape_and_greedy_token_is_the_top_one(engine: LLMEngine) -> None:
    out = run(engine, {"lp": ([5, 6, 7, 8], greedy(6, logprobs=3))})["lp"]
    assert out.logprobs is not None and len(out.logprobs) == 6
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert len(entry) == 3 and token in entry
        assert max(entry, key=entry.get) == token
        assert all(v <= 0.0 for v in entry.values())


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_batch_of_16(engine: LLMEngine) -> None:
    def seeded(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)

    alone = run(engine, {"x": ([20, 21, 22, 23], seeded(1234))})["x"].token_ids
    batch: Requests = {}
    for i in range(15):
        params = seeded(i) if i % 2 else SamplingParams(max_tokens=4 + i, temperature=0.9, ignore_eos=True)
        batch[f"o{i}"] = ([30 + i] * (i + 1), params)
    for rid, (prompt, params) in list(batch.items())[:7]:
        engine.add_request(rid, prompt, params)
    engine.step()
    engine.step()  # x arrives mid-generation of others; the rest arrive after it
    engine.add_request("x", [20, 21, 22, 23], seeded(1234))
    for rid, (prompt, params) in list(batch.items())[7:]:
        engine.add_request(rid, prompt, params)
    done = drain(engine)
    assert done["x"].token_ids == alone
    other_seed = run(engine, {"y": ([20, 21, 22, 23], seeded(4321))})["y"].token_ids
    assert other_seed != alone


def test_metrics_timestamps_are_ordered(engine: LLMEngine) -> None:
    out = run(engine, {"t": ([5, 6, 7], greedy(3))})["t"]
    m = out.metrics
    assert None not in (m.first_scheduled_time, m.first_token_time, m.finished_time)
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.num_preemptions == 0


def test_streaming_outputs_grow_by_one_token(engine: LLMEngine) -> None:
    engine.add_request("s", "Good morning", greedy(5))
    seen = []
    while engine.has_unfinished_requests():
        seen += [len(o.token_ids) for o in engine.step() if o.request_id == "s"]
    assert seen == [1, 2, 3, 4, 5]


def test_stats_report_classes_blocks_and_step_tokens(engine: LLMEngine) -> None:
    engine.add_request("a", list(range(3, 40)), greedy(4))
    engine.add_request("b", [5], greedy(4))
    engine.step()
    stats = engine.stats()
    assert stats["running"] == {"default": 2} and stats["waiting"] == {"default": 0}
    assert stats["kv_blocks_total"] == 128 and stats["kv_blocks_used"] == 4
    assert stats["last_step"]["prefill_tokens"] == 38 and stats["last_step"]["decode_tokens"] == 0
    engine.step()
    assert engine.stats()["last_step"]["decode_tokens"] == 2
    assert engine.stats()["last_step"]["forward_seconds"] > 0
    drain(engine)
    assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["num_running"] == 0


def test_llm_generate_returns_outputs_in_input_order(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=64, max_num_seqs=2)
    prompts: list[str | list[int]] = ["The queue", [5, 6, 7, 8, 9], "Good morning! How are you?"]
    params = [greedy(7), greedy(2), greedy(4)]
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [7, 2, 4]
    assert outs[1].prompt_token_ids == [5, 6, 7, 8, 9]
    assert outs[0].prompt_token_ids == llm.engine.tokenizer.encode("The queue")
    chat = llm.chat([{"role": "user", "content": "hi"}], greedy(3))
    assert len(chat) == 1 and len(chat[0].token_ids) == 3
    broken = greedy(2)
    broken.temperature = -1.0
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(["a", "b"], [greedy(2), broken])
    assert not llm.engine.has_unfinished_requests(), "a bad batch queues nothing"


def test_command_line_generates(llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from conveyor.engine.__main__ import main

    main(["--model", str(llama_dir), "--prompt", "Hello", "--max-tokens", "3", "--ignore-eos",
          "--num-kv-blocks", "32", "--max-model-len", "128"])
    assert "3 tokens, finish_reason=length" in capsys.readouterr().out
