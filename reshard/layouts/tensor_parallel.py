"""DeepSpeed AutoTP's tensor-parallel split rules, pure (no torch): which parameter splits how.

    from reshard.layouts.tensor_parallel import TensorSplit, shard_sizes
    shard_sizes(9, 2)                                   # (5, 4): uneven, as DeepSpeed sizes them
    split = TensorSplit("column", 0)
    split.local_shape((9, 8), tp=2, tp_rank=1)          # (4, 8)
    split.local_box(0, (9, 8), tp=2, tp_rank=1)         # Box(0, offsets=(5, 0), sizes=(4, 8))

Kinds, as DeepSpeed 0.19.8 AutoTP writes them into `universal_checkpoint_info`
(module_inject/layers.py `collect_autotp_universal_checkpoint_info`):
- column-parallel (`LinearLayer`): weight and bias split on dim 0;
- row-parallel (`LinearAllreduce`): weight split on dim 1 (`parameter_with_row_parallelism_patterns`),
  its bias replicated;
- replicated (`tp_replicated_parameter_patterns`): everything AutoTP left whole, held by every TP rank;
- vocabulary-parallel (`vocabulary_parameter_patterns`: `VocabParallelLinear` heads and the
  `VocabParallelEmbedding` tied to them): split on dim 0, the vocabulary, like a column-parallel
  weight. AutoTP does not pad the vocabulary: a vocabulary that does not divide by TP gives
  uneven shards (`get_shard_size`), and `original_vocab_size` is the logical row count at every
  TP size, so it is carried unchanged.
- sub-parameter (`parameter_with_sub_params`, a layer spec with `shape`: `SubParamLinearLayer`,
  `SubParamLinearAllreduce`): the parameter is viewed row-major as a logical shape, and each fused
  sub-parameter (e.g. gate and up) along the partition dimension is cut on its own, with
  `sub_param_shard_widths` per sub-parameter and rank; a rank's shard concatenates its piece of
  every sub-parameter (module_inject/layers.py `_partition_logical_tensor`), so it is several
  boxes of the global parameter (`TensorSplit.local_pieces`).
`autotp_unsupported_parameter_patterns` are refused by the reader.

Shard sizes mirror module_inject/tp_shard.py `get_shard_size` for a model without a known
key/value head count (a plain `nn.Module`): with `tp_grain_size` g, rank r of T holds
(grains // T + (r < grains % T)) * g elements, the last rank also the remainder. The source's
own per-rank shard shapes (its `affine_map`) are checked against this rule, so a split
DeepSpeed sized by another rule (kv heads) is refused, not misread.

`universal_checkpoint_info` for a target TP size is recomputed here too (`target_universal_info`):
the pattern lists do not depend on TP; the `affine_map` does (checkpoint/affine.py
`contiguous_split_map`, `replicated_map`, `ParamAffineMap.to_dict`).
"""
from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from reshard.layouts.boxes import Box, row_major_strides

KINDS = ("column", "row", "vocabulary", "sub-parameter", "replicated")


def shard_sizes(total: int, tp: int, grain: int = 1) -> tuple[int, ...]:
    """Elements of a dimension of `total` on each of `tp` ranks (tp_shard.py `get_shard_size`)."""
    sizes = []
    for rank in range(tp):
        if total >= grain:
            grains, remainder = divmod(total, grain)
            size = (grains // tp + (1 if rank < grains % tp else 0)) * grain
            sizes.append(size + (remainder if rank == tp - 1 else 0))
        else:
            sizes.append(total // tp + (1 if rank < total % tp else 0))
    return tuple(sizes)


def shard_bounds(totals, tp: int, grain: int = 1) -> np.ndarray:
    """`shard_sizes` of many dimensions at once, as boundaries: row i is 0, then the end of each
    rank's shard, for a dimension of totals[i] elements ([len(totals), tp + 1])."""
    totals = np.asarray(totals, dtype=np.int64).reshape(-1, 1)
    rank = np.arange(tp, dtype=np.int64).reshape(1, -1)
    grains, remainder = totals // grain, totals % grain
    coarse = (grains // tp + (rank < grains % tp)) * grain + np.where(rank == tp - 1, remainder, 0)
    fine = totals // tp + (rank < totals % tp)
    sizes = np.where(totals >= grain, coarse, fine)
    return np.concatenate((np.zeros((len(totals), 1), np.int64), np.cumsum(sizes, axis=1)), axis=1)


@dataclass(frozen=True)
class TensorSplit:
    """How one parameter is spread over a tensor-parallel group."""

    kind: str
    """"column", "row", "vocabulary" (split on dim 0 as column), "sub-parameter" or "replicated"."""
    dim: int | None
    """The dimension cut across TP ranks (of `view` when set); None when replicated."""
    view: tuple[int, ...] | None = None
    """Sub-parameter splits: the logical shape, a row-major view of the parameter, that is cut."""
    parts: tuple[int, ...] | None = None
    """Sub-parameter splits: the sizes of the fused sub-parameters along `dim` of the view."""

    def sizes(self, shape: Sequence[int], tp: int, grain: int = 1) -> tuple[int, ...] | None:
        return None if self.dim is None else shard_sizes(shape[self.dim], tp, grain)

    def widths(self, tp: int, grain: int = 1) -> list[tuple[int, ...]]:
        """Per sub-parameter, its width on each TP rank (layers.py `_subparam_shard_widths`)."""
        return [shard_sizes(part, tp, grain) for part in self.parts]

    def local_box(self, param: int, shape: Sequence[int], tp: int, tp_rank: int, grain: int = 1) -> Box:
        """The block of the global parameter `param` (of `shape`) that TP rank `tp_rank` holds
        (a plain split; a sub-parameter split holds several, `local_pieces`)."""
        shape = tuple(shape)
        if self.view is not None:
            raise ValueError("a sub-parameter split is several boxes: use local_pieces")
        if self.dim is None:
            return Box(param, (0,) * len(shape), shape)
        sizes = shard_sizes(shape[self.dim], tp, grain)
        offsets, local = [0] * len(shape), list(shape)
        offsets[self.dim], local[self.dim] = sum(sizes[:tp_rank]), sizes[tp_rank]
        return Box(param, tuple(offsets), tuple(local))

    def local_pieces(self, param: int, shape: Sequence[int], tp: int, tp_rank: int,
                     grain: int = 1) -> list[tuple[int, Box, tuple[int, ...]]]:
        """[(element offset in the rank's local tensor, box of the global parameter, the shape the
        box is in)], in local order, each piece contiguous in the local tensor. A plain split is
        one box of `shape`; a sub-parameter split one box of `view` per sub-parameter (per index
        of the view's dimensions before `dim`, when `dim` is not the outermost)."""
        shape = tuple(int(d) for d in shape)
        if self.view is None:
            return [(0, self.local_box(param, shape, tp, tp_rank, grain), shape)]
        view, dim = self.view, self.dim
        widths = [w[tp_rank] for w in self.widths(tp, grain)]
        starts = [sum(self.parts[:s]) + sum(w[:tp_rank]) for s, w in enumerate(self.widths(tp, grain))]
        inner = math.prod(view[dim + 1:])
        local_width = sum(widths)
        pieces = []
        for count, index in enumerate(itertools.product(*(range(size) for size in view[:dim]))):
            base = count * local_width * inner   # the local tensor is the view with `dim` cut to local_width
            for s, (width, start) in enumerate(zip(widths, starts)):
                if width:
                    box = Box(param, (*index, start, *(0,) * len(view[dim + 1:])), (*(1,) * dim, width, *view[dim + 1:]))
                    pieces.append((base + sum(widths[:s]) * inner, box, view))
        return pieces

    def local_shape(self, shape: Sequence[int], tp: int, tp_rank: int, grain: int = 1) -> tuple[int, ...]:
        if self.view is not None:  # layers.py `SubParamLinearLayer._tp_partition`: a bias's shard is
            local = list(self.view)    # flat, a weight's the cut view as (leading, last)
            local[self.dim] = sum(w[tp_rank] for w in self.widths(tp, grain))
            return (math.prod(local),) if len(shape) == 1 else (math.prod(local[:-1]), local[-1])
        return self.local_box(0, shape, tp, tp_rank, grain).sizes


REPLICATED = TensorSplit("replicated", None)


def describe_splits(names: Sequence[str], splits: Sequence[TensorSplit]) -> dict[str, list[str]]:
    """{kind: parameter names} for the dry run."""
    found: dict[str, list[str]] = {kind: [] for kind in KINDS}
    for name, split in zip(names, splits):
        found[split.kind].append(name)
    return {kind: names for kind, names in found.items() if names}


def affine_map(split: TensorSplit, shape: Sequence[int], tp: int, grain: int = 1) -> dict:
    """The `affine_map` entry of one parameter at `tp` ranks, as `ParamAffineMap.to_dict` writes it."""
    if split.view is not None:
        return _sub_param_affine_map(split, tp, grain)
    shape = tuple(int(d) for d in shape)
    strides = list(row_major_strides(shape))
    ranks = {}
    if split.dim is None:
        for rank in range(tp):
            ranks[rank] = {"shard_shape": list(shape),
                           "pieces": [{"shape": list(shape), "source": [0, strides], "dest": [0, strides],
                                       "locations": list(range(tp))}]}
        return {"logical_shape": list(shape), "ranks": ranks}
    start = 0
    for rank, size in enumerate(shard_sizes(shape[split.dim], tp, grain)):
        local = list(shape)
        local[split.dim] = size
        ranks[rank] = {"shard_shape": local,
                       "pieces": [{"shape": local, "source": [start * strides[split.dim], strides],
                                   "dest": [0, list(row_major_strides(local))], "locations": [rank]}]}
        start += size
    return {"logical_shape": list(shape), "ranks": ranks}


def _sub_param_affine_map(split: TensorSplit, tp: int, grain: int) -> dict:
    """checkpoint/affine.py `sub_param_map` in its dict form: over the logical view, rank r's
    shard holds, in sub-parameter order, a piece of each sub-parameter along `dim`."""
    view, dim = list(split.view), split.dim
    strides = list(row_major_strides(view))
    widths = split.widths(tp, grain)
    ranks = {}
    for rank in range(tp):
        local = list(view)
        local[dim] = sum(w[rank] for w in widths)
        local_strides = list(row_major_strides(local))
        pieces, dest = [], 0
        for s, per_rank in enumerate(widths):
            piece = list(view)
            piece[dim] = per_rank[rank]
            source = sum(split.parts[:s]) + sum(per_rank[:rank])
            pieces.append({"shape": piece, "source": [source * strides[dim], strides],
                           "dest": [dest * local_strides[dim], local_strides], "locations": [rank]})
            dest += per_rank[rank]
        ranks[rank] = {"shard_shape": local, "pieces": pieces}
    return {"logical_shape": view, "ranks": ranks}


def target_universal_info(source_info: dict, patterns: dict[str, tuple[TensorSplit, tuple[int, ...]]], tp: int,
                          grain: int = 1) -> dict:
    """`universal_checkpoint_info` for `tp` ranks: the source's, with every affine map recomputed.

    `patterns`: affine-map pattern -> (split, global shape), for every pattern the source maps."""
    info = copy.deepcopy(source_info)
    amap = info.get("affine_map")
    if isinstance(amap, dict) and isinstance(amap.get("params"), dict):
        amap["params"] = {pattern: affine_map(split, shape, tp, grain)
                          for pattern, (split, shape) in patterns.items()}
    if isinstance(info.get("sub_param_shard_widths"), dict):  # layers.py `collect_autotp_universal_checkpoint_info`
        info["sub_param_shard_widths"] = {pattern: [list(w) for w in patterns[pattern][0].widths(tp, grain)]
                                          for pattern in info["sub_param_shard_widths"]}
    return info


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


@dataclass(frozen=True)
class TensorParallelParams:
    """Parameters by their global (unsharded) shapes, each with its TP split; one `grain`."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    """Global shapes."""
    splits: tuple[TensorSplit, ...]
    grain: int = 1
    """`tensor_parallel.tp_grain_size` of the ds_config."""

    def local_shape(self, index: int, tp: int, tp_rank: int) -> tuple[int, ...]:
        return self.splits[index].local_shape(self.shapes[index], tp, tp_rank, self.grain)

    def local_box(self, index: int, tp: int, tp_rank: int) -> Box:
        return self.splits[index].local_box(index, self.shapes[index], tp, tp_rank, self.grain)

    def local_pieces(self, index: int, tp: int, tp_rank: int) -> list[tuple[int, Box, tuple[int, ...]]]:
        return self.splits[index].local_pieces(index, self.shapes[index], tp, tp_rank, self.grain)

    def local_shapes(self, tp: int, tp_rank: int) -> tuple[tuple[int, ...], ...]:
        """Every parameter's local shape on TP rank `tp_rank` (vectorised: `shard_bounds` once)."""
        dims = [split.dim if split.view is None else None for split in self.splits]
        extents = [shape[dim] if dim is not None else 1 for shape, dim in zip(self.shapes, dims)]
        bounds = shard_bounds(extents, tp, self.grain)
        sizes = (bounds[:, tp_rank + 1] - bounds[:, tp_rank]).tolist()
        return tuple(self.local_shape(p, tp, tp_rank) if split.view is not None else
                     shape if dim is None else (*shape[:dim], size, *shape[dim + 1:])
                     for p, (shape, dim, size, split) in enumerate(zip(self.shapes, dims, sizes, self.splits)))

    def check_target(self, tp: int, where: str) -> str | None:
        """Why AutoTP could not build this model at `tp` ranks (a split dimension smaller than
        tp leaves a rank with an empty shard), or None."""
        for name, shape, split in zip(self.names, self.shapes, self.splits):
            if split.view is not None:
                shape = split.view
            if split.dim is not None and min(shard_sizes(shape[split.dim], tp, self.grain)) < 1:
                return (f"{where}: parameter {name} of shape {list(shape)} is split on dimension {split.dim} "
                        f"({shape[split.dim]} elements), which cannot give each of {tp} TP ranks a shard")
        return None


@dataclass(frozen=True, eq=False)
class TensorParallelSpec:
    """What a checkpoint says about its tensor parallelism, independent of the TP size."""

    params: TensorParallelParams
    """Trainable parameters, in the checkpoint spec's order, with global shapes."""
    module: TensorParallelParams
    """The split tensors of the ZeRO-1/2 model-states `module` (resliced, never copied)."""
    info: dict
    """The source's `universal_checkpoint_info`."""
    patterns: tuple[tuple[str, TensorSplit, tuple[int, ...]], ...]
    """(affine-map pattern, split, global shape) of every parameter the source maps."""
    aliases: tuple[tuple[str, str], ...] = ()
    """(alias, owner) of the tied module tensors whose owner is a trainable module tensor
    (`shared_params`, e.g. lm_head.weight -> embed.weight): the alias is the owner's tensor."""

    def universal_info(self, tp: int) -> dict:
        return target_universal_info(self.info, {p: (s, shape) for p, s, shape in self.patterns}, tp,
                                     self.params.grain)
