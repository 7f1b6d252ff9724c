"""The n-gram proposer (prompt lookup): the sequence's last n tokens, looked up among its earlier tokens
(prompt and output), propose the tokens that followed their latest earlier occurrence, or their first when the
latest is too recent to be followed by a whole draft (inside a run that repeats: "0000", a list's pattern).

Lengths max_ngram down to min_ngram are tried, longest first: a longer match is better evidence. The index
maps each n-gram to where its first and latest occurrences end, and is extended as the sequence grows, so a
lookup costs a few dict probes however long the sequence is.
"""

from __future__ import annotations

from conveyor.engine.sequence import Sequence


class NgramDrafter:
    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []  # the sequence's tokens seen so far
        # n-gram -> index just past its first and its latest occurrence, over occurrences that end before the
        # last token (the current suffix must find an earlier copy of itself, not itself).
        self._first_end: dict[tuple[int, ...], int] = {}
        self._latest_end: dict[tuple[int, ...], int] = {}
        self._num_indexed_ends = 0

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to max_tokens drafts following seq's tokens; [] when no n-gram recurs."""
        self.tokens += seq.token_slice(len(self.tokens), seq.num_tokens)
        self._index_until(len(self.tokens) - 1)
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            key = tuple(tokens[-n:])
            end = self._latest_end.get(key)
            if end is None:
                continue
            if end + max_tokens > len(tokens):
                end = self._first_end[key]
            return tokens[end : end + max_tokens]
        return []

    def _index_until(self, last_end: int) -> None:
        """Indexes the n-grams ending (exclusive) at every index up to last_end."""
        tokens = self.tokens
        for end in range(self._num_indexed_ends + 1, last_end + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(tokens[end - n : end])
                self._first_end.setdefault(key, end)
                self._latest_end[key] = end
        self._num_indexed_ends = max(self._num_indexed_ends, last_end)
