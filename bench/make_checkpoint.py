"""Make (or reuse) a real DeepSpeed ZeRO checkpoint of the benchmark model, trained one step.

    python bench/make_checkpoint.py --stage 2 [--quick] [--ranks 4] [--cache-dir bench/.cache] [--no-frozen]

prints the save directory. Under the hood, on a cache miss:

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=4 bench/make_checkpoint.py \
        --train --stage 2 --config-json '{...}' --save-dir DIR

builds the model on every rank, runs one fp32 AdamW step with ZeRO-`stage` over gloo and saves
with engine.save_checkpoint(DIR, tag="global_step1"). The cache directory name carries a hash
of the model config, stage, rank count and DeepSpeed/torch versions; `meta.json` is written
last, so a half-made checkpoint is never reused.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from bench_model import FULL, QUICK, ModelConfig, config_from_json, config_to_json  # noqa: E402

TAG = "global_step1"
DEFAULT_CACHE = os.path.join(HERE, ".cache")


def child_env() -> dict:
    """Environment for every torchrun/DeepSpeed child: CPU accelerator, one thread per rank."""
    env = dict(os.environ)
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    # reshard from this checkout, and its proof harness beside the tests (synthetic_load_check.py uses it)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH")]))
    return env


def torchrun_command(nproc: int, script: str, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            os.path.join(HERE, script), *map(str, args)]


def versions() -> dict:
    from importlib.metadata import version
    return {"deepspeed": version("deepspeed"), "torch": version("torch")}


def checkpoint_dir(cfg: ModelConfig, stage: int, ranks: int, cache_dir: str) -> str:
    return os.path.join(cache_dir, f"ckpt-{cfg.name}-z{stage}-n{ranks}-{cfg.key(stage=stage, ranks=ranks, **versions())}")


def tree_bytes(path: str) -> int:
    """Apparent size of every file under `path`."""
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def expected_files(stage: int, ranks: int) -> list[str]:
    names = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(ranks)]
    if stage == 3:
        names += [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(ranks)]
    else:
        names.append("mp_rank_00_model_states.pt")
    return names


def saved_completely(save_dir: str, stage: int, ranks: int) -> bool:
    paths = [os.path.join(save_dir, TAG, name) for name in expected_files(stage, ranks)]
    return os.path.isfile(os.path.join(save_dir, "latest")) and all(
        os.path.isfile(p) and os.path.getsize(p) > 0 for p in paths)


def ensure_checkpoint(cfg: ModelConfig, stage: int, ranks: int, cache_dir: str, log=print) -> dict:
    """The cached checkpoint's meta (save_dir, bytes, ...), training and saving it on a miss."""
    from process_tree import run_watched
    root = checkpoint_dir(cfg, stage, ranks, cache_dir)
    meta_path = os.path.join(root, "meta.json")
    if os.path.isfile(meta_path):
        with open(meta_path) as fd:
            meta = json.load(fd)
        log(f"reusing cached checkpoint {meta['save_dir']} ({meta['bytes'] / 1e9:.2f} GB)")
        return meta
    if os.path.exists(root):
        shutil.rmtree(root)
    save_dir = os.path.join(root, "save")
    os.makedirs(root)
    command = torchrun_command(ranks, "make_checkpoint.py", "--train", "--stage", stage,
                               "--config-json", config_to_json(cfg), "--save-dir", save_dir)
    log(f"training {cfg.name} ({cfg.param_count / 1e6:.0f}M params) one step with ZeRO-{stage} on {ranks} ranks ...")
    for attempt in (1, 2):
        run = run_watched(command, env=child_env(), cwd=REPO, log_path=os.path.join(root, "train.log"),
                          disk_path=root)
        if run.returncode == 0 or saved_completely(save_dir, stage, ranks):
            break  # a launch that died only at teardown, after saving everything, counts
        if attempt == 2:
            raise RuntimeError(f"training failed (exit {run.returncode}):\n{run.output_tail}")
        shutil.rmtree(save_dir, ignore_errors=True)
    meta = {"save_dir": save_dir, "tag": TAG, "stage": stage, "ranks": ranks, "config": json.loads(config_to_json(cfg)),
            "params": cfg.param_count, "bytes": tree_bytes(os.path.join(save_dir, TAG)), "versions": versions(),
            "train_wall_seconds": run.wall_seconds, "train_peak_tree_rss_bytes": run.peak_tree_rss_bytes,
            "train_returncode": run.returncode}
    with open(meta_path + ".tmp", "w") as fd:
        json.dump(meta, fd, indent=1)
    os.replace(meta_path + ".tmp", meta_path)
    log(f"saved {save_dir} ({meta['bytes'] / 1e9:.2f} GB) in {run.wall_seconds:.0f} s, "
        f"peak tree RSS {run.peak_tree_rss_bytes / 1e9:.1f} GB")
    return meta


def random_batch(cfg: ModelConfig, rank: int):
    import torch
    generator = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.micro_batch, cfg.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def train_and_save(cfg: ModelConfig, stage: int, save_dir: str) -> None:
    """One rank of the torchrun job: initialise, one step, save."""
    import deepspeed
    import torch
    from bench_model import build_engine

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    started = time.perf_counter()
    engine = build_engine(cfg, stage)
    tokens, targets = random_batch(cfg, rank)
    loss = engine(tokens, targets)
    engine.backward(loss)
    engine.step()
    stepped = time.perf_counter()
    engine.save_checkpoint(save_dir, tag=TAG, client_state={"bench_note": "reshard benchmark", "loss": loss.item()})
    saved = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"[rank {rank}] loss {float(loss):.3f}; init+step {stepped - started:.1f} s, save {saved - stepped:.1f} s, "
          f"peak RSS {peak:.2f} GB", flush=True)
    torch.distributed.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, choices=(2, 3), required=True)
    parser.add_argument("--quick", action="store_true", help="the small model on 2 ranks")
    parser.add_argument("--ranks", type=int, help="ranks to train on (default 4, quick 2)")
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE)
    parser.add_argument("--no-frozen", action="store_true", help="no frozen parameter (see ModelConfig)")
    parser.add_argument("--train", action="store_true", help="(internal) run as one torchrun rank")
    parser.add_argument("--config-json", help="(internal) model config")
    parser.add_argument("--save-dir", help="(internal) where to save")
    args = parser.parse_args()
    if args.train:
        train_and_save(config_from_json(args.config_json), args.stage, args.save_dir)
        return
    cfg = QUICK if args.quick else FULL
    if args.no_frozen:
        cfg = dataclasses.replace(cfg, frozen_position=False, name=cfg.name + "-nofrozen")
    meta = ensure_checkpoint(cfg, args.stage, args.ranks or (2 if args.quick else 4), args.cache_dir)
    print(meta["save_dir"])


if __name__ == "__main__":
    main()
