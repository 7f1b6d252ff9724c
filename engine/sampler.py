"""Turns one step's logits into tokens, vectorised over the batch.

Order: logprobs of the raw model distribution; repetition penalty; presence and frequency penalties;
min_tokens masking; grammar masks of constrained rows (so temperature, top-k/p and seeds apply to the allowed
tokens only); greedy rows take the argmax; the other rows get temperature, top-k, top-p, min-p and an
exponential race (argmax p / E with E ~ Exp(1)), which samples exactly from p. A seeded row draws its noise
from its own generator with a shape fixed per row ([V]), so its tokens do not depend on what else is in the
batch.

A row is a sequence, or one row of a speculating sequence (engine/speculation/draft_row.py: the sequence as
if some of its drafts were accepted), sampled alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.engine.speculation.draft_row import SamplingRow
from conveyor.engine.structured_output.mask import apply_grammar_masks


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[dict[int, float] | None]  # per row: {token: logprob} top-n plus the sampled token


class Sampler:
    def __init__(self, device: torch.device | str, seed: int = 0) -> None:
        self.device = torch.device(device)
        self._generator = torch.Generator(self.device).manual_seed(seed)  # for unseeded rows

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, seqs: list[SamplingRow], eos_token_ids: frozenset[int]
    ) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(seqs), f"{tuple(logits.shape)}, {len(seqs)} seqs"
        logits = logits.float()  # [B, V]
        raw_logprobs = logits.log_softmax(dim=-1) if _wants_logprobs(seqs) else None
        logits = _apply_repetition_penalty(logits, seqs)
        logits = _apply_presence_frequency_penalties(logits, seqs)
        logits = _mask_until_min_tokens(logits, seqs, eos_token_ids)
        logits = apply_grammar_masks(logits, seqs)
        tokens = logits.argmax(dim=-1)  # [B]
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if rows:
            row_idx = torch.tensor(rows, device=logits.device)
            tokens[row_idx] = self._sample(logits[row_idx], [seqs[i] for i in rows])
        token_list = tokens.tolist()
        return SamplerOutput(token_list, _gather_logprobs(raw_logprobs, token_list, seqs))

    def _sample(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
        temperature = torch.tensor([s.params.temperature for s in seqs], device=logits.device)
        logits = logits / temperature[:, None]  # [n, V]
        logits = _apply_top_k_top_p(logits, seqs)
        logits = _apply_min_p(logits, seqs)
        probs = logits.softmax(dim=-1)  # [n, V]
        return (probs / self._exponential_noise(probs, seqs)).argmax(dim=-1)

    def _exponential_noise(self, probs: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
        noise = torch.empty_like(probs)  # [n, V]
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        if unseeded:
            idx = torch.tensor(unseeded, device=probs.device)
            noise[idx] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                generator=self._generator
            )
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                noise[i].exponential_(generator=seq.generator)
        return noise


def _wants_logprobs(seqs: list[SamplingRow]) -> bool:
    return any(s.params.logprobs is not None for s in seqs)


def _apply_repetition_penalty(logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
    """As in transformers: seen tokens' logits are divided by the penalty if positive, else multiplied."""
    rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    if not rows:
        return logits
    vocab = logits.shape[1]
    histories = [seqs[i].all_token_ids() for i in rows]
    width = max(len(h) for h in histories)
    # Padded with `vocab`, a column sliced off below.
    ids = torch.full((len(rows), width), vocab, dtype=torch.long)
    for r, history in enumerate(histories):
        ids[r, : len(history)] = torch.tensor(history, dtype=torch.long)
    seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool).scatter_(1, ids, True)[:, :vocab]
    seen = seen.to(logits.device)  # [n, V]
    penalty = torch.tensor([seqs[i].params.repetition_penalty for i in rows], device=logits.device)[:, None]
    row_idx = torch.tensor(rows, device=logits.device)
    sub = logits[row_idx]  # [n, V]
    penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
    logits = logits.clone()
    logits[row_idx] = torch.where(seen, penalised, sub)
    return logits


def _apply_presence_frequency_penalties(logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
    """As in OpenAI, over output tokens only: logits[t] -= frequency_penalty * count(t) + presence_penalty *
    (count(t) > 0). Rows with neither penalty are left as they are; a batch without any costs nothing."""
    rows = [i for i, s in enumerate(seqs) if s.params.presence_penalty or s.params.frequency_penalty]
    if not rows:
        return logits
    counts = _output_token_counts([seqs[i].output_token_ids for i in rows], logits.shape[1], logits.device)
    params = [seqs[i].params for i in rows]
    frequency = torch.tensor([p.frequency_penalty for p in params], device=logits.device)[:, None]  # [n, 1]
    presence = torch.tensor([p.presence_penalty for p in params], device=logits.device)[:, None]  # [n, 1]
    row_idx = torch.tensor(rows, device=logits.device)
    logits = logits.clone()
    logits[row_idx] -= frequency * counts + presence * (counts > 0)  # [n, V]
    return logits


def _output_token_counts(outputs: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[n, V] float32: how often each token occurs in each row's output."""
    width = max(1, max(len(out) for out in outputs))
    # Padded with `vocab`, a column sliced off below.
    ids = torch.full((len(outputs), width), vocab, dtype=torch.long)
    for r, out in enumerate(outputs):
        ids[r, : len(out)] = torch.tensor(out, dtype=torch.long)
    ids = ids.to(device)
    ones = torch.ones(ids.shape, device=device)
    counts = torch.zeros(len(outputs), vocab + 1, device=device).scatter_add_(1, ids, ones)
    return counts[:, :vocab]  # [n, V]


def _mask_until_min_tokens(
    logits: torch.Tensor, seqs: list[SamplingRow], eos_token_ids: frozenset[int]
) -> torch.Tensor:
    rows: list[int] = []
    cols: list[int] = []
    for i, seq in enumerate(seqs):
        if seq.num_output_tokens >= seq.params.min_tokens:
            continue
        banned = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else set(eos_token_ids))
        banned = {t for t in banned if t < logits.shape[1]}
        rows += [i] * len(banned)
        cols += sorted(banned)
    if not rows:
        return logits
    logits = logits.clone()
    logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
    return logits


def _apply_top_k_top_p(logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
    vocab = logits.shape[1]
    top_k = [s.params.top_k if s.params.top_k > 0 else vocab for s in seqs]
    top_p = [s.params.top_p if s.params.top_p < 1.0 else 2.0 for s in seqs]  # 2.0: off, immune to rounding
    if all(k >= vocab for k in top_k) and all(p > 1.0 for p in top_p):
        return logits
    k = torch.tensor(top_k, device=logits.device)[:, None]  # [n, 1]
    p = torch.tensor(top_p, device=logits.device, dtype=logits.dtype)[:, None]  # [n, 1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [n, V]
    ranks = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    outside_p = (probs.cumsum(dim=-1) - probs) >= p
    sorted_logits = sorted_logits.masked_fill(outside_p & (ranks > 0), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _apply_min_p(logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
    min_p = [s.params.min_p for s in seqs]
    if not any(min_p):
        return logits
    probs = logits.softmax(dim=-1)  # [n, V]
    threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=logits.device)[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _gather_logprobs(
    logprobs: torch.Tensor | None, tokens: list[int], seqs: list[SamplingRow]
) -> list[dict[int, float] | None]:
    if logprobs is None:
        return [None] * len(seqs)
    n_max = max(s.params.logprobs or 0 for s in seqs)
    top_vals, top_ids = logprobs.topk(n_max, dim=-1) if n_max else (logprobs[:, :0], logprobs[:, :0].long())
    sampled = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0]  # [B]
    top_vals, top_ids, sampled_list = top_vals.tolist(), top_ids.tolist(), sampled.tolist()
    result: list[dict[int, float] | None] = []
    for i, seq in enumerate(seqs):
        n = seq.params.logprobs
        if n is None:
            result.append(None)
            continue
        entry = dict(zip(top_ids[i][:n], top_vals[i][:n], strict=True))
        entry[tokens[i]] = sampled_list[i]
        result.append(entry)
    return result
