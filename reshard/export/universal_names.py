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

LATEST_UNIVERSAL = "latest_universal"

OPTIMIZER_STATE = "optimizer_state.pt"
"""The one file zero/ holds beside the parameters' directories."""


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
