"""The plan for one checkpoint: its spaces, from the spec and the two topologies. Pure, no torch.

    from reshard.checkpoint_plan import plan_reshard
    plan = plan_reshard(source.spec, Topology(dp=16), workers=8, budget_bytes=1 << 30)
    plan.rounds, plan.traffic()

Every worker calls this with the same arguments and gets the same plan (it reads nothing).
A checkpoint has one or two logical spaces, moved one after the other: the optimizer space
(fp32 master weights and every per-partition optimizer state) and, under ZeRO-3, the
partitioned frozen parameters. ZeRO-1/2 layouts have O(params + ranks) pieces and are planned
from their piece tables (`reshard.plan`); ZeRO-3 layouts are evenly chunked and planned per
worker by arithmetic (`reshard.chunked_plan`).
"""
from __future__ import annotations

from reshard.chunked_plan import ChunkedSide, plan_chunked_space
from reshard.layout import buffer_numels, logical_bases
from reshard.plan import Ownership, ReshardPlan, plan_space
from reshard.topology import Topology


def plan_reshard(spec, target: Topology, workers: int, budget_bytes: int, *, tabulated: bool = False
                 ) -> ReshardPlan:
    """The plan for moving a checkpoint of `spec` (a CheckpointSpec: topology, layout rules,
    streams with item sizes) to the `target` topology with `workers` workers.

    `tabulated`: plan every space from its piece tables, ZeRO-3 too. A SLURM array task
    (`reshard.array_job`) restricts a one-worker plan to its files by selecting segments, which
    needs the table; it plans once per task, so the O(params x ranks) table is affordable there."""
    ownership = Ownership.between(spec.topology, target, workers)
    old, new = spec.layout(spec.topology), spec.layout(target)
    if spec.stage == 3 and not tabulated:
        bases = logical_bases([p.numel for p in spec.params])
        spaces = [plan_chunked_space("optim", ChunkedSide.of_zero3(old), ChunkedSide.of_zero3(new), spec.streams,
                                     bases, ownership, budget_bytes)]
    else:
        spaces = [plan_space("optim", old.pieces, new.pieces, spec.streams, buffer_numels(new), ownership,
                             budget_bytes)]
    if spec.frozen and tabulated:
        (old_frozen, _), (new_frozen, chunks) = spec.frozen_layout(spec.topology.dp), spec.frozen_layout(target.dp)
        spaces.append(plan_space("frozen", old_frozen, new_frozen, spec.frozen_streams, chunks, ownership,
                                 budget_bytes, round_offset=spaces[0].rounds))
    elif spec.frozen:
        numels = [p.numel for p in spec.frozen]
        spaces.append(plan_chunked_space("frozen", ChunkedSide.of_frozen(numels, spec.topology.dp),
                                         ChunkedSide.of_frozen(numels, target.dp), spec.frozen_streams,
                                         logical_bases(numels), ownership, budget_bytes,
                                         round_offset=spaces[0].rounds))
    return ReshardPlan(ownership, tuple(spaces), budget_bytes)
