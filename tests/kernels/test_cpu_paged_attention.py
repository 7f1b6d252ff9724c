"""The cpu backend: the C++ decode kernel against the reference, its plan, its checks and its fallback.

These tests need the CPU kernels built (the first run on a machine compiles them, ~20-40 s); where they cannot
be built (no C++ compiler, a CPU without AVX2) test_cpu_extension.py's build test fails and says why, and
these are skipped.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.cpu_paged_attention import (
    CpuAttentionPlan,
    paged_attention_cpu,
    plan_paged_attention_cpu,
)
from conveyor.kernels.paged_attention import paged_attention, plan_paged_attention, reshape_and_cache

STEPS = {
    "decodes only": ([1, 1, 1, 1], [5, 40, 17, 300]),
    "decodes and prefill chunks": ([3, 1, 0, 1, 7, 16], [8, 20, 4, 33, 7, 50]),
    "one token long context": ([1], [1000]),
    "block-aligned contexts": ([1, 1], [16, 32]),
}


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize(("heads", "head_dim", "block_size"), [((4, 2), 64, 16), ((8, 1), 32, 8),
                                                               ((2, 2), 128, 32)])
def test_matches_the_reference(built, paged_batch, step, heads, head_dim, block_size) -> None:
    query_lens, seq_lens = STEPS[step]
    batch = paged_batch(query_lens, seq_lens, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                        block_size=block_size, seed=len(step))
    expected = paged_attention(*batch.args(), backend="torch")
    got = paged_attention(*batch.args(), backend="cpu")
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_half_precision_caches_accumulate_in_fp32(built, paged_batch, dtype, atol) -> None:
    batch = paged_batch([1, 2, 1], [70, 9, 33], dtype=dtype)
    expected = paged_attention(*batch.args(), backend="torch")
    got = paged_attention(*batch.args(), backend="cpu")
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0)


def test_strided_queries_and_a_given_out(built, paged_batch) -> None:
    batch = paged_batch([1, 4, 1], [25, 4, 60])
    fused = torch.cat([batch.q, torch.randn_like(batch.q)], dim=1)  # q as a view of a wider projection
    q = fused[:, : batch.q.shape[1]]
    assert not q.is_contiguous()
    out = torch.full_like(batch.q, float("nan"))
    result = paged_attention(q, batch.k_cache, batch.v_cache, batch.meta(), batch.scale, out,
                                     backend="cpu")
    assert result is out
    torch.testing.assert_close(out, paged_attention(*batch.args(), backend="torch"))


def test_the_plan_sends_short_queries_to_the_kernel_row_by_row_and_the_rest_to_the_reference(
    built, paged_batch
) -> None:
    batch = paged_batch([1, 5, 1, 0, 20], [30, 5, 7, 3, 40])
    plan = plan_paged_attention(batch.k_cache, batch.meta(), batch.q.shape[1], backend="cpu")
    assert isinstance(plan, CpuAttentionPlan)
    # Sequence 1's five queries (a token and four drafts) are rows 1..5 of q, each seeing the keys up to it.
    assert plan.decode_rows.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert plan.decode_seq_lens.tolist() == [30, 1, 2, 3, 4, 5, 7]
    assert [g.num_seqs for g in plan.rest.groups] == [1]  # the 20-token chunk alone
    one_plan = paged_attention(*batch.args(plan), backend="cpu")
    torch.testing.assert_close(one_plan, paged_attention(*batch.args(), backend="torch"))


def test_a_head_dim_the_kernel_cannot_vectorise_goes_to_the_reference(built, paged_batch) -> None:
    batch = paged_batch([1, 1], [20, 9], head_dim=12)
    plan = plan_paged_attention(batch.k_cache, batch.meta(), batch.q.shape[1], backend="cpu")
    assert plan.decode_rows.numel() == 0 and sum(g.num_seqs for g in plan.rest.groups) == 2
    torch.testing.assert_close(paged_attention(*batch.args(), backend="cpu"),
                               paged_attention(*batch.args(), backend="torch"))


def test_plans_are_not_interchangeable_between_backends(built, paged_batch) -> None:
    batch = paged_batch([1, 3], [10, 3])
    reference_plan = plan_paged_attention(batch.k_cache, batch.meta(), 4, backend="torch")
    cpu_plan = plan_paged_attention(batch.k_cache, batch.meta(), 4, backend="cpu")
    with pytest.raises(ValueError, match="plan: built for another backend"):
        paged_attention(*batch.args(reference_plan), backend="cpu")
    with pytest.raises(ValueError, match="plan: built for another backend"):
        paged_attention(*batch.args(cpu_plan), backend="torch")


def test_a_block_id_beyond_the_cache_is_an_error_not_a_wild_read(built, paged_batch) -> None:
    batch = paged_batch([1], [40])
    batch.block_tables[0, 1] = batch.k_cache.shape[0] + 5
    with pytest.raises(RuntimeError, match=r"block_tables\[0, 1\].*outside the cache"):
        paged_attention(*batch.args(), backend="cpu")


def test_non_contiguous_caches_are_refused(built, paged_batch) -> None:
    batch = paged_batch([1], [20])
    strided = torch.cat([batch.k_cache, batch.k_cache], dim=3)[..., : batch.k_cache.shape[3]]
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention(batch.q, strided, batch.v_cache, batch.meta(), batch.scale, backend="cpu")





WINDOW_STEPS = {
    # name: (query_lens, seq_lens, Hq, Hkv, D, block_size, window, softcap); D: a multiple of the lanes
    "decodes_and_chunks_window_5_unaligned": ([1, 6, 1, 3, 0, 1], [40, 6, 23, 30, 9, 5], 4, 2, 32, 8, 5,
                                              None),
    "window_above_every_context": ([1, 4, 1], [12, 20, 7], 4, 2, 32, 8, 64, None),
    "window_1": ([1, 5, 1], [17, 5, 30], 4, 2, 32, 8, 1, None),
    "window_on_a_block_boundary": ([1, 1], [48, 33], 4, 2, 32, 16, 16, None),
    "gqa4_window_13": ([1, 1, 9], [35, 50, 9], 8, 2, 64, 16, 13, None),
    "softcap_alone": ([1, 7, 1], [33, 7, 12], 4, 2, 32, 8, None, 0.3),
    "softcap_and_window": ([1, 7, 1, 1], [33, 7, 26, 12], 8, 2, 32, 8, 7, 0.4),
}


@pytest.mark.parametrize("step", WINDOW_STEPS.values(), ids=WINDOW_STEPS.keys())
def test_window_and_softcap_match_the_dense_oracle(built, paged_batch, dense_oracle, tolerance, step) -> None:
    *shape, window, softcap = step
    batch = paged_batch(*shape, seed=3)
    expected = dense_oracle(batch, window, softcap)
    plan = plan_paged_attention_cpu(batch.k_cache, batch.meta(), batch.q.shape[1], window=window)
    assert plan.window == window and plan.decode_rows.numel() >= 1  # the C++ kernel takes the decodes
    got = paged_attention_cpu(*batch.args(plan), window=window, softcap=softcap)
    err = (got - expected).abs().max().item()
    assert err <= tolerance[torch.float32], f"max abs error {err:.3g}"
    unplanned = paged_attention_cpu(*batch.args(), window=window, softcap=softcap)
    assert torch.equal(unplanned, got)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_window_and_softcap_in_half_precision(built, paged_batch, dense_oracle, dtype) -> None:
    batch = paged_batch([1, 3, 1], [70, 9, 33], dtype=dtype)
    got = paged_attention_cpu(*batch.args(), window=20, softcap=0.5)
    expected = dense_oracle(batch, 20, 0.5)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-3 if dtype == torch.float16 else 1e-2,
                               rtol=0)


@pytest.mark.parametrize("poison", [False, True], ids=["minus_one", "stale_nan_block"])
def test_blocks_before_the_window_are_never_read(
        built, paged_batch, dense_oracle, free_blocks, poison) -> None:
    window, softcap = 11, 0.5
    batch = paged_batch([1, 4, 1, 1], [70, 30, 12, 41], head_dim=32, block_size=8)
    expected = dense_oracle(batch, window, softcap)
    before = paged_attention_cpu(*batch.args(), window=window, softcap=softcap)
    assert free_blocks(batch, window, poison=poison) >= 10  # -1 would fail the kernel's block check if read
    got = paged_attention_cpu(*batch.args(), window=window, softcap=softcap)
    assert torch.equal(got, before)
    assert (got - expected).abs().max().item() <= 2e-5


def test_the_kernel_reads_window_0_or_minus_1_and_softcap_0_as_none(built, paged_batch) -> None:
    batch = paged_batch([1, 1], [40, 7], head_dim=32)
    plan = plan_paged_attention_cpu(batch.k_cache, batch.meta(), 4)
    outs = []
    for window in (0, -1):
        out = torch.zeros_like(batch.q)
        built.module.paged_decode(batch.q, batch.k_cache, batch.v_cache, plan.decode_tables,
                                  plan.decode_seq_lens, plan.decode_rows, batch.scale, window, 0.0, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], paged_attention(*batch.args(), backend="torch"))
    with pytest.raises(RuntimeError, match="softcap"):
        built.module.paged_decode(batch.q, batch.k_cache, batch.v_cache, plan.decode_tables,
                                  plan.decode_seq_lens, plan.decode_rows, batch.scale, 0, -1.0,
                                  torch.zeros_like(batch.q))


@pytest.mark.parametrize(("kwargs", "name"), [({"window": 0}, "window"), ({"softcap": -2.0}, "softcap")])
def test_bad_window_or_softcap_is_a_value_error_naming_it(built, paged_batch, kwargs, name) -> None:
    batch = paged_batch([1, 3], [10, 3], head_dim=32)
    with pytest.raises(ValueError, match=name):
        paged_attention_cpu(*batch.args(), **kwargs)


@pytest.mark.parametrize(("planned", "asked"), [(4, None), (None, 4), (4, 8)])
def test_a_plan_for_another_window_is_refused(built, paged_batch, planned, asked) -> None:
    batch = paged_batch([1, 3], [10, 3], head_dim=32)
    plan = plan_paged_attention_cpu(batch.k_cache, batch.meta(), 4, window=planned)
    with pytest.raises(ValueError, match=rf"plan: built for window {planned}.* window {asked}"):
        paged_attention_cpu(*batch.args(plan), window=asked)


def test_threads_share_a_batch_of_uneven_contexts(built, paged_batch) -> None:
    # Long documents first, then short chats, as a step admits them: each thread takes the longest left.
    seq_lens = [900, 700, 800, 650] + [40 + 3 * i for i in range(20)]
    batch = paged_batch([1] * len(seq_lens), seq_lens, seed=3)
    expected = paged_attention(*batch.args(), backend="torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = paged_attention(*batch.args(), backend="cpu")
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("dtype", "block_size", "num_kv_heads", "head_dim"),
                         [(torch.float32, 16, 2, 64), (torch.float16, 32, 3, 24)])
def test_cache_write_matches_the_reference(built, dtype, block_size, num_kv_heads, head_dim,
                                           slot_dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(4, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(4, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    # k and v as views of one fused projection [T, (k|v) * Hkv * D], as the model hands them over.
    kv = torch.randn(6, 2, num_kv_heads, head_dim, generator=gen).to(dtype)
    k, v = kv[:, 0], kv[:, 1]
    slots = [block_size * 3 + 5, -1, 0, block_size * 2 - 1, -5, block_size + 2]
    slots = torch.tensor(slots, dtype=slot_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reshape_and_cache(k, v, expected_k, expected_v, slots, backend="torch")
    reshape_and_cache(k, v, k_cache, v_cache, slots, backend="cpu")
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert torch.equal(k_cache[3, 5], k[0]) and torch.equal(v_cache[1, block_size - 1], v[3])


def test_cache_write_takes_any_layout_and_refuses_slots_beyond_the_cache(built) -> None:
    k_cache, v_cache = torch.zeros(2, 16, 2, 16), torch.zeros(2, 16, 2, 16)
    k = torch.randn(2, 16, 2).transpose(1, 2)  # heads of a token not contiguous: the reference's path
    reshape_and_cache(k, k, k_cache, v_cache, torch.tensor([17, 3]), backend="cpu")
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[0, 3], k[1])
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 32 is outside the cache's 32 slots"):
        reshape_and_cache(torch.ones(2, 2, 16), torch.ones(2, 2, 16), k_cache, v_cache,
                                  torch.tensor([0, 32]), backend="cpu")
