"""Fixed-size KV blocks for one model: free list, reference counts, prefix caching.

A full block's hash chains its parent's hash, its token ids and the request's salt, so a
block is shared only by requests with the same prefix *and* salt (tenants cannot probe each
other's cache by timing); a hit is confirmed by its token ids, so a hash collision never
serves wrong KV. Unreferenced blocks keep contents and hash until reused, least recently
freed first: the LRU eviction of the prefix cache.

A sequence with a KV window (sequence.KVWindow) drops whole blocks after its sinks as it grows
(`evict`). Its other blocks are never written again, so those it registered before the first
drop stay valid cache entries; at that drop its sinks move to fresh blocks, which the model
runner rewrites at each drop as rotated copies of the original sink blocks (those stay held,
untouched and cached: `sink_source`). Blocks it computes after the first drop hold KV of
windowed attention, which no hash of their prefix describes: they are never registered.
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

    def can_allocate(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        """Room for the sequence's first `num_tokens` (all of them by default)."""
        n = len(seq) if num_tokens is None else num_tokens
        return self.num_free >= -(-n // self.block_size)

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

    def allocate(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Give a waiting sequence blocks for its first `num_tokens` (all by default; a windowed
        one grows chunk by chunk), reusing cached prefix blocks: their tokens are its
        num_cached_tokens, whose KV its scheduler counts as computed."""
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
        seq.num_cached_tokens = len(seq.block_table) * self.block_size
        self.resize(seq, max(len(seq) if num_tokens is None else num_tokens, seq.num_cached_tokens))

    def resize(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow or shrink the block table to cover num_tokens (a decode's newest token, drafts
        and their rollback); False, and nothing changed, when there are not enough free blocks.
        Tokens a window dropped hold no block."""
        want = max(num_tokens - seq.num_dropped + self.block_size - 1, 0) // self.block_size
        if want == len(seq.block_table):
            return True
        if want - len(seq.block_table) > self.num_free:
            return False
        while len(seq.block_table) < want:
            seq.block_table.append(self._evict_and_take())
        while len(seq.block_table) > want:
            self._release(seq.block_table.pop())
        return True

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None

    def evict(self, seq: Sequence, position: int) -> int | None:
        """Drop what the sequence's window no longer shows the token at `position` (whole blocks
        after the sinks). Returns the tokens dropped now; the runner then rewrites the sinks'
        blocks (step.shift). At the first drop the sinks get fresh blocks for that, and the
        originals become `sink_source`. None, and nothing changed, when there are no free
        blocks for those."""
        w, bs = seq.window, self.block_size
        shift = 0 if w is None else w.dropped(position, bs) - seq.num_dropped
        if shift <= 0:
            return 0
        first, n = w.sink_tokens(bs) // bs, shift // bs
        dropped = seq.block_table[first:first + n]
        fresh = 0 if seq.sink_source else first
        if fresh > self.num_free + sum(self.blocks[b].ref_count == 1 for b in dropped):
            return None
        del seq.block_table[first:first + n]
        for block_id in dropped:
            self._release(block_id)
        if fresh:
            seq.sink_source = seq.block_table[:first]
            seq.block_table[:first] = [self._evict_and_take() for _ in range(first)]
        seq.num_dropped += shift
        seq.num_evicted = max(seq.num_evicted, seq.num_dropped)
        return shift

    def register_computed(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Enter blocks that became full and computed (of its first `num_computed` tokens, by
        default its num_computed_tokens) into the prefix cache."""
        if not self.prefix_caching or seq.num_dropped:
            return
        bs = self.block_size
        full = (seq.num_computed_tokens if num_computed is None else num_computed) // bs
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
        """Give the sequence's blocks back (its scheduler then counts none of its KV computed).
        With `forget` (its step failed, its KV may hold NaNs) the blocks no other sequence holds
        also leave the prefix cache; returns those."""
        blocks = list(seq.block_table) + seq.sink_source
        self.resize(seq, 0)          # tail first, so the tail is evicted before the shared prefix
        for block_id in seq.sink_source:
            self._release(block_id)
        seq.sink_source = []
        seq.num_hashed_blocks = seq.num_dropped = 0
        forgotten = [b for b in blocks if forget and self.blocks[b].ref_count == 0]
        for block_id in forgotten:
            self._uncache(self.blocks[block_id])
        return forgotten
