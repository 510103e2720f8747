"""BlockPool / KVCacheManager bookkeeping: allocation, sharing, freeing, LRU eviction, prefix hits."""
from __future__ import annotations

import pytest

from shardserve.engine.kv_cache import BlockPool, KVCacheManager

BS = 4


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def state(kv: KVCacheManager) -> tuple:
    """Everything allocate_slots could change, as plain values."""
    pool = kv.pool
    return (list(pool.free_queue), [(b.ref_cnt, b.block_hash, b.token_ids) for b in pool.blocks],
            dict(pool.cached), {r: [b.block_id for b in rec.blocks] for r, rec in kv.requests.items()})


def run_request(kv: KVCacheManager, req_id: str, tokens: list[int], cache_salt: str | None = None) -> list[int]:
    """Admit a request the way the scheduler does (prefix lookup, then allocate); returns block ids."""
    hits, num_hit = kv.get_computed_blocks(req_id, tokens, cache_salt)
    assert kv.allocate_slots(req_id, tokens, num_hit, len(tokens) - num_hit, hits) is not None
    kv.record_prefix_lookup(len(tokens), num_hit)
    return kv.block_ids(req_id)


# ---- BlockPool ------------------------------------------------------------------------------
def test_pool_needs_two_blocks():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4 and pool.num_free_blocks == 4
    got = pool.allocate(4)
    assert sorted(b.block_id for b in got) == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.num_free_blocks == 0 and pool.usage() == 1.0
    with pytest.raises(RuntimeError, match="asked for 1 KV blocks with only 0 free"):
        pool.allocate(1)
    pool.free(got)
    # Cycle through the pool many times: block 0 must never appear.
    for _ in range(10):
        blocks = pool.allocate(3)
        assert 0 not in [b.block_id for b in blocks]
        pool.free(blocks)
    assert pool.null_block.ref_cnt == 1
    pool.reset_prefix_cache()
    assert pool.null_block.ref_cnt == 1 and 0 not in pool.free_queue


def test_pool_allocates_least_recently_freed_first():
    pool = BlockPool(6)
    a, b, c = pool.allocate(3)
    pool.free([b])
    pool.free([a])
    pool.free([c])
    # Never-used blocks 4, 5 first, then in the order they were freed.
    assert [blk.block_id for blk in pool.allocate(5)] == [4, 5, b.block_id, a.block_id, c.block_id]


def test_double_free_is_caught():
    pool = BlockPool(3)
    (blk,) = pool.allocate(1)
    pool.free([blk])
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([blk])


# ---- KVCacheManager: allocate / share / free --------------------------------------------------
def test_allocate_rounds_up_to_blocks_and_caches_only_full_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    tokens = toks(100, 10)          # 2 full blocks + 2 tokens
    new = kv.allocate_slots("a", tokens, 0, 10)
    assert len(new) == 3 and kv.num_free_blocks == 9 - 3
    blocks = kv.requests["a"].blocks
    assert [b.token_ids for b in blocks] == [tuple(tokens[0:4]), tuple(tokens[4:8]), None]
    assert blocks[2].block_hash is None
    assert len(kv.pool.cached) == 2
    # Growing into the partial block needs no new block; crossing into a 4th block needs one.
    assert kv.allocate_slots("a", tokens + [1, 2], 10, 2) == []
    assert blocks[2].token_ids == tuple(tokens[8:10] + [1, 2])   # now full, so cached
    assert len(kv.allocate_slots("a", tokens + [1, 2, 3], 12, 1)) == 1
    assert len(kv.block_ids("a")) == 4


def test_prefix_hit_shares_blocks_and_counts_references():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = toks(1, 12)
    a = run_request(kv, "a", prompt + [50, 51])
    b = run_request(kv, "b", prompt + [60, 61, 62])
    assert b[:3] == a[:3]                   # the 3 shared full blocks
    assert set(b[3:]).isdisjoint(a)         # the rest is private
    assert [kv.pool.blocks[i].ref_cnt for i in a] == [2, 2, 2, 1]
    kv.free("a")
    assert [kv.pool.blocks[i].ref_cnt for i in a] == [1, 1, 1, 0]
    assert a[3] in kv.pool.free_queue and a[0] not in kv.pool.free_queue
    kv.free("b")
    assert all(kv.pool.blocks[i].ref_cnt == 0 for i in a + b)
    assert kv.num_free_blocks == 19


def test_cache_salt_shares_blocks_only_within_the_salt():
    kv = KVCacheManager(num_blocks=40, block_size=BS)
    prompt = toks(1, 12) + [99]
    plain = run_request(kv, "plain", prompt)
    a1 = run_request(kv, "a1", prompt, cache_salt="tenant-a")
    b1 = run_request(kv, "b1", prompt, cache_salt="tenant-b")
    assert len({*plain[:3], *a1[:3], *b1[:3]}) == 9   # same tokens, three salts: nothing shared
    a2 = run_request(kv, "a2", prompt, cache_salt="tenant-a")
    assert a2[:3] == a1[:3]                            # the same salt shares, every block of the chain
    assert kv.get_computed_blocks("p2", prompt)[1] == 12 and kv.get_computed_blocks("c", prompt, "c")[1] == 0
    for req_id in ("plain", "a1", "b1", "a2"):
        kv.free(req_id)
    # A salted request that allocates without a lookup first (prompt logprobs) still caches salted.
    kv.allocate("a3", prompt, len(prompt), cache_salt="tenant-a")
    assert kv.get_computed_blocks("a4", prompt, "tenant-a")[1] == 12


def test_free_puts_blocks_in_queue_tail_first():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    ids = run_request(kv, "a", toks(1, 12))
    assert len(ids) == 3
    kv.free("a")
    assert list(kv.pool.free_queue)[-3:] == ids[::-1]   # the prefix's first block is evicted last
    assert "a" not in kv.requests   # blocks, hashes and all
    kv.free("a")   # freeing an unknown request is a no-op
    assert kv.num_free_blocks == 9


def test_prefix_hit_on_freed_blocks_pulls_them_out_of_the_free_queue():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = run_request(kv, "a", toks(1, 9))
    kv.free("a")
    assert kv.num_free_blocks == 9
    hits, num_hit = kv.get_computed_blocks("b", toks(1, 9))
    assert [h.block_id for h in hits] == a[:2] and num_hit == 8
    assert kv.num_free_blocks == 9            # a lookup alone takes nothing
    kv.allocate_slots("b", toks(1, 9), num_hit, 1, hits)
    assert kv.block_ids("b")[:2] == a[:2]
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in a[:2])
    assert not set(a[:2]) & set(kv.pool.free_queue)
    assert kv.num_free_blocks == 9 - 3


def test_lru_eviction_drops_hash_of_reused_block():
    kv = KVCacheManager(num_blocks=5, block_size=BS)   # 4 usable
    first = toks(1, 8)
    a = run_request(kv, "a", first + [99])   # 3 blocks, 2 of them full and cached
    kv.free("a")
    cached_before = {b.block_id for b in kv.pool.cached.values()}
    assert cached_before == set(a[:2])
    # Queue: [never used, a[2], a[1], a[0]]. Taking 3 blocks evicts a[1] but keeps a[0].
    kv.allocate_slots("x", toks(500, 12), 0, 12)
    assert a[1] in kv.block_ids("x") and a[0] not in kv.block_ids("x")
    cached_tokens = {b.token_ids: b.block_id for b in kv.pool.cached.values()}
    assert cached_tokens[tuple(first[:4])] == a[0]
    assert tuple(first[4:8]) not in cached_tokens
    # The first block is still a hit, the evicted second one is not.
    hits, num_hit = kv.get_computed_blocks("c", first + [99])
    assert [h.block_id for h in hits] == [a[0]] and num_hit == 4


def test_evicted_block_hash_is_removed_from_cache():
    kv = KVCacheManager(num_blocks=3, block_size=BS)   # 2 usable
    a = run_request(kv, "a", toks(1, 5))
    blk = kv.pool.blocks[a[0]]
    h = blk.block_hash
    assert h is not None and kv.pool.cached[h] is blk
    kv.free("a")
    assert kv.pool.cached[h] is blk            # free keeps the hash: still reusable
    kv.allocate_slots("x", toks(200, 8), 0, 8)  # takes both blocks, evicting the cached one
    assert h not in kv.pool.cached
    assert kv.get_computed_blocks("b", toks(1, 5)) == ([], 0)


def test_reset_prefix_cache_forgets_only_free_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    run_request(kv, "a", toks(1, 5))
    run_request(kv, "b", toks(50, 5))
    kv.free("a")
    kv.pool.reset_prefix_cache()
    assert kv.get_computed_blocks("a2", toks(1, 5)) == ([], 0)
    hits, num_hit = kv.get_computed_blocks("b2", toks(50, 5))
    assert num_hit == 4 and hits[0].block_id == kv.block_ids("b")[0]


# ---- prefix hits --------------------------------------------------------------------------
@pytest.mark.parametrize("num_tokens,expected_hit", [(16, 12), (12, 8), (13, 12), (14, 12), (5, 4), (4, 0), (1, 0)])
def test_prefix_hit_leaves_the_last_token_uncomputed(num_tokens, expected_hit):
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    tokens = toks(1, 16)
    run_request(kv, "a", tokens)
    hits, num_hit = kv.get_computed_blocks("b", tokens[:num_tokens])
    assert num_hit == expected_hit == len(hits) * BS
    assert num_hit < num_tokens


def test_prefix_hit_stops_at_first_differing_block():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    tokens = toks(1, 16)
    run_request(kv, "a", tokens + [0])
    other = tokens[:4] + [77] + tokens[5:] + [0]   # second block differs; later blocks are equal
    hits, num_hit = kv.get_computed_blocks("b", other)
    assert num_hit == 4 and [h.block_id for h in hits] == kv.block_ids("a")[:1]


def test_prefix_caching_disabled_never_hits_nor_counts():
    kv = KVCacheManager(num_blocks=20, block_size=BS, enable_prefix_caching=False)
    run_request(kv, "a", toks(1, 9))
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks("b", toks(1, 9)) == ([], 0)
    kv.record_prefix_lookup(9, 0)
    assert kv.prefix_cache_queries == 0 and kv.prefix_cache_hits == 0


def test_prefix_cache_counters():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    run_request(kv, "a", toks(1, 9))                  # 9 queried, 0 hit
    run_request(kv, "b", toks(1, 9))                  # 9 queried, 8 hit
    run_request(kv, "c", toks(1, 4) + toks(90, 6))    # 10 queried, 4 hit
    assert kv.prefix_cache_queries == 28
    assert kv.prefix_cache_hits == 12


# ---- hash collisions ----------------------------------------------------------------------
def constant_hash(parent, token_ids) -> int:
    return 42


def test_hash_collision_does_not_hand_out_other_requests_blocks():
    kv = KVCacheManager(num_blocks=20, block_size=BS, hash_fn=constant_hash)
    a = run_request(kv, "a", toks(1, 9))
    assert kv.get_computed_blocks("b", toks(500, 9)) == ([], 0)
    b = run_request(kv, "b", toks(500, 9))
    assert set(a).isdisjoint(b)
    # Same tokens as a: its first block is a genuine hit even under the degenerate hash.
    hits, num_hit = kv.get_computed_blocks("c", toks(1, 9))
    assert [h.block_id for h in hits] == a[:1] and num_hit == 4
    kv.free("a")
    assert kv.get_computed_blocks("d", toks(600, 9)) == ([], 0)


def test_hash_collision_guard_checks_position_in_the_chain():
    """A block with equal tokens at a different depth (so a different prefix) is not a hit: its KV
    was computed at other positions, after other tokens."""
    kv = KVCacheManager(num_blocks=20, block_size=BS, hash_fn=constant_hash)
    block = toks(1, 4)
    a = run_request(kv, "a", block + [9])
    hits, num_hit = kv.get_computed_blocks("b", block + block + [9])
    assert [h.block_id for h in hits] == a[:1] and num_hit == 4


def test_hash_ignoring_parent_cannot_splice_foreign_kv():
    def tokens_only_hash(parent, token_ids) -> int:
        return hash(token_ids)

    kv = KVCacheManager(num_blocks=20, block_size=BS, hash_fn=tokens_only_hash)
    p, q = toks(1, 4), toks(100, 4)
    run_request(kv, "a", p + q + [0])
    # q's block was computed after p; after another first block it is a different prefix.
    hits, num_hit = kv.get_computed_blocks("b", q + [0])
    assert num_hit == 0 and hits == []
    run_request(kv, "c", toks(50, 4) + [0])
    assert kv.get_computed_blocks("d", toks(50, 4) + q + [0])[1] == 4


# ---- running out of blocks ----------------------------------------------------------------
def test_allocate_slots_returns_none_and_changes_nothing_when_short():
    kv = KVCacheManager(num_blocks=6, block_size=BS)   # 5 usable
    run_request(kv, "a", toks(1, 9))                   # 3 blocks
    before = state(kv)
    assert kv.allocate_slots("b", toks(300, 12), 0, 12) is None       # needs 3, 2 free
    assert state(kv) == before
    assert kv.allocate_slots("a", toks(1, 9) + toks(40, 12), 9, 12) is None   # grow by 3
    assert state(kv) == before
    assert len(kv.allocate_slots("b", toks(300, 8), 0, 8)) == 2       # exactly what is free
    assert kv.num_free_blocks == 0


def test_free_prefix_hits_do_not_count_as_allocatable():
    kv = KVCacheManager(num_blocks=5, block_size=BS)   # 4 usable
    tokens = toks(1, 8) + [0]
    run_request(kv, "a", tokens)                       # 3 blocks, 2 cached
    kv.free("a")
    assert kv.num_free_blocks == 4
    hits, num_hit = kv.get_computed_blocks("b", tokens + toks(20, 8))
    assert num_hit == 8
    before = state(kv)
    # 17 tokens = 5 blocks: 2 hits + 3 new, but only 2 free blocks are not hits.
    assert kv.allocate_slots("b", tokens + toks(20, 8), 8, 9, hits) is None
    assert state(kv) == before
    # 16 tokens = 4 blocks: 2 hits + 2 new fits exactly.
    assert len(kv.allocate_slots("b", tokens + toks(20, 7), 8, 8, hits)) == 2
    assert kv.num_free_blocks == 0
    assert all(b.ref_cnt == 1 for b in kv.requests["b"].blocks)


def test_usage():
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    assert kv.usage() == 0.0
    kv.allocate_slots("a", toks(1, 8), 0, 8)
    assert kv.usage() == 0.5
    kv.free("a")
    assert kv.usage() == 0.0


def test_chunked_allocation_caches_only_filled_blocks():
    """A lookup hashes the whole prompt; a first chunk must still cache only the blocks it fills."""
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    tokens = toks(1, 16)
    hits, num_hit = kv.get_computed_blocks("a", tokens)
    assert num_hit == 0
    kv.allocate_slots("a", tokens, 0, 6, hits)          # first chunk: 6 tokens, 2 blocks
    assert [b.token_ids for b in kv.requests["a"].blocks] == [tuple(tokens[:4]), None]
    assert len(kv.pool.cached) == 1
    kv.allocate_slots("a", tokens, 6, 10)               # the rest
    assert [b.token_ids for b in kv.requests["a"].blocks] == [tuple(tokens[i:i + 4]) for i in range(0, 16, 4)]
    assert kv.get_computed_blocks("b", tokens + [0])[1] == 16
