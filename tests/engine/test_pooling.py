"""engine/pooling.py: reading a sentence-transformers folder, choosing the task, and the pooling ops."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from conveyor.engine.pooling import (
    PoolingConfig,
    accumulate,
    chunk_rows,
    embedding_max_len,
    finish_embeddings,
    pooling_config,
    read_sentence_transformers_config,
    resolve_task,
)

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
OLD_MEAN = {"word_embedding_dimension": 8, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
            "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}


def st_folder(path: Path, modules: list[dict[str, Any]], pooling: dict[str, Any],
              files: dict[str, dict[str, Any]] | None = None) -> Path:
    """A folder with the sentence-transformers files only (what the reader looks at)."""
    (path / "1_Pooling").mkdir(parents=True)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    for name, content in (files or {}).items():
        (path / name).write_text(json.dumps(content))
    return path


def test_reads_the_older_sentence_transformers_layout(tmp_path: Path) -> None:
    folder = st_folder(tmp_path, [TRANSFORMER, POOLING], OLD_MEAN,
                       {"sentence_bert_config.json": {"max_seq_length": 256, "do_lower_case": True}})
    assert read_sentence_transformers_config(folder) == PoolingConfig("mean", False, 256, lowercase=True)


def test_reads_the_newer_layout_its_max_length_and_default_prompt(tmp_path: Path) -> None:
    folder = st_folder(
        tmp_path, [TRANSFORMER, POOLING, NORMALIZE], {"embedding_dimension": 8, "pooling_mode": "lasttoken"},
        {"sentence_bert_config.json": {"modality_config": {"text": {"method": "forward"}}},
         "tokenizer_config.json": {"model_max_length": 128},
         "config_sentence_transformers.json": {"prompts": {"query": "query: ", "document": ""},
                                               "default_prompt_name": "query"}})
    assert read_sentence_transformers_config(folder) == PoolingConfig("last", True, 128, prompt="query: ")
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": int(1e30)}))
    config = read_sentence_transformers_config(folder)
    assert config is not None and config.max_length is None  # transformers' "no limit"
    assert embedding_max_len(512, config) == 512
    assert embedding_max_len(512, PoolingConfig("cls", True, 128)) == 128


@pytest.mark.parametrize(("modules", "pooling", "files", "named"), [
    ([TRANSFORMER, POOLING, {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}], OLD_MEAN, {},
     "Dense"),
    ([TRANSFORMER], OLD_MEAN, {}, "Transformer"),
    ([TRANSFORMER, POOLING], {"pooling_mode": "max"}, {}, "max"),
    ([TRANSFORMER, POOLING], {**OLD_MEAN, "pooling_mode_cls_token": True}, {}, "cls_token"),
    ([TRANSFORMER, POOLING], {"pooling_mode": "mean", "include_prompt": False}, {}, "include_prompt"),
    ([TRANSFORMER, POOLING], OLD_MEAN,
     {"sentence_bert_config.json": {"modality_config": {"text": {}, "message": {}}}}, "message"),
])
def test_refuses_what_it_cannot_reproduce(tmp_path: Path, modules, pooling, files, named) -> None:
    folder = st_folder(tmp_path, modules, pooling, files)
    with pytest.raises(ValueError, match=named):
        read_sentence_transformers_config(folder)


def test_defaults_without_a_sentence_transformers_folder_and_overrides(tmp_path: Path) -> None:
    assert read_sentence_transformers_config(tmp_path) is None
    assert pooling_config(tmp_path, is_encoder=True) == PoolingConfig("cls", True, None)
    assert pooling_config(tmp_path, is_encoder=False) == PoolingConfig("last", True, None)
    assert pooling_config(tmp_path, is_encoder=False, method="mean", normalize=False) == PoolingConfig(
        "mean", False, None)
    with pytest.raises(ValueError, match="pooling must be one of"):
        PoolingConfig("max", True, None)


def test_resolve_task(tmp_path: Path) -> None:
    assert resolve_task("auto", tmp_path, is_encoder=False, has_lm_head=True) == "generate"
    assert resolve_task("auto", tmp_path, is_encoder=True, has_lm_head=False) == "embed"
    assert resolve_task("embed", tmp_path, is_encoder=False, has_lm_head=True) == "embed"
    with pytest.raises(ValueError, match="is an encoder"):
        resolve_task("generate", tmp_path, is_encoder=True, has_lm_head=False)
    with pytest.raises(ValueError, match="without its LM head"):
        resolve_task("generate", tmp_path, is_encoder=False, has_lm_head=False)
    with pytest.raises(ValueError, match="task must be one of"):
        resolve_task("score", tmp_path, is_encoder=False, has_lm_head=True)
    st_folder(tmp_path, [TRANSFORMER, POOLING], OLD_MEAN)
    assert resolve_task("auto", tmp_path, is_encoder=False, has_lm_head=False) == "embed"


def test_chunk_rows_reduce_each_chunk() -> None:
    hidden = torch.arange(12, dtype=torch.float32).view(6, 2)  # chunks of 1, 3 and 2 tokens
    query_start_loc = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    seq_of_token = torch.tensor([0, 1, 1, 1, 2, 2])
    sums = [hidden[0], hidden[1:4].sum(0), hidden[4:].sum(0)]
    torch.testing.assert_close(chunk_rows(hidden, query_start_loc, seq_of_token, "mean"), torch.stack(sums))
    torch.testing.assert_close(chunk_rows(hidden, query_start_loc, seq_of_token, "cls"), hidden[[0, 1, 4]])
    torch.testing.assert_close(chunk_rows(hidden, query_start_loc, seq_of_token, "last"), hidden[[0, 3, 5]])


def test_accumulate_across_chunks() -> None:
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])
    torch.testing.assert_close(accumulate(accumulate(None, a, 0, "mean"), b, 4, "mean"), a + b)
    torch.testing.assert_close(accumulate(accumulate(None, a, 0, "cls"), b, 4, "cls"), a)
    torch.testing.assert_close(accumulate(accumulate(None, a, 0, "last"), b, 4, "last"), b)


def test_finish_embeddings_divides_cuts_and_normalises_per_request() -> None:
    pooled = torch.tensor([[3.0, 4.0, 12.0], [6.0, 8.0, 0.0], [2.0, 0.0, 0.0]])
    out = finish_embeddings(pooled, [1, 2, 4], "mean", dimensions=[3, 2, 3], normalize=[True, True, False])
    torch.testing.assert_close(torch.tensor(out[0]), torch.tensor([3.0, 4.0, 12.0]) / 13)
    torch.testing.assert_close(torch.tensor(out[1]), torch.tensor([0.6, 0.8]))  # cut to 2, then normalised
    torch.testing.assert_close(torch.tensor(out[2]), torch.tensor([0.5, 0.0, 0.0]))  # divided, not normalised
