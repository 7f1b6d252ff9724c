"""The device's LoRA weights: a fixed pool of `max_loras` slots, one stacked tensor pair per (layer, fused
projection), allocated once, so loading an adapter is a copy and a step finds every adapter it needs in
place.

The weights are packed by the decoder's fused projections (GROUPS): a slot of an adapter of rank r holds, for
the qkv group, A = [A_q; A_k; A_v] (3r rows) and B block-diagonal (B_q in q's output rows and columns 0..r,
B_k in k's rows and columns r..2r, ...), zeros elsewhere, so one shrink and one expand serve the three
projections: x @ A.T @ B.T is [x A_q.T B_q.T | x A_k.T B_k.T | x A_v.T B_v.T]. A projection the adapter does
not target (in that layer) is a zero block; a group it does not target at all is skipped (width 0).

`place` puts an adapter into a free slot, else into the least recently used one whose adapter the step does
not need, zeroing all the previous adapter left (the batched path of engine/lora/batch.py reads a slot up to
the widest adapter of its step). The scheduler keeps the adapters of the running requests
within `max_loras` (engine/scheduler.py), so a step's adapters always fit.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from conveyor.engine.lora.adapter import TARGETS, LoRAAdapter, TargetShape

# A fused projection of the decoder -> the PEFT projections inside it, in order along its output rows.
GROUPS: dict[str, tuple[str, ...]] = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                                      "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


@dataclass(frozen=True)
class GroupPart:
    target: str  # the PEFT projection
    start: int  # its output columns in the fused projection's output: [start, end)
    end: int


@dataclass
class SlotState:
    key: str | None = None  # the adapter's key (engine/lora/manager.py), None: free
    scale: float = 0.0
    # (layer, group) -> the rows of A (columns of B) in use: parts x rank where the adapter targets any of
    # the group's projections in that layer; absent: nothing to add there
    widths: dict[tuple[int, str], int] = field(default_factory=dict)
    last_used: int = 0


class LoRASlots:
    def __init__(self, max_loras: int, max_rank: int, shapes: dict[str, TargetShape], num_layers: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        assert max_loras >= 1 and max_rank >= 1 and set(shapes) <= set(TARGETS)
        self.max_rank = max_rank
        # The groups whose projections the model lets adapters target (an MoE model: attention only).
        self.groups = {group: _parts(targets, shapes) for group, targets in GROUPS.items()
                       if all(target in shapes for target in targets)}
        assert {t for targets in (GROUPS[g] for g in self.groups) for t in targets} == set(shapes), shapes
        # (layer, group) -> A [max_loras, parts * max_rank, in], B [max_loras, out, parts * max_rank]
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for layer, (group, parts) in itertools.product(range(num_layers), self.groups.items()):
            width, in_features = len(parts) * max_rank, shapes[parts[0].target].in_features
            self.a[(layer, group)] = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
            self.b[(layer, group)] = torch.zeros(max_loras, parts[-1].end, width, dtype=dtype, device=device)
        self.states = [SlotState() for _ in range(max_loras)]
        self._clock = itertools.count(1)

    def slot_of(self, key: str) -> int | None:
        return next((i for i, state in enumerate(self.states) if state.key == key), None)

    def touch(self, slot: int) -> None:
        self.states[slot].last_used = next(self._clock)

    def place(self, key: str, adapter: LoRAAdapter, keep: set[str]) -> int:
        """Copies `adapter` into a free slot, else the least recently used one not holding a key in `keep`."""
        slot = self._victim(keep)
        r = adapter.rank
        widths: dict[tuple[int, str], int] = {}
        for (layer, group), a_all in self.a.items():
            parts = self.groups[group]
            mine = [(i, part, adapter.weights.get((layer, part.target))) for i, part in enumerate(parts)]
            a_all[slot].zero_()  # all of it: the batched path reads up to the widest adapter of a step
            self.b[(layer, group)][slot].zero_()
            if all(weights is None for _, _, weights in mine):
                continue
            width = len(parts) * r
            b_slot = self.b[(layer, group)][slot, :, :width]
            for i, part, weights in mine:
                if weights is not None:
                    a_all[slot, i * r:(i + 1) * r].copy_(weights[0])  # [r, in]
                    b_slot[part.start:part.end, i * r:(i + 1) * r].copy_(weights[1])  # [out, r]
            widths[(layer, group)] = width
        self.states[slot] = SlotState(key, adapter.scale, widths)
        self.touch(slot)
        return slot

    def drop(self, key: str) -> None:
        """Frees the slot holding `key`, if any (its weights are overwritten by the next adapter placed)."""
        slot = self.slot_of(key)
        if slot is not None:
            self.states[slot] = SlotState()

    def _victim(self, keep: set[str]) -> int:
        free = [i for i, state in enumerate(self.states) if state.key is None]
        if free:
            return free[0]
        unneeded = [i for i, state in enumerate(self.states) if state.key not in keep]
        assert unneeded, "more adapters in one step than LoRA slots (the scheduler keeps them within)"
        return min(unneeded, key=lambda i: self.states[i].last_used)


def _parts(targets: tuple[str, ...], shapes: dict[str, TargetShape]) -> list[GroupPart]:
    parts, start = [], 0
    for target in targets:
        end = start + shapes[target].out_features
        parts.append(GroupPart(target, start, end))
        start = end
    return parts
