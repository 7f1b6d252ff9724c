"""The LoRA adapters one engine serves: registered by name, kept in host memory, placed into device slots.

`add` reads and checks an adapter against the base model at once, so a bad one is refused before any
request names it. At most `max_cpu_loras` adapters stay in host memory (least recently used dropped, read
from disk again when next needed); at most `max_loras` are on the device (engine/lora/slots.py).

Each registration gets a key, `name#n`, that never repeats: the prefix cache keys blocks by it, so the KV of
an adapter removed and added again under the same name (other weights, perhaps) is never reused.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from conveyor.engine.lora.adapter import LoRAAdapter, TargetShape, load_adapter
from conveyor.engine.lora.batch import LoRABatch
from conveyor.engine.lora.slots import LoRASlots


@dataclass(frozen=True)
class Registration:
    key: str
    path: Path


class LoRAManager:
    def __init__(self, *, max_loras: int, max_rank: int, max_cpu_loras: int, shapes: dict[str, TargetShape],
                 num_layers: int, dtype: torch.dtype, device: torch.device) -> None:
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self._shapes, self._num_layers, self._dtype = shapes, num_layers, dtype
        self.slots = LoRASlots(max_loras, max_rank, shapes, num_layers, dtype, device)
        self._registered: dict[str, Registration] = {}
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # key -> weights, least recent first
        self._serial = itertools.count(1)

    # --- registration --------------------------------------------------------------------------------

    def add(self, name: str, path: str | Path) -> None:
        """Registers the PEFT adapter folder `path` as `name`; ValueError naming what is wrong."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"lora name must be a non-empty string, got {name!r}")
        if name in self._registered:
            raise ValueError(f"lora {name!r} is already loaded; remove it first")
        folder = Path(path)
        adapter = self._read(name, folder)
        key = f"{name}#{next(self._serial)}"
        self._registered[name] = Registration(key, folder)
        self._keep_on_host(key, adapter)

    def remove(self, name: str) -> None:
        key = self.key_of(name)
        del self._registered[name]
        self._host.pop(key, None)
        self.slots.drop(key)

    def key_of(self, name: str) -> str:
        registration = self._registered.get(name)
        if registration is None:
            known = ", ".join(sorted(self._registered)) or "none"
            raise ValueError(f"lora {name!r} is not loaded (loaded: {known})")
        return registration.key

    def is_current(self, key: str) -> bool:
        """Whether `key` is a registration still loaded (not removed since a request took it)."""
        return any(registration.key == key for registration in self._registered.values())

    def names(self) -> list[str]:
        return sorted(self._registered)

    # --- one step ------------------------------------------------------------------------------------

    def batch(self, chunk_keys: list[str | None], chunk_lengths: list[int], device: torch.device, *,
              triton: bool = False) -> LoRABatch | None:
        """The step's LoRABatch, each adapter it needs placed in a slot first (None: no chunk uses one);
        `triton`: its deltas by the Triton kernels."""
        needed = {key for key in chunk_keys if key is not None}
        slot_of: dict[str, int] = {}
        for key in needed:
            slot = self.slots.slot_of(key)
            if slot is None:
                slot = self.slots.place(key, self._adapter(key), keep=needed)
            self.slots.touch(slot)
            slot_of[key] = slot
        chunk_slots = [None if key is None else slot_of[key] for key in chunk_keys]
        return LoRABatch.of_chunks(self.slots, chunk_slots, chunk_lengths, device, triton=triton)

    # --- host memory ---------------------------------------------------------------------------------

    def _adapter(self, key: str) -> LoRAAdapter:
        adapter = self._host.get(key)
        if adapter is not None:
            self._host.move_to_end(key)
            return adapter
        name, registration = next((n, r) for n, r in self._registered.items() if r.key == key)
        adapter = self._read(name, registration.path)  # dropped from host memory earlier: read again
        self._keep_on_host(key, adapter)
        return adapter

    def _read(self, name: str, folder: Path) -> LoRAAdapter:
        return load_adapter(name, folder, self._shapes, self._num_layers, self.max_rank, self._dtype)

    def _keep_on_host(self, key: str, adapter: LoRAAdapter) -> None:
        self._host[key] = adapter
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
