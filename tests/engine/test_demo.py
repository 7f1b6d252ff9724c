from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from conveyor.engine.demo import SUPPORTED_ARCHS, build_tiny_model


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_folder_is_a_complete_checkpoint(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [arch]
    assert (path / "model.safetensors").exists()
    assert (path / "generation_config.json").exists()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) <= config["vocab_size"]
    ids = tokenizer("The queue holds jobs.").input_ids
    assert ids[0] == tokenizer.bos_token_id == config["bos_token_id"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "The queue holds jobs."
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat == "<s><|user|>\nhi</s>\n<|assistant|>\n"


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    a = load_file(build_tiny_model(tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(build_tiny_model(tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(build_tiny_model(tmp_path / "c", seed=4) / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_sharded_checkpoint_has_an_index(tiny_model_dir):
    path = tiny_model_dir("LlamaForCausalLM", max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (path / "model.safetensors").exists()


def test_rejects_unknown_arch_and_tiny_vocab(tmp_path):
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        build_tiny_model(tmp_path, "GPT2LMHeadModel")
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_model(tmp_path, vocab_size=100)


def test_rebuilding_into_the_same_folder_leaves_no_stale_weights(tmp_path):
    build_tiny_model(tmp_path, max_shard_size="40KB")
    build_tiny_model(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors*")) == ["model.safetensors"]
