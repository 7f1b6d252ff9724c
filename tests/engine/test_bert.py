"""BertEncoder against transformers' BertModel / XLMRobertaModel, and its config and weight checks."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from conveyor.engine.models import bert
from conveyor.engine.models.bert import BertEncoder, bert_settings, xlm_roberta_settings
from tests.support.encoder_models import save_encoder_checkpoint

VOCAB = 300
FIRST_PLAIN_ID = 5  # ids 0..4 are the special tokens: XLM-R's pad (1) would change its position ids
SETTINGS = {"bert": bert_settings, "xlm-roberta": xlm_roberta_settings}


def ours(folder: Path, arch: str) -> BertEncoder:
    cfg = json.loads((folder / "config.json").read_text())
    model = BertEncoder(SETTINGS[arch](cfg, torch.float32))
    model.load_weights(sorted(folder.glob("*.safetensors")))
    return model.eval()


Packed = tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]


def packed(lengths: list[int], vocab: int, seed: int = 0) -> Packed:
    """Random sequences and their packed form: input_ids [T], positions [T], query_start_loc [S + 1]."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(FIRST_PLAIN_ID, vocab, (n,), generator=gen) for n in lengths]
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    return seqs, torch.cat(seqs), positions, starts


def transformers_model(folder: Path) -> Any:
    """The oracle: transformers' own class for the folder, fp32, eval mode."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(folder, dtype=torch.float32).eval()


def model_vocab(folder: Path) -> int:
    return int(json.loads((folder / "config.json").read_text())["vocab_size"])


@torch.no_grad()
def assert_matches_transformers(model: BertEncoder, reference: Any, lengths: list[int]) -> None:
    seqs, input_ids, positions, starts = packed(lengths, model.settings.vocab_size)
    hidden = model(input_ids, positions, starts, max(lengths))
    assert hidden.shape == (sum(lengths), model.settings.hidden_size)
    for i, seq in enumerate(seqs):
        expected = reference(input_ids=seq[None]).last_hidden_state[0]
        torch.testing.assert_close(hidden[starts[i]:starts[i + 1]], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta"])
def test_hidden_states_match_transformers_per_packed_sequence(tmp_path: Path, arch: str) -> None:
    save_encoder_checkpoint(tmp_path, arch=arch)
    assert_matches_transformers(ours(tmp_path, arch), transformers_model(tmp_path), [1, 7, 33, 130])


def test_more_tokens_than_a_row_chunk_go_through_the_chunked_path(tmp_path: Path) -> None:
    save_encoder_checkpoint(tmp_path)
    lengths = [130, 200, 500, 300, 9]
    assert sum(lengths) > bert.ROW_CHUNK
    assert_matches_transformers(ours(tmp_path, "bert"), transformers_model(tmp_path), lengths)


@pytest.mark.parametrize("act", ["gelu_new", "gelu_pytorch_tanh"])
def test_tanh_gelu_variants_match(tmp_path: Path, act: str) -> None:
    save_encoder_checkpoint(tmp_path, hidden_act=act)
    model = ours(tmp_path, "bert")
    assert model.settings.gelu_approximation == "tanh"
    assert_matches_transformers(model, transformers_model(tmp_path), [5, 17])


def base_config(**changes: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, max_position_embeddings=512)
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


@pytest.mark.parametrize(("changes", "message"), [
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
    ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'"),
    ({"num_attention_heads": 5}, "hidden_size 32 is not a multiple of num_attention_heads 5"),
    ({"num_hidden_layers": None}, "missing key(s) ['num_hidden_layers']"),
])
def test_unsupported_configs_are_refused_naming_the_key(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="config.json: " + re.escape(message)):
        bert_settings(base_config(**changes), torch.float32)


def test_xlm_roberta_needs_pad_token_id_for_its_position_offset() -> None:
    with pytest.raises(ValueError, match=r"missing key\(s\) \['pad_token_id'\]"):
        xlm_roberta_settings(base_config(), torch.float32)
    assert xlm_roberta_settings(base_config(pad_token_id=1), torch.float32).position_offset == 2
    with pytest.raises(ValueError, match="leaves no position"):
        xlm_roberta_settings(base_config(pad_token_id=1, max_position_embeddings=2), torch.float32)


def rewrite_weights(folder: Path, rename: Any) -> None:
    """Rewrite model.safetensors with `rename(name, tensor) -> dict of tensors` applied to every tensor."""
    file = folder / "model.safetensors"
    tensors = load_file(file)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        out.update(rename(name, tensor))
    file.unlink()
    save_file({k: v.contiguous() for k, v in out.items()}, file)


def test_prefixed_checkpoint_with_heads_and_legacy_gamma_beta_loads_the_same(tmp_path: Path) -> None:
    save_encoder_checkpoint(tmp_path)
    reference = transformers_model(tmp_path)

    def old_style(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        name = name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        return {"bert." + name: tensor}

    rewrite_weights(tmp_path, old_style)
    extra = load_file(tmp_path / "model.safetensors")
    extra["cls.predictions.bias"] = torch.zeros(model_vocab(tmp_path))
    extra["bert.pooler.dense.weight"] = torch.zeros(32, 32)
    extra["bert.embeddings.position_ids"] = torch.arange(512)[None]
    (tmp_path / "model.safetensors").unlink()
    save_file(extra, tmp_path / "model.safetensors")
    assert any(".gamma" in name for name in extra)
    assert_matches_transformers(ours(tmp_path, "bert"), reference, [3, 40])


def test_missing_unexpected_and_misshaped_tensors_are_named(tmp_path: Path) -> None:
    save_encoder_checkpoint(tmp_path)
    key_name = "encoder.layer.1.attention.self.key.weight"

    rewrite_weights(tmp_path, lambda n, t: {} if n == key_name else {n: t})
    missing_key = re.escape("missing ['encoder.layer.1.attention.self.qkv.weight[1]']")
    with pytest.raises(ValueError, match=missing_key):
        ours(tmp_path, "bert")

    save_encoder_checkpoint(tmp_path)
    rewrite_weights(tmp_path, lambda n, t: {n: t, "encoder.layer.0.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"unexpected \['encoder\.layer\.0\.extra\.weight'\]"):
        ours(tmp_path, "bert")

    save_encoder_checkpoint(tmp_path)
    rewrite_weights(tmp_path, lambda n, t: {n: t[:16] if n == key_name else t})
    with pytest.raises(ValueError, match=f"{key_name} has shape \\(16, 32\\), expected \\(32, 32\\)"):
        ours(tmp_path, "bert")
