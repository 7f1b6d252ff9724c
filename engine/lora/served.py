"""The LoRA adapters an engine serves, as its callers manage them (LLMEngine.add_lora, remove_lora,
list_loras): added by name, listed, and removed only once no unfinished request names the adapter, so
that it stays served until they finish or are aborted. With LoRA off, adding or removing one is refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from conveyor.engine.lora.manager import LoRAManager


class ServedLoRAs:
    def __init__(self, manager: LoRAManager | None, num_unfinished_with: Callable[[str], int]) -> None:
        """`manager`: the runner's (None: LoRA off); `num_unfinished_with(name)`: the requests waiting or
        running with that adapter."""
        self._manager = manager
        self._num_unfinished_with = num_unfinished_with

    def add(self, name: str, path: str | Path) -> None:
        self._enabled().add(name, path)

    def remove(self, name: str) -> None:
        manager = self._enabled()
        manager.key_of(name)  # unknown: ValueError
        holders = self._num_unfinished_with(name)
        if holders:
            raise ValueError(f"lora {name!r} is used by {holders} unfinished request(s); remove it once they "
                             "finish, or abort them first")
        manager.remove(name)

    def names(self) -> list[str]:
        return self._manager.names() if self._manager is not None else []

    def is_current(self, key: str) -> bool:
        """Whether `key` (a request's registration of its adapter) is still loaded."""
        return self._manager is not None and self._manager.is_current(key)

    def _enabled(self) -> LoRAManager:
        if self._manager is None:
            raise ValueError("LoRA is off: this engine was built with max_loras 0 (or embeds)")
        return self._manager
