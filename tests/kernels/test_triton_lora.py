"""The Triton LoRA deltas (under TRITON_INTERPRET=1) against PyTorch: the kernels alone, and the engine's
LoRABatch applying a step's adapters both ways."""

from __future__ import annotations

import pytest
import torch

from conveyor.engine.lora.adapter import LoRAAdapter, TargetShape
from conveyor.engine.lora.batch import LoRABatch
from conveyor.engine.lora.slots import LoRASlots
from conveyor.kernels.triton_lora import lora_delta_triton

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2}


def reference(x: torch.Tensor, out: torch.Tensor, col: int, a: torch.Tensor, b: torch.Tensor,
              rows: torch.Tensor, starts: list[int], slots: list[int], ranks: list[int], scales: list[float],
              ) -> torch.Tensor:
    expected = out.float().clone()
    for s, slot in enumerate(slots):
        r, seg_rows = ranks[s], rows[starts[s]:starts[s + 1]]
        if r == 0:
            continue
        delta = (x[seg_rows].float() @ a[slot, :r].float().t()) @ b[slot, :, :r].float().t() * scales[s]
        expected[seg_rows, col:col + b.shape[1]] += delta
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_segments_of_several_slots_ranks_and_an_offset(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, k, n, slots_total, max_rank, offset = 70, 96, 80, 3, 20, 24
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    out = torch.randn(tokens, offset + n + 8, generator=gen).to(dtype)  # columns on both sides untouched
    a = (torch.randn(slots_total, max_rank, k, generator=gen) * 0.1).to(dtype)
    b = (torch.randn(slots_total, n, max_rank, generator=gen) * 0.1).to(dtype)
    rows = torch.randperm(tokens, generator=gen)[:57]  # gathered, out of order; 13 rows use no adapter
    # four segments: rows[0:20] slot 2 at rank 20, rows[20:21] slot 0, rows[21:40] an adapter that does not
    # target this projection (rank 0), rows[40:57] slot 2 again at rank 16
    starts, slots, ranks, scales = [0, 20, 21, 40, 57], [2, 0, 1, 2], [20, 7, 0, 16], [2.0, 0.5, 1.0, 1.5]
    expected = reference(x, out, offset, a, b, rows, starts, slots, ranks, scales)
    got = out.clone()
    lora_delta_triton(x, got, offset, a, b, rows, starts, slots, ranks, scales)
    assert (got.float() - expected).abs().max().item() <= TOLERANCE[dtype]
    untouched = torch.ones(tokens, dtype=torch.bool)
    untouched[rows[:21]] = untouched[rows[40:]] = False
    assert torch.equal(got[untouched], out[untouched])  # the rank-0 segment and the base rows
    assert torch.equal(got[:, :offset], out[:, :offset])
    assert torch.equal(got[:, offset + n:], out[:, offset + n:])


def random_adapter(name: str, rank: int, shapes: dict[str, TargetShape], targets: list[str], seed: int,
                   ) -> LoRAAdapter:
    gen = torch.Generator().manual_seed(seed)
    weights = {(layer, t): (torch.randn(rank, shapes[t].in_features, generator=gen) * 0.1,
                            torch.randn(shapes[t].out_features, rank, generator=gen) * 0.1)
               for layer in range(2) for t in targets}
    return LoRAAdapter(name, rank, 2.0, weights)


def test_a_step_of_adapters_and_base_rows_applies_alike_both_ways() -> None:
    h, q, kv, inner = 32, 32, 16, 48
    shapes = {"q_proj": TargetShape(h, q), "k_proj": TargetShape(h, kv), "v_proj": TargetShape(h, kv),
              "o_proj": TargetShape(q, h), "gate_proj": TargetShape(h, inner),
              "up_proj": TargetShape(h, inner), "down_proj": TargetShape(inner, h)}
    slots = LoRASlots(3, 16, shapes, 2, torch.float32, torch.device("cpu"))
    first = slots.place("qv", random_adapter("qv", 8, shapes, ["q_proj", "v_proj"], 1), keep=set())
    second = slots.place("all", random_adapter("all", 16, shapes, list(shapes), 2), keep=set())
    chunk_slots, lengths = [first, None, second, first, None], [9, 4, 1, 17, 3]
    x = torch.randn(sum(lengths), h)
    for group, width in (("qkv", q + 2 * kv), ("gate_up", 2 * inner)):
        by_torch, by_triton = torch.zeros(sum(lengths), width), torch.zeros(sum(lengths), width)
        for out, triton in ((by_torch, False), (by_triton, True)):
            batch = LoRABatch.of_chunks(slots, chunk_slots, lengths, torch.device("cpu"), triton=triton)
            assert batch is not None
            batch.apply(1, group, x, out)
        assert by_torch.abs().max() > 0.1, "the adapters add something"
        torch.testing.assert_close(by_triton, by_torch, atol=1e-5, rtol=1e-5)
    one = LoRABatch.of_chunks(slots, [second, second], [5, 6], torch.device("cpu"), triton=True)
    assert one is not None and one.rows is not None and one.rows.tolist() == list(range(11))
