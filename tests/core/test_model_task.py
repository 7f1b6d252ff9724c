"""core/protocol/model_task.py: what a model folder serves, read without torch: "auto" resolved as the engine
resolves it, the embedding size, and the longest input (sentence-transformers' max_seq_length within the
positions the model can use)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conveyor.core.protocol.model_task import ModelTask, model_task
from tests.support.encoder_models import build_encoder_st_folder


def folder(path: Path, config: dict[str, Any], *, st_max_seq_length: int | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if st_max_seq_length is not None:
        (path / "modules.json").write_text("[]")
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": st_max_seq_length}))
    return path


BERT = {"model_type": "bert", "architectures": ["BertModel"], "hidden_size": 384, "vocab_size": 30522,
        "max_position_embeddings": 512}
XLMR = {"model_type": "xlm-roberta", "architectures": ["XLMRobertaModel"], "hidden_size": 768,
        "vocab_size": 250002, "max_position_embeddings": 514, "pad_token_id": 1}
QWEN = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "vocab_size": 640,
        "max_position_embeddings": 4096}


def test_an_encoder_embeds_up_to_the_positions_it_can_use(tmp_path: Path) -> None:
    assert model_task(folder(tmp_path / "bert", BERT)) == ModelTask("embed", 384, 512, 30522)
    # XLM-R's position ids start after the padding index: 514 - 1 - 1 usable positions.
    assert model_task(folder(tmp_path / "xlmr", XLMR)) == ModelTask("embed", 768, 512, 250002)


def test_sentence_transformers_max_seq_length_caps_the_input(tmp_path: Path) -> None:
    assert model_task(folder(tmp_path / "bert", BERT, st_max_seq_length=256)).max_input_tokens == 256
    assert model_task(folder(tmp_path / "long", BERT, st_max_seq_length=8192)).max_input_tokens == 512
    decoder = folder(tmp_path / "qwen", QWEN, st_max_seq_length=1024)
    assert model_task(decoder) == ModelTask("embed", 64, 1024, 640)  # modules.json: a sentence-transformer


@pytest.mark.parametrize(("architecture", "task"),
                         [("Qwen2ForCausalLM", "generate"), ("Qwen2Model", "embed")])
def test_a_decoder_generates_unless_saved_without_its_lm_head(tmp_path: Path, architecture: str,
                                                                task: str) -> None:
    assert model_task(folder(tmp_path, {**QWEN, "architectures": [architecture]})).task == task


def test_the_setting_wins_over_the_folder_and_a_missing_folder_generates(tmp_path: Path) -> None:
    assert model_task(folder(tmp_path / "q", QWEN), "embed") == ModelTask("embed", 64, 4096, 640)
    assert model_task(folder(tmp_path / "b", BERT), "generate") == ModelTask("generate")
    assert model_task(tmp_path / "not-built-yet") == ModelTask("generate")
    assert "serves embeddings" in ModelTask("embed").serves()
    assert "generates text" in ModelTask("generate").serves()


def test_a_real_sentence_transformers_folder(tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    path = build_encoder_st_folder(tmp_path / "bert-st", max_seq_length=64)
    task = model_task(path)
    model = SentenceTransformer(str(path), device="cpu")
    assert (task.task, task.max_input_tokens) == ("embed", model.max_seq_length)
    assert task.embedding_size == model.get_embedding_dimension()


def test_the_api_reads_a_folder_as_the_engine_does(tmp_path: Path) -> None:
    """The engine's reading (engine/pooling.py), which the API may not import: the same maximum length,
    default prompt and lowercasing."""
    from conveyor.engine.pooling import read_sentence_transformers_config

    path = build_encoder_st_folder(tmp_path / "bert-st", max_seq_length=48)
    settings = path / "config_sentence_transformers.json"
    config = json.loads(settings.read_text())
    prompts = {"prompts": {"query": "query: "}, "default_prompt_name": "query"}
    settings.write_text(json.dumps({**config, **prompts}))
    st_config = path / "sentence_bert_config.json"
    st_config.write_text(json.dumps({**json.loads(st_config.read_text()), "do_lower_case": True}))
    engine = read_sentence_transformers_config(path)
    task = model_task(path)
    assert engine is not None and engine.max_length == task.max_input_tokens == 48
    assert (engine.prompt, engine.lowercase) == (task.text_prefix, task.lowercase) == ("query: ", True)
    assert task.as_embedded("Hello") == "query: hello"
