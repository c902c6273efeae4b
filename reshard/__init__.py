"""reshard: distributed resharding of DeepSpeed ZeRO checkpoints to a new data-parallel size.

    import reshard
    reshard.reshard_checkpoint("/ckpt/run1", "/ckpt/run1-dp16", target_dp=16)

or from the shell, one process per worker:

    torchrun --nproc_per_node=8 -m reshard /ckpt/run1 /ckpt/run1-dp16 --target-dp 16
"""
from reshard.errors import CheckpointError, ReshardError, UnsupportedCheckpoint
from reshard.version import __version__

__all__ = ["reshard_checkpoint", "ReshardError", "CheckpointError", "UnsupportedCheckpoint", "__version__"]


def reshard_checkpoint(source, destination, target_dp, **options):
    """Reshard `source` for `target_dp` data-parallel ranks (and `target_tp=T` tensor-parallel ranks,
    AutoTP checkpoints; default the source's) into `destination`; see reshard.jobs.collective_job."""
    from reshard.jobs.collective_job import reshard_checkpoint as run
    return run(source, destination, target_dp, **options)
