"""The PyTorch reference against an independent oracle: per-sequence contiguous K/V + SDPA, causal offset."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import paged_attention_ref, reference, reshape_and_cache_ref


def naive_paged_attention(batch) -> torch.Tensor:
    """One sequence at a time: copy its cache rows out contiguously, then plain SDPA with an explicit mask."""
    out = torch.zeros_like(batch.q)
    block_size = batch.k_cache.shape[1]
    group = batch.q.shape[1] // batch.k_cache.shape[2]
    for s in range(batch.block_tables.shape[0]):
        begin, end = int(batch.query_start_loc[s]), int(batch.query_start_loc[s + 1])
        seq_len, query_len = int(batch.seq_lens[s]), end - begin
        if query_len == 0:
            continue
        positions = torch.arange(seq_len)
        blocks = batch.block_tables[s, positions // block_size].long()
        k = batch.k_cache[blocks, positions % block_size].float()  # [L, Hkv, D]
        v = batch.v_cache[blocks, positions % block_size].float()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = batch.q[begin:end].float().transpose(0, 1)  # [Hq, Q, D]
        query_pos = seq_len - query_len + torch.arange(query_len)
        mask = positions[None, :] <= query_pos[:, None]  # [Q, L]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=batch.scale)
        out[begin:end] = o.transpose(0, 1).to(out.dtype)
    return out


CASES = {
    # name: (query_lens, seq_lens, Hq, Hkv, D, block_size)
    "decode": ([1, 1, 1, 1], [1, 17, 40, 64], 8, 4, 64, 16),
    "prefill": ([9, 20], [9, 20], 4, 4, 64, 16),
    "mixed_chunked": ([12, 1, 5, 0, 1, 3], [12, 33, 29, 7, 70, 40], 8, 1, 32, 32),
    "gqa4_big_blocks": ([3, 1, 6], [3, 50, 40], 8, 2, 128, 64),
}


@pytest.mark.parametrize("budget", [reference.GROUP_BUDGET_ELEMENTS, 1], ids=["grouped", "one_per_group"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_reference_matches_naive_oracle(paged_batch, tolerance, monkeypatch, case, dtype, budget) -> None:
    monkeypatch.setattr(reference, "GROUP_BUDGET_ELEMENTS", budget)
    query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size = case
    batch = paged_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    got = paged_attention_ref(*batch.args())
    assert got.dtype == dtype and got.shape == batch.q.shape
    err = (got.float() - naive_paged_attention(batch).float()).abs().max().item()
    assert err <= tolerance[dtype]


def test_sequences_grouped_by_kind_then_context_length(monkeypatch) -> None:
    query_lens, seq_lens = [1, 7, 1, 0, 1, 3], [90, 7, 10, 5, 40, 30]
    shape = {"row_elements": 8, "num_heads": 2}
    groups = reference._group_sequences(query_lens, seq_lens, **shape, include_decodes=True)
    assert groups == [[2, 4, 0], [1, 5]]  # decodes first, each kind by context length; query length 0 dropped
    prefills = reference._group_sequences(query_lens, seq_lens, **shape, include_decodes=False)
    assert prefills == [[1, 5]]  # the cpu backend's C++ kernel takes the decodes
    # Padded cost per sequence: longest context x (2 * 8 + 2 * 2 * longest query) elements.
    monkeypatch.setattr(reference, "GROUP_BUDGET_ELEMENTS", 2000)
    groups = reference._group_sequences(query_lens, seq_lens, **shape, include_decodes=True)
    assert groups == [[2, 4], [0], [1], [5]]


def test_reference_writes_into_out_and_ignores_block_table_padding(paged_batch) -> None:
    batch = paged_batch([4, 1], [10, 21])
    expected = naive_paged_attention(batch)
    batch.block_tables[0, 1:] = 10_000  # garbage past the sequence's last block must never be read
    out = torch.full_like(batch.q, float("nan"))
    got = paged_attention_ref(*batch.args(), out=out)
    assert got is out
    assert (got - expected).abs().max().item() <= 2e-5


def test_reference_cache_write_skips_negative_slots() -> None:
    k_cache, v_cache = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    slot_mapping = torch.tensor([9, -1, 0, 7], dtype=torch.int64)
    reshape_and_cache_ref(k, v, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache[2, 1], k[0]) and torch.equal(v_cache[2, 1], v[0])
    assert torch.equal(k_cache[0, 0], k[2]) and torch.equal(k_cache[1, 3], k[3])
    written = torch.zeros(3, 4, dtype=torch.bool)
    written[2, 1] = written[0, 0] = written[1, 3] = True
    assert k_cache[~written].abs().sum() == 0 and v_cache[~written].abs().sum() == 0  # slot -1 wrote nothing


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda b: setattr(b, "q", b.q[:, :3]), "q"),  # 3 query heads over 2 KV heads
        (lambda b: setattr(b, "block_tables", b.block_tables.float()), "block_tables"),
        (lambda b: setattr(b, "seq_lens", b.seq_lens[:1]), "seq_lens"),
        (lambda b: setattr(b, "v_cache", b.v_cache.half()), "k_cache/v_cache"),
        (lambda b: setattr(b, "max_seq_len", 10_000), "max_seq_len"),
        (lambda b: setattr(b, "max_seq_len", 6), "max_seq_len"),  # below seq_lens[1] = 9
        (lambda b: b.seq_lens.fill_(1), "query_start_loc"),  # 2 queries but 1 cached token
    ],
)
def test_reference_rejects_bad_inputs_naming_the_field(paged_batch, change, field) -> None:
    batch = paged_batch([2, 1], [5, 9])
    change(batch)
    with pytest.raises(ValueError, match=field):
        paged_attention_ref(*batch.args())


def plan_for(batch, num_heads: int, backend: str = "torch") -> kernels.AttentionPlan | None:
    return kernels.plan_paged_attention(batch.k_cache, batch.meta(), num_heads, backend=backend)


@pytest.mark.parametrize("budget", [reference.GROUP_BUDGET_ELEMENTS, 1], ids=["grouped", "one_per_group"])
def test_one_plan_serves_every_layer_with_the_unplanned_result(paged_batch, monkeypatch, budget) -> None:
    monkeypatch.setattr(reference, "GROUP_BUDGET_ELEMENTS", budget)
    query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size = CASES["mixed_chunked"]
    first = paged_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32)
    # Two layers of one step: the same metadata, other q and caches.
    second = replace(first, q=torch.randn_like(first.q), k_cache=torch.randn_like(first.k_cache),
                     v_cache=torch.randn_like(first.v_cache))
    plan = plan_for(first, num_heads, backend="torch")
    assert plan is not None
    for batch in (first, second):
        planned = kernels.paged_attention(*batch.args(plan=plan), backend="torch")
        assert torch.equal(planned, paged_attention_ref(*batch.args()))


def test_a_plan_for_other_shapes_is_refused(paged_batch) -> None:
    batch = paged_batch([2, 1], [5, 9])
    plan = plan_for(batch, batch.q.shape[1] * 2)
    with pytest.raises(ValueError, match="plan"):
        paged_attention_ref(*batch.args(plan=plan))


def test_triton_plans_nothing_on_the_host(paged_batch) -> None:
    batch = paged_batch([2, 1], [5, 9])
    assert plan_for(batch, batch.q.shape[1], backend="triton") is None


def test_fresh_prefills_run_as_plain_causal_attention_with_the_masked_result(paged_batch) -> None:
    batch = paged_batch([20, 9, 3, 1], [20, 9, 3, 30])  # three chunks from position 0, one decode
    plan = plan_for(batch, batch.q.shape[1])
    prefill = next(g for g in plan.groups if g.max_q > 1)
    assert prefill.num_seqs == 3 and prefill.causal and prefill.mask is None
    masked = replace(prefill, causal=False, mask=reference._visibility_mask(  # group sorted by length
        [2, 1, 0], [20, 9, 3, 1], [20, 9, 3, 30], prefill.max_q, prefill.max_kv, batch.q.device))
    masked_plan = replace(plan, groups=tuple(masked if g is prefill else g for g in plan.groups))
    got = paged_attention_ref(*batch.args(plan=plan))
    assert torch.equal(got, paged_attention_ref(*batch.args(plan=masked_plan)))
    assert (got - naive_paged_attention(batch)).abs().max().item() <= 2e-5
