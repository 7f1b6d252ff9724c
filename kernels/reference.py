"""Pure-PyTorch paged attention and cache writes: the `torch` backend and the oracle for the Triton kernels.

Vectorised in groups of sequences: decodes (query length 1) and prefill chunks are grouped apart, sorted by
context length and cut into groups whose padded working set stays under GROUP_BUDGET_ELEMENTS, so a long
prefill never pads the decodes to its length and a decode batch never pads to its longest context. Each group
gathers its K/V through the block table at block granularity and runs one batched masked SDPA (fp32).
NOTE: the bounded groups also make CPU decoding about 2x faster: allocations of tens of MB are fresh mmaps
whose page faults cost more than the attention itself, while small buffers are reused by the allocator.
"""

from __future__ import annotations

import torch

from kernels.checks import check_paged_attention, check_reshape_and_cache

GROUP_BUDGET_ELEMENTS = 1 << 21  # fp32 elements of padded K/V, scores and mask per group (8 MiB)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    check_paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                          max_query_len, max_seq_len, out)
    out = torch.empty_like(q) if out is None else out
    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    row_elements = k_cache.shape[2] * k_cache.shape[3]  # Hkv * D per cached token
    for group in _group_sequences(query_lens.tolist(), seq_lens.tolist(), row_elements, q.shape[1]):
        seq_ids = torch.tensor(group, device=q.device)  # [G]
        _attend_group(q, k_cache, v_cache, block_table[seq_ids], seq_lens[seq_ids],
                      query_start_loc[seq_ids], query_lens[seq_ids], scale, out)
    return out


def _group_sequences(
    query_lens: list[int], seq_lens: list[int], row_elements: int, num_heads: int
) -> list[list[int]]:
    """Sequence ids in groups: decodes apart from prefills, by context length, each padded group bounded."""
    order = sorted((s for s in range(len(query_lens)) if query_lens[s] > 0),
                   key=lambda s: (query_lens[s] > 1, seq_lens[s]))
    groups: list[list[int]] = []
    max_q = 0
    for s in order:
        group = groups[-1] if groups else []
        same_kind = bool(group) and (query_lens[group[0]] > 1) == (query_lens[s] > 1)
        grown_q = max(max_q, query_lens[s])
        # Per sequence: K and V rows, plus scores and mask per query row (sorted: s has the longest context).
        padded = (len(group) + 1) * seq_lens[s] * (2 * row_elements + 2 * num_heads * grown_q)
        if same_kind and padded <= GROUP_BUDGET_ELEMENTS:
            group.append(s)
            max_q = grown_q
        else:
            groups.append([s])
            max_q = query_lens[s]
    return groups


def _attend_group(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [G, max_blocks]
    seq_lens: torch.Tensor,  # [G]
    query_starts: torch.Tensor,  # [G]
    query_lens: torch.Tensor,  # [G]
    scale: float,
    out: torch.Tensor,  # [T, Hq, D], written at this group's tokens
) -> None:
    num_seqs, num_heads, head_dim = query_lens.shape[0], q.shape[1], q.shape[2]
    max_q, max_kv = int(query_lens.max()), int(seq_lens.max())
    seq_of_token, row_of_token, token_ids = _token_layout(query_starts, query_lens)  # [Tg] each

    k = _gather_contiguous(k_cache, block_table, max_kv)  # [G, L, Hkv, D] fp32
    v = _gather_contiguous(v_cache, block_table, max_kv)
    q_pad = q.new_zeros(num_seqs, max_q, num_heads, head_dim, dtype=torch.float32)  # [G, Qp, Hq, D]
    q_pad[seq_of_token, row_of_token] = q[token_ids].float()

    q_pos = (seq_lens - query_lens)[:, None] + torch.arange(max_q, device=q.device)  # [G, Qp]
    k_pos = torch.arange(max_kv, device=q.device)  # [L]
    # Padded query rows get q_pos >= seq_len, so they still see every valid key: no all-masked row, no NaN.
    allowed = (k_pos <= q_pos[:, :, None]) & (k_pos < seq_lens[:, None, None])  # [G, Qp, L]

    # SDPA repeats each KV head over its query heads (h -> h // group) without copying K/V.
    o = torch.nn.functional.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [G, H, Qp|L, D]
        attn_mask=allowed[:, None], scale=scale, enable_gqa=True,
    ).transpose(1, 2)  # [G, Qp, Hq, D]
    out[token_ids] = o[seq_of_token, row_of_token].to(out.dtype)


def _token_layout(
    query_starts: torch.Tensor, query_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every query token of the group: its sequence (within the group), its row, its index in q."""
    lens = query_lens.long()
    seq_of_token = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens)  # [Tg]
    first_token = torch.cumsum(lens, 0) - lens  # [G], position of each sequence in the group's tokens
    row_of_token = torch.arange(seq_of_token.shape[0], device=lens.device) - first_token[seq_of_token]
    token_ids = query_starts.long()[seq_of_token] + row_of_token
    return seq_of_token, row_of_token, token_ids


def _gather_contiguous(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[G, length, Hkv, D] fp32: each sequence's first `length` cache rows, read through its block table."""
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    used = -(-length // block_size)
    # Entries past a sequence's last block may hold anything (padding); their rows are masked out anyway.
    blocks = block_table[:, :used].long().clamp(0, num_blocks - 1)  # [G, nb]
    # index_select over whole blocks: one contiguous copy per block, the cheapest gather on CPU.
    rows = cache.reshape(num_blocks, -1).index_select(0, blocks.flatten())  # [G * nb, block_size * Hkv * D]
    rows = rows.view(blocks.shape[0], used * block_size, *cache.shape[2:])[:, :length]  # [G, L, Hkv, D]
    return rows.float()


def reshape_and_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes k, v [T, Hkv, D] at slot_mapping[t] = block * block_size + offset; skips negative slots."""
    check_reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0  # [T]
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)
