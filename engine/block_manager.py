"""Fixed-size KV blocks for one model: free list, reference counts, prefix caching.

A full block's hash chains its parent's hash, its token ids and the request's salt, so a
block is shared only by requests with the same prefix *and* salt (tenants cannot probe each
other's cache by timing). A hit is confirmed by comparing token ids, so a hash collision can
never serve wrong KV. Unreferenced blocks keep their contents and hash until they are
reused, least recently freed first: that is the LRU eviction of the prefix cache.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from engine.sequence import Sequence


def block_hash(parent: bytes, token_ids: list[int], salt: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(salt)
    h.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return h.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: list[int] = field(default_factory=list)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.cached: dict[bytes, int] = {}
        self.hits = self.queries = 0     # prefix-cache counters, in blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    def _take(self, block_id: int | None = None) -> Block:
        if block_id is None:
            block_id, _ = self.free.popitem(last=False)
        else:
            del self.free[block_id]
        block = self.blocks[block_id]
        block.ref_count += 1
        return block

    def _evict_and_take(self) -> int:
        block = self._take()
        self._uncache(block)                 # reusing a cached block: it leaves the cache
        return block.block_id

    def _uncache(self, block: Block) -> None:
        if block.hash is not None:
            if self.cached.get(block.hash) == block.block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, []

    def _lookup(self, h: bytes, token_ids: list[int]) -> int | None:
        block_id = self.cached.get(h)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def can_allocate(self, seq: Sequence) -> bool:
        return self.num_free >= seq.num_blocks(self.block_size)

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table
        bs, parent, cached_tokens = self.block_size, b"", 0
        # The last full block is always recomputed when everything hits: the step needs at
        # least one token to produce logits from.
        hashable = (len(seq) - 1) // bs if self.prefix_caching else 0
        for i in range(seq.num_blocks(bs)):
            ids = seq.token_ids[i * bs:(i + 1) * bs]
            block_id = None
            if i < hashable and cached_tokens == i * bs:
                h = block_hash(parent, ids, seq.salt)
                self.queries += 1
                block_id = self._lookup(h, ids)
                if block_id is not None:
                    self.hits += 1
                    cached_tokens += bs
                    parent = h
                    if block_id in self.free:
                        self._take(block_id)
                    else:
                        self.blocks[block_id].ref_count += 1
            if block_id is None:
                block_id = self._evict_and_take()
            seq.block_table.append(block_id)
        seq.num_cached_tokens = seq.num_computed_tokens = cached_tokens
        seq.num_hashed_blocks = cached_tokens // bs

    def resize(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow or shrink the block table to cover num_tokens (speculation's drafts and their
        rollback); False, and nothing changed, when there are not enough free blocks."""
        want = (num_tokens + self.block_size - 1) // self.block_size
        if want - len(seq.block_table) > self.num_free:
            return False
        while len(seq.block_table) < want:
            seq.block_table.append(self._evict_and_take())
        while len(seq.block_table) > want:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block.block_id] = None
        return True

    def can_append(self, seq: Sequence) -> bool:
        return len(seq.block_table) >= seq.num_blocks(self.block_size) or self.num_free > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make room for the sequence's newest token before a decode step."""
        if len(seq.block_table) < seq.num_blocks(self.block_size):
            seq.block_table.append(self._evict_and_take())

    def register_computed(self, seq: Sequence) -> None:
        """Enter blocks that became full and computed into the prefix cache."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        parent = self.blocks[seq.block_table[seq.num_hashed_blocks - 1]].hash if seq.num_hashed_blocks else b""
        for i in range(seq.num_hashed_blocks, full):
            ids = seq.token_ids[i * bs:(i + 1) * bs]
            parent = block_hash(parent, ids, seq.salt)
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = parent, ids
            self.cached.setdefault(parent, block.block_id)
        seq.num_hashed_blocks = max(full, seq.num_hashed_blocks)

    def free_seq(self, seq: Sequence, forget: bool = False) -> list[int]:
        """Give the sequence's blocks back. With `forget` (its step failed, its KV may hold
        NaNs) the blocks no other sequence holds also leave the prefix cache; returns those."""
        forgotten = []
        # Tail blocks go back first so they are evicted before the shared prefix.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if forget:
                    self._uncache(block)
                    forgotten.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_hashed_blocks = 0
        return forgotten
