"""How each parameter of a pipeline save with a model axis is sliced, from `universal_checkpoint_info`: pure, no torch.

    from reshard.layouts.model_axis import model_axis_rules
    rules = model_axis_rules(info, where="…/mp_rank_00_model_states.pt")   # ModelAxisError if it cannot serve
    rule = rules.rule("3.weight")                    # ModelAxisRule("row", TensorSplit("row", 1))
    whole = rule.joined_shape((24, 21), tp=2)        # (24, 42)
    rule.local_shape(whole, tp=1)                    # (24, 42); ModelAxisError if tp does not divide dim 1

A Megatron-style PipelineModule (PipeModelDataParallelTopology) records which dim each parameter is
sliced on nowhere in its files but in the `universal_checkpoint_info` the training script saves as
client state (Megatron-DeepSpeed does): regex lists matched with `re.match` against the stage's
parameter names (`tied_modules.embed.word_embeddings.weight`, `3.self_attention.dense.weight`).
DeepSpeed 0.19.8's rule (checkpoint/ds_to_universal.py `merge_tp_slices`, which joins the slices of
every model rank; checkpoint/universal_checkpoint.py `load_hp_checkpoint_state`, which cuts a rank's
slice back out), and what reshard does with each:

- `tp_replicated_parameter_patterns`: every model rank holds the whole tensor (ds_to_universal asserts
  the slices equal and takes the first): "replicated", checked equal by the caller;
- `parameter_to_average_patterns`: ds_to_universal averages the ranks' tensors, which is lossy unless
  they are equal: "average", the caller takes it as replicated when every rank's equals, and refuses
  otherwise;
- `parameter_with_row_parallelism_patterns`: joined on dim 1 (row-parallel weights): "row";
- `vocabulary_parameter_patterns`: joined on dim 0, then cut to `original_vocab_size` rows (the
  padding Megatron adds to make the vocabulary divide by tp is dropped; load_hp_checkpoint_state pads
  again for the target tp): "vocabulary", served only when the joined rows already equal
  `original_vocab_size` (no padding at the source; the target's padded size is the script's choice);
- `parameter_with_2_sub_params_cat_dim_0`: each rank's slice is two fused sub-parameters on dim 0
  (e.g. SwiGLU's h_to_4h); ds_to_universal joins the first halves of every rank, then the second
  halves: "two-sub-params", cut the same way back (the view split of
  reshard.layouts.tensor_parallel.TensorSplit with two equal parts);
- everything else: joined on dim 0 (column-parallel weights and biases): "column".
`parameter_with_sub_params` (SubparamShape views), an `affine_map`, and a save with none of these
lists are refused by name (`ModelAxisError`): an empty info would have every parameter joined on
dim 0, replicated ones too. Megatron cuts evenly, so the target tp must divide every sliced dim
(half of it for two sub-parameters). More than one pattern of one list matching a name is refused,
as ds_to_universal's `get_matched_pattern` asserts; a name matched by several lists takes the first
in the order above, as `merge_tp_slices` tests them.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from reshard.layouts.tensor_parallel import REPLICATED, TensorParallelParams, TensorSplit
from reshard.layouts.zero import Stream

REPLICATED_PATTERNS = "tp_replicated_parameter_patterns"
AVERAGE_PATTERNS = "parameter_to_average_patterns"
ROW_PATTERNS = "parameter_with_row_parallelism_patterns"
VOCABULARY_PATTERNS = "vocabulary_parameter_patterns"
TWO_SUB_PARAMS_PATTERNS = "parameter_with_2_sub_params_cat_dim_0"
SUB_PARAMS = "parameter_with_sub_params"
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
AFFINE_MAP = "affine_map"
# merge_tp_slices' order of tests: replicated, average, two sub-params, (SubparamShape), else cat on
# dim 1 for row-parallel or 0; vocabulary is applied after the join, on its dim-0 result
LISTS = ((REPLICATED_PATTERNS, "replicated"), (AVERAGE_PATTERNS, "average"),
         (TWO_SUB_PARAMS_PATTERNS, "two-sub-params"), (ROW_PATTERNS, "row"), (VOCABULARY_PATTERNS, "vocabulary"))


class ModelAxisError(ValueError):
    """Why a model-axis change cannot be made; the caller names the file."""


@dataclass(frozen=True)
class ModelAxisRule:
    """How one tensor is spread over the model axis."""

    kind: str
    """"replicated", "average", "row", "column", "vocabulary" or "two-sub-params"."""
    dim: int | None
    """The dim joined and cut; None for replicated and averaged tensors."""

    @property
    def whole(self) -> bool:
        """Every model rank holds the whole tensor (checked equal across ranks by the caller)."""
        return self.dim is None

    def joined_shape(self, local: Sequence[int], tp: int) -> tuple[int, ...]:
        """The whole tensor's shape from one rank's `local` shape at `tp` ranks (even slices)."""
        shape = tuple(int(d) for d in local)
        if self.whole:
            return shape
        self._check_dim(shape)
        if self.kind == "two-sub-params" and shape[0] % 2:
            raise ModelAxisError(f"has {shape[0]} rows on a model rank, which do not hold two equal sub-parameters")
        return (*shape[:self.dim], shape[self.dim] * tp, *shape[self.dim + 1:])

    def local_shape(self, whole: Sequence[int], tp: int) -> tuple[int, ...]:
        """One rank's shape at `tp` ranks; ModelAxisError when `tp` does not cut the dim evenly."""
        shape = tuple(int(d) for d in whole)
        if self.whole:
            return shape
        self._check_dim(shape)
        parts = 2 if self.kind == "two-sub-params" else 1
        if shape[self.dim] % (parts * tp):
            what = "each of its two sub-parameters' " if parts == 2 else ""
            raise ModelAxisError(f"is {self.kind} on dim {self.dim} ({what}{shape[self.dim] // parts} of shape "
                                 f"{list(shape)}), which {tp} model ranks do not cut evenly")
        return (*shape[:self.dim], shape[self.dim] // tp, *shape[self.dim + 1:])

    def split(self, whole: Sequence[int]) -> TensorSplit:
        """The same cut as reshard.layouts.tensor_parallel's TensorSplit (its `local_pieces`: where
        each rank's elements sit in the whole tensor); even, since local_shape checked it divides."""
        shape = tuple(int(d) for d in whole)
        if self.whole:
            return REPLICATED
        if self.kind == "two-sub-params":  # two fused halves on dim 0, each cut on its own
            return TensorSplit("sub-parameter", 0, view=shape, parts=(shape[0] // 2, shape[0] // 2))
        return TensorSplit("row" if self.kind == "row" else "column", self.dim)

    def _check_dim(self, shape: tuple[int, ...]) -> None:
        if self.dim >= len(shape):
            raise ModelAxisError(f"has shape {list(shape)}, but its {self.kind} slices are joined on dim {self.dim}")


@dataclass(frozen=True)
class ModelAxisRules:
    """The pattern lists of one save's `universal_checkpoint_info`."""

    lists: tuple[tuple[str, tuple[str, ...]], ...]
    """(kind, its patterns) in LISTS order."""
    original_vocab_size: int | None = None

    def rule(self, name: str) -> ModelAxisRule:
        for kind, patterns in self.lists:
            matched = [pattern for pattern in patterns if re.match(pattern, name)]
            if len(matched) > 1:  # ds_to_universal.py get_matched_pattern asserts the same
                raise ModelAxisError(f"{name} matches more than one {kind} pattern: {matched}")
            if matched and kind != "vocabulary":
                return ModelAxisRule(kind, None if kind in ("replicated", "average") else (1 if kind == "row" else 0))
            if matched:
                return ModelAxisRule("vocabulary", 0)
        return ModelAxisRule("column", 0)

    def check_vocabulary(self, name: str, whole: Sequence[int]) -> None:
        """A vocabulary tensor must need no padding change: its joined rows equal original_vocab_size."""
        if self.original_vocab_size is None:
            raise ModelAxisError(f"{name} is a vocabulary parameter, but universal_checkpoint_info has no "
                                 f"{ORIGINAL_VOCAB_SIZE} (ds_to_universal needs it too)")
        if int(whole[0]) != self.original_vocab_size:
            raise ModelAxisError(f"{name} joins to {int(whole[0])} vocabulary rows, {ORIGINAL_VOCAB_SIZE} is "
                                 f"{self.original_vocab_size}: the padding depends on the target tp as the training "
                                 "script pads it (Megatron's make_vocab_size_divisible_by), which the checkpoint does "
                                 "not record; reshard changes tp only for an unpadded vocabulary")


def model_axis_rules(info: object) -> ModelAxisRules:
    """The rules of a `universal_checkpoint_info` (a client-state dict); ModelAxisError saying what is
    missing or not served."""
    if not isinstance(info, Mapping):
        raise ModelAxisError("has no universal_checkpoint_info (client state a Megatron-DeepSpeed script saves), "
                             "so which dim each parameter is sliced on over the model axis is not recorded")
    lists = []
    for key, kind in LISTS:
        patterns = info.get(key) or ()
        if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
            raise ModelAxisError(f"universal_checkpoint_info[{key!r}] is {patterns!r}, not a list of regexes")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ModelAxisError(f"universal_checkpoint_info[{key!r}] pattern {pattern!r}: {error}") from None
        lists.append((kind, tuple(patterns)))
    if info.get(SUB_PARAMS):
        raise ModelAxisError(f"universal_checkpoint_info has {SUB_PARAMS} (fused sub-parameter views); changing "
                             "tp of a pipeline save does not support them")
    if info.get(AFFINE_MAP):
        raise ModelAxisError(f"universal_checkpoint_info has an {AFFINE_MAP} (AutoTP's geometry); changing tp of a "
                             "pipeline save reads the pattern lists only and does not support it")
    if not any(patterns for _, patterns in lists):
        raise ModelAxisError("has a universal_checkpoint_info with none of "
                             f"{', '.join(key for key, _ in LISTS)}: without them every parameter, a replicated one "
                             "too, would be joined on dim 0 (as ds_to_universal does), so which dim each parameter is "
                             "sliced on over the model axis is not recorded")
    vocab = info.get(ORIGINAL_VOCAB_SIZE)
    return ModelAxisRules(tuple(lists), None if vocab is None else int(vocab))


def target_local_shapes(rules: ModelAxisRules, local: Mapping[str, Sequence[int]], source_tp: int,
                        target_tp: int) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape on one model rank at `target_tp`, from its shape at `source_tp` (names in
    `local` order); ModelAxisError naming the tensor the target tp cannot cut."""
    shapes = {}
    for name, shape in local.items():
        rule = rules.rule(name)
        try:
            whole = rule.joined_shape(shape, source_tp)
            if rule.kind == "vocabulary":
                rules.check_vocabulary(name, whole)
            shapes[name] = rule.local_shape(whole, target_tp)
        except ModelAxisError as error:
            raise ModelAxisError(error.args[0] if str(error).startswith(name) else f"{name} {error}") from None
    return shapes


@dataclass(frozen=True)
class LayerFileSpace:
    """The tensors of a pipeline save's layer files of one dtype (`layer_XX-model_YY-model_states.pt`: each
    layer's state_dict per model rank, weights in the training dtype, buffers and frozen parameters too), as
    one space of the plan (docs/architecture.md, "One road": layer files are module tensors): tensor j is
    buffer j of the (dp rank 0, model rank, stage) rank whose layer file holds it, source and target alike."""

    name: str
    """The plan's space name (one per dtype: a piece moves every stream of its space)."""
    stream: Stream
    tensors: TensorParallelParams
    """Every layer tensor of this dtype by its whole shape and its model-axis split, layer files in index order."""
    keys: tuple[tuple[int, str], ...]
    """(layer index, state_dict key) of each tensor."""
    source_stages: tuple[int, ...]
    """The source stage whose ranks read each tensor's layer files."""
    target_stages: tuple[int, ...]
    """The target stage whose layer file holds each tensor."""


@dataclass(frozen=True)
class PipelineModelAxis:
    """A pipeline save's tp change as the planner lowers it (reshard.layouts.tensor_pieces
    `pipeline_model_axis_pieces`): each trainable parameter's split over the model axis and whole shape,
    by its stage name, and its layer files' tensors."""

    splits: Mapping[str, TensorSplit]
    shapes: Mapping[str, tuple[int, ...]]
    """Whole (joined) shapes."""
    layer_spaces: tuple[LayerFileSpace, ...] = ()
    model_suffix: bool = True
    """The layer files are named `layer_XX-model_YY-...` (saved with PipeModelDataParallelTopology), else
    `layer_XX-model_states.pt` (tp kept on a save without a model axis)."""

    def layer_file_model(self, model: int) -> int | None:
        """The model rank in a layer file's name (schema.layer_file_name): `model`, or None without a suffix."""
        return model if self.model_suffix else None

    def tensor(self, index: int, key: str) -> tuple[LayerFileSpace, int] | None:
        """(space, tensor index) of layer `index`'s entry `key`, None when it is no tensor of the plan."""
        found = self.__dict__.get("_tensor_index")
        if found is None:
            found = {k: (space, j) for space in self.layer_spaces for j, k in enumerate(space.keys)}
            object.__setattr__(self, "_tensor_index", found)
        return found.get((index, key))

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_tensor_index"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
