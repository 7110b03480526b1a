"""Fixed-size KV blocks for one model: free list, reference counts, prefix caching.

A full block's hash chains its parent's hash, its token ids and the request's salt, so a
block is shared only by requests with the same prefix *and* salt (tenants cannot probe each
other's cache by timing); a hit is confirmed by its token ids, so a hash collision never
serves wrong KV. Unreferenced blocks keep contents and hash until reused, least recently
freed first: the LRU eviction of the prefix cache.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from engine.sequence import Sequence


def block_hash(parent: bytes, token_ids: list[int], salt: bytes) -> bytes:
    return hashlib.blake2b(parent + salt + b"".join(t.to_bytes(4, "little") for t in token_ids),
                           digest_size=16).digest()


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

    def _evict_and_take(self) -> int:
        """The least recently freed block; if it was cached, it leaves the cache."""
        block_id, _ = self.free.popitem(last=False)
        self.blocks[block_id].ref_count += 1
        self._uncache(self.blocks[block_id])
        return block_id

    def _uncache(self, block: Block) -> None:
        if block.hash is not None:
            if self.cached.get(block.hash) == block.block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, []

    def can_allocate(self, seq: Sequence) -> bool:
        return self.num_free >= seq.num_blocks(self.block_size)

    def _cached_blocks(self, token_ids: list[int], salt: bytes) -> list[int]:
        """The cached blocks holding the leading full blocks of token_ids. The last full block
        is never among them when everything hits: a step needs at least one token to produce
        logits from."""
        bs, parent, found = self.block_size, b"", []
        for i in range((len(token_ids) - 1) // bs if self.prefix_caching else 0):
            ids = token_ids[i * bs:(i + 1) * bs]
            parent = block_hash(parent, ids, salt)
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != ids:
                break
            found.append(block_id)
        return found

    def num_cached_tokens(self, token_ids: list[int], salt: bytes) -> int:
        """How many of a new sequence's tokens the prefix cache would serve now."""
        return len(self._cached_blocks(token_ids, salt)) * self.block_size

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table
        hits = self._cached_blocks(seq.token_ids, seq.salt)
        full = (len(seq) - 1) // self.block_size if self.prefix_caching else 0
        self.queries += len(hits) + (len(hits) < full)      # lookups up to and with the first miss
        self.hits += len(hits)
        for block_id in hits:
            self.free.pop(block_id, None)
            self.blocks[block_id].ref_count += 1
        seq.block_table = list(hits)
        seq.num_hashed_blocks = len(seq.block_table)
        seq.num_cached_tokens = seq.num_computed_tokens = len(seq.block_table) * self.block_size
        self.resize(seq, len(seq))

    def resize(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow or shrink the block table to cover num_tokens (a decode's newest token, drafts
        and their rollback); False, and nothing changed, when there are not enough free blocks."""
        want = (num_tokens + self.block_size - 1) // self.block_size
        if want == len(seq.block_table):
            return True
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

    def register_computed(self, seq: Sequence) -> None:
        """Enter blocks that became full and computed into the prefix cache."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        if full <= seq.num_hashed_blocks:
            return
        parent = self.blocks[seq.block_table[seq.num_hashed_blocks - 1]].hash if seq.num_hashed_blocks else b""
        for i in range(seq.num_hashed_blocks, full):
            ids = seq.token_ids[i * bs:(i + 1) * bs]
            parent = block_hash(parent, ids, seq.salt)
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = parent, ids
            self.cached.setdefault(parent, block.block_id)
        seq.num_hashed_blocks = full

    def reset_cache(self) -> None:
        """Forget every cached block no sequence holds: a cold prefix cache, for measurements."""
        for block_id in self.free:
            self._uncache(self.blocks[block_id])

    def free_seq(self, seq: Sequence, forget: bool = False) -> list[int]:
        """Give the sequence's blocks back. With `forget` (its step failed, its KV may hold
        NaNs) the blocks no other sequence holds also leave the prefix cache; returns those."""
        blocks = list(seq.block_table)
        self.resize(seq, 0)          # tail first, so the tail is evicted before the shared prefix
        seq.num_computed_tokens = seq.num_hashed_blocks = 0
        forgotten = [b for b in blocks if forget and self.blocks[b].ref_count == 0]
        for block_id in forgotten:
            self._uncache(self.blocks[block_id])
        return forgotten
