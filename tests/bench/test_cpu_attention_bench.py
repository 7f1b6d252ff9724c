"""`python -m conveyor.bench.cpu_attention`: both CPU backends over the same step, compared, agreeing."""

from __future__ import annotations

import argparse

import pytest
import torch

from conveyor.bench import cpu_attention


def test_a_small_run_prints_both_backends_and_agrees(capsys) -> None:
    threads = str(torch.get_num_threads())  # main sets the process' count: leave it as the suite had it
    code = cpu_attention.main(["--seqs", "5", "--context", "3:70", "--layers", "2", "--rounds", "2",
                               "--heads", "4:2", "--head-dim", "16", "--threads", threads])
    printed = capsys.readouterr().out
    assert code == 0
    assert "cpu" in printed and "torch" in printed and "max |cpu - torch|" in printed


def test_the_step_reads_every_layer_and_counts_its_bytes() -> None:
    step = cpu_attention.build_step(seqs=3, context=(10, 40), heads=(4, 2), head_dim=8, block_size=16,
                                    layers=3)
    assert len(step.caches) == 3
    assert step.context_tokens == int(step.meta.seq_lens.sum())
    assert step.kv_bytes() == 2 * 3 * step.context_tokens * 2 * 8 * 4  # K and V, layers, tokens, Hkv * D fp32
    assert cpu_attention.agree(step) <= 1e-5
    assert torch.equal(step.meta.block_tables[0, :2], torch.tensor([0, 1], dtype=torch.int32))


@pytest.mark.parametrize("text", ["0:5", "9:3", "x"])
def test_a_bad_range_is_refused(text: str) -> None:
    with pytest.raises((argparse.ArgumentTypeError, ValueError)):
        cpu_attention.parse_range(text)


@pytest.mark.parametrize("text", ["8:3", "0:1"])
def test_heads_must_group_evenly(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        cpu_attention.parse_heads(text)
    assert cpu_attention.parse_heads("8:4") == (8, 4)
