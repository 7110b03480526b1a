import engine.block_manager as bm_mod
from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def seq(ids, salt=b""):
    return Sequence(list(ids), SamplingParams(), salt=salt)


def computed(bm, s):
    """Pretend the sequence's prefill ran, so its full blocks enter the prefix cache."""
    s.num_computed_tokens = len(s)
    bm.register_computed(s)
    return s


def test_ref_counts_and_free():
    bm = BlockManager(8, 4)
    a = seq(range(10))
    bm.allocate(a)
    computed(bm, a)
    b = seq(list(range(8)) + [99])
    bm.allocate(b)
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared and b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in shared] == [2, 2]
    bm.free_seq(a)
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1]
    bm.free_seq(b)
    assert bm.num_free == 8


def test_full_hit_still_recomputes_last_block():
    bm = BlockManager(8, 4)
    a = seq(range(8))
    bm.allocate(a)
    computed(bm, a)
    b = seq(range(8))
    bm.allocate(b)
    assert b.num_cached_tokens == 4      # the last token must be computed to get logits


def test_lru_eviction_keeps_recently_used_prefixes():
    bm = BlockManager(4, 4)
    old, new = seq(range(100, 108)), seq(range(200, 208))
    for s in (old, new):
        bm.allocate(s)
        computed(bm, s)
        bm.free_seq(s)
    filler = seq(range(300, 308))         # needs two blocks: evicts the least recently freed
    bm.allocate(filler)
    again_new = seq(list(range(200, 208)) + [1])
    again_old = seq(list(range(100, 108)) + [1])
    bm.free_seq(filler)
    bm.allocate(again_new)
    assert again_new.num_cached_tokens == 8
    bm.free_seq(again_new)
    bm.allocate(again_old)
    assert again_old.num_cached_tokens == 0


def test_hash_collision_never_serves_wrong_kv(monkeypatch):
    monkeypatch.setattr(bm_mod, "block_hash", lambda parent, ids, salt: b"same")
    bm = BlockManager(8, 4)
    a = seq(range(9))
    bm.allocate(a)
    computed(bm, a)
    b = seq(range(50, 59))
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    assert set(b.block_table).isdisjoint(a.block_table)


def test_salt_isolates_tenants():
    bm = BlockManager(16, 4)
    a = seq(range(12), salt=b"tenant-a")
    bm.allocate(a)
    computed(bm, a)
    b = seq(range(13), salt=b"tenant-b")
    bm.allocate(b)
    assert b.num_cached_tokens == 0
    c = seq(range(13), salt=b"tenant-a")
    bm.allocate(c)
    assert c.num_cached_tokens == 12


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(16, 4, prefix_caching=False)
    a = seq(range(12))
    bm.allocate(a)
    computed(bm, a)
    b = seq(range(13))
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and bm.queries == 0


def test_cached_tokens_are_counted_without_allocating_and_a_reset_forgets_them():
    bm = BlockManager(16, 4)
    a, held = seq(range(10)), seq(range(100, 110))
    for s in (a, held):
        bm.allocate(s)
        computed(bm, s)
    bm.free_seq(a)
    queries = bm.queries
    assert bm.num_cached_tokens(list(range(10)), b"") == 8          # two full blocks of a's prompt
    assert bm.num_cached_tokens(list(range(10)), b"tenant") == 0    # another salt sees nothing
    assert bm.queries == queries                                      # a question, not a lookup
    bm.reset_cache()
    assert bm.num_cached_tokens(list(range(10)), b"") == 0
    # Blocks a running sequence holds keep their place in the cache.
    assert bm.num_cached_tokens(list(range(100, 110)), b"") == 8
