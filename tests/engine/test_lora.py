"""LoRA adapters in the engine: greedy tokens equal transformers + PEFT (adapter applied unmerged) for
adapters of different ranks and target modules and for the base model, all in the same steps, under chunked
prefill and preemption; adapters wait for a slot without holding back others; the prefix cache never shares KV
across adapters; bad adapters and bad names are refused naming what is wrong."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conveyor.engine import EngineConfig, LLMEngine, SamplingParams
from conveyor.engine.lora.adapter import TargetShape, load_adapter
from conveyor.engine.scheduled_chunk import ScheduledChunk
from tests.support.engine import drain
from tests.support.lora_adapters import peft_greedy, save_peft_adapter

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, targets, extra LoraConfig fields)
ADAPTERS: dict[str, tuple[int, float, list[str], dict[str, object]]] = {
    "qv8": (8, 16, ["q_proj", "v_proj"], {}),
    "all4": (4, 8, ALL_LINEAR, {}),
    "mlp16": (16, 8, ["o_proj", "gate_proj", "up_proj", "down_proj"], {"use_rslora": True}),
}
PROMPT_LENGTHS = [3, 17, 40, 64, 9, 130, 33, 5]
MAX_TOKENS = [24, 30, 18, 28, 36, 20, 26, 32]
WHO = [None, "qv8", "all4", "mlp16"]  # request i runs with WHO[i % 4]


@pytest.fixture(scope="module")
def adapters(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: save_peft_adapter(llama_dir, root / name, rank=rank, alpha=alpha, targets=targets,
                                    seed=seed, **extra)
            for seed, (name, (rank, alpha, targets, extra)) in enumerate(ADAPTERS.items())}


def requests() -> list[tuple[str, list[int], int, str | None]]:
    rng = random.Random(7)
    return [(f"r{i}", [rng.randrange(3, 500) for _ in range(n)], m, WHO[i % len(WHO)])
            for i, (n, m) in enumerate(zip(PROMPT_LENGTHS, MAX_TOKENS, strict=True))]


@pytest.fixture(scope="module")
def reference(llama_dir: Path, adapters: dict[str, Path]) -> dict[str, list[int]]:
    """PEFT's greedy tokens of every request, with its own adapter."""
    expected: dict[str, list[int]] = {}
    for who in WHO:
        mine = [r for r in requests() if r[3] == who]
        tokens = peft_greedy(llama_dir, adapters[who] if who else None, [r[1] for r in mine],
                             [r[2] for r in mine])
        expected.update({r[0]: t for r, t in zip(mine, tokens, strict=True)})
    return expected


def engine_with(llama_dir: Path, adapters: dict[str, Path], **config: object) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(llama_dir), **{"max_loras": 2, "num_kv_blocks": 256, **config}))
    for name, path in adapters.items():
        engine.add_lora(name, path)
    return engine


def run(engine: LLMEngine) -> tuple[dict[str, list[int]], list[list[ScheduledChunk]]]:
    steps: list[list[ScheduledChunk]] = []
    execute = engine.runner.execute

    def recording(chunks: list[ScheduledChunk]) -> object:
        steps.append(list(chunks))
        return execute(chunks)

    engine.runner.execute = recording  # type: ignore[method-assign]
    for rid, prompt, max_tokens, who in requests():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                           lora=who)
    return {rid: out.token_ids for rid, out in drain(engine).items()}, steps


def test_mixed_adapters_and_base_in_one_step_match_peft(llama_dir: Path, adapters: dict[str, Path],
                                                        reference: dict[str, list[int]]) -> None:
    engine = engine_with(llama_dir, adapters, max_cpu_loras=2)  # the third adapter is read from disk again
    got, steps = run(engine)
    assert got == reference
    keys = [{c.lora for c in chunks} for chunks in steps]
    assert any(None in k and len(k) >= 3 for k in keys), "base and two adapters should share a step"
    assert all(len(k - {None}) <= 2 for k in keys), "never more adapters in a step than max_loras"
    assert any("mlp16" in (k or "") for s in keys for k in s)


def test_chunked_prefill_and_preemption_keep_parity(llama_dir: Path, adapters: dict[str, Path],
                                                    reference: dict[str, list[int]]) -> None:
    chunked = engine_with(llama_dir, adapters, max_num_batched_tokens=32, long_prefill_token_threshold=24)
    got, steps = run(chunked)
    assert got == reference
    assert any(not c.sample and c.lora for chunks in steps for c in chunks), "adapter prefills were chunked"

    tight = engine_with(llama_dir, adapters, num_kv_blocks=10, max_model_len=160)
    got, _ = run(tight)
    assert tight.stats()["preemptions_total"] > 0
    assert got == reference


def test_a_request_waiting_for_a_slot_does_not_hold_back_others(llama_dir: Path,
                                                                adapters: dict[str, Path]) -> None:
    engine = engine_with(llama_dir, adapters, max_loras=1)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.add_request("first", [5] * 10, params, lora="qv8")
    engine.add_request("other-adapter", [6] * 10, params, lora="all4")  # waits: the one slot is taken
    engine.add_request("base", [7] * 10, params)  # behind it, runs at once
    engine.add_request("same-adapter", [8] * 10, params, lora="qv8")  # shares the slot: runs at once
    first_step = {c.lora for c in engine.scheduler.schedule().chunks}
    assert len(engine.scheduler.running) == 3
    assert {seq.request_id for seq in engine.scheduler.running} == {"first", "base", "same-adapter"}
    assert first_step == {engine.lora.key_of("qv8"), None}  # type: ignore[union-attr]


def test_prefix_cache_is_keyed_by_adapter(llama_dir: Path, adapters: dict[str, Path]) -> None:
    engine = engine_with(llama_dir, adapters)
    prompt = list(range(10, 74))  # four full blocks
    params = SamplingParams(max_tokens=1, temperature=0)

    def cached(rid: str, lora: str | None) -> int:
        engine.add_request(rid, prompt, params, lora=lora)
        out = drain(engine)[rid]
        return out.num_cached_tokens

    assert cached("a1", "qv8") == 0
    assert cached("a2", "qv8") == 48  # the blocks before the last token's
    assert cached("base", None) == 0
    assert cached("other", "all4") == 0
    engine.remove_lora("qv8")
    engine.add_lora("qv8", adapters["qv8"])  # the same name again: a new key, nothing reused
    assert cached("a3", "qv8") == 0


def test_remove_waits_for_the_requests_that_hold_it(llama_dir: Path, adapters: dict[str, Path]) -> None:
    engine = engine_with(llama_dir, adapters)
    engine.add_request("x", [3, 4, 5], SamplingParams(max_tokens=4), lora="all4")
    with pytest.raises(ValueError, match=r"lora 'all4' is used by 1 unfinished request"):
        engine.remove_lora("all4")
    drain(engine)
    engine.remove_lora("all4")
    assert engine.list_loras() == ["mlp16", "qv8"]
    with pytest.raises(ValueError, match=r"lora 'all4' is not loaded \(loaded: mlp16, qv8\)"):
        engine.add_request("y", [3], SamplingParams(max_tokens=1), lora="all4")
    with pytest.raises(ValueError, match="lora 'qv8' is already loaded"):
        engine.add_lora("qv8", adapters["qv8"])


def test_lora_off_refuses_adapters(llama_dir: Path, adapters: dict[str, Path]) -> None:
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=64))
    with pytest.raises(ValueError, match="LoRA is off"):
        engine.add_lora("qv8", adapters["qv8"])
    with pytest.raises(ValueError, match=r"lora: this engine serves no LoRA adapters \(max_loras is 0\)"):
        engine.add_request("x", [3], SamplingParams(max_tokens=1), lora="qv8")
    with pytest.raises(ValueError, match="max_cpu_loras must be >= max_loras"):
        EngineConfig(model=str(llama_dir), max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank must be in"):
        EngineConfig(model=str(llama_dir), max_loras=1, max_lora_rank=0)


def edited_copy(source: Path, target: Path, config: dict[str, object] | None = None,
                tensors: dict[str, object] | None = None) -> Path:
    """The adapter at `source` copied to `target`, with config keys changed and tensors replaced (a None
    value drops the key or tensor)."""
    shutil.copytree(source, target)
    if config:
        current = json.loads((target / "adapter_config.json").read_text())
        current.update(config)
        (target / "adapter_config.json").write_text(json.dumps({k: v for k, v in current.items()
                                                               if v is not None}))
    if tensors:
        weights = load_file(target / "adapter_model.safetensors")
        weights.update(tensors)  # type: ignore[arg-type]
        save_file({k: v for k, v in weights.items() if v is not None}, target / "adapter_model.safetensors")
    return target


def test_bad_adapters_are_refused_naming_what(llama_dir: Path, adapters: dict[str, Path], tmp_path: Path,
                                              ) -> None:
    engine = engine_with(llama_dir, {}, max_lora_rank=8)
    source = adapters["qv8"]
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    a_like = torch.zeros_like(load_file(source / "adapter_model.safetensors")[q_a])
    cases: list[tuple[Path, str]] = [
        (edited_copy(source, tmp_path / "dora", {"use_dora": True}), r"DoRA \(use_dora\) is not supported"),
        (edited_copy(source, tmp_path / "bias", {"bias": "all"}), "bias 'all' is not supported"),
        (edited_copy(source, tmp_path / "save", {"modules_to_save": ["lm_head"]}), "modules_to_save"),
        (edited_copy(source, tmp_path / "ia3", {"peft_type": "IA3"}), "peft_type 'IA3' is not supported"),
        (edited_copy(source, tmp_path / "rank", {"r": 0}), "r must be a positive integer"),
        (edited_copy(source, tmp_path / "half", tensors={q_a: None}),
         r"layers\.0\.q_proj: has lora_B without"),
        (edited_copy(source, tmp_path / "shape", tensors={q_a: torch.zeros(8, 3)}),
         r"layers\.0\.q_proj: lora_A \(8, 3\) and lora_B \(.*\) do not fit rank 8"),
        (edited_copy(source, tmp_path / "layer", tensors={
            q_a.replace("layers.0", "layers.9"): a_like}), "targets a module the base model does not"),
        (edited_copy(source, tmp_path / "head", tensors={"base_model.model.lm_head.lora_A.weight": a_like}),
         "is not a LoRA weight of a "),
        (tmp_path / "missing", r"adapter_config\.json not found"),
    ]
    for folder, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.add_lora(folder.name, folder)
    with pytest.raises(ValueError, match="rank 16 exceeds max_lora_rank 8"):
        engine.add_lora("mlp16", adapters["mlp16"])
    with pytest.raises(ValueError, match="lora name must be a non-empty string"):
        engine.add_lora(" ", source)
    assert engine.list_loras() == []


def test_adapters_with_nan_or_infinite_weights_are_refused_naming_the_tensor(
    llama_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """Before, they loaded, and their jobs "succeeded" with the tokens of NaN logits."""
    engine = engine_with(llama_dir, {})
    source = adapters["qv8"]
    v_b = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    weights = load_file(source / "adapter_model.safetensors")[v_b]
    for value, label in ((float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf")):
        poisoned = weights.clone()
        poisoned[3, 1] = value
        folder = edited_copy(source, tmp_path / label, tensors={v_b: poisoned})
        with pytest.raises(ValueError, match=rf"tensor {re.escape(v_b)} holds NaN or infinite values"):
            engine.add_lora(label, folder)
    assert engine.list_loras() == []
    big = edited_copy(source, tmp_path / "big", tensors={v_b: torch.full_like(weights, 1e6)})
    shapes = {"q_proj": TargetShape(64, 64), "v_proj": TargetShape(64, 32)}
    with pytest.raises(ValueError, match=r"layers\.1\.v_proj\.lora_B holds values beyond the range of "
                                         r"torch\.float16"):
        load_adapter("big", big, shapes, num_layers=2, max_rank=8, dtype=torch.float16)


def test_the_offline_llm_and_the_engine_host_serve_adapters(llama_dir: Path, adapters: dict[str, Path],
                                                            reference: dict[str, list[int]]) -> None:
    from conveyor.engine import LLM, EngineHost

    mine = [r for r in requests() if r[3] in (None, "qv8")]
    params = [SamplingParams(max_tokens=r[2], temperature=0, ignore_eos=True) for r in mine]
    llm = LLM(str(llama_dir), max_loras=1, num_kv_blocks=128)
    llm.add_lora("qv8", str(adapters["qv8"]))
    outs = llm.generate([r[1] for r in mine], params, lora=[r[3] for r in mine])
    assert [o.token_ids for o in outs] == [reference[r[0]] for r in mine]
    with pytest.raises(ValueError, match="lora: got 1 adapters for 2 prompts"):
        llm.generate([[3], [4]], lora=["qv8"])

    host = EngineHost(LLMEngine(EngineConfig(model=str(llama_dir), max_loras=1, num_kv_blocks=64)))
    try:
        host.add_lora("all4", str(adapters["all4"])).result(timeout=60)
        with pytest.raises(ValueError, match="already loaded"):
            host.add_lora("all4", str(adapters["all4"])).result(timeout=60)
        rid, prompt, max_tokens, _ = next(r for r in requests() if r[3] == "all4")
        out = host.submit(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                          lora="all4").result(timeout=60)
        assert out.token_ids == reference[rid]
        host.remove_lora("all4").result(timeout=60)
        with pytest.raises(ValueError, match="not loaded"):
            host.submit("again", prompt, SamplingParams(max_tokens=1), lora="all4")
    finally:
        host.shutdown()


def test_the_triton_backend_applies_adapters_by_its_kernels(llama_dir: Path, adapters: dict[str, Path],
                                                            reference: dict[str, list[int]]) -> None:
    """Triton attention and the Triton LoRA kernels (interpreted on CPU): the same tokens as PEFT."""
    engine = engine_with(llama_dir, adapters, attention_backend="triton", max_num_batched_tokens=64)
    mine = [r for r in requests() if len(r[1]) <= 40][:4]  # short: the interpreter is slow
    for rid, prompt, max_tokens, who in mine:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=min(max_tokens, 8), temperature=0,
                                                       ignore_eos=True), lora=who)
    got = {rid: out.token_ids for rid, out in drain(engine).items()}
    assert {r[3] for r in mine} >= {None, "qv8", "all4"}
    assert got == {rid: reference[rid][:min(max_tokens, 8)] for rid, _, max_tokens, _ in mine}


def test_a_slot_reused_by_an_adapter_of_fewer_layers_keeps_nothing_of_the_last(
        llama_dir: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    """layers_to_transform=[0]: layer 1's part of the slot must not keep the previous adapter's weights."""
    first_layer = save_peft_adapter(llama_dir, tmp_path / "first-layer", rank=4, alpha=8, targets=ALL_LINEAR,
                                    seed=9, layers_to_transform=[0])
    prompt, params = list(range(20, 45)), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    engine = engine_with(llama_dir, {"all4": adapters["all4"], "first": first_layer}, max_loras=1)
    engine.add_request("before", prompt, params, lora="all4")
    drain(engine)
    engine.add_request("after", prompt, params, lora="first")
    got = drain(engine)["after"].token_ids
    assert got == peft_greedy(llama_dir, first_layer, [prompt], [10])[0]


def test_an_moe_model_serves_attention_adapters_and_refuses_expert_ones(tiny_model_dir, tmp_path: Path
                                                                         ) -> None:
    """On Mixtral the attention projections take adapters (PEFT's tokens); its experts are no LoRA target."""
    base = tiny_model_dir("MixtralForCausalLM")
    attention = save_peft_adapter(base, tmp_path / "attn", rank=4, alpha=8.0, targets=["q_proj", "o_proj"],
                                  seed=3)
    prompts, max_tokens = [[5, 9, 33, 7, 81, 12], list(range(3, 40))], [9, 6]
    expected = peft_greedy(base, attention, prompts, max_tokens)
    engine = LLMEngine(EngineConfig(model=str(base), max_loras=1, num_kv_blocks=64, max_model_len=256))
    engine.add_lora("attn", attention)
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                           lora="attn")
    assert [out.token_ids for _, out in sorted(drain(engine).items())] == expected
    experts = save_peft_adapter(base, tmp_path / "experts", rank=4, alpha=8.0, targets=["q_proj", "w1", "w3"],
                                seed=4)
    with pytest.raises(ValueError, match="LoRA adapter"):  # PEFT saves per-module ranks for fused experts
        engine.add_lora("experts", experts)
