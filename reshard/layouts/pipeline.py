"""Pure layer-to-stage rules of DeepSpeed's PipelineModule: which parameters each stage holds, in order.

    from reshard.layouts.pipeline import PipelineLayers, stage_bounds, stage_names
    layers = PipelineLayers(count=7, tied={"embed": (0, 6)})
    bounds = stage_bounds("parameters", layers, numels, stages=2)     # e.g. [0, 3, 7]
    stage_names(layers, bounds, 1, names)                             # tied_modules.embed.weight, 3.weight, ...

DeepSpeed 0.19.8, runtime/pipe/module.py:
- `_partition_layers`: `uniform` -> `partition_uniform(len(layers), P)`; `parameters` ->
  `partition_balanced(_count_layer_params(), P)`, where a layer's weight is its trainable
  parameter count (a TiedLayerSpec counts its module's parameters at every occurrence; a
  function counts 0); `type:REGEX` weighs layers by class name, which a checkpoint does not record.
- `__init__` assigns `self.tied_modules` before `_build` adds the layers, so a stage's
  `named_parameters()` (and the optimizer's flat order) lists `tied_modules.<key>.*` first, keys
  in order of first occurrence in the stage, then `<global layer index>.*` in index order. The
  same module walk gives the stage's `buffer_names` (runtime/engine.py `_get_buffer_names`, its
  persistent buffers, owner by owner in that order).
- Several optimizer param groups: runtime/zero/stage_1_and_2.py `__init__` flattens each group's
  trainable parameters in the order the group lists them; a script building its groups from the
  stage's `named_parameters()` (the usual "no weight decay on biases and norms" split) lists each
  group in the stage's order, filtered (`split_by_group`; checked against the source's stages).
The partition functions are runtime/utils.py `partition_uniform` and `partition_balanced`
(dynamic programming over the linear partition problem, ties resolved towards the later split),
restated here from their definitions and tested against DeepSpeed's own.

What a checkpoint does not record, the caller supplies: the layer count and where tied layers sit.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class PipelineLayers:
    """The model's layer list as far as stage assignment needs it."""

    count: int
    """len(layers) given to PipelineModule, functions and parameterless layers included."""
    tied: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """TiedLayerSpec key -> the global layer indices where it occurs."""

    def tied_key(self, index: int) -> str | None:
        for key, indices in self.tied.items():
            if index in indices:
                return key
        return None


def partition_uniform(items: int, parts: int) -> list[int]:
    """runtime/utils.py `partition_uniform`: the first `items % parts` parts get one more item."""
    if items <= parts:
        return [min(p, items) for p in range(parts + 1)]
    size, extra = divmod(items, parts)
    return [p * size + min(p, extra) for p in range(parts + 1)]


def partition_balanced(weights: Sequence[int], parts: int) -> list[int]:
    """runtime/utils.py `partition_balanced`: split points minimising (largest - smallest part
    weight), the last split point among equal costs winning (DeepSpeed compares with >=).

    The same dynamic programme over float64 prefix sums as DeepSpeed's, with the innermost loop
    (every last split point k, for one prefix i and every part count j) done as one numpy step: the winner
    is the last k of least cost, which is what DeepSpeed's ascending loop with `>=` keeps. A
    96-stage, 200-layer model costs ~0.1 s instead of seconds (bench/plan_cost.py --suite pipeline)."""
    n = len(weights)
    if n <= parts:
        return partition_uniform(n, parts)
    prefix = np.zeros(n + 1)
    prefix[1:] = np.cumsum(np.asarray(weights, dtype=np.float64))
    best_max = np.full((n + 1, parts + 1), np.inf)
    best_min = np.full((n + 1, parts + 1), np.inf)
    split = np.zeros((n + 1, parts + 1), dtype=np.int64)
    best_max[0, 0] = 0.0
    for i in range(1, n + 1):
        part = (prefix[i] - prefix[:i])[:, None]             # the last part's weight for k = 0 .. i-1
        width = min(i, parts)                                # part counts j = 1 .. width
        high = np.maximum(best_max[:i, :width], part)        # [k, j - 1]
        low = np.minimum(best_min[:i, :width], part)
        last = i - 1 - np.argmin((high - low)[::-1], axis=0)  # per j, the last k of least cost
        columns = np.arange(width)
        best_max[i, 1:width + 1] = high[last, columns]
        best_min[i, 1:width + 1] = low[last, columns]
        split[i, 1:width + 1] = last
    bounds = [n]
    for j in range(parts, 0, -1):
        bounds.append(int(split[bounds[-1], j]))
    return bounds[::-1]


def layer_weights(layers: PipelineLayers, numels: Mapping[str, int]) -> list[int]:
    """`_count_layer_params` from the checkpoint's parameter names and sizes (every trainable one)."""
    weights = [0] * layers.count
    for name, numel in numels.items():
        head, _, rest = name.partition(".")
        if head == "tied_modules":
            key = rest.partition(".")[0]
            for index in layers.tied.get(key, ()):
                weights[index] += numel
        elif head.isdigit() and int(head) < layers.count:
            weights[int(head)] += numel
    return weights


def stage_bounds(method: str, layers: PipelineLayers, numels: Mapping[str, int], stages: int) -> list[int]:
    """DeepSpeed's `parts` for `stages` stages: `parameters`, `uniform`, or explicit boundaries
    "0,3,7" (stages + 1 ascending numbers from 0 to the layer count)."""
    if method == "parameters":
        return partition_balanced(layer_weights(layers, numels), stages)
    if method == "uniform":
        return partition_uniform(layers.count, stages)
    if method.startswith("type:"):
        raise ValueError(f"partition method {method!r} weighs layers by class name, which the checkpoint does "
                         "not record; give the stage boundaries instead (e.g. 0,3,7)")
    try:
        bounds = [int(part) for part in method.split(",")]
    except ValueError:
        raise ValueError(f"partition method {method!r}: use parameters, uniform or boundaries like 0,3,7") from None
    if len(bounds) != stages + 1 or bounds[0] != 0 or bounds[-1] != layers.count or bounds != sorted(bounds):
        raise ValueError(f"stage boundaries {method!r}: {stages + 1} ascending numbers from 0 to {layers.count} "
                         "are needed")
    return bounds


def stage_names(layers: PipelineLayers, bounds: Sequence[int], stage: int, names: Sequence[str]) -> list[str]:
    """Stage `stage`'s parameter names in its optimizer's flat order (see the module docstring);
    `names` gives every parameter name of the model once, each module's own names in its order."""
    return _stage_names(layers, bounds, stage, _names_by_owner(names))


@dataclass(frozen=True)
class StageAssignment:
    """Every stage's parameters for one (method, layer list, stage count): worked out once per job
    and passed to what estimates, checks and writes the stages."""

    method: str
    bounds: tuple[int, ...]
    """DeepSpeed's `parts`: stage s holds layers bounds[s] .. bounds[s + 1] - 1."""
    names: tuple[tuple[str, ...], ...]
    """Per stage, its parameter names in the optimizer's flat order."""
    buffer_names: tuple[tuple[str, ...], ...] = ()
    """Per stage, its persistent buffers in `buffer_names` order (empty when none were given)."""


def assign_stages(method: str, layers: PipelineLayers, numels: Mapping[str, int], stages: int,
                  counted: Mapping[str, int] | None = None, buffers: Sequence[str] = ()) -> StageAssignment:
    """`stage_bounds`, then every stage's names from one pass over the parameter names (a
    100k-parameter, 96-stage model in well under a second; ValueError as stage_bounds).

    `numels`: the parameters the optimizer holds, which the stages list. `counted`: parameters
    frozen after the PipelineModule was built, which `_count_layer_params` (run in its constructor)
    still counted as trainable: they weigh in the `parameters` partition but no stage lists them.
    `buffers`: every persistent buffer's name once (buffers weigh nothing in any partition)."""
    bounds = stage_bounds(method, layers, {**numels, **(counted or {})}, stages)
    owners, buffer_owners = _names_by_owner(list(numels)), _names_by_owner(list(buffers))
    # a buffer of the PipelineModule's own attributes (a loss_fn module, registered in __init__
    # before tied_modules) is on every stage, first
    everywhere = [name for name in buffers if name.partition(".")[0] != "tied_modules"
                  and not name.partition(".")[0].isdigit()]
    return StageAssignment(method, tuple(bounds),
                           tuple(tuple(_stage_names(layers, bounds, s, owners)) for s in range(stages)),
                           tuple(tuple(everywhere + _stage_names(layers, bounds, s, buffer_owners))
                                 for s in range(stages)) if buffers else ())


def stage_model_rank(stage: int, model: int, tp: int) -> int:
    """The `mp_rank_XX` index of the files of pipeline stage `stage`, model (tensor-slicing) rank
    `model`, with `tp` model ranks: runtime/pipe/topology.py `PipelineParallelGrid.__init__` makes a
    rank's model-parallel rank (`get_model_parallel_rank`, which runtime/engine.py uses as
    `checkpoint_mp_rank` in `_get_ckpt_name` and `_get_zero_ckpt_name`) its index among the sorted
    global ranks of its data-parallel coordinate; `PipeModelDataParallelTopology` orders the axes
    (pipe, data, model), model fastest, so that index is stage * tp + model (checked on a real
    (pp, tp, dp) = (2, 2, 1) save: mp_rank_01 holds stage 0's model-rank-1 slices)."""
    if not (0 <= model < tp and stage >= 0):
        raise ValueError(f"stage {stage}, model rank {model} of {tp}")
    return stage * tp + model


def split_by_group(names: Sequence[str], group_of: Mapping[str, int], groups: int) -> tuple[tuple[str, ...], ...]:
    """A stage's parameters (in its flat order) per optimizer param group: each group in the
    stage's order, filtered to the group's members (see the module docstring)."""
    split: list[list[str]] = [[] for _ in range(groups)]
    for name in names:
        split[group_of[name]].append(name)
    return tuple(tuple(group) for group in split)


def _names_by_owner(names: Sequence[str]) -> dict[tuple[str, str], list[str]]:
    """("tied", key) or ("layer", index as written) -> the names it owns, in `names`' order. A
    ModuleDict key holds no dot, so `tied_modules.<key>.` is the key's prefix."""
    owners: dict[tuple[str, str], list[str]] = {}
    for name in names:
        head, _, rest = name.partition(".")
        owner = ("tied", rest.partition(".")[0]) if head == "tied_modules" else ("layer", head)
        owners.setdefault(owner, []).append(name)
    return owners


def _stage_names(layers: PipelineLayers, bounds: Sequence[int], stage: int,
                 owners: Mapping[tuple[str, str], list[str]]) -> list[str]:
    start, stop = bounds[stage], bounds[stage + 1]
    keys = []
    for index in range(start, stop):
        key = layers.tied_key(index)
        if key is not None and key not in keys:
            keys.append(key)
    ordered = [name for key in keys for name in owners.get(("tied", key), ())]
    for index in range(start, stop):
        if layers.tied_key(index) is None:
            ordered += owners.get(("layer", str(index)), ())
    return ordered
