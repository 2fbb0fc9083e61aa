"""The engine seam for process groups: a :class:`Topology` is built once per process.

Every group may be of size one, so the same model code runs on one rank and on many. Groups are
compared by their rank sets, never by object identity, because engines often create equal groups
twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist

from ._layout import SumGroup

__all__ = ["GroupInfo", "Topology"]


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """One process group as the boundary sees it.

    ``ranks`` are global ranks in group order; ``rank`` is this process's index in the group;
    ``group`` is the torch.distributed handle (``None`` for a group of one).
    """

    ranks: tuple[int, ...]
    rank: int
    group: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("GroupInfo.ranks is empty; a group holds at least this rank")
        if not 0 <= self.rank < len(self.ranks):
            raise ValueError(f"GroupInfo.rank {self.rank} is outside the group of size {len(self.ranks)}")
        if len(self.ranks) > 1 and self.group is None:
            raise ValueError(
                f"group over ranks {self.ranks} has no torch.distributed handle; "
                "pass the ProcessGroup created with torch.distributed.new_group"
            )

    @property
    def size(self) -> int:
        return len(self.ranks)

    @classmethod
    def solo(cls, global_rank: int = 0) -> "GroupInfo":
        return cls(ranks=(global_rank,), rank=0)

    @classmethod
    def of(cls, group: Any) -> "GroupInfo":
        """Describe an existing torch.distributed group (``None`` means the default group)."""
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        return cls(ranks=ranks, rank=ranks.index(dist.get_rank()), group=group or dist.group.WORLD)


@dataclass(frozen=True, slots=True)
class Topology:
    """Process groups a boundary may communicate over.

    ``tp`` is the full tensor-parallel group, ``attn_tp`` the attention-TP group inside one
    attention-DP replica (``tp`` = ``attn_dp`` x ``attn_tp``), ``attn_cp`` the context-parallel
    group, ``moe_out`` the group over which MoE outputs are summed, and ``pp`` the pipeline group.

    Context parallelism splits attention TP: ``attn_tp`` = ``attn_cp`` x ``attn_heads``. The ranks
    of one CP group hold different tokens of the same heads, so attention heads (and the
    vocabulary of the embedding and LM head, whose ranks must hold the same rows) are sharded over
    ``attn_heads``, the attention-TP ranks that share this rank's CP position; the attention's
    partial sum (``SumGroup.ATTN_TP``) runs over it. Without CP it is ``attn_tp`` itself.
    """

    tp: GroupInfo
    attn_tp: GroupInfo
    attn_dp: GroupInfo
    attn_cp: GroupInfo
    moe_out: GroupInfo
    pp: GroupInfo
    attn_heads: Optional[GroupInfo] = None

    def __post_init__(self) -> None:
        if self.attn_heads is None:
            if self.attn_cp.size > 1:
                raise ValueError(
                    f"a context-parallel topology (attn_cp of {self.attn_cp.size} ranks) needs "
                    "attn_heads, the attention-TP ranks sharing this rank's CP position; build the "
                    "groups with Topology.from_sizes(cp=...)"
                )
            object.__setattr__(self, "attn_heads", self.attn_tp)
        self._check_cp()
        if self.attn_tp.size * self.attn_dp.size != self.tp.size:
            raise ValueError(
                f"attention TP ({self.attn_tp.size}) x attention DP ({self.attn_dp.size}) must equal "
                f"TP ({self.tp.size}); build the groups with Topology.from_sizes or fix the sizes"
            )
        # Row moves over the TP group (reduce-scatter, gathers) rely on this rank order: attention
        # DP outer, attention TP inner.
        expected = self.attn_dp.rank * self.attn_tp.size + self.attn_tp.rank
        if self.tp.rank != expected:
            raise ValueError(
                f"this rank is TP rank {self.tp.rank} but attention DP rank {self.attn_dp.rank} x "
                f"attention TP size {self.attn_tp.size} + attention TP rank {self.attn_tp.rank} = "
                f"{expected}; order the TP group's ranks DP-group by DP-group (Topology.from_sizes does)"
            )

    def _check_cp(self) -> None:
        cp, heads, a = self.attn_cp, self.attn_heads, self.attn_tp
        assert heads is not None
        if cp.size * heads.size != a.size:
            raise ValueError(
                f"attention CP ({cp.size}) x attention heads ({heads.size}) must equal attention TP "
                f"({a.size}); build the groups with Topology.from_sizes or fix the sizes"
            )
        if cp.size == 1:
            return
        # The CP row moves (adapters in layer_boundary._cp) rely on this rank order inside attention
        # TP: CP groups are consecutive blocks, head groups the strides across them, so attention-TP
        # rank t sits at CP rank t % cp.
        c = a.rank // cp.size
        block = a.ranks[c * cp.size : (c + 1) * cp.size]
        stride = a.ranks[a.rank % cp.size :: cp.size]
        if cp.ranks != block or heads.ranks != stride or cp.rank != a.rank % cp.size:
            raise ValueError(
                f"attention TP ranks {a.ranks} with CP group {cp.ranks} and head group {heads.ranks}: "
                f"CP groups must be consecutive blocks of {cp.size} attention-TP ranks and head groups "
                "the ranks at one position of every block (Topology.from_sizes builds them so)"
            )

    @classmethod
    def single(cls) -> "Topology":
        """Every group of size one: the single-rank model."""
        solo = GroupInfo.solo()
        return cls(tp=solo, attn_tp=solo, attn_dp=solo, attn_cp=solo, moe_out=solo, pp=solo)

    @classmethod
    def from_sizes(cls, *, tp: int = 1, dp: int = 1, cp: int = 1, pp: int = 1) -> "Topology":
        """Create the groups from plain sizes on an initialized default group.

        Global rank layout (outermost first): pipeline stage, then TP (attention DP outer,
        attention TP inner). Context parallelism splits attention TP (``cp`` divides ``tp // dp``).
        Every process must call this with the same sizes, as torch.distributed.new_group requires.
        """
        for name, v in (("tp", tp), ("dp", dp), ("cp", cp), ("pp", pp)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Topology.from_sizes: {name}={v!r} must be a positive integer")
        if tp % dp:
            raise ValueError(f"tp={tp} is not divisible by dp={dp}; attention DP splits the TP group")
        world = tp * pp
        if not dist.is_initialized():
            if world == 1:
                return cls.single()
            raise RuntimeError(
                f"Topology.from_sizes(tp={tp}, pp={pp}) needs {world} processes but torch.distributed "
                "is not initialized; call torch.distributed.init_process_group first (torchrun does)"
            )
        if dist.get_world_size() != world:
            raise ValueError(
                f"tp={tp} x pp={pp} = {world} ranks, but the default group has {dist.get_world_size()}"
            )
        me = dist.get_rank()
        attn_tp = tp // dp
        if attn_tp % cp:
            raise ValueError(f"cp={cp} must divide the attention-TP size {attn_tp}")

        def build(partitions: list[list[int]]) -> GroupInfo:
            # new_group is collective over the whole world, so every partition is created everywhere.
            mine = None
            for ranks in partitions:
                handle = dist.new_group(ranks) if len(ranks) > 1 else None
                if me in ranks:
                    mine = GroupInfo(tuple(ranks), ranks.index(me), handle)
            assert mine is not None
            return mine

        stages = [list(range(s * tp, (s + 1) * tp)) for s in range(pp)]
        tp_g = build(stages)
        attn_tp_g = build([st[d * attn_tp : (d + 1) * attn_tp] for st in stages for d in range(dp)])
        attn_dp_g = build([st[i::attn_tp] for st in stages for i in range(attn_tp)])
        cp_g = build(
            [
                st[d * attn_tp : (d + 1) * attn_tp][c * cp : (c + 1) * cp]
                for st in stages
                for d in range(dp)
                for c in range(attn_tp // cp)
            ]
        )
        heads_g = (
            build([st[d * attn_tp : (d + 1) * attn_tp][j::cp] for st in stages for d in range(dp)
                   for j in range(cp)])
            if cp > 1 else attn_tp_g
        )
        pp_g = build([list(range(i, world, tp)) for i in range(tp)])
        return cls(tp=tp_g, attn_tp=attn_tp_g, attn_dp=attn_dp_g, attn_cp=cp_g, moe_out=tp_g, pp=pp_g,
                   attn_heads=heads_g)

    def sum_group(self, which: SumGroup) -> GroupInfo:
        if which is SumGroup.ATTN_TP:
            return self.attn_heads  # type: ignore[return-value]  # attn_tp without CP
        if which is SumGroup.TP:
            return self.tp
        return self.moe_out

    def describe(self) -> str:
        return (
            f"tp={self.tp.size} attn_tp={self.attn_tp.size} attn_dp={self.attn_dp.size} "
            f"cp={self.attn_cp.size} pp={self.pp.size}"
        )
