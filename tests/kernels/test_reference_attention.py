"""The PyTorch reference against an independent oracle: per-sequence contiguous K/V + SDPA, causal offset."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from conveyor.kernels import reference
from conveyor.kernels.paged_attention import AttentionPlan, paged_attention, plan_paged_attention
from conveyor.kernels.reference import paged_attention_ref, reshape_and_cache_ref


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
    groups = reference._group_sequences(query_lens, seq_lens, **shape, skip_query_len=0)
    assert groups == [[2, 4, 0], [1, 5]]  # decodes first, each kind by context length; query length 0 dropped
    prefills = reference._group_sequences(query_lens, seq_lens, **shape, skip_query_len=1)
    assert prefills == [[1, 5]]  # the cpu backend's C++ kernel takes the decodes
    # Padded cost per sequence: longest context x (2 * 8 + 2 * 2 * longest query) elements.
    monkeypatch.setattr(reference, "GROUP_BUDGET_ELEMENTS", 2000)
    groups = reference._group_sequences(query_lens, seq_lens, **shape, skip_query_len=0)
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


def plan_for(batch, num_heads: int, backend: str = "torch") -> AttentionPlan | None:
    return plan_paged_attention(batch.k_cache, batch.meta(), num_heads, backend=backend)


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
        planned = paged_attention(*batch.args(plan=plan), backend="torch")
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


# Sliding windows and soft-capping, against the dense oracle (conftest.dense_attention).
WINDOW_CASES = {
    # name: (query_lens, seq_lens, Hq, Hkv, D, block_size, window, softcap)
    "decodes_and_chunks_window_5_unaligned": ([1, 6, 1, 3, 0, 1], [40, 6, 23, 30, 9, 5], 4, 2, 32, 8, 5,
                                              None),
    "window_above_every_context": ([1, 4, 1], [12, 20, 7], 4, 2, 32, 8, 64, None),
    "window_1": ([1, 5, 2], [17, 5, 30], 4, 2, 32, 8, 1, None),
    "gqa4_window_13_across_blocks": ([3, 1, 9], [35, 50, 9], 8, 2, 32, 16, 13, None),
    "fresh_prefills_window_below_chunk": ([20, 9], [20, 9], 4, 4, 32, 16, 6, None),
    "softcap_alone": ([1, 7, 1], [33, 7, 12], 4, 2, 32, 8, None, 0.3),
    "softcap_and_window": ([1, 7, 4, 1], [33, 7, 26, 12], 8, 2, 32, 8, 7, 0.4),
}


def features_matter(batch, window: int | None, softcap: float | None) -> bool:
    """Whether the window hides a key from some query, or a softcap is set: the case can catch their loss."""
    query_lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
    longest_seen = max(n for n, q in zip(batch.seq_lens.tolist(), query_lens, strict=True) if q)
    return softcap is not None or (window is not None and window < longest_seen)


@pytest.mark.parametrize("budget", [reference.GROUP_BUDGET_ELEMENTS, 1], ids=["grouped", "one_per_group"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", WINDOW_CASES.values(), ids=WINDOW_CASES.keys())
def test_reference_window_and_softcap_match_the_dense_oracle(
        paged_batch, dense_oracle, tolerance, monkeypatch, case, dtype, budget) -> None:
    monkeypatch.setattr(reference, "GROUP_BUDGET_ELEMENTS", budget)
    *shape, window, softcap = case
    batch = paged_batch(*shape, dtype=dtype)
    expected = dense_oracle(batch, window, softcap)
    if features_matter(batch, window, softcap):  # the case fails if the window or the cap is dropped
        assert (expected.float() - dense_oracle(batch).float()).abs().max().item() > 1e-2
    got = paged_attention_ref(*batch.args(), window=window, softcap=softcap)
    assert got.dtype == dtype
    err = (got.float() - expected.float()).abs().max().item()
    assert err <= tolerance[dtype], f"max abs error {err:.3g}"
    # A plan built once for the window gives the same result.
    plan = reference.plan_paged_attention_ref(batch.k_cache, batch.meta(), batch.q.shape[1], window=window)
    assert plan.window == window
    assert torch.equal(paged_attention_ref(*batch.args(plan=plan), window=window, softcap=softcap), got)


@pytest.mark.parametrize("poison", [False, True], ids=["minus_one", "stale_nan_block"])
def test_reference_never_reads_blocks_before_the_window(
        paged_batch, dense_oracle, free_blocks, poison) -> None:
    window, softcap = 11, 0.5
    batch = paged_batch([1, 4, 1, 2], [70, 30, 12, 41], num_kv_heads=2, head_dim=32, block_size=8)
    expected = dense_oracle(batch, window, softcap)
    before = paged_attention_ref(*batch.args(), window=window, softcap=softcap)
    assert free_blocks(batch, window, poison=poison) >= 10
    got = paged_attention_ref(*batch.args(), window=window, softcap=softcap)
    assert torch.equal(got, before)
    assert (got - expected).abs().max().item() <= 2e-5


def test_reference_gathers_from_the_window_and_keeps_the_causal_shortcut_only_when_it_covers_all(
        paged_batch) -> None:
    batch = paged_batch([20, 9, 1], [20, 9, 100], head_dim=16, block_size=8)
    covering = reference.plan_paged_attention_ref(batch.k_cache, batch.meta(), 4, window=20)
    prefill = next(g for g in covering.groups if g.max_q > 1)
    assert prefill.causal and prefill.mask is None and covering.window == 20
    narrower = reference.plan_paged_attention_ref(batch.k_cache, batch.meta(), 4, window=19)
    prefill = next(g for g in narrower.groups if g.max_q > 1)
    assert not prefill.causal and prefill.mask is not None  # sorted by length: the 20-token chunk is second
    assert not prefill.mask[1, 0, 19, 0] and prefill.mask[1, 0, 19, 1:].all()
    # The decode at position 99 with window 19 sees keys 81..99: blocks 10..12 of 13, keys from 80 on.
    decode = next(g for g in narrower.groups if g.max_q == 1)
    assert decode.max_kv == 20 and decode.blocks.tolist() == batch.block_tables[2, 10:13].tolist()
    assert decode.mask is not None and decode.mask[0, 0, 0].tolist() == [False] + [True] * 19


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"window": 0}, "window"), ({"window": -4}, "window"), ({"window": 2.5}, "window"),
     ({"window": True}, "window"), ({"softcap": -1.0}, "softcap"), ({"softcap": 0.0}, "softcap"),
     ({"softcap": float("nan")}, "softcap"), ({"softcap": "30"}, "softcap")],
)
def test_bad_window_or_softcap_is_a_value_error_naming_it(paged_batch, kwargs, name) -> None:
    batch = paged_batch([2, 1], [5, 9])
    with pytest.raises(ValueError, match=name):
        paged_attention_ref(*batch.args(), **kwargs)
    if name == "window":
        with pytest.raises(ValueError, match=name):
            reference.plan_paged_attention_ref(batch.k_cache, batch.meta(), 4, **kwargs)


@pytest.mark.parametrize(("planned", "asked"), [(4, None), (None, 4), (4, 8)])
def test_a_plan_for_another_window_is_refused(paged_batch, planned, asked) -> None:
    batch = paged_batch([2, 1], [5, 9])
    plan = reference.plan_paged_attention_ref(batch.k_cache, batch.meta(), 4, window=planned)
    with pytest.raises(ValueError, match=rf"plan: built for window {planned}.* window {asked}"):
        paged_attention_ref(*batch.args(plan=plan), window=asked)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_the_dispatcher_passes_window_and_softcap_to_every_backend(
        paged_batch, dense_oracle, tolerance, request, backend) -> None:
    if backend == "cpu":
        request.getfixturevalue("built")  # skips where the C++ kernels cannot be built
    batch = paged_batch([1, 5, 1], [40, 5, 23], head_dim=32, block_size=8)
    plan = plan_paged_attention(batch.k_cache, batch.meta(), 4, window=6, backend=backend)
    assert plan is None if backend == "triton" else plan.window == 6
    got = paged_attention(*batch.args(plan=plan), window=6, softcap=0.5, backend=backend)
    assert (got - dense_oracle(batch, 6, 0.5)).abs().max().item() <= tolerance[torch.float32]
    with pytest.raises(ValueError, match="window"):
        plan_paged_attention(batch.k_cache, batch.meta(), 4, window=0, backend=backend)
    with pytest.raises(ValueError, match="softcap"):
        paged_attention(*batch.args(), softcap=0.0, backend=backend)
    if plan is not None:
        with pytest.raises(ValueError, match="plan: built for window 6"):
            paged_attention(*batch.args(plan=plan), backend=backend)
