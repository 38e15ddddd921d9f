"""Block pool and KV cache manager: reference counts, the LRU free list, prefix cache hits,
eviction order and the integrity invariant."""

from __future__ import annotations

import pytest

from core.block_pool import BlockPool
from core.kv_cache_manager import KVCacheManager
from core.request import EngineRequest, Request
from core.sampling import SamplingParams


def make_request(rid: str, tokens, salt: str | None = None) -> Request:
    tokens = list(range(tokens)) if isinstance(tokens, int) else list(tokens)
    return Request(EngineRequest(rid, tokens, SamplingParams(), cache_salt=salt), max_tokens=16)


def admit(kv: KVCacheManager, r: Request) -> int:
    """What the scheduler does for a waiting request: hits first, then new blocks; the whole
    prompt is then computed and its full blocks cached. Returns the number of cached tokens."""
    hits = kv.find_cached(r)
    cached = len(hits) * kv.block_size
    assert kv.can_allocate(r, r.num_tokens - cached, hits)
    kv.allocate(r, r.num_tokens - cached, hits)
    kv.count_lookup(r.num_tokens, cached)
    r.num_computed_tokens = r.num_tokens
    kv.cache_computed(r)
    kv.check_integrity()
    return cached


def test_pool_take_and_give_back():
    pool = BlockPool(8)
    a = pool.take(3)
    b = pool.take(5)
    assert len({x.block_id for x in a + b}) == 8 and pool.num_free == 0
    pool.check_integrity()
    with pytest.raises(RuntimeError):
        pool.take(1)
    pool.give_back(a)
    assert pool.num_free == 3
    pool.check_integrity()
    with pytest.raises(RuntimeError, match="double free"):
        pool.give_back(a)


def test_blocks_are_made_on_first_use_in_the_eager_free_order():
    """A pool of a hundred million blocks (a tiny model on an 80 GB GPU has millions) costs
    nothing up front; never-used blocks are handed out first, in id order, then recycled ones
    least recently freed first: the order of a free list that started with every block."""
    big = BlockPool(100_000_000)
    assert big.num_free == 100_000_000 and big.num_in_use == 0 and len(big.blocks) == 0
    assert [b.block_id for b in big.take(3)] == [0, 1, 2]
    big.check_integrity()
    pool = BlockPool(4)
    a = pool.take(3)
    pool.give_back([a[1]])
    assert pool.num_free == 2 and pool.num_in_use == 2
    assert [b.block_id for b in pool.take(2)] == [3, 1]
    pool.check_integrity()


def test_free_list_is_lru_and_touch_takes_blocks_off_it():
    pool = BlockPool(4)
    blocks = pool.take(4)
    pool.give_back([blocks[2], blocks[0]])
    assert [b.block_id for b in pool.free] == [2, 0]  # freed first, handed out first
    pool.touch([blocks[2]])  # shared again while idle: off the free list, ref 1
    assert [b.block_id for b in pool.free] == [0] and blocks[2].ref_cnt == 1
    pool.touch([blocks[1]])  # already owned: just one more reference
    assert blocks[1].ref_cnt == 2
    pool.check_integrity()


def test_manager_grows_tables_by_whole_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = make_request("r", 9)
    assert kv.blocks_needed(r, 9) == 3
    kv.allocate(r, 9)
    r.num_computed_tokens = 9
    assert kv.blocks_needed(r, 3) == 0  # tokens 10-12 fit in the third block
    assert kv.blocks_needed(r, 4) == 1
    kv.allocate(r, 4)
    assert len(kv.block_tables["r"]) == 4 and kv.num_free_blocks == 6
    kv.check_integrity()


def test_can_allocate_refuses_without_side_effects():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    a, b = make_request("a", 12), make_request("b", 8)
    kv.allocate(a, 12)
    assert not kv.can_allocate(b, 8)
    assert kv.num_free_blocks == 1 and "b" not in kv.block_tables
    kv.free(a)
    assert kv.can_allocate(b, 8)
    kv.free(b)  # never allocated: freeing is a no-op
    kv.check_integrity()
    assert kv.num_free_blocks == 4


def test_prefix_hit_shares_blocks_but_never_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", range(100, 110))  # 10 tokens: blocks 0-1 full, block 2 partial
    assert admit(kv, a) == 0
    b = make_request("b", list(range(100, 108)) + [7, 7, 7])
    assert admit(kv, b) == 8  # both full blocks shared
    assert kv.tables["a"][:2] == kv.tables["b"][:2]
    assert kv.tables["a"][0].ref_cnt == 2
    # Exactly the cached prefix again: 8 tokens, but the last one must be computed, so 1 block.
    c = make_request("c", range(100, 108))
    assert admit(kv, c) == 4
    assert kv.num_hit_tokens == 12 and kv.num_queried_tokens == 10 + 11 + 8


def test_freed_blocks_stay_cached_until_needed_and_evict_tails_first():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", range(13))  # 3 full blocks + 1 partial: the whole pool
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4 and len(kv.pool.cached) == 3
    kv.check_integrity()
    # A stranger needs one block: the partial tail goes first, then the chain's last full block.
    s = make_request("s", [999] * 4)
    hits = kv.find_cached(s)
    assert hits == []
    kv.allocate(s, 4)
    kv.allocate(make_request("t", [998] * 4), 4)
    assert len(kv.pool.cached) == 2 and kv.pool.num_evictions == 1
    again = make_request("again", range(13))
    assert len(kv.find_cached(again)) == 2  # the head of the chain survived
    kv.check_integrity()


def test_salt_and_token_mismatch_prevent_sharing():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit(kv, make_request("a", range(9), salt="tenant-1"))
    assert admit(kv, make_request("b", range(9), salt="tenant-2")) == 0
    assert admit(kv, make_request("c", range(9), salt="tenant-1")) == 8
    # A hash that matches but whose stored tokens differ is not a hit.
    d = make_request("d", range(9))
    admit(kv, d)
    forged = make_request("e", [5, 5, 5, 5, 6])
    forged.block_hashes.append(d.block_hashes[0])  # pretend its first block hashed the same
    assert kv.find_cached(forged) == []


def test_disabled_caching_never_hits():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False)
    admit(kv, make_request("a", range(9)))
    assert admit(kv, make_request("b", range(9))) == 0
    assert not kv.pool.cached


def test_integrity_check_catches_a_leak():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate(make_request("a", 4), 4)
    kv.tables.clear()  # a table lost without freeing its blocks
    kv.block_tables.clear()
    with pytest.raises(AssertionError):
        kv.check_integrity()
