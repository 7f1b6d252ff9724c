"""The prefix cache: full KV blocks found by the hash of the whole prefix they end, and the least-recently
used order in which the cached blocks that no sequence holds are evicted.

A block's hash chains its parent's: sha256(parent hash + the block's token ids as int64). The first block's
parent is the sequence's root: empty (ROOT_HASH) for an unsalted request, else a hash of its cache salt
(`salt_root`). Equal hashes therefore mean equal whole prefixes under equal salts, positions included (the
chain fixes where a block sits). NOTE: a hit is trusted without comparing token ids (they are not kept):
sha256 is a 256-bit cryptographic hash, so the chance that two different prefixes collide is negligible
(about n^2 / 2^257 for n cached blocks), far below the chance of a hardware fault.

The salt partitions the cache (as vLLM's `cache_salt`): requests under different salts never share a block,
so a hit, its `cached_tokens` count and its shorter time to first token say nothing about what a request
under another salt asked. The service salts every job with its tenant's cache namespace.

A block's K/V depend on the tokens up to its end and on the model, its weights and dtype. The cache lives and
dies with one engine (one model, one dtype), and nothing else changes K/V today: no LoRA adapters, no
multimodal inputs. Any of those, once added, must be hashed in with the tokens (as the salt is).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from conveyor.engine.sequence import Sequence

ROOT_HASH = b""  # the parent of an unsalted sequence's first block


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """The 32-byte hash of a full block: its parent's hash chained with its token ids."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def salt_root(cache_salt: str | None, lora_key: str | None = None) -> bytes:
    """The parent of a sequence's first block: ROOT_HASH when unsalted and without an adapter, else 32 bytes
    derived from the salt and the LoRA adapter's key (engine/lora/manager.py): the KV an adapter computes
    differs from the base model's, so blocks are never shared across adapters.

    NOTE: blake2b with its own personalisation, not sha256: no block's hash input (a 0- or 32-byte parent and
    int64 token ids) can then produce a salt's root, so a salted chain never continues an unsalted one.
    """
    if lora_key is not None:
        salted = b"-" if cache_salt is None else b"+" + cache_salt.encode()
        keyed = salted + b"\0" + lora_key.encode()
        return hashlib.blake2b(keyed, digest_size=32, person=b"conveyor-lora").digest()
    if cache_salt is None:
        return ROOT_HASH
    return hashlib.blake2b(cache_salt.encode(), digest_size=32, person=b"conveyor-salt").digest()


def block_hashes(seq: Sequence, block_size: int, num_blocks: int) -> list[bytes]:
    """seq.block_hashes, extended to (at least) its first num_blocks blocks, which must be full of tokens.

    Hashes are computed once per sequence and block: the list only grows (tokens never change).
    """
    assert num_blocks * block_size <= seq.num_tokens, (seq.request_id, num_blocks, seq.num_tokens)
    hashes = seq.block_hashes
    for i in range(len(hashes), num_blocks):
        parent = hashes[i - 1] if i else salt_root(seq.cache_salt, seq.lora_key)
        hashes.append(hash_block(parent, seq.token_slice(i * block_size, (i + 1) * block_size)))
    return hashes


class PrefixCache:
    """Maps hashes to blocks and back; orders evictable blocks (cached, reference count 0) oldest first.

    Reference counts stay in the BlockManager: it tells this index when a cached block's last holder lets go
    (`release`) and when a hit takes an evictable block back (`reclaim`).
    """

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        # Cached blocks no sequence holds, least recently released first (the next one evicted).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._block_of.get(block_hash)

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def insert(self, block: int, block_hash: bytes) -> bool:
        """Indexes a held block whose K/V are now computed. False when another block already caches this
        prefix: that copy stays the cached one, and `block` stays private to its sequence."""
        assert block not in self._hash_of and block not in self._evictable, f"block {block} is cached twice"
        if block_hash in self._block_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def release(self, block: int) -> None:
        """A cached block's last holder let go: it keeps its content and is evicted last among evictables."""
        assert block in self._hash_of and block not in self._evictable, block
        self._evictable[block] = None

    def reclaim(self, block: int) -> None:
        """A hit took an evictable block: it is held again, so not evictable."""
        del self._evictable[block]

    def evict(self) -> int:
        """Forgets the least recently released evictable block and returns it, empty, for reuse."""
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        self.num_evictions += 1
        return block

    def evictable_ids(self) -> list[int]:
        """Evictable blocks in eviction order."""
        return list(self._evictable)

    def drop_evictable(self) -> list[int]:
        """Forgets every evictable block (not counted as evictions); returns them in eviction order."""
        dropped = list(self._evictable)
        for block in dropped:
            del self._block_of[self._hash_of.pop(block)]
        self._evictable.clear()
        return dropped
