"""The launch floor: what `torchrun` + W workers cost before and after any resharding work.

    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/launch_floor.py

Each worker imports what a reshard worker imports (torch, reshard.jobs.collective_job, and deepspeed, which
reshard's pickle allowlist pulls in), joins a gloo process group, meets the others at a barrier
and exits. run.py times the whole command: the part of reshard's wall time no resharding
design can remove short of keeping workers alive inside a training job.
"""
import deepspeed  # noqa: F401  (reshard.formats.deepspeed_files.deepspeed_schema imports it for the allowlist)
import torch.distributed as dist

import reshard.jobs.collective_job  # noqa: F401

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
