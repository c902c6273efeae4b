"""The parallel topology of a checkpoint: the one value every rank count is derived from.

    from reshard.topology import Topology
    Topology(dp=4).describe()            # "dp=4 tp=1 ep=1"
    Topology(dp=8, ep=4).world_size      # 8: expert parallelism splits the dp ranks, it adds none
    Topology(dp=6, ep=4)                 # TopologyError: ep=4 does not divide dp=6
    Topology(dp=2, tp=2, ep=2).folded    # True: AutoEP folded with AutoTP (EP groups cross TP lanes)

Sizes, as DeepSpeed defines them (runtime/engine.py, utils/groups.py):
- `dp`: data-parallel ranks, the ZeRO partition count of dense parameters;
- `tp`: tensor-parallel ranks (the `mp_rank_XX` index of DeepSpeed's file names);
- `ep`: expert-parallel ranks; experts are sharded over `ep` ranks carved out of the `dp`
  ranks (utils/groups.py `_create_expert_and_data_parallel`), so `ep` divides `dp` and expert
  parameters are ZeRO-partitioned over `dp // ep` expert-data-parallel ranks. With tp > 1
  (AutoEP folded with AutoTP, the only way DeepSpeed 0.19.8 combines them) see below;
- `pp`: pipeline stages (DeepSpeed PipelineModule saves; reshard.layouts.pipeline). A target at
  another pp or tp of a pipeline save also says which parameters each of its stages holds
  (`Topology.stages`, a `PipelineStages`): the stage assignment is the target's, worked out once where the
  source is inspected (reshard.jobs.collective_job.pipeline_stage_change), and travels with the target's
  axes to the planner and the writers; a source's stages are its spec's (`CheckpointSpec.columns`);
- room for `sp` (not a field yet): DeepSpeed Ulysses partitions ZeRO over the sequence-data-parallel
  group of sp x dp ranks and saves that product as `dp_world_size`, so a save's and a target's `dp`
  here count sp x dp ranks, and the target sp is checked against it where the batch config is
  (reshard.jobs.preflight.target_sequence_parallel). An `sp` axis would be carved out of `dp` as `ep`
  is (it divides dp and adds no ranks), read by whatever first lays sequence-parallel files out apart.

The world is `dp * tp * pp` ranks. reshard numbers a rank by its coordinates with tp fastest,
then dp, then pp, as DeepSpeed lays out its groups (utils/groups.py `_init_tp_groups_with_new_group`:
TP group of data rank d is ranks d*tp .. d*tp+tp-1; `_init_tp_mesh_device` builds the mesh
(dp, tp), tp fastest, too); with tp = pp = 1 the rank is the dp rank.

Expert parallelism is laid over the GLOBAL ranks of a pipeline stage, which with tp = 1 are the
dp ranks, so one rule serves plain and folded layouts. DeepSpeed's folding
(module_inject/auto_ep_folding.py `build_folding_spec`, `expected_folding_group_tables`; the
engine builds its groups from those tables, runtime/engine.py `_configure_distributed_model`
with `FoldingGroupHandles`), for a stage of S = dp * tp consecutive ranks:
- TP groups: runs of tp consecutive ranks (dp rank d holds ranks d*tp .. d*tp+tp-1);
- dense DP groups: the ranks of one TP lane, tp apart (t, t+tp, ...): dense parameters (and the
  router gates, family `router_gate_replicated`) are ZeRO-partitioned over these dp ranks;
- EP groups: runs of ep consecutive ranks, which may cross TP lanes (ep need not divide dp,
  only S): rank r is EP rank r % ep;
- expert-DP (EDP) groups: the ranks at one position of every EP group, ep apart: routed
  experts (family `routed_expert`) are ZeRO-partitioned over these S // ep ranks, rank r being
  EDP rank r // ep.
Experts are never split by TP (each rank holds its EP rank's experts whole). With tp = 1 these
are exactly the plain AutoEP groups above; DeepSpeed refuses ep = 1 with tp > 1 when folding
(`validate_folding_global`), and reshard has no experts then.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from reshard.errors import TopologyError

@dataclass(frozen=True)
class RankCoordinates:
    """Where one rank sits in a topology."""

    dp: int
    tp: int = 0
    pp: int = 0


@dataclass(frozen=True)
class PipelineStages:
    """Which parameters each stage of a pipeline target holds, where its stages or model ranks differ
    from the source's (another pp or tp): DeepSpeed's layer partition at the target (reshard.layouts.pipeline
    .StageAssignment), lowered to what the planner and the writers lay out."""

    columns: tuple
    """Per target column (stage * tp + model rank): its (params, groups), the `ParamSpec`s at the target's
    local shapes and the param groups as indices into them: a ZeRO-1 save over that stage's parameters
    (reshard.formats.deepspeed_files.deepspeed_spec.CheckpointSpec.layout lays a target of these out)."""
    buffer_names: tuple = ()
    """Per target stage, its persistent buffers' names as its model-states file lists them (empty when the
    save lists none)."""


@dataclass(frozen=True)
class LayerFiles:
    """A pipeline target's layer files (`layer_XX-model_YY-model_states.pt`) as tensors of the plan, rather
    than carried whole: re-cut for another tp (`recut`, reshard.formats.deepspeed_files.deepspeed_pipeline
    .pipeline_model_axis), or whole with tp kept (a node-local job writes them on every node whose ranks load
    them, deepspeed_pipeline.kept_layer_files). Worked out once where the source is inspected and carried on
    the target (`Topology.layer_files`), so the source's spec describes the source only."""

    axis: object
    """The layer files' tensors (reshard.layouts.model_axis.PipelineModelAxis): with `recut`, also each
    parameter's split and whole shape; without, each model rank's tensors whole."""
    recut: bool
    """True: a tp change (the source's model axis re-cut for the target's model ranks); False: tp kept."""
    templates: tuple
    """Per layer file index, (index, source stage reading it, target stage, model rank 0's portable tree),
    which each target model rank's layer file is built from."""
    copies: tuple[tuple[int, ...], ...] = ()
    """More copies of the layer files than dp rank 0's of each column (a node-local job: a column's first
    rank on each node writes them, since its ranks load them there,
    reshard.jobs.node_local_columns.layer_file_copies): per extra copy, per target column (stage * tp + model
    rank), the target rank writing it, -1 where that stage has no such copy. Each copy takes the layer
    tensors as pieces of the plan (reshard.planning.checkpoint_plan.every_copy_pieces)."""


@dataclass(frozen=True)
class Topology:
    """Sizes of each parallel dimension of one checkpoint (source or target)."""

    dp: int
    """Data-parallel ranks (the ZeRO partition count)."""
    tp: int = 1
    """Tensor-parallel ranks."""
    ep: int = 1
    """Expert-parallel ranks, taken from the ranks of a stage (divides dp * tp; dp when tp = 1)."""
    pp: int = 1
    """Pipeline stages."""
    stages: PipelineStages | None = field(default=None, compare=False, repr=False)
    """A pipeline target at another pp or tp: its stages (`PipelineStages`); None for a source, for every
    other save, and for a pipeline target whose stages are the source's. Not part of equality: two
    topologies with the same axes have the same ranks."""
    layer_files: LayerFiles | None = field(default=None, compare=False, repr=False)
    """A pipeline target whose layer files move through the plan (`LayerFiles`: re-cut at another tp, or whole
    for a node-local job); None for a source, for every other save, and where the layer files are carried
    whole (`SourceCheckpoint.other_files`). Not part of equality, as `stages`."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "ep", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TopologyError(f"topology size {name} must be an integer >= 1, got {value!r}")
        if self.tp == 1 and self.dp % self.ep:
            raise TopologyError(f"ep={self.ep} does not divide dp={self.dp}: expert parallelism splits the "
                                "data-parallel ranks into groups of ep")
        if (self.dp * self.tp) % self.ep:
            raise TopologyError(f"ep={self.ep} does not divide the {self.dp * self.tp} ranks (dp={self.dp} x "
                                f"tp={self.tp}) of a stage: folded expert parallelism splits them into groups of ep "
                                "(module_inject/auto_ep_folding.py `build_folding_spec`)")

    @property
    def world_size(self) -> int:
        """Ranks in the whole job: dp * tp * pp (expert parallelism reuses the dp ranks)."""
        return self.dp * self.tp * self.pp

    @property
    def expert_dp(self) -> int:
        """Ranks each expert parameter is ZeRO-partitioned over (dp * tp // ep; dp // ep when tp = 1)."""
        return self.dp * self.tp // self.ep

    @property
    def folded(self) -> bool:
        """AutoEP folded with AutoTP: experts spread over EP groups that cross TP lanes."""
        return self.tp > 1 and self.ep > 1

    def coordinates(self, rank: int) -> RankCoordinates:
        """The (dp, tp, pp) coordinates of global rank `rank` (tp fastest, then dp, then pp)."""
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside a world of {self.world_size} ({self.describe()})")
        tp, rest = rank % self.tp, rank // self.tp
        return RankCoordinates(dp=rest % self.dp, tp=tp, pp=rest // self.dp)

    def _stage_rank(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside a world of {self.world_size} ({self.describe()})")
        return rank % (self.dp * self.tp)

    def expert_parallel_rank(self, rank: int) -> int:
        """EP rank of global rank `rank`: which block of experts it holds. DeepSpeed's legacy
        E+D ordering (utils/groups.py `_create_expert_and_data_parallel`, mp 1) and its folding
        (auto_ep_folding.py `expected_folding_group_tables`) alike: EP groups are runs of `ep`
        consecutive ranks, so the EP rank is rank % ep (dp rank % ep when tp = 1)."""
        return self._stage_rank(rank) % self.ep

    def expert_data_parallel_rank(self, rank: int) -> int:
        """Rank of `rank` in its expert-data-parallel group (ranks ep apart): rank // ep, the
        ZeRO partition of its experts it holds."""
        return self._stage_rank(rank) // self.ep

    def expert_dp_rank_of(self, ep_rank: int, expert_dp_rank: int) -> int:
        """The global rank at (EP rank, expert-data-parallel rank): the inverse of the two above
        (the dp rank when tp = 1)."""
        return expert_dp_rank * self.ep + ep_rank

    def rank_of(self, dp: int, tp: int = 0, pp: int = 0) -> int:
        """The global rank at coordinates (dp, tp, pp): the inverse of `coordinates`."""
        return (pp * self.dp + dp) * self.tp + tp

    def describe(self) -> str:
        text = f"dp={self.dp} tp={self.tp} ep={self.ep}"
        return text + (f" pp={self.pp}" if self.pp > 1 else "")

    def __str__(self) -> str:
        return self.describe()
