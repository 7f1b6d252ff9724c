from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conveyor.engine.config import EngineConfig
from conveyor.engine.llm import LLM
from conveyor.engine.loader import (
    ModelFolderError,
    load_model,
    read_hf_config,
    resolve_dtype,
    safetensors_files,
)
from conveyor.engine.model_runner import ModelRunner
from conveyor.engine.models import MODEL_REGISTRY
from conveyor.kernels.paged_attention import resolve_backend

CPU = torch.device("cpu")


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def load(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return load_model(path, CPU, dtype, "torch")[0]


def test_missing_folder_and_missing_config_name_the_culprit(tmp_path, llama_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_hf_config(tmp_path / "nowhere")
    path = copy_of(llama_dir, tmp_path / "m")
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load(path)


def test_missing_weights_name_safetensors(tmp_path, llama_dir):
    path = copy_of(llama_dir, tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"\*\.safetensors"):
        load(path)


def test_missing_shard_listed_by_the_index_is_named(tmp_path, tiny_model_dir):
    path = copy_of(tiny_model_dir("LlamaForCausalLM", max_shard_size="40KB"), tmp_path / "m")
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(victim.name)):
        load(path)


def test_missing_tokenizer_is_named_by_the_runner(tmp_path, llama_dir):
    path = copy_of(llama_dir, tmp_path / "m")
    (path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        ModelRunner(EngineConfig(model=str(path), num_kv_blocks=64))


def test_unsupported_architecture_is_named_with_the_supported_ones(tmp_path, llama_dir):
    path = copy_of(llama_dir, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM") as raised:
        load(path)
    message = str(raised.value)
    assert "\n" not in message, "one line"
    assert all(arch in message for arch in MODEL_REGISTRY)
    for family in ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                   "Phi3ForCausalLM"):
        assert family in message


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"])
def test_a_checkpoint_missing_an_expert_or_with_a_stray_one_is_named(tmp_path, tiny_model_dir, arch):
    """Per-expert tensors are checked like any other: a missing one and an extra one are both named."""
    from safetensors.torch import load_file, save_file

    path = copy_of(tiny_model_dir(arch), tmp_path / "m")
    weights = load_file(path / "model.safetensors")
    victim = next(name for name in sorted(weights) if ".experts.1." in name or ".q_norm." in name)
    stray = victim.replace(".1.", ".9.") if ".experts." in victim else f"{victim}_stray"  # expert 9 of 4
    weights[stray] = weights.pop(victim)
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match="missing") as raised:
        load(path)
    assert "unexpected ['model.layers" in str(raised.value)


@pytest.mark.parametrize(("arch", "change", "named"), [
    ("Gemma2ForCausalLM", {"hidden_size": None}, "hidden_size"),  # not filled in by Gemma2Config's default
    ("Gemma3ForCausalLM", {"layer_types": ["sliding_attention", "chunked_attention"]}, "chunked_attention"),
    ("MixtralForCausalLM", {"num_experts_per_tok": 5}, "num_experts_per_tok=5"),
    ("MixtralForCausalLM", {"num_local_experts": 0}, "num_local_experts"),
    ("Qwen3MoeForCausalLM", {"moe_intermediate_size": None}, "moe_intermediate_size"),
    ("Phi3ForCausalLM", {"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ("Phi3ForCausalLM", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
])
def test_bad_family_configs_are_named(tmp_path, tiny_model_dir, arch, change, named):
    path = copy_of(tiny_model_dir(arch), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    for key, value in change.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=named):
        load(path)


@pytest.mark.parametrize(("change", "named"), [
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "low_freq_factor"),
])
def test_bad_config_values_are_named(tmp_path, llama_dir, change, named):
    path = copy_of(llama_dir, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config.update(change)
    config = {key: value for key, value in config.items() if value is not None}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=named):
        load(path)


def test_sharded_checkpoint_loads_equal_to_unsharded(tmp_path, llama_dir, tiny_model_dir):
    sharded_dir = tiny_model_dir("LlamaForCausalLM", max_shard_size="40KB")
    assert len(safetensors_files(sharded_dir)) > 1
    whole = dict(load(llama_dir).named_parameters())
    sharded = dict(load(sharded_dir).named_parameters())
    # Without the index, every *.safetensors in the folder is read.
    no_index_dir = copy_of(sharded_dir, tmp_path / "no-index")
    (no_index_dir / "model.safetensors.index.json").unlink()
    no_index = dict(load(no_index_dir).named_parameters())
    assert whole.keys() == sharded.keys() == no_index.keys()
    for name, param in whole.items():
        assert torch.equal(param, sharded[name]), name
        assert torch.equal(param, no_index[name]), name


def test_fused_projections_hold_the_checkpoint_tensors(llama_dir):
    model = load(llama_dir)
    tensors = load_file(llama_dir / "model.safetensors")
    attn = model.model.layers[1].self_attn
    q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
    assert torch.equal(q, tensors["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(k, tensors["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(v, tensors["model.layers.1.self_attn.v_proj.weight"])
    gate, up = model.model.layers[1].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(gate, tensors["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(up, tensors["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])


def test_tied_embeddings_share_one_parameter(tiny_model_dir):
    path = tiny_model_dir("LlamaForCausalLM", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model = load(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_missing_tensor_and_an_unexpected_one_are_named(tmp_path, llama_dir):
    path = copy_of(llama_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    tensors["model.layers.0.self_attn.mystery.weight"] = torch.zeros(2)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"qkv_proj\.weight\[1\].*mystery"):
        load(path)


def test_wrong_shape_is_named(tmp_path, llama_dir):
    path = copy_of(llama_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = torch.zeros(3)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(3,\)"):
        load(path)


def test_dtype_auto_is_float32_on_cpu_and_weights_take_the_requested_dtype(llama_dir):
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    model = load(llama_dir, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary.inv_freq.dtype == torch.float32  # RoPE angles stay fp32


def test_a_model_folder_that_does_not_exist_is_named_as_such(tmp_path):
    missing = tmp_path / "x" / "y"
    with pytest.raises(ValueError, match=f"model folder {re.escape(str(missing))} does not exist"):
        LLM(str(missing))  # not "no tokenizer file": the runner checks the folder first
    a_file = tmp_path / "weights.safetensors"
    a_file.write_bytes(b"")
    with pytest.raises(ModelFolderError, match="is not a folder"):
        ModelRunner(EngineConfig(model=str(a_file), num_kv_blocks=64))


def test_the_runner_reports_its_load_timings(llama_dir, monkeypatch):
    resolve = resolve_backend

    def slow_resolve(*args, **kwargs):  # as a first start that compiles the C++ CPU kernels
        time.sleep(0.05)
        return resolve(*args, **kwargs)

    monkeypatch.setattr("conveyor.engine.model_runner.resolve_backend", slow_resolve)
    runner = ModelRunner(EngineConfig(model=str(llama_dir), num_kv_blocks=64))
    assert runner.load_timings.weights_s > 0 and runner.load_timings.kv_cache_s > 0
    assert runner.load_timings.attention_s >= 0.05


def test_a_generation_checkpoint_without_its_head_is_named(tmp_path, llama_dir):
    path = copy_of(llama_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"no LM head \(lm_head\.weight\).*task='embed'"):
        load(path)
    assert load_model(path, CPU, torch.float32, "torch", task="embed").model.lm_head is None


def test_an_embedding_model_drops_the_head_and_reads_a_head_less_checkpoint(tmp_path, llama_dir):
    whole = load_model(llama_dir, CPU, torch.float32, "torch", task="embed")
    assert whole.task == "embed" and whole.model.lm_head is None
    # As sentence-transformers saves a decoder: LlamaModel, tensor names without "model.", no head.
    path = copy_of(llama_dir, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    save_file({name.removeprefix("model."): t for name, t in tensors.items() if name != "lm_head.weight"},
              path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaModel"]}))
    head_less = load_model(path, CPU, torch.float32, "torch", task="embed").model
    expected = dict(whole.model.named_parameters())
    assert expected.keys() == dict(head_less.named_parameters()).keys()
    for name, param in head_less.named_parameters():
        assert torch.equal(param, expected[name]), name
    with pytest.raises(ValueError, match="without its LM head"):
        load_model(path, CPU, torch.float32, "torch", task="generate")
