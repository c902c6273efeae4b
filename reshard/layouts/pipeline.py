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
  in order of first occurrence in the stage, then `<global layer index>.*` in index order.
The partition functions are runtime/utils.py `partition_uniform` and `partition_balanced`
(dynamic programming over the linear partition problem, ties resolved towards the later split),
restated here from their definitions and tested against DeepSpeed's own.

What a checkpoint does not record, the caller supplies: the layer count and where tied layers sit.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


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
    weight), the last split point among equal costs winning (DeepSpeed compares with >=)."""
    n = len(weights)
    if n <= parts:
        return partition_uniform(n, parts)
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    inf = math.inf
    best_max = [[inf] * (parts + 1) for _ in range(n + 1)]
    best_min = [[inf] * (parts + 1) for _ in range(n + 1)]
    cost = [[inf] * (parts + 1) for _ in range(n + 1)]
    split = [[0] * (parts + 1) for _ in range(n + 1)]
    best_max[0][0], cost[0][0] = 0, 0
    for i in range(1, n + 1):
        for j in range(1, min(i, parts) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                high, low = max(best_max[k][j - 1], part), min(best_min[k][j - 1], part)
                if cost[i][j] >= high - low:
                    cost[i][j], best_max[i][j], best_min[i][j], split[i][j] = high - low, high, low, k
    bounds = [n]
    for j in range(parts, 0, -1):
        bounds.append(split[bounds[-1]][j])
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
    start, stop = bounds[stage], bounds[stage + 1]
    keys = []
    for index in range(start, stop):
        key = layers.tied_key(index)
        if key is not None and key not in keys:
            keys.append(key)
    ordered = [name for key in keys for name in names if name.startswith(f"tied_modules.{key}.")]
    for index in range(start, stop):
        if layers.tied_key(index) is None:
            ordered += [name for name in names if name.startswith(f"{index}.")]
    return ordered
