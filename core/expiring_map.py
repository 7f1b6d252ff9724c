"""A thread-safe map whose entries expire a fixed time after the value they hold was read, that holds at most
`max_entries`, and that can be told to forget: what the per-process caches of API keys and tenant limits
stand on (core/store/auth_cache.py).

Filling it is two steps, so that an invalidation is never undone by a read in flight:

    ticket = cache.ticket()        # before reading the source
    value = read_the_source()
    cache.put(key, value, ticket)  # stored only if nothing was dropped since the ticket

- Staleness counts from the ticket, i.e. from before the read, not from the store: an entry is never
  older than `ttl_s`, however long the read took.
- The ticket carries the map's generation, bumped by every `drop` and `clear`. A value read before an
  invalidation and stored after it (the read raced the change) is turned away.

NOTE: the generation is the map's, not the key's: dropping one key also turns away the reads in flight of
every other key. They are read again at their next miss; invalidations (revocations, limit changes) are
rare, lookups many, and one counter cannot miss a race that a counter per key could (a key dropped, then
forgotten by eviction, loses its counter).

Full, the map evicts the entry stored longest ago: every entry lives equally long, so it is about the first
to expire anyway. Expired entries are removed when read, or evicted; either way never more than
`max_entries` are kept.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(frozen=True)
class Ticket:
    """Taken before reading the source: when the read began, and the generation it began in."""

    generation: int
    read_at: float


class ExpiringMap(Generic[K, V]):
    def __init__(self, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic) -> None:
        """`ttl_s` 0: the map keeps nothing (every `put` is turned away)."""
        if not 0 <= ttl_s < float("inf"):
            raise ValueError(f"ttl_s: must be a finite number of seconds >= 0, got {ttl_s!r}")
        if max_entries < 1:
            raise ValueError(f"max_entries: must be at least 1, got {max_entries!r}")
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[K, tuple[float, V]] = {}  # key -> (expires_at, value), oldest stored first
        self._generation = 0

    def get(self, key: K) -> V | None:
        """The value while it is fresh, else None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            expires_at, value = entry
            if self._clock() < expires_at:
                return value
            del self._entries[key]
            return None

    def ticket(self) -> Ticket:
        with self._lock:
            return Ticket(self._generation, self._clock())

    def put(self, key: K, value: V, ticket: Ticket) -> bool:
        """Keeps `value`, read under `ticket`, until ticket.read_at + ttl_s; False (nothing kept) when the
        map was invalidated since the ticket, or that time has already passed."""
        expires_at = ticket.read_at + self._ttl_s
        with self._lock:
            if ticket.generation != self._generation or self._clock() >= expires_at:
                return False
            self._entries.pop(key, None)  # stored again: now the newest
            while len(self._entries) >= self._max_entries:
                del self._entries[next(iter(self._entries))]
            self._entries[key] = (expires_at, value)
            return True

    def drop(self, key: K) -> None:
        """Forgets `key`, and turns away every read in flight."""
        with self._lock:
            self._generation += 1
            self._entries.pop(key, None)

    def clear(self) -> None:
        """Forgets everything, and turns away every read in flight."""
        with self._lock:
            self._generation += 1
            self._entries.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
