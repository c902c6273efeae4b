"""The parallel topology of a checkpoint: the one value every rank count is derived from.

    from reshard.topology import Topology
    Topology(dp=4).describe()            # "dp=4 tp=1 ep=1"
    Topology(dp=8, ep=4).world_size      # 8: expert parallelism splits the dp ranks, it adds none
    Topology(dp=6, ep=4)                 # TopologyError: ep=4 does not divide dp=6

Sizes, as DeepSpeed defines them (runtime/engine.py, utils/groups.py):
- `dp`: data-parallel ranks, the ZeRO partition count of dense parameters;
- `tp`: tensor-parallel ranks (the `mp_rank_XX` index of DeepSpeed's file names);
- `ep`: expert-parallel ranks; experts are sharded over `ep` ranks carved out of the `dp`
  ranks (utils/groups.py `_create_expert_and_data_parallel`), so `ep` divides `dp` and expert
  parameters are ZeRO-partitioned over `dp // ep` expert-data-parallel ranks;
- `pp`: pipeline stages (room for later; reshard refuses pipeline checkpoints today).

The world is `dp * tp * pp` ranks. reshard numbers a rank by its coordinates with tp fastest,
then dp, then pp, as DeepSpeed lays out its groups (utils/groups.py `_init_tp_groups_with_new_group`:
TP group of data rank d is ranks d*tp .. d*tp+tp-1; `_init_tp_mesh_device` builds the mesh
(dp, tp), tp fastest, too); with tp = pp = 1 the rank is the dp rank.
"""
from __future__ import annotations

from dataclasses import dataclass

from reshard.errors import TopologyError

@dataclass(frozen=True)
class RankCoordinates:
    """Where one rank sits in a topology."""

    dp: int
    tp: int = 0
    pp: int = 0


@dataclass(frozen=True)
class Topology:
    """Sizes of each parallel dimension of one checkpoint (source or target)."""

    dp: int
    """Data-parallel ranks (the ZeRO partition count)."""
    tp: int = 1
    """Tensor-parallel ranks."""
    ep: int = 1
    """Expert-parallel ranks, taken from the data-parallel ranks (divides dp)."""
    pp: int = 1
    """Pipeline stages."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "ep", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TopologyError(f"topology size {name} must be an integer >= 1, got {value!r}")
        if self.dp % self.ep:
            raise TopologyError(f"ep={self.ep} does not divide dp={self.dp}: expert parallelism splits the "
                                "data-parallel ranks into groups of ep")

    @property
    def world_size(self) -> int:
        """Ranks in the whole job: dp * tp * pp (expert parallelism reuses the dp ranks)."""
        return self.dp * self.tp * self.pp

    @property
    def expert_dp(self) -> int:
        """Ranks each expert parameter is ZeRO-partitioned over (dp // ep)."""
        return self.dp // self.ep

    def coordinates(self, rank: int) -> RankCoordinates:
        """The (dp, tp, pp) coordinates of global rank `rank` (tp fastest, then dp, then pp)."""
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside a world of {self.world_size} ({self.describe()})")
        tp, rest = rank % self.tp, rank // self.tp
        return RankCoordinates(dp=rest % self.dp, tp=tp, pp=rest // self.dp)

    def rank_of(self, dp: int, tp: int = 0, pp: int = 0) -> int:
        """The global rank at coordinates (dp, tp, pp): the inverse of `coordinates`."""
        return (pp * self.dp + dp) * self.tp + tp

    def describe(self) -> str:
        text = f"dp={self.dp} tp={self.tp} ep={self.ep}"
        return text + (f" pp={self.pp}" if self.pp > 1 else "")

    def __str__(self) -> str:
        return self.describe()
