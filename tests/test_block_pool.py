"""Block pool and KV cache manager: check-then-act allocation, freeing, the integrity invariant."""

from __future__ import annotations

import pytest

from core.block_pool import BlockPool
from core.kv_cache_manager import KVCacheManager
from core.request import EngineRequest, Request
from core.sampling import SamplingParams


def make_request(rid: str, n: int) -> Request:
    return Request(EngineRequest(rid, list(range(n)), SamplingParams()), max_tokens=16)


def test_pool_take_and_give_back():
    pool = BlockPool(8)
    a = pool.take(3)
    b = pool.take(5)
    assert len(set(a + b)) == 8 and pool.num_free == 0
    pool.check_integrity()
    with pytest.raises(RuntimeError):
        pool.take(1)
    pool.give_back(a)
    assert pool.num_free == 3
    pool.check_integrity()
    with pytest.raises(KeyError):
        pool.give_back(a)  # double free


def test_manager_grows_tables_by_whole_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = make_request("r", 9)
    assert kv.blocks_needed(r, 9) == 3
    assert kv.can_allocate(r, 9)
    table = kv.allocate(r, 9)
    assert len(table) == 3
    r.num_computed_tokens = 9
    # Token 10, 11, 12 fit in the third block; token 13 needs a fourth.
    assert kv.blocks_needed(r, 3) == 0
    assert kv.blocks_needed(r, 4) == 1
    kv.allocate(r, 4)
    assert len(kv.block_tables["r"]) == 4
    kv.check_integrity()
    assert kv.num_free_blocks == 6


def test_can_allocate_refuses_without_side_effects():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a, b = make_request("a", 12), make_request("b", 8)
    kv.allocate(a, 12)
    assert not kv.can_allocate(b, 8)
    assert kv.num_free_blocks == 1 and "b" not in kv.block_tables
    kv.free(a)
    assert kv.can_allocate(b, 8)
    kv.free(b)  # never allocated: freeing is a no-op
    kv.check_integrity()
    assert kv.num_free_blocks == 4


def test_integrity_check_catches_a_leak():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate(make_request("a", 4), 4)
    kv.block_tables.clear()  # a table lost without freeing its blocks
    with pytest.raises(AssertionError):
        kv.check_integrity()
