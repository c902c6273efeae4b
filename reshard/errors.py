"""The errors reshard raises on purpose, each naming the file and what is wrong with it.

    from reshard.errors import CheckpointError
    raise CheckpointError("/ckpt/global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt",
                          "exp_avg of group 0 has 130 elements, the partition holds 129")

The CLI prints ``str(error)`` and exits with status 2; anything else is a bug and keeps
its traceback.
"""
from __future__ import annotations

import os


class ReshardError(Exception):
    """A refusal with a message meant for the user (bad input, bad options, unsupported)."""


class CheckpointError(ReshardError):
    """Something is wrong with a file or directory of the source checkpoint."""

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")

    def __reduce__(self):  # errors travel between workers pickled
        return (type(self), (self.path, self.problem))


class UnsupportedCheckpoint(CheckpointError):
    """A valid DeepSpeed checkpoint that reshard cannot transform (yet)."""


class OptionError(ReshardError):
    """The options given to a job contradict each other or the file system."""


class PeerFailure(ReshardError):
    """Another worker failed; this one stops without having written anything final."""


class TopologyError(OptionError):
    """A topology that cannot exist: a size below 1, or ep not dividing dp (see reshard.topology)."""


class UnsupportedTorch(ReshardError):
    """The installed torch lacks what this step needs (reshard.formats.torch_bytes.torch_release names it)."""
