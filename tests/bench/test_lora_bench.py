"""The `lora` profile end to end on the tiny model: every system runs the same requests and the report holds
what the docs quote (output tokens/s, the ratios to the base model alone and to transformers + PEFT)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from conveyor.bench.lora import LoraOptions, run


def test_adapters_mixed_against_the_base_alone_and_peft(tmp_path: Path, llama_dir: Path) -> None:
    opts = LoraOptions(model=llama_dir, model_cache=tmp_path / "cache", adapter_counts=(1, 2), num_requests=4,
                       prompt_tokens=8, max_tokens=4, rank=4, peft_adapters=2, peft_batch_size=2, rounds=1)
    printed = io.StringIO()
    report = run(opts, Console(file=printed, width=200), tmp_path / "out")

    systems = sorted((r["system"], r["adapters"]) for r in report["runs"])
    assert systems == [("conveyor", 0), ("conveyor", 1), ("conveyor", 2), ("transformers+peft", 2)]
    assert all(r["output_tokens_per_s"] > 0 for r in report["runs"])
    assert set(report["vs_base"]) == {"1", "2"} and report["vs_peft"] > 0
    assert json.loads((tmp_path / "out" / "lora.json").read_text())["vs_peft"] == report["vs_peft"]
    assert "transformers + PEFT" in printed.getvalue()
    saved = sorted(p.name for p in (tmp_path / "cache").glob("lora-*/adapter-*"))
    assert saved == ["adapter-0", "adapter-1"]


@pytest.mark.parametrize(("changes", "message"), [
    ({"adapter_counts": ()}, "adapter counts"), ({"adapter_counts": (0, 2)}, "adapter counts"),
    ({"num_requests": 0}, "num_requests"), ({"rank": 0}, "rank"),
    ({"peft_adapters": 3}, "peft_adapters"),
])
def test_bad_options_are_refused_naming_them(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    opts = LoraOptions(**{"model": tmp_path, "model_cache": tmp_path, **changes})
    with pytest.raises(ValueError, match=message):
        opts.check()
