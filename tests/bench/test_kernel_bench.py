"""The GPU check's bookkeeping, and its CPU smoke run through the interpreter."""

from __future__ import annotations

import torch

from conveyor.bench import kernels as kernel_bench


def test_flops_and_bytes_count_causal_work() -> None:
    shape = kernel_bench.Shape(num_heads=2, num_kv_heads=1, head_dim=4, block_size=16, dtype=torch.float16,
                        atol=0.0, rtol=0.0)
    case = kernel_bench.Case("one chunk and one decode", query_lens=[3, 1], seq_lens=[5, 7])
    # Chunk: 3 queries x 2 context keys + causal triangle 1 + 2 + 3 = 12 keys; decode: 7 keys.
    assert kernel_bench.attention_flops(case, shape) == 4 * 4 * 2 * 19
    assert kernel_bench.minimal_bytes(case, shape) == (2 * 12 * 1 * 4 + 2 * 4 * 2 * 4) * 2


def test_peaks_known_by_device_name_order() -> None:
    names = [name for name, _, _ in kernel_bench.PEAKS]
    assert names.index("H100 PCIe") < names.index("H100") and names.index("L40S") < names.index("L4")


def test_cpu_smoke_run_passes(capsys) -> None:
    assert kernel_bench.main(["--cpu-smoke", "--iters", "1"]) == 0
    assert "decode b=2 split=3 (forced)" in capsys.readouterr().out
