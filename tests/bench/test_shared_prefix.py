"""The `shared-prefix` profile and `--compare enable_prefix_caching=false` on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conveyor.bench.cli import main
from conveyor.bench.experiment import parse_value
from conveyor.bench.workload import WorkloadSpec, generate


def test_the_shared_prefix_profile_gives_every_request_one_prefix_and_its_own_suffix() -> None:
    spec = WorkloadSpec(profile="shared-prefix", num_requests=5, seed=2, prefix_tokens=20, suffix_tokens=3,
                        output_tokens=4)
    vocab = list(range(3, 500))
    requests = generate(spec, vocab, 64)
    assert requests == generate(spec, vocab, 64), "seeded"
    prompts = [r.prompt_token_ids or [] for r in requests]
    assert all(len(p) == 23 and p[:20] == prompts[0][:20] for p in prompts)
    assert len({tuple(p[20:]) for p in prompts}) == 5, "every suffix is its own"
    assert all(r.max_tokens == 4 and r.arrival_s == 0 and r.group == "interactive" for r in requests)
    with pytest.raises(ValueError, match="exceeds the context"):
        generate(spec, vocab, 26)
    with pytest.raises(ValueError, match="output_tokens"):
        WorkloadSpec(profile="shared-prefix", output_tokens=0)


def test_defaults_are_64_requests_sharing_768_tokens() -> None:
    s = WorkloadSpec(profile="shared-prefix")
    assert (s.num_requests, s.prefix_tokens, s.suffix_tokens, s.output_tokens) == (64, 768, 32, 32)


def test_booleans_parse_for_compare() -> None:
    assert parse_value("false") is False and parse_value("True") is True and parse_value("1") == 1


def test_compare_prefix_caching_off_on_the_shared_prefix_profile(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "apc"
    args = ["--model", str(llama_dir), "--profile", "shared-prefix", "-n", "6", "--prefix-tokens", "48",
            "--suffix-tokens", "4", "--output-tokens", "3", "--set", "max_num_seqs=8", "--no-progress",
            "--no-matmul-bound", "--out", str(out), "--compare", "enable_prefix_caching=false"]
    assert main(args) == 0
    sheet = json.loads((out / "decision.json").read_text())
    assert (sheet["baseline_value"], sheet["candidate_value"]) == (True, False)
    cache = sheet["baseline_run"]["prefix_cache"]
    assert cache["queried_tokens"] == 6 * 52
    assert cache["hit_tokens"] == 5 * 48, "the first computes the prefix; the 5 others find its 3 blocks"
    assert sheet["candidate_run"]["prefix_cache"] is None
    assert sheet["inventory"]["parameters"]["candidate"]["engine"]["enable_prefix_caching"] is False
    text = (out / "decision.md").read_text()
    assert "wall time end to end" in text and "hit rate 76.9%" in text
