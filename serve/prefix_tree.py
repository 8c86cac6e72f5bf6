"""An approximate radix tree of the prompts a router sent to each replica, one KV block per edge.

The cache-aware router (:class:`~flotilla.serve.router.CacheAwareRouter`) keeps one
:class:`PrefixTree` for its deployment. Every prompt it routes is cut into full KV blocks of
``block_size`` tokens (only full blocks enter an engine's prefix cache); the path of those
blocks from the root is inserted under the replica it went to. For a new prompt,
:meth:`PrefixTree.match` walks the same path and says, per replica, how many leading blocks
that replica was sent before: the blocks it likely still holds in its prefix cache.

It is approximate on purpose (SGLang's gateway and Ray Serve LLM's prefix-aware router are
too): the tree records what the router sent, not what the engine kept, so it can believe in a
block the engine has evicted; each replica's share of the tree is bounded (``capacity_blocks``,
least recently routed dropped first) to stay near what a KV cache can hold. The routers of
several ingress replicas share one tree per pool (:mod:`~flotilla.serve.shared_prefix_tree`).

NOTE (invariant): a replica holding a node holds every ancestor of it. Insertion touches the
path from the leaf up, so an ancestor is always at least as recently used as its descendants
and eviction, which drops a replica's least recently used node first, removes descendants
before their ancestors.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator, Sequence

# Blocks of one replica's share of the tree, by default: 1 Mi tokens at 16 tokens a block, more
# than a CPU engine's KV cache holds; a deployment passes its own from the KV pool size.
DEFAULT_CAPACITY_BLOCKS = 65536


def block_keys(token_ids: Sequence[int], block_size: int) -> list[tuple[int, ...]]:
    """The prompt's full blocks of ``block_size`` tokens, in order (a last partial block is
    left out: the engine does not cache it either)."""
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be at least 1")
    full = len(token_ids) - len(token_ids) % block_size
    return [tuple(token_ids[i : i + block_size]) for i in range(0, full, block_size)]


class _Node:
    __slots__ = ("parent", "key", "children", "holders")

    def __init__(self, parent: "_Node | None", key: tuple[int, ...] | None):
        self.parent = parent
        self.key = key
        self.children: dict[tuple[int, ...], _Node] = {}
        self.holders: set[Hashable] = set()


class PrefixTree:
    """Which replica was sent which prompt prefix, block by block.

    Args:
        block_size: tokens per KV block (the engines' page size).
        capacity_blocks: the most nodes one replica holds; the least recently routed go first.
    """

    def __init__(self, block_size: int, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS):
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be at least 1")
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks={capacity_blocks} must be at least 1")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._root = _Node(None, None)
        # Per replica: its nodes, least recently routed first.
        self._lru: dict[Hashable, OrderedDict[_Node, None]] = {}

    def blocks(self, token_ids: Sequence[int]) -> list[tuple[int, ...]]:
        """``token_ids`` cut into this tree's blocks (see :func:`block_keys`)."""
        return block_keys(token_ids, self.block_size)

    def match(self, blocks: Sequence[tuple[int, ...]]) -> dict[Hashable, int]:
        """For each replica holding at least the first block: how many leading ``blocks`` it
        holds. Replicas holding none are absent."""
        matched: dict[Hashable, int] = {}
        alive: set[Hashable] | None = None
        for depth, node in enumerate(self._walk(blocks), start=1):
            alive = set(node.holders) if alive is None else alive & node.holders
            if not alive:
                break
            for replica in alive:
                matched[replica] = depth
        return matched

    def insert(self, blocks: Sequence[tuple[int, ...]], replica: Hashable) -> None:
        """Record that ``replica`` was sent a prompt starting with ``blocks``."""
        if not blocks:
            return
        path: list[_Node] = []
        node = self._root
        for key in blocks:
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(node, key)
            path.append(child)
            node = child
        lru = self._lru.setdefault(replica, OrderedDict())
        for node in reversed(path):  # leaf first: ancestors end up most recent (module NOTE)
            node.holders.add(replica)
            lru[node] = None
            lru.move_to_end(node)
        while len(lru) > self.capacity_blocks:
            oldest, _ = lru.popitem(last=False)
            self._drop(oldest, replica)

    def forget(self, replica: Hashable) -> None:
        """Drop everything ``replica`` holds (it died: its cache is gone)."""
        for node in list(self._lru.pop(replica, ())):
            self._drop(node, replica)

    def size(self, replica: Hashable) -> int:
        """Blocks ``replica`` holds in the tree."""
        return len(self._lru.get(replica, ()))

    def __len__(self) -> int:
        """Nodes in the tree (any replica's)."""
        count, stack = 0, list(self._root.children.values())
        while stack:  # NOTE: iterative: a long prompt's path is deeper than Python's recursion limit
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count

    def _walk(self, blocks: Sequence[tuple[int, ...]]) -> Iterator[_Node]:
        node = self._root
        for key in blocks:
            node = node.children.get(key)
            if node is None:
                return
            yield node

    def _drop(self, node: _Node, replica: Hashable) -> None:
        node.holders.discard(replica)
        # Prune nodes nobody holds and that lead nowhere, up the path.
        while node.parent is not None and not node.holders and not node.children:
            del node.parent.children[node.key]
            node = node.parent
