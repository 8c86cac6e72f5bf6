"""Property tests for cluster/eplb.py (seeded random loops; hypothesis is not installed)."""

import random

import pytest

from flotilla.cluster.eplb import (
    ExpertPlacement,
    balanced_placement,
    choose_replica,
    grow_placement,
    rank_loads,
    trivial_placement,
)


def _random_cases(n=300, seed=0):
    """(num_logical, ep_size, num_physical, load) over many sizes, including skewed loads."""
    rng = random.Random(seed)
    for _ in range(n):
        num_logical = rng.randint(1, 40)
        ep_size = rng.randint(1, 8)
        spr = -(-num_logical // ep_size) + rng.randint(0, 3)
        num_physical = spr * ep_size
        kind = rng.choice(["uniform", "skewed", "zeros", "one_hot"])
        if kind == "uniform":
            load = [rng.random() for _ in range(num_logical)]
        elif kind == "skewed":
            load = [rng.paretovariate(1.0) * rng.randint(0, 100) for _ in range(num_logical)]
        elif kind == "zeros":
            load = [0.0] * num_logical
        else:
            load = [0.0] * num_logical
            load[rng.randrange(num_logical)] = 1000.0
        yield num_logical, ep_size, num_physical, load


def _check_invariants(p: ExpertPlacement):
    assert len(p.phy2log) == p.num_physical
    assert p.num_physical % p.ep_size == 0
    # Every logical expert has at least one replica.
    assert all(len(slots) >= 1 for slots in p.log2phy)
    # phy2log and log2phy are inverse.
    for e, slots in enumerate(p.log2phy):
        for s in slots:
            assert p.phy2log[s] == e
    assert sorted(s for slots in p.log2phy for s in slots) == list(range(p.num_physical))
    # Slots per rank are equal and partition the slot range.
    sizes = [len(p.slots_of_rank(r)) for r in range(p.ep_size)]
    assert sizes == [p.num_physical // p.ep_size] * p.ep_size
    assert [p.rank_of_slot(s) for s in range(p.num_physical)] == [
        r for r in range(p.ep_size) for _ in p.slots_of_rank(r)
    ]


def test_trivial_placement_without_redundancy_is_identity():
    p = trivial_placement(8, 4)
    assert p.phy2log == tuple(range(8))
    assert p.log2phy == tuple((e,) for e in range(8))
    assert list(p.slots_of_rank(1)) == [2, 3]
    assert p.local_expert_map(1) == [-1, -1, 0, 1, -1, -1, -1, -1]
    assert p.local_logical_experts(3) == [6, 7]


def test_trivial_placement_appends_redundant_copies_in_order():
    p = trivial_placement(4, 2, num_redundant=2)
    assert p.phy2log == (0, 1, 2, 3, 0, 1)
    assert p.log2phy == ((0, 4), (1, 5), (2,), (3,))
    _check_invariants(p)


@pytest.mark.parametrize("seed", range(3))
def test_trivial_placement_invariants_over_many_sizes(seed):
    for num_logical, ep_size, num_physical, _ in _random_cases(seed=seed):
        _check_invariants(trivial_placement(num_logical, ep_size, num_physical - num_logical))


def test_slot_count_not_divisible_by_ep_size_names_values():
    with pytest.raises(ValueError, match=r"num_physical=7.*ep_size=2"):
        trivial_placement(7, 2)
    with pytest.raises(ValueError, match=r"num_physical=9.*ep_size=4"):
        balanced_placement([1.0] * 8, 4, 9)
    with pytest.raises(ValueError, match=r"num_physical=4.*num_logical=8"):
        balanced_placement([1.0] * 8, 4, 4)


def test_bad_load_and_bad_maps_are_rejected():
    with pytest.raises(ValueError, match=r"load has 3 entries"):
        grow_placement(trivial_placement(4, 2), 4, [1.0] * 3)
    with pytest.raises(ValueError, match=r"load\[1\]=-1"):
        balanced_placement([1.0, -1.0], 2, 2)
    with pytest.raises(ValueError, match="logical expert 2 has no physical slot"):
        ExpertPlacement.from_phy2log([0, 1, 0, 1], num_logical=3, ep_size=2)
    with pytest.raises(ValueError, match="does not map it back"):
        ExpertPlacement(num_logical=2, num_physical=2, ep_size=1, phy2log=(0, 1), log2phy=((1,), (0,)))
    with pytest.raises(ValueError, match=r"rank=2"):
        trivial_placement(4, 2).slots_of_rank(2)


@pytest.mark.parametrize("seed", range(3))
def test_balanced_placement_invariants_and_never_worse_than_trivial(seed):
    for num_logical, ep_size, num_physical, load in _random_cases(seed=seed):
        p = balanced_placement(load, ep_size, num_physical)
        _check_invariants(p)
        trivial = trivial_placement(num_logical, ep_size, num_physical - num_logical)
        # NOTE: small relative slack only for float summation order; the function compares the
        # same quantities itself.
        assert max(rank_loads(p, load)) <= max(rank_loads(trivial, load)) * (1 + 1e-12) + 1e-12


def test_balanced_placement_replicates_the_hot_expert_and_beats_trivial():
    load = [100.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    p = balanced_placement(load, ep_size=4, num_physical=12)
    # The hot expert gets one copy per rank (more would share a rank and add no capacity).
    assert len(p.log2phy[0]) == 4
    assert len({p.rank_of_slot(s) for s in p.log2phy[0]}) == 4
    trivial = trivial_placement(8, 4, num_redundant=4)
    assert max(rank_loads(p, load)) < max(rank_loads(trivial, load))


@pytest.mark.parametrize("seed", range(3))
def test_grow_keeps_old_slots_and_covers_every_expert(seed):
    rng = random.Random(100 + seed)
    for num_logical, ep_size, num_physical, load in _random_cases(n=200, seed=seed):
        old = balanced_placement(load, ep_size, num_physical)
        new_ep_size = ep_size + rng.randint(0, 4)
        new_load = [x * rng.random() for x in load]
        grown = grow_placement(old, new_ep_size, new_load)
        _check_invariants(grown)
        assert grown.ep_size == new_ep_size
        assert grown.slots_per_rank == old.slots_per_rank
        assert grown.phy2log[: old.num_physical] == old.phy2log
        for r in range(ep_size):
            assert grown.slots_of_rank(r) == old.slots_of_rank(r)
            assert grown.local_logical_experts(r) == old.local_logical_experts(r)
        for e in range(num_logical):
            assert grown.log2phy[e][: len(old.log2phy[e])] == old.log2phy[e]


def test_grow_gives_new_slots_to_the_heaviest_experts():
    old = trivial_placement(8, 2)  # 4 slots per rank
    grown = grow_placement(old, 4, load=[100.0, 50.0] + [1.0] * 6)
    assert grown.phy2log[:8] == tuple(range(8))
    # 8 new slots on 2 joining ranks: experts 0 and 1 take one copy per joining rank (the cap),
    # the remaining 4 slots go to the lightest-tied experts by id.
    assert sorted(grown.phy2log[8:]) == [0, 0, 1, 1, 2, 3, 4, 5]
    for e in (0, 1):
        assert len({grown.rank_of_slot(s) for s in grown.log2phy[e]}) == 3


def test_grow_rejects_shrinking():
    with pytest.raises(ValueError, match=r"new_ep_size=1.*ep_size=2"):
        grow_placement(trivial_placement(4, 2), 1, [1.0] * 4)


@pytest.mark.parametrize("seed", range(3))
def test_choose_replica_is_deterministic_and_valid(seed):
    for num_logical, ep_size, num_physical, load in _random_cases(n=100, seed=seed):
        p = balanced_placement(load, ep_size, num_physical)
        seen = {e: set() for e in range(num_logical)}
        for e in range(num_logical):
            for row in range(3 * num_physical):
                slot = choose_replica(p.log2phy, e, row)
                assert slot == choose_replica(p.log2phy, e, row)
                assert p.phy2log[slot] == e
                seen[e].add(slot)
        # Cycling rows reaches every replica (even split of load).
        assert all(seen[e] == set(p.log2phy[e]) for e in range(num_logical))


def test_dispatch_and_local_maps_route_each_token_to_exactly_one_rank():
    """Under the `none` backend each (token, expert) pair must be computed by exactly one rank."""
    p = balanced_placement([9.0, 1.0, 1.0, 5.0, 1.0, 1.0], ep_size=2, num_physical=8)
    rng = random.Random(0)
    topk_ids = [[rng.randrange(6) for _ in range(2)] for _ in range(50)]
    slots = p.dispatch_slots(topk_ids)
    maps = [p.local_expert_map(r) for r in range(p.ep_size)]
    for ids, row in zip(topk_ids, slots):
        for e, slot in zip(ids, row):
            holders = [r for r in range(p.ep_size) if maps[r][slot] >= 0]
            assert len(holders) == 1
            local = maps[holders[0]][slot]
            assert p.local_logical_experts(holders[0])[local] == e
