"""Names in a DeepSpeed universal checkpoint, shared by both universal exports (plain and pipeline).

    from reshard.export.universal_names import LATEST_UNIVERSAL, OPTIMIZER_STATE, check_directory_name
    check_directory_name("tied_modules.embed.weight", source)   # the name, or UnsupportedCheckpoint

DeepSpeed 0.19.8 checkpoint/ds_to_universal.py writes OUT/TAG/zero/<param>/<state>.pt beside the one
file zero/optimizer_state.pt, and names the tag in OUT/latest_universal (runtime/engine.py
`load_checkpoint` reads it under "load_universal").
"""
from __future__ import annotations

from reshard.errors import UnsupportedCheckpoint
from reshard.files.paths import tag_problem
from reshard.layouts.model_axis import ModelAxisRule

LATEST_UNIVERSAL = "latest_universal"

OPTIMIZER_STATE = "optimizer_state.pt"
"""The one file zero/ holds beside the parameters' directories."""
# the keys of a universal checkpoint's per-state dict (DeepSpeed 0.19.8 checkpoint/constants.py
# PARAM, CAT_DIM, PARAM_N_SUB_PARAMS, VOCAB_TENSOR), as ds_to_universal.py `merge_tp_slices` writes them
UNIVERSAL_PARAM, CAT_DIM, N_SUB_PARAMS, VOCAB_TENSOR = "param", "cat_dim", "param_n_sub_params", "vocab_tensor"


def check_directory_name(name: str, source) -> str:
    """A parameter or buffer name becomes a directory under zero/ (as in ds_to_universal): it must be
    one plain path component, so a crafted checkpoint cannot make reshard write outside OUT, and
    not the name of the file zero/ holds. `source`: its `model_path(0)` is named in the refusal."""
    problem = tag_problem(name)
    if problem is None and name == OPTIMIZER_STATE:
        problem = f"is the name of the file zero/{OPTIMIZER_STATE} the universal format writes"
    if problem is not None:
        raise UnsupportedCheckpoint(source.model_path(0), f"parameter name {name!r} {problem}: it cannot be a "
                                                          "directory of a universal checkpoint")
    return name


def universal_entry(rule: ModelAxisRule | None, param) -> dict:
    """One state's file of one parameter, as ds_to_universal.py `merge_tp_slices` writes it (and
    universal_checkpoint.py `load_hp_checkpoint_state` reads it back, cutting the target rank's slice
    by these keys): replicated and averaged tensors bare {"param"} (taken whole at any tp); two fused
    sub-parameters {"cat_dim": 0, "param_n_sub_params": 2}; others {"cat_dim": 1 (row) or 0}; a
    vocabulary tensor also "vocab_tensor": True; the param last. `rule` None (no model axis, no
    patterns): {"cat_dim": 0}, merge_tp_slices' default."""
    entry: dict = {}
    if rule is None:
        entry[CAT_DIM] = 0
    elif rule.kind == "two-sub-params":
        entry.update({CAT_DIM: 0, N_SUB_PARAMS: 2})
    elif not rule.whole:
        entry[CAT_DIM] = rule.dim
    if rule is not None and rule.kind == "vocabulary":
        entry[VOCAB_TENSOR] = True
    entry[UNIVERSAL_PARAM] = param
    return entry
