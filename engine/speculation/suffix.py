"""The suffix proposer: a trie of every span of up to max_depth tokens of the request's prompt and output,
each node counting how often its span occurs (and keeping its most frequent child). The longest recent
context found in the trie with a continuation proposes the continuation seen most often after it, token by
token, while the estimated probability of the whole draft (each step's count / its parent's, multiplied)
stays at least min_token_prob (SuffixDecoding's idea, on a depth-bounded trie instead of a suffix tree).

Optionally (SpeculativeConfig.tenant_history) a request also drafts from a trie of recent finished outputs
for the same cache salt and prompt head (TenantHistory): repeated jobs of one tenant tend to answer alike.
The salt keeps tenants apart: a request never drafts from another tenant's outputs.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from conveyor.engine.sequence import Sequence

PROMPT_HEAD_TOKENS = 64  # the prompt tokens that pick a history: the instructions of a repeated job
MAX_HISTORY_KEYS = 1024  # (salt, prompt head) histories kept, least recently used dropped first


class _Node:
    __slots__ = ("best", "best_token", "children", "count", "depth", "total")

    def __init__(self, depth: int) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0  # occurrences of its span
        self.total = 0  # occurrences of its span followed by a token: its children's counts summed
        self.best: _Node | None = None  # its most frequent child (kept as counts grow: a draft is O(length))
        self.best_token = -1
        self.depth = depth

    def count_child(self, token: int) -> _Node:
        child = self.children.get(token)
        if child is None:
            child = self.children[token] = _Node(self.depth + 1)
        child.count += 1
        self.total += 1
        if self.best is None or child.count > self.best.count:
            self.best, self.best_token = child, token
        return child


class SuffixTrie:
    """Every span of up to max_depth consecutive tokens of the texts added, with its count."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(0)
        self._open: list[_Node] = []  # nodes of the current text's suffixes that can still grow

    def extend(self, tokens: list[int]) -> None:
        """Appends tokens to the current text: O(max_depth) per token."""
        for token in tokens:
            grown = []
            for node in [self.root, *self._open]:
                child = node.count_child(token)
                if child.depth < self.max_depth:
                    grown.append(child)
            self._open = grown

    def end_text(self) -> None:
        """The next tokens start a new text (no span crosses the boundary)."""
        self._open = []

    def draft(self, context: list[int], max_tokens: int, min_prob: float) -> tuple[list[int], float]:
        """The draft after the longest of `context`'s suffixes that has one, and its score: the expected
        number of its tokens accepted, each counted with the probability of the draft up to it. A longer
        match is better evidence (trying every length for the best score cost more than it won), but a match
        leaves only max_depth minus its length for the draft: it is at most max_depth - max_tokens long."""
        longest = min(len(context), max(self.max_depth - max_tokens, 1))
        for length in range(longest, 0, -1):
            node = self._find(context[-length:])
            if node is not None and node.children:
                candidate = _follow(node, max_tokens, min_prob)
                if candidate[0]:
                    return candidate
        return [], 0.0

    def _find(self, span: list[int]) -> _Node | None:
        node: _Node | None = self.root
        for token in span:
            node = node.children.get(token)
            if node is None:
                return None
        return node


def _follow(node: _Node, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent path below node, while its probability stays at least min_prob."""
    draft: list[int] = []
    prob, score = 1.0, 0.0
    while len(draft) < max_tokens and node.best is not None:
        prob *= node.best.count / node.total
        if prob < min_prob:
            break
        draft.append(node.best_token)
        score += prob
        node = node.best
    return draft, score


class SuffixDrafter:
    """One request's trie over its prompt and output, plus the tenant's history trie when given."""

    def __init__(self, max_depth: int, min_token_prob: float, history: SuffixTrie | None = None) -> None:
        self.trie = SuffixTrie(max_depth)
        self.min_token_prob = min_token_prob
        self.history = history
        self._num_seen = 0
        self._context: list[int] = []  # the last max_depth tokens

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        new = seq.token_slice(self._num_seen, seq.num_tokens)
        self._num_seen = seq.num_tokens
        # The trie gets the tokens before the last: the context must find earlier copies, not itself.
        if self._context:
            self.trie.extend(self._context[-1:])
        self.trie.extend(new[:-1])
        self._context = (self._context + new)[-self.trie.max_depth :]
        drafts, score = self.trie.draft(self._context, max_tokens, self.min_token_prob)
        if self.history is not None:
            other, other_score = self.history.draft(self._context, max_tokens, self.min_token_prob)
            if other_score > score:
                drafts = other
        return drafts


class TenantHistory:
    """Recent finished outputs, one trie per (cache salt, prompt head), each fed at most `size` outputs."""

    def __init__(self, size: int, max_depth: int) -> None:
        assert size >= 1
        self.size = size
        self.max_depth = max_depth
        self._tries: OrderedDict[bytes, tuple[SuffixTrie, int]] = OrderedDict()

    def trie_for(self, seq: Sequence) -> SuffixTrie:
        """The trie seq drafts from (made empty when its key is new)."""
        key = _history_key(seq)
        if key not in self._tries:
            self._tries[key] = (SuffixTrie(self.max_depth), 0)
            if len(self._tries) > MAX_HISTORY_KEYS:
                self._tries.popitem(last=False)
        self._tries.move_to_end(key)
        return self._tries[key][0]

    def add_output(self, seq: Sequence) -> None:
        """Feeds a finished request's output to its key's trie, until that trie has `size` outputs (then
        a new trie starts, so old answers fade out)."""
        key = _history_key(seq)
        trie, count = self._tries.get(key, (SuffixTrie(self.max_depth), 0))
        if count >= self.size:
            trie, count = SuffixTrie(self.max_depth), 0
        trie.extend(seq.output_token_ids)
        trie.end_text()
        self._tries[key] = (trie, count + 1)
        self._tries.move_to_end(key)
        if len(self._tries) > MAX_HISTORY_KEYS:
            self._tries.popitem(last=False)


def _history_key(seq: Sequence) -> bytes:
    """The salt (tenant) and the prompt's head, hashed: equal keys only for one tenant's same instructions."""
    head = array("q", seq.prompt_token_ids[:PROMPT_HEAD_TOKENS]).tobytes()
    salt = (seq.cache_salt or "").encode()
    return hashlib.sha256(len(salt).to_bytes(4, "little") + salt + head).digest()
