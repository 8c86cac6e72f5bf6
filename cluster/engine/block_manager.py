"""The paged KV cache's block bookkeeping, with prefix caching.

The cache is ``num_blocks`` blocks of ``block_size`` token slots. The pool hands
out block ids and counts references; it never touches tensors (pure Python, no
torch).

Prefix caching: every FULL block of a request gets a key that chains its
parent's key with the block's token ids, so a key names the whole prefix up to
the end of that block. Committed full blocks are registered under their key. A
later request whose prompt starts with the same tokens takes a reference on the
same blocks (ref count > 1) instead of recomputing them. A registered block
whose last reference goes away stays in the cache, free but reusable, until an
allocation needs it: blocks that hold no cached prefix are handed out first,
then cached ones, least recently freed first (LRU).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterable, Mapping, Sequence

from flotilla.cluster.engine.request import Request

# A block's prefix-cache key: (hash of the parent block's key, this block's token ids).
# NOTE: the dict compares the token tuple exactly, so two blocks share a key only if
# their tokens are equal and their parents' keys hash alike (a 64-bit collision).
# Python does not salt hashes of ints and tuples, so keys are stable across processes.
BlockKey = tuple[int, tuple[int, ...]]
_ROOT_PARENT_HASH = 0


def extend_block_keys(keys: list[BlockKey], token_ids: Sequence[int], num_full_blocks: int, block_size: int) -> None:
    """Append to ``keys`` the keys of full blocks ``len(keys) .. num_full_blocks-1`` of ``token_ids``.

    ``keys`` is a cache (e.g. ``Request.block_hashes``) of the keys already known
    for this token sequence; keys depend only on tokens, so it stays valid as the
    sequence grows.
    """
    parent = hash(keys[-1]) if keys else _ROOT_PARENT_HASH
    for index in range(len(keys), num_full_blocks):
        key = (parent, tuple(token_ids[index * block_size : (index + 1) * block_size]))
        keys.append(key)
        parent = hash(key)


class KVBlockPool:
    """Reference-counted cache blocks with an LRU prefix cache.

    Every block is in exactly one of three states: referenced (ref count >= 1),
    free and uncached, or free and cached (registered under a key, reusable by
    :meth:`match_prefix` until evicted by :meth:`allocate`).

    Args:
        num_blocks: blocks in the cache (>= 1).
        block_size: token slots per block (>= 1).
        enable_prefix_caching: register full blocks and reuse shared prefixes.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1 (got num_blocks={num_blocks!r})")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1 (got block_size={block_size!r})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_keys: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[BlockKey, int] = {}
        self._free_uncached: deque[int] = deque(range(num_blocks))
        # Insertion order is eviction order: the front is the least recently freed.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self.prefix_queries = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- state -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now (uncached free plus cached free)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live requests, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (referenced or free)."""
        return len(self._cached)

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit tokens over queried prompt tokens (0.0 before any query)."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    # ---- allocation ----------------------------------------------------------

    def can_allocate(self, num_new_blocks: int, reusing: Sequence[int] = ()) -> bool:
        """Whether :meth:`allocate` of ``num_new_blocks`` would succeed after
        :meth:`touch` of the cached blocks ``reusing`` (free ones among them
        stop being free)."""
        reused_free = sum(1 for block in reusing if self._ref_counts[block] == 0)
        return num_new_blocks <= self.num_free_blocks - reused_free

    def allocate(self, num_new_blocks: int) -> list[int]:
        """Take ``num_new_blocks`` fresh blocks (ref count 1 each).

        Uncached free blocks go first; then cached free blocks are evicted, least
        recently freed first. Raises RuntimeError if too few blocks are free
        (check :meth:`can_allocate` first).
        """
        if num_new_blocks > self.num_free_blocks:
            raise RuntimeError(
                f"KV block pool exhausted: {num_new_blocks} blocks asked, {self.num_free_blocks} free"
            )
        blocks = []
        for _ in range(num_new_blocks):
            if self._free_uncached:
                block = self._free_uncached.popleft()
            else:
                block, _ = self._free_cached.popitem(last=False)
                del self._cached[self._block_keys[block]]
                self._block_keys[block] = None
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each of ``block_ids`` (cached blocks found by
        :meth:`match_prefix`); a free one leaves the free queue."""
        for block in block_ids:
            if self._ref_counts[block] == 0:
                # NOTE: a free block can only be touched if it is still cached;
                # an uncached free block has no content anyone could match.
                if block not in self._free_cached:
                    raise RuntimeError(f"block {block} is free and uncached; it cannot be reused")
                del self._free_cached[block]
            self._ref_counts[block] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each of ``block_ids`` (a request's blocks in position order).

        Blocks whose count reaches zero become free; cached ones stay reusable.
        NOTE: they join the eviction queue tail first, so a prefix's later blocks
        are evicted before its earlier (more widely shared) ones.
        """
        for block in reversed(block_ids):
            if self._ref_counts[block] <= 0:
                raise RuntimeError(f"block {block} freed more often than it was referenced")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if self._block_keys[block] is None:
                    self._free_uncached.append(block)
                else:
                    self._free_cached[block] = None

    # ---- prefix cache --------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], known_keys: list[BlockKey] | None = None) -> tuple[list[int], int]:
        """The cached blocks holding the longest cached prefix of ``token_ids``.

        Returns ``(block_ids, num_cached_tokens)`` with ``num_cached_tokens ==
        len(block_ids) * block_size``. Takes no references (call :meth:`touch` to
        use them) and records no statistics (see :meth:`record_prefix_query`).
        NOTE: never the whole sequence: at least its last token is left to compute,
        so the model produces logits for the next sample.

        ``known_keys``, if given, caches this sequence's block keys and is extended
        in place (pass ``Request.block_hashes``).
        """
        if not self.enable_prefix_caching:
            return [], 0
        keys = known_keys if known_keys is not None else []
        num_matchable = (len(token_ids) - 1) // self.block_size
        extend_block_keys(keys, token_ids, num_matchable, self.block_size)
        blocks = []
        for key in keys[:num_matchable]:
            block = self._cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def commit_full_blocks(self, request: Request) -> None:
        """Register ``request``'s newly filled blocks in the prefix cache.

        A block counts once all its tokens are computed (``num_computed_tokens``).
        If another block already holds the same prefix (two requests computed it
        in the same step), this one stays unregistered and is plain free later.
        """
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if not self.enable_prefix_caching or num_full <= request.num_committed_blocks:
            return
        extend_block_keys(request.block_hashes, request.all_token_ids, num_full, self.block_size)
        for index in range(request.num_committed_blocks, num_full):
            block = request.block_ids[index]
            key = request.block_hashes[index]
            if self._block_keys[block] is None and key not in self._cached:
                self._cached[key] = block
                self._block_keys[block] = key
        request.num_committed_blocks = num_full

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix lookup for :attr:`hit_rate`."""
        self.prefix_queries += 1
        self.prefix_query_tokens += num_query_tokens
        self.prefix_hit_tokens += num_hit_tokens

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix that no live request uses (e.g. between benchmark runs)."""
        while self._free_cached:
            block, _ = self._free_cached.popitem(last=False)
            del self._cached[self._block_keys[block]]
            self._block_keys[block] = None
            self._free_uncached.append(block)

    # ---- checks ----------------------------------------------------------------

    def check_invariants(self, expected_refs: Mapping[int, int] | None = None) -> None:
        """Raise AssertionError unless the bookkeeping is consistent.

        Every block is exactly one of referenced, free-uncached or free-cached;
        the key index matches the blocks' keys. With ``expected_refs`` (block id
        -> references held by live requests), ref counts must equal it exactly:
        no leaked and no over-freed blocks.
        """
        uncached = set(self._free_uncached)
        assert len(uncached) == len(self._free_uncached), "a block is twice in the uncached free queue"
        cached_free = set(self._free_cached)
        assert not uncached & cached_free, f"blocks in both free queues: {sorted(uncached & cached_free)}"
        for block in range(self.num_blocks):
            refs = self._ref_counts[block]
            is_free = block in uncached or block in cached_free
            assert refs >= 0, f"block {block} has ref count {refs}"
            assert (refs == 0) == is_free, f"block {block}: ref count {refs} but free={is_free}"
            key = self._block_keys[block]
            if key is None:
                assert block not in cached_free, f"block {block} is in the cached free queue without a key"
            else:
                assert self._cached.get(key) == block, f"block {block}'s key is not indexed to it"
                assert block not in uncached, f"cached block {block} is in the uncached free queue"
        assert len(self._cached) == sum(key is not None for key in self._block_keys), "key index has stale entries"
        if expected_refs is not None:
            actual = {block: refs for block, refs in enumerate(self._ref_counts) if refs}
            expected = {block: refs for block, refs in expected_refs.items() if refs}
            assert actual == expected, f"ref counts {actual} differ from live requests' references {expected}"
