"""The `embed` profile end to end on a tiny preset: both systems embed the same corpus, their vectors agree,
and the report holds what the docs quote (inputs/s, tokens/s, the ratio to the best batch size)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from conveyor.bench.embed import EmbedOptions, build_corpus, run
from conveyor.engine.model_source import model_folder


def test_the_engine_and_sentence_transformers_embed_the_corpus_alike(tmp_path: Path) -> None:
    opts = EmbedOptions(model="preset:bert-tiny", model_cache=tmp_path / "models", num_inputs=8,
                        min_tokens=16, max_tokens=64, batch_sizes=(2, 4), rounds=1)
    printed = io.StringIO()
    report = run(opts, Console(file=printed, width=200), tmp_path / "out")

    assert report["max_abs_diff"] < 1e-4
    systems = sorted((r["system"], r["batch_size"]) for r in report["runs"])
    assert systems == [("conveyor", None), ("sentence-transformers", 2), ("sentence-transformers", 4)]
    assert report["best_peer_batch_size"] in (2, 4) and report["ratio_to_best_peer"] > 0
    assert all(r["inputs_per_s"] > 0 and r["tokens_per_s"] > r["inputs_per_s"] for r in report["runs"])
    assert json.loads((tmp_path / "out" / "embed.json").read_text())["num_tokens"] == report["num_tokens"]
    assert "conveyor / best sentence-transformers" in printed.getvalue()
    # the floor: the linear layers alone at torch.mm's speed; neither system beats it
    fastest = min(r["seconds"] for r in report["runs"])
    assert 0 < report["linear_floor_s"] < fastest
    assert report["ratio_bound"] > 1 and "linear-layer floor" in printed.getvalue()


def test_the_corpus_spreads_over_the_token_range(tmp_path: Path) -> None:
    opts = EmbedOptions(model="preset:bert-tiny", model_cache=tmp_path, num_inputs=40, min_tokens=16,
                        max_tokens=48)
    folder = model_folder(opts.model, cache_dir=opts.model_cache)
    texts, total = build_corpus(folder, opts)
    from transformers import AutoTokenizer

    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(folder)(texts)["input_ids"]]
    assert len(texts) == 40 and sum(lengths) == total
    assert min(lengths) >= 16 and max(lengths) <= 48 and max(lengths) - min(lengths) > 16


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_inputs": 0}, "num_inputs"), ({"min_tokens": 2}, "min_tokens"), ({"max_tokens": 8}, "min_tokens"),
    ({"batch_sizes": ()}, "batch sizes"), ({"rounds": 0}, "rounds"),
])
def test_bad_options_are_refused_naming_them(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    opts = EmbedOptions(**{"model": "preset:bert-tiny", "model_cache": tmp_path, **changes})
    with pytest.raises(ValueError, match=message):
        opts.check()
    with pytest.raises(ValueError, match=r"unknown preset .nope."):
        model_folder("preset:nope", cache_dir=tmp_path)
