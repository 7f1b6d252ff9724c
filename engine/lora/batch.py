"""One step's LoRA: which token rows use which slot, and the deltas added to a fused projection's output.

The rows of the requests that use an adapter are gathered once per projection input, ordered by slot, so each
slot's rows are one contiguous segment; per segment, two small matmuls (shrink to the rank, expand to the
output: one pair for each fused projection, its parts packed in the slot, engine/lora/slots.py) and the delta
is scattered back into the projection's output. The loop runs over the adapters in the step (at most
max_loras) and the four fused projections, never over requests or tokens. Rows of base-model requests are
left as they are. When every row uses one adapter, nothing is gathered; when padding the segments to the
longest at most doubles the rows, all of them run as two batched matmuls instead (PaddedSegments).

With `triton` (the engine's Triton backend, on CUDA) each fused projection is one launch of each of two
kernels for every adapter of the step at once (kernels/triton_lora.py), reading the rows in place.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from conveyor.engine.lora.slots import LoRASlots


@dataclass(frozen=True)
class Segment:
    slot: int
    start: int  # into `rows` (or into the step's tokens when rows is None): [start, end)
    end: int


@dataclass(frozen=True)
class PaddedSegments:
    """The segments as one batch of equal-length row lists, for two batched matmuls per projection instead
    of two per adapter (on CPU each small op costs more in dispatch than in arithmetic)."""

    index: torch.Tensor  # [S * Lmax] int64: each segment's token rows, padded with row 0
    slots: torch.Tensor  # [S] int64: each segment's slot
    # [S, Lmax, 1]: each segment's adapter's scale at its rows, 0 at the padding (which so adds exact zeros
    # to row 0: cheaper than masking the padding out)
    weights: torch.Tensor

    @classmethod
    def of(cls, slots: LoRASlots, rows: torch.Tensor, segments: list[Segment]) -> PaddedSegments | None:
        """None when padding would more than double the rows computed (a long prefill beside decodes)."""
        longest = max(seg.end - seg.start for seg in segments)
        if len(segments) < 2 or longest * len(segments) > 2 * rows.shape[0]:
            return None
        device = rows.device
        index = torch.zeros(len(segments), longest, dtype=torch.int64, device=device)
        weights = torch.zeros(len(segments), longest, 1, device=device)
        for i, seg in enumerate(segments):
            index[i, : seg.end - seg.start] = rows[seg.start:seg.end]
            weights[i, : seg.end - seg.start] = slots.states[seg.slot].scale
        slot_ids = torch.tensor([seg.slot for seg in segments], device=device)
        return cls(index.flatten(), slot_ids, weights)


@dataclass(frozen=True)
class LoRABatch:
    slots: LoRASlots
    rows: torch.Tensor | None  # [N] int64: the token rows that use an adapter, by slot; None: all, one slot
    segments: list[Segment]
    triton: bool = False  # the deltas by kernels/triton_lora.py (CUDA, or CPU under TRITON_INTERPRET=1)
    padded: PaddedSegments | None = None  # the batched-matmul path's rows (several adapters, little padding)

    @classmethod
    def of_chunks(cls, slots: LoRASlots, chunk_slots: list[int | None], chunk_lengths: list[int],
                  device: torch.device, *, triton: bool = False) -> LoRABatch | None:
        """Each chunk's slot (None: the base model) and its number of tokens, in step order; None when no
        chunk uses an adapter."""
        used = {slot for slot in chunk_slots if slot is not None}
        if not used:
            return None
        if len(used) == 1 and None not in chunk_slots:
            total = sum(chunk_lengths)
            rows = torch.arange(total, device=device) if triton else None  # the kernels read a row list
            return cls(slots, rows, [Segment(used.pop(), 0, total)], triton)
        starts = list(itertools.accumulate(chunk_lengths, initial=0))[:-1]
        adapted = sorted((slot, start, length) for slot, start, length
                         in zip(chunk_slots, starts, chunk_lengths, strict=True) if slot is not None)
        ranges: list[torch.Tensor] = []
        segments: list[Segment] = []
        position = 0
        for slot, group in itertools.groupby(adapted, key=lambda entry: entry[0]):
            begin = position
            for _, start, length in group:
                ranges.append(torch.arange(start, start + length))
                position += length
            segments.append(Segment(slot, begin, position))
        rows = torch.cat(ranges).to(device)
        padded = None if triton else PaddedSegments.of(slots, rows, segments)
        return cls(slots, rows, segments, triton, padded)

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, O] (the fused projection `group` of `layer` applied to x [T, I]) += each row's delta."""
        if self.triton:
            self._apply_triton(layer, group, x, out)
            return
        a_all, b_all = self.slots.a[(layer, group)], self.slots.b[(layer, group)]
        if self.padded is not None:
            self._apply_padded(layer, group, x, out, self.padded)
            return
        xs = x if self.rows is None else x.index_select(0, self.rows)  # [N, I]
        for seg in self.segments:
            state = self.slots.states[seg.slot]
            width = state.widths.get((layer, group))
            if width is None:
                continue
            shrunk = xs[seg.start:seg.end] @ a_all[seg.slot, :width].t()  # [n, parts * r]
            delta = (shrunk @ b_all[seg.slot, :, :width].t()).mul_(state.scale)  # [n, O]
            if self.rows is None:
                out[seg.start:seg.end] += delta
            else:
                out.index_add_(0, self.rows[seg.start:seg.end], delta)

    def _apply_padded(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor,
                      padded: PaddedSegments) -> None:
        """Every segment at once: [S, Lmax, I] @ A.T @ B.T. A slot's rows past its adapter's width, and a
        group it does not target, are zeros (LoRASlots.place), so the widest segment's width serves all."""
        width = max(self.slots.states[seg.slot].widths.get((layer, group), 0) for seg in self.segments)
        if width == 0:
            return
        a = self.slots.a[(layer, group)][:, :width].index_select(0, padded.slots)  # [S, W, I]
        b = self.slots.b[(layer, group)][:, :, :width].index_select(0, padded.slots)  # [S, O, W]
        num_segments = padded.slots.shape[0]
        xs = x.index_select(0, padded.index).view(num_segments, -1, x.shape[1])  # [S, Lmax, I]
        shrunk = torch.bmm(xs, a.transpose(1, 2))  # [S, Lmax, W]
        delta = torch.bmm(shrunk, b.transpose(1, 2)).mul_(padded.weights)  # [S, Lmax, O]
        out.index_add_(0, padded.index, delta.view(-1, delta.shape[2]))

    def _apply_triton(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        from conveyor.kernels.triton_lora import lora_delta_triton

        assert self.rows is not None
        states = [self.slots.states[seg.slot] for seg in self.segments]
        lora_delta_triton(x, out, 0, self.slots.a[(layer, group)], self.slots.b[(layer, group)], self.rows,
                          [self.segments[0].start, *(seg.end for seg in self.segments)],
                          [seg.slot for seg in self.segments],
                          [state.widths.get((layer, group), 0) for state in states],
                          [state.scale for state in states])
