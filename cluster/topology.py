"""Rank topology of one engine group: pure rank math, the single place that knows the parallel layout.

One engine group is ``world_size`` ranks (SGLang's ``tp_size``; pipeline parallelism is not
supported, so the group is exactly one TP world). The same ranks are read through two views:

* **Attention view** ``(attn_dp, attn_cp, attn_tp)``, attn_tp fastest::

      rank = (attn_dp * attn_cp_size + attn_cp) * attn_tp_size + attn_tp

  ``attn_dp_size`` is ``dp_size`` with DP attention on and 1 otherwise (with it off, ``dp_size``
  counts independent replicas, each its own engine group, which this module never sees);
  ``attn_tp_size = world_size // attn_dp_size // attn_cp_size``.
* **MoE view** ``(moe_dp, ep, moe_tp)``, moe_tp fastest::

      rank = (moe_dp * ep_size + ep) * moe_tp_size + moe_tp

  with ``moe_tp_size = world_size // (ep_size * moe_dp_size)``.

Decode context parallelism (DCP) splits each attention-TP group into consecutive slices of
``dcp_size`` ranks; a rank's DCP coordinate is ``attn_tp % dcp_size`` (the KV shard it owns).

The layout matches SGLang's ``initialize_model_parallel`` and ``compute_dp_attention_world_info``
so that checkpoints sharded, and rank-ordered collectives written, against one read the same on
the other. Nothing here imports torch or ray: workers read their coordinates and group member
lists from a :class:`Topology` and create process groups from those lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # NOTE: type-only; the topology is plain integers and needs no resolution code at run time.
    from flotilla.resolution.config import ResolvedConfig

# Every group kind, in the order :meth:`Topology.groups_of` reports them.
GROUP_NAMES = ("tp", "attn_tp", "attn_cp", "attn_dp", "dcp", "ep", "moe_tp", "moe_dp")

RankGroups = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class RankCoords:
    """One rank's coordinates in both views.

    Attributes:
        attn_dp: attention data-parallel index (which scheduler and KV cache the rank serves).
        attn_cp: attention context-parallel index.
        attn_tp: index within its attention-TP group (which heads it holds).
        moe_dp: MoE data-parallel index.
        ep: expert-parallel index (which experts it holds).
        moe_tp: index within its MoE-TP group (which slice of each expert it holds).
        dcp: index within its DCP group (which token shard of the KV cache it owns).
    """

    attn_dp: int
    attn_cp: int
    attn_tp: int
    moe_dp: int
    ep: int
    moe_tp: int
    dcp: int


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer (got {name}={value!r})")


@dataclass(frozen=True)
class Topology:
    """The parallel layout of one engine group; built by :meth:`from_config` or :meth:`create`.

    Attributes:
        world_size: ranks in the engine group (SGLang's ``tp_size``): every dense layer's TP world.
        attn_dp_size: attention data-parallel width (``dp_size`` with DP attention on, else 1).
        attn_cp_size: attention context-parallel width.
        dcp_size: decode context-parallel width, a slice of attention TP.
        ep_size: expert-parallel width.
        moe_dp_size: MoE data-parallel width.

    Group properties (``tp_groups``, ``attn_tp_groups``, ...) return every group of that kind as
    a tuple of rank tuples, each sorted ascending and the whole sorted by first rank; every kind
    partitions ``range(world_size)``. Invalid layouts raise ``ValueError`` naming the sizes.
    """

    world_size: int
    attn_dp_size: int = 1
    attn_cp_size: int = 1
    dcp_size: int = 1
    ep_size: int = 1
    moe_dp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "attn_dp_size", "attn_cp_size", "dcp_size", "ep_size", "moe_dp_size"):
            _positive(name, getattr(self, name))
        world, dp, cp = self.world_size, self.attn_dp_size, self.attn_cp_size
        if world % cp:
            raise ValueError(
                f"tp_size (the engine group's world size) must be divisible by attn_cp_size "
                f"(got tp_size={world}, attn_cp_size={cp})"
            )
        if world % (dp * cp):
            raise ValueError(
                f"tp_size must be divisible by dp_size * attn_cp_size with DP attention "
                f"(got tp_size={world}, dp_size={dp}, attn_cp_size={cp})"
            )
        attn_tp = world // (dp * cp)
        if attn_tp % self.dcp_size:
            raise ValueError(
                f"dcp_size must divide the attention TP size tp_size // dp_size // attn_cp_size "
                f"(got dcp_size={self.dcp_size}, attention TP size={attn_tp} from tp_size={world}, "
                f"dp_size={dp}, attn_cp_size={cp})"
            )
        ep, moe_dp = self.ep_size, self.moe_dp_size
        if ep * moe_dp > world or world % (ep * moe_dp):
            raise ValueError(
                f"ep_size * moe_dp_size must divide tp_size, the rest being MoE TP "
                f"(got ep_size={ep}, moe_dp_size={moe_dp}, tp_size={world})"
            )
        if moe_dp > 1 and ep > 1 and ep * moe_dp != world:
            raise ValueError(
                f"ep_size * moe_dp_size must equal tp_size when both exceed 1 "
                f"(got ep_size={ep}, moe_dp_size={moe_dp}, tp_size={world})"
            )
        # NOTE: SGLang's MoE-DP token exchange reuses the attention-CP group, so a MoE-DP width
        # other than 1 must match attn_cp_size (the seed's context-parallel handler).
        if moe_dp > 1 and moe_dp != cp:
            raise ValueError(
                f"moe_dp_size > 1 requires moe_dp_size == attn_cp_size "
                f"(got moe_dp_size={moe_dp}, attn_cp_size={cp})"
            )

    # -- builders --------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: "ResolvedConfig") -> "Topology":
        """The topology a resolved configuration describes.

        Reads ``tp_size``, ``pp_size``, ``dp_size``, ``enable_dp_attention``, ``attn_cp_size``,
        ``dcp_size``, ``ep_size`` and ``moe_dp_size``. Raises ``ValueError`` for ``pp_size != 1``
        (pipeline parallelism is not supported) and for any invalid layout.
        """
        if config.pp_size != 1:
            raise ValueError(
                f"pipeline parallelism is not supported: pp_size must be 1 (got pp_size={config.pp_size}); "
                f"use tp_size, ep_size or DP attention instead"
            )
        return cls(
            world_size=config.tp_size,
            attn_dp_size=config.dp_size if config.enable_dp_attention else 1,
            attn_cp_size=config.attn_cp_size,
            dcp_size=config.dcp_size,
            ep_size=config.ep_size,
            moe_dp_size=config.moe_dp_size,
        )

    @classmethod
    def create(
        cls, *, world_size: int, dp: int = 1, attn_cp: int = 1, dcp: int = 1, ep: int = 1, moe_dp: int = 1
    ) -> "Topology":
        """A topology from sizes directly; ``dp`` is the attention-DP width (DP attention on)."""
        return cls(world_size, attn_dp_size=dp, attn_cp_size=attn_cp, dcp_size=dcp, ep_size=ep, moe_dp_size=moe_dp)

    # -- derived sizes ---------------------------------------------------------------------

    @property
    def attn_tp_size(self) -> int:
        """Ranks that split one attention layer's heads: ``world // attn_dp // attn_cp``."""
        return self.world_size // (self.attn_dp_size * self.attn_cp_size)

    @property
    def moe_tp_size(self) -> int:
        """Ranks that split each expert's weights: ``world // (ep * moe_dp)``."""
        return self.world_size // (self.ep_size * self.moe_dp_size)

    # -- coordinates -----------------------------------------------------------------------

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}) (got rank={rank!r})")

    def coords(self, rank: int) -> RankCoords:
        """``rank``'s coordinates in the attention view, the MoE view and its DCP group."""
        self._check_rank(rank)
        attn_block, attn_tp = divmod(rank, self.attn_tp_size)
        attn_dp, attn_cp = divmod(attn_block, self.attn_cp_size)
        moe_block, moe_tp = divmod(rank, self.moe_tp_size)
        moe_dp, ep = divmod(moe_block, self.ep_size)
        return RankCoords(attn_dp, attn_cp, attn_tp, moe_dp, ep, moe_tp, dcp=attn_tp % self.dcp_size)

    def attention_rank(self, attn_dp: int, attn_cp: int, attn_tp: int) -> int:
        """The rank at attention coordinates ``(attn_dp, attn_cp, attn_tp)``."""
        for name, value, size in (
            ("attn_dp", attn_dp, self.attn_dp_size),
            ("attn_cp", attn_cp, self.attn_cp_size),
            ("attn_tp", attn_tp, self.attn_tp_size),
        ):
            if not 0 <= value < size:
                raise ValueError(f"{name} must be in [0, {size}) (got {name}={value})")
        return (attn_dp * self.attn_cp_size + attn_cp) * self.attn_tp_size + attn_tp

    def moe_rank(self, moe_dp: int, ep: int, moe_tp: int) -> int:
        """The rank at MoE coordinates ``(moe_dp, ep, moe_tp)``."""
        for name, value, size in (
            ("moe_dp", moe_dp, self.moe_dp_size),
            ("ep", ep, self.ep_size),
            ("moe_tp", moe_tp, self.moe_tp_size),
        ):
            if not 0 <= value < size:
                raise ValueError(f"{name} must be in [0, {size}) (got {name}={value})")
        return (moe_dp * self.ep_size + ep) * self.moe_tp_size + moe_tp

    @property
    def attn_dp_leaders(self) -> tuple[int, ...]:
        """The first rank of each attention-DP block (attn_cp == attn_tp == 0), by attn_dp index:
        the rank that owns that DP rank's scheduler output."""
        return tuple(self.attention_rank(dp, 0, 0) for dp in range(self.attn_dp_size))

    # -- groups ----------------------------------------------------------------------------

    def _strided(self, size: int, stride: int) -> RankGroups:
        """Groups of ``size`` ranks spaced ``stride`` apart, tiling the world in blocks of size*stride."""
        block = size * stride
        return tuple(
            tuple(range(start + offset, start + block, stride))
            for start in range(0, self.world_size, block)
            for offset in range(stride)
        )

    @property
    def tp_groups(self) -> RankGroups:
        """The whole engine group: dense layers (and the LM head) shard across every rank."""
        return (tuple(range(self.world_size)),)

    @property
    def attn_tp_groups(self) -> RankGroups:
        """Consecutive blocks of ``attn_tp_size`` ranks sharing (attn_dp, attn_cp)."""
        return self._strided(self.attn_tp_size, 1)

    @property
    def attn_cp_groups(self) -> RankGroups:
        """Ranks sharing (attn_dp, attn_tp): ``attn_cp_size`` ranks, ``attn_tp_size`` apart."""
        return self._strided(self.attn_cp_size, self.attn_tp_size)

    @property
    def attn_dp_groups(self) -> RankGroups:
        """Ranks sharing (attn_cp, attn_tp) across DP ranks: ``attn_dp_size`` ranks,
        ``attn_cp_size * attn_tp_size`` apart."""
        return self._strided(self.attn_dp_size, self.attn_cp_size * self.attn_tp_size)

    @property
    def dcp_groups(self) -> RankGroups:
        """Consecutive slices of ``dcp_size`` ranks; each lies inside one attention-TP group."""
        return self._strided(self.dcp_size, 1)

    @property
    def ep_groups(self) -> RankGroups:
        """Ranks sharing (moe_dp, moe_tp): ``ep_size`` ranks, ``moe_tp_size`` apart."""
        return self._strided(self.ep_size, self.moe_tp_size)

    @property
    def moe_tp_groups(self) -> RankGroups:
        """Consecutive blocks of ``moe_tp_size`` ranks sharing (moe_dp, ep)."""
        return self._strided(self.moe_tp_size, 1)

    @property
    def moe_dp_groups(self) -> RankGroups:
        """Ranks sharing (ep, moe_tp): ``moe_dp_size`` ranks, ``ep_size * moe_tp_size`` apart.

        NOTE: with ``attn_cp_size > moe_dp_size`` SGLang exchanges MoE tokens over the
        attention-CP group instead; callers that need that exchange use ``attn_cp_groups``.
        """
        return self._strided(self.moe_dp_size, self.ep_size * self.moe_tp_size)

    def groups(self, name: str) -> RankGroups:
        """Every group of kind ``name`` (one of :data:`GROUP_NAMES`)."""
        if name not in GROUP_NAMES:
            raise ValueError(f"unknown group kind {name!r}; choose from {', '.join(GROUP_NAMES)}")
        return getattr(self, f"{name}_groups")

    def groups_of(self, rank: int) -> dict[str, tuple[int, ...]]:
        """The group of each kind that ``rank`` belongs to, keyed by :data:`GROUP_NAMES`."""
        self._check_rank(rank)
        return {name: next(g for g in self.groups(name) if rank in g) for name in GROUP_NAMES}
