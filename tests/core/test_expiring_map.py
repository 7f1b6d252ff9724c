"""The map under the auth cache: entries expire ttl_s after they were read (not stored), it holds at most
max_entries (the oldest go first), drop and clear forget at once, and a read that began before an
invalidation is never stored after it; a ttl of 0 keeps nothing; bad arguments are refused."""

from __future__ import annotations

import threading

import pytest

from conveyor.core.expiring_map import ExpiringMap


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_entry_lives_ttl_s_from_its_read_not_from_its_store() -> None:
    clock = FakeClock()
    cache: ExpiringMap[str, int] = ExpiringMap(1.0, 10, clock)
    ticket = cache.ticket()
    clock.now += 0.4  # the read took 0.4 s
    assert cache.put("a", 1, ticket)
    clock.now += 0.5
    assert cache.get("a") == 1
    clock.now += 0.1  # 1.0 s after the read began
    assert cache.get("a") is None and len(cache) == 0


def test_a_read_slower_than_the_ttl_is_not_stored() -> None:
    clock = FakeClock()
    cache: ExpiringMap[str, int] = ExpiringMap(1.0, 10, clock)
    ticket = cache.ticket()
    clock.now += 1.0
    assert not cache.put("a", 1, ticket) and cache.get("a") is None


def test_full_it_evicts_the_entry_stored_longest_ago() -> None:
    cache: ExpiringMap[str, int] = ExpiringMap(60.0, 3, FakeClock())
    for n, key in enumerate("abc"):
        cache.put(key, n, cache.ticket())
    cache.put("a", 10, cache.ticket())  # stored again: now the newest
    cache.put("d", 3, cache.ticket())
    assert [cache.get(key) for key in "abcd"] == [10, None, 2, 3] and len(cache) == 3


def test_a_thousand_misses_never_grow_it_past_max_entries() -> None:
    cache: ExpiringMap[str, int] = ExpiringMap(60.0, 50, FakeClock())
    for n in range(1000):
        cache.put(f"key-{n}", n, cache.ticket())
    assert len(cache) == 50 and cache.get("key-999") == 999 and cache.get("key-949") is None


def test_drop_forgets_one_key_and_clear_every_key() -> None:
    cache: ExpiringMap[str, int] = ExpiringMap(60.0, 10, FakeClock())
    for n, key in enumerate("abc"):
        cache.put(key, n, cache.ticket())
    cache.drop("b")
    assert [cache.get(key) for key in "abc"] == [0, None, 2]
    cache.clear()
    assert [cache.get(key) for key in "abc"] == [None, None, None]


@pytest.mark.parametrize("invalidate", ["drop", "drop_another", "clear"])
def test_a_read_that_began_before_an_invalidation_is_not_stored_after_it(invalidate: str) -> None:
    """The race: a lookup reads the store (the key still active), the revocation commits and its notice
    drops the key, then the lookup stores what it read. It must be turned away."""
    cache: ExpiringMap[str, str] = ExpiringMap(60.0, 10, FakeClock())
    ticket = cache.ticket()  # the lookup begins, then reads "active"
    if invalidate == "clear":
        cache.clear()
    else:
        cache.drop("a" if invalidate == "drop" else "z")
    assert not cache.put("a", "active", ticket)
    assert cache.get("a") is None
    assert cache.put("a", "read again", cache.ticket()) and cache.get("a") == "read again"


def test_a_ttl_of_zero_keeps_nothing() -> None:
    cache: ExpiringMap[str, int] = ExpiringMap(0.0, 10, FakeClock())
    assert not cache.put("a", 1, cache.ticket()) and cache.get("a") is None and len(cache) == 0


@pytest.mark.parametrize(("ttl_s", "max_entries", "field"), [
    (-1.0, 10, "ttl_s"), (float("inf"), 10, "ttl_s"), (float("nan"), 10, "ttl_s"), (1.0, 0, "max_entries")])
def test_bad_arguments_are_refused_naming_them(ttl_s: float, max_entries: int, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        ExpiringMap(ttl_s, max_entries)


def test_threads_reading_while_keys_are_dropped_never_keep_a_read_older_than_its_keys_last_drop() -> None:
    """Lookups run in the thread pool while the listener drops keys. Each lookup here stores the generation
    its ticket saw: at the end, every key kept must have been read after its last drop."""
    cache: ExpiringMap[int, int] = ExpiringMap(60.0, 100)
    stop = threading.Event()
    stored = [0]

    def reader() -> None:
        while not stop.is_set():
            for key in range(10):
                ticket = cache.ticket()
                stored[0] += cache.put(key, ticket.generation, ticket)

    last_drop = dict.fromkeys(range(10), 0)
    threads = [threading.Thread(target=reader) for _ in range(3)]
    for thread in threads:
        thread.start()
    for round_ in range(3000):
        key = round_ % 10
        cache.drop(key)
        last_drop[key] = cache.ticket().generation  # no other thread drops: still the generation of the drop
    stop.set()
    for thread in threads:
        thread.join()
    assert stored[0] > 0
    for key in range(10):
        value = cache.get(key)
        assert value is None or value >= last_drop[key], (key, value, last_drop[key])
