"""Train the proof model with real DeepSpeed on N ranks, save a checkpoint, record its truth.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 -m reshard_proof.train \
        --variant z2_fp32 --save-dir /tmp/ck --truth /tmp/ck.truth.pt [--steps 3] [--seed 0] [--tag TAG] \
        [--also VARIANT SAVE_DIR TRUTH ...] [--also-steps VARIANT SAVE_DIR TRUTH STEPS ...]

Order matters: train, save, then capture the engine (so nothing the capture touches can leak into
the checkpoint), then the eval loss (eval mode, no_grad: changes nothing), then rank 0 writes the
truth file atomically. See truth_file.py for its schema.

Each `--also` trains one more variant in the same launch, one after the other, each in a fresh
engine from the same seed (build_engine), with the same steps and tag rules, saving a launch per
checkpoint; its files are byte for byte those of a launch of its own (tests/test_trained_together.py).
Each `--also-steps` does the same with a step count of its own (after every `--also`).
"""

import argparse

import torch

from reshard_proof.bitwise import compare_trees
from reshard_proof.client_state import make_client_state
from reshard_proof.engine_setup import (
    build_engine,
    eval_loss,
    finish_and_exit,
    init_distributed,
    node_path,
    train_steps,
)
from reshard_proof.engine_state import (
    MASTER_FROM_GETTERS,
    MASTER_FROM_INTERNALS,
    capture_engine_state,
    capture_master_state,
    master_route,
)
from reshard_proof.truth_file import write_truth
from reshard_proof.variants import get_variant


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", required=True)
    parser.add_argument("--save-dir", required=True, help='"{node}" in it becomes the node rank (node-local storage)')
    parser.add_argument("--truth", required=True, help="path of the truth file rank 0 writes")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default=None, help="checkpoint tag; default global_step{steps}")
    parser.add_argument("--also", nargs=3, action="append", default=[], metavar=("VARIANT", "SAVE_DIR", "TRUTH"),
                        help="train one more variant in this launch (repeatable)")
    parser.add_argument("--also-steps", nargs=4, action="append", default=[],
                        metavar=("VARIANT", "SAVE_DIR", "TRUTH", "STEPS"),
                        help="train one more variant in this launch, STEPS steps (repeatable)")
    return parser.parse_args(argv)


def cross_check_master_routes(engine) -> list[str]:
    """Getter route vs internals route, on ZeRO-1/2 and BF16_Optimizer. Collective."""
    if engine.zero_optimization_partition_weights():
        return []
    by_getters = capture_master_state(engine, MASTER_FROM_GETTERS)
    by_internals = capture_master_state(engine, MASTER_FROM_INTERNALS)
    return compare_trees(by_internals, by_getters, "getters vs internals").mismatches


def require_same_on_every_rank(what: str, value) -> None:
    """The truth is rank 0's view; it must be every rank's view, or it is no truth. Collective."""
    import torch.distributed as dist  # deepspeed.comm <= 0.16 has no all_gather_object

    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, value)
    for rank, view in enumerate(views[1:], start=1):
        mismatches = compare_trees(views[0], view, f"{what} rank0 vs rank{rank}").mismatches
        if mismatches:
            raise RuntimeError(f"{what} differs across ranks:\n" + "\n".join(mismatches[:20]))


def main(argv=None) -> None:
    args = parse_args(argv)
    for name, *_ in [(args.variant,), *args.also, *args.also_steps]:
        get_variant(name)  # an unknown name fails before any training
    steps = [int(job[3]) for job in args.also_steps]  # a bad count fails before any training too
    init_distributed()
    train(args)
    for name, save_dir, truth_path in args.also:
        train(argparse.Namespace(**{**vars(args), "variant": name, "save_dir": save_dir, "truth": truth_path}))
    for (name, save_dir, truth_path, _), count in zip(args.also_steps, steps):
        train(argparse.Namespace(**{**vars(args), "variant": name, "save_dir": save_dir, "truth": truth_path,
                                    "steps": count}))


def train(args: argparse.Namespace) -> None:
    """Train one variant in a fresh engine, save it, write its truth. Collective."""
    import deepspeed
    import torch.distributed as dist  # deepspeed.comm <= 0.16 has no all_gather_object

    variant = get_variant(args.variant)
    engine = build_engine(variant, args.seed)
    losses = train_steps(engine, seed=args.seed, first_step=0, count=args.steps)
    tag = args.tag or f"global_step{engine.global_steps}"
    client_state = make_client_state()
    engine.save_checkpoint(node_path(args.save_dir), tag=tag, client_state=client_state,
                           exclude_frozen_parameters=variant.exclude_frozen_parameters)
    dist.barrier()  # every rank's files are on disk before anyone records the truth

    route = master_route(variant)
    engine_state = capture_engine_state(engine, master_from=route)
    route_disagreements = cross_check_master_routes(engine)
    if route_disagreements and not variant.round_robin_gradients:
        raise RuntimeError("DeepSpeed's getters and the internals route disagree:\n"
                           + "\n".join(route_disagreements[:20]))
    loss = eval_loss(engine)
    require_same_on_every_rank("engine state", engine_state)
    require_same_on_every_rank("eval loss", loss)
    all_losses = [None] * dist.get_world_size()
    dist.all_gather_object(all_losses, losses)

    if dist.get_rank() == 0:
        truth = {
            "meta": {
                "variant": variant.name,
                "world_size": dist.get_world_size(),
                "seed": args.seed,
                "steps": args.steps,
                "tag": tag,
                "master_from": route,
                "optimizer_class": type(engine.optimizer).__name__,
                "zero_stage": variant.zero_stage,
                "precision": variant.precision,
                "exclude_frozen_parameters": variant.exclude_frozen_parameters,
                "deepspeed_version": deepspeed.__version__,
                "torch_version": str(torch.__version__),
                "master_route_cross_check": route_disagreements,
            },
            "engine": engine_state,
            "client_state": client_state,
            "eval_loss": loss,
            "train_losses": all_losses,
        }
        if variant.sequence_parallel:  # only where there is one: every other truth keeps the values,
            truth["meta"]["sequence_parallel"] = variant.sequence_parallel  # and the digests pinned on them
        write_truth(args.truth, truth)
        print(f"[proof.train] {variant.name} N={dist.get_world_size()} tag={tag} eval_loss={loss.item():.6f} "
              f"route={route} route_disagreements={len(route_disagreements)} -> {args.truth}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
    finish_and_exit()
