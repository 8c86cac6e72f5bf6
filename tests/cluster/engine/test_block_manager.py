"""KVBlockPool: allocation, reference counts, prefix caching and eviction, with fake block counts."""

import pytest

from flotilla.cluster.engine.block_manager import KVBlockPool
from flotilla.cluster.engine.request import Request

BS = 4


def computed_request(pool: KVBlockPool, request_id: str, tokens: list[int]) -> Request:
    """A request whose prompt is fully computed in freshly allocated blocks, then committed."""
    request = Request(request_id, tokens, max_tokens=1)
    request.block_ids = pool.allocate(pool.blocks_for_tokens(len(tokens)))
    request.num_computed_tokens = len(tokens)
    pool.commit_full_blocks(request)
    return request


def test_allocate_and_free_count_blocks():
    pool = KVBlockPool(num_blocks=8, block_size=BS)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3
    assert pool.num_free_blocks == 5 and pool.usage == pytest.approx(3 / 8)
    assert all(pool.ref_count(b) == 1 for b in blocks)
    pool.check_invariants({b: 1 for b in blocks})
    pool.free(blocks)
    assert pool.num_free_blocks == 8 and pool.usage == 0.0
    pool.check_invariants({})


def test_exhaustion_and_double_free_raise():
    pool = KVBlockPool(num_blocks=2, block_size=BS)
    assert pool.can_allocate(2) and not pool.can_allocate(3)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(3)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(blocks[:1])


@pytest.mark.parametrize("kwargs", [{"num_blocks": 0, "block_size": 4}, {"num_blocks": 4, "block_size": 0}])
def test_bad_sizes_name_the_parameter(kwargs):
    name = next(k for k, v in kwargs.items() if v == 0)
    with pytest.raises(ValueError, match=name):
        KVBlockPool(**kwargs)


def test_shared_prefix_reuses_blocks():
    pool = KVBlockPool(num_blocks=16, block_size=BS)
    prefix = list(range(100, 108))  # two full blocks
    first = computed_request(pool, "a", prefix + [1, 2, 3])
    blocks, num_cached = pool.match_prefix(prefix + [7, 8, 9, 10, 11])
    assert blocks == first.block_ids[:2] and num_cached == 8
    # Matching takes no references until touched.
    assert pool.ref_count(blocks[0]) == 1
    pool.touch(blocks)
    assert [pool.ref_count(b) for b in blocks] == [2, 2]
    pool.check_invariants({**{b: 1 for b in first.block_ids}, **{b: 2 for b in blocks}})


def test_match_needs_the_whole_chain_not_just_equal_blocks():
    pool = KVBlockPool(num_blocks=16, block_size=BS)
    computed_request(pool, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # Second block equal, first block different: no hit at all.
    assert pool.match_prefix([0, 2, 3, 4, 5, 6, 7, 8, 9]) == ([], 0)
    # First block equal, second different: one block.
    blocks, num_cached = pool.match_prefix([1, 2, 3, 4, 5, 6, 7, 0, 9])
    assert len(blocks) == 1 and num_cached == 4


def test_match_leaves_at_least_one_token_to_compute():
    pool = KVBlockPool(num_blocks=16, block_size=BS)
    tokens = list(range(8))
    computed_request(pool, "a", tokens)
    blocks, num_cached = pool.match_prefix(tokens)  # exactly two cached blocks
    assert num_cached == 4 and len(blocks) == 1
    assert pool.match_prefix(tokens + [99])[1] == 8
    assert pool.match_prefix(tokens[:1]) == ([], 0)


def test_freed_cached_blocks_stay_reusable_until_evicted():
    pool = KVBlockPool(num_blocks=4, block_size=BS)
    tokens = list(range(9))
    request = computed_request(pool, "a", tokens)  # 3 blocks, 2 full and cached
    pool.free(request.block_ids)
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    # The uncached blocks (the partial one and the never-used one) are handed out first.
    fresh = pool.allocate(2)
    assert set(fresh).isdisjoint(request.block_ids[:2])
    assert pool.match_prefix(tokens)[1] == 8
    # Then the cached ones are evicted, the prefix's tail first.
    evicted = pool.allocate(1)
    assert evicted == [request.block_ids[1]]
    assert pool.match_prefix(tokens)[1] == 4
    pool.allocate(1)
    assert pool.match_prefix(tokens) == ([], 0) and pool.num_cached_blocks == 0
    pool.check_invariants()


def test_eviction_is_least_recently_freed_first():
    pool = KVBlockPool(num_blocks=2, block_size=BS)
    old = computed_request(pool, "old", [1, 1, 1, 1, 0])
    pool.free(old.block_ids)
    new = computed_request(pool, "new", [2, 2, 2, 2])  # takes the uncached block, caches nothing (last token)
    pool.free(new.block_ids)
    # new's only block holds a full block of [2,2,2,2]: cached; freed after old's.
    assert pool.num_cached_blocks == 2
    pool.allocate(1)
    assert pool.match_prefix([1, 1, 1, 1, 0])[1] == 0
    assert pool.match_prefix([2, 2, 2, 2, 0])[1] == 4


def test_touching_a_free_cached_block_protects_it_from_eviction():
    pool = KVBlockPool(num_blocks=2, block_size=BS)
    request = computed_request(pool, "a", [5, 5, 5, 5, 6])
    pool.free(request.block_ids)
    blocks, _ = pool.match_prefix([5, 5, 5, 5, 9])
    assert pool.can_allocate(1, blocks) and not pool.can_allocate(2, blocks)
    pool.touch(blocks)
    other = pool.allocate(1)
    assert other != blocks and pool.num_free_blocks == 0
    pool.check_invariants({blocks[0]: 1, other[0]: 1})


def test_duplicate_content_keeps_one_cached_copy():
    pool = KVBlockPool(num_blocks=8, block_size=BS)
    a = computed_request(pool, "a", [3] * 5)
    b = computed_request(pool, "b", [3] * 5)  # computed concurrently: its own block, same content
    assert a.block_ids[0] != b.block_ids[0]
    assert pool.num_cached_blocks == 1
    pool.free(b.block_ids)
    pool.free(a.block_ids)
    pool.check_invariants({})
    assert pool.match_prefix([3] * 5) == ([a.block_ids[0]], 4)


def test_commit_is_incremental_as_a_request_grows():
    pool = KVBlockPool(num_blocks=8, block_size=BS)
    request = Request("a", [1, 2, 3], max_tokens=8)
    request.block_ids = pool.allocate(1)
    request.num_computed_tokens = 3
    pool.commit_full_blocks(request)
    assert pool.num_cached_blocks == 0
    for token in (4, 5, 6):
        request.append_output_token(token)
        request.num_computed_tokens += 1
        if request.num_computed_tokens > len(request.block_ids) * BS:
            request.block_ids += pool.allocate(1)
        pool.commit_full_blocks(request)
    # 6 computed tokens: one full block committed.
    assert request.num_committed_blocks == 1 and pool.num_cached_blocks == 1
    assert pool.match_prefix([1, 2, 3, 4, 5]) == (request.block_ids[:1], 4)


def test_disabled_prefix_caching_never_matches():
    pool = KVBlockPool(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    request = computed_request(pool, "a", list(range(9)))
    assert pool.num_cached_blocks == 0
    assert pool.match_prefix(list(range(9))) == ([], 0)
    pool.free(request.block_ids)
    pool.check_invariants({})


def test_hit_rate_counts_recorded_queries():
    pool = KVBlockPool(num_blocks=4, block_size=BS)
    assert pool.hit_rate == 0.0
    pool.record_prefix_query(10, 0)
    pool.record_prefix_query(10, 8)
    assert (pool.prefix_queries, pool.prefix_query_tokens, pool.prefix_hit_tokens) == (2, 20, 8)
    assert pool.hit_rate == pytest.approx(0.4)


def test_reset_prefix_cache_forgets_free_prefixes_only():
    pool = KVBlockPool(num_blocks=4, block_size=BS)
    kept = computed_request(pool, "kept", [1] * 5)
    gone = computed_request(pool, "gone", [2] * 5)
    pool.free(gone.block_ids)
    pool.reset_prefix_cache()
    assert pool.match_prefix([2] * 5) == ([], 0)
    assert pool.match_prefix([1] * 5)[1] == 4
    pool.check_invariants({b: 1 for b in kept.block_ids})


def test_invariant_check_catches_a_leak():
    pool = KVBlockPool(num_blocks=4, block_size=BS)
    blocks = pool.allocate(2)
    with pytest.raises(AssertionError, match="differ"):
        pool.check_invariants({blocks[0]: 1})
