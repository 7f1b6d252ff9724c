"""The device's LoRA weights: a fixed pool of `max_loras` slots, one stacked tensor pair per (layer,
projection), allocated once, so loading an adapter is a copy and a step finds every adapter it needs in
place.

A slot holds one adapter (its rank's first rows of A, first columns of B; the rest is never read) and the
projections it targets. `place` puts an adapter into a free slot, else into the least recently used one whose
adapter the step does not need. The scheduler keeps the adapters of the running requests within
`max_loras` (engine/scheduler.py), so a step's adapters always fit.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.lora.adapter import TARGETS, LoRAAdapter, TargetShape

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
    key: str | None = None  # the adapter's key (engine/lora/registry.py), None: free
    rank: int = 0
    scale: float = 0.0
    targets: frozenset[str] = frozenset()
    last_used: int = 0


class LoRASlots:
    def __init__(self, max_loras: int, max_rank: int, shapes: dict[str, TargetShape], num_layers: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        assert max_loras >= 1 and max_rank >= 1 and set(shapes) == set(TARGETS)
        self.max_rank = max_rank
        # (layer, target) -> A [max_loras, max_rank, in], B [max_loras, out, max_rank]
        self.a = {(layer, t): torch.zeros(max_loras, max_rank, s.in_features, dtype=dtype, device=device)
                  for layer in range(num_layers) for t, s in shapes.items()}
        self.b = {(layer, t): torch.zeros(max_loras, s.out_features, max_rank, dtype=dtype, device=device)
                  for layer in range(num_layers) for t, s in shapes.items()}
        self.groups = {group: _parts(targets, shapes) for group, targets in GROUPS.items()}
        self.states = [SlotState() for _ in range(max_loras)]
        self._clock = itertools.count(1)

    def slot_of(self, key: str) -> int | None:
        return next((i for i, state in enumerate(self.states) if state.key == key), None)

    def touch(self, slot: int) -> None:
        self.states[slot].last_used = next(self._clock)

    def place(self, key: str, adapter: LoRAAdapter, keep: set[str]) -> int:
        """Copies `adapter` into a free slot, else the least recently used one not holding a key in `keep`."""
        slot = self._victim(keep)
        for (layer, target), (a, b) in adapter.weights.items():
            self.a[(layer, target)][slot, : adapter.rank].copy_(a)
            self.b[(layer, target)][slot, :, : adapter.rank].copy_(b)
        self.states[slot] = SlotState(key, adapter.rank, adapter.scale, frozenset(adapter.targets))
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
