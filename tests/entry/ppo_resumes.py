"""torchrun entry for tests: several resumes of launch/examples/ppo_actor_critic.py in one launch.

    torchrun --standalone --nproc_per_node=3 tests/entry/ppo_resumes.py JOBS.json

JOBS.json lists the example's resume arguments, one object each: {"ckpt", "in_job", "iterations",
"truth", "report"}. Each resume builds its own actor and critic engines (another seed), loads, is
compared with the truth and trains on, exactly as `ppo_actor_critic.py resume` does; they share the
launch, since starting torch and DeepSpeed on every rank is most of what one resume costs.
"""
import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "launch" / "examples" / "ppo_actor_critic.py"


def main() -> None:
    spec = importlib.util.spec_from_file_location("ppo_actor_critic", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with open(sys.argv[1]) as jobs_file:
        jobs = json.load(jobs_file)
    import deepspeed
    import deepspeed.comm as dist
    deepspeed.init_distributed(dist_backend="gloo")
    for job in jobs:
        example.resume(argparse.Namespace(**job), dist.get_rank())
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
