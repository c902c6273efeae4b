"""Load a checkpoint at M ranks with plain engine.load_checkpoint() and judge it against the truth.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 -m reshard_proof.check_load \
        --variant z2_fp32 --load-dir /tmp/ck --truth /tmp/ck.truth.pt --verdict /tmp/verdict.json \
        [--seed 1] [--tag TAG] [--extra-steps 1] [--in-job] \
        [--also VARIANT LOAD_DIR TRUTH VERDICT ...] [--also-in-job VARIANT LOAD_DIR TRUTH VERDICT ...]
        [--also-module-only VARIANT LOAD_DIR TRUTH RESULT ...]
                                        # or only --also / --also-in-job / --also-module-only

The target engine is built from another seed, so nothing matches by accident. Every rank compares
its own view with the truth (full fp32 masters and optimizer states, module values, frozen params,
buffers, counters, hyperparameters, scheduler, loss scaler, client_state, eval loss), the
mismatches are merged on rank 0, then `--extra-steps` more steps must give finite losses.
With --in-job the checkpoint is loaded by reshard.deepspeed.load_checkpoint (the drop-in that
reshards over the job's process group when the world size differs) instead of the plain call.
Each `--also` judges one more checkpoint in the same launch, in a fresh engine of its own
variant (a variant may name a ZeRO stage: `z2_bf16@stage3`), saving a launch per checkpoint;
`--in-job` applies to them too. Each `--also-in-job` is judged after them, loaded in-job whatever
`--in-job` says, so plain and in-job loads at one M share a launch. Each `--also-module-only` comes
last: an in-job load with load_optimizer_states=False (judge_module_only), whose RESULT says what
came back and whether it went through reshard's staging directory.
Exit code 0 whenever the run completes, whatever the verdict; see verdict_file.py for its schema.
"""

import argparse
import math
import time
import traceback
from pathlib import Path

import torch

from reshard_proof.bitwise import Comparison, compare_trees
from reshard_proof.engine_setup import (
    all_finite,
    build_engine,
    eval_loss,
    finish_and_exit,
    init_distributed,
    node_path,
    train_steps,
)
from reshard_proof.engine_state import capture_engine_state, master_route
from reshard_proof.truth_file import read_truth
from reshard_proof.variants import get_variant
from reshard_proof.verdict_file import MAX_REPORTED_MISMATCHES, write_verdict

_MISSING = "<missing from the loaded client_state>"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant")
    parser.add_argument("--load-dir")
    parser.add_argument("--truth")
    parser.add_argument("--verdict", help="path of the JSON verdict rank 0 writes")
    parser.add_argument("--seed", type=int, default=1, help="model seed of the target engine; differ from train's")
    parser.add_argument("--tag", default=None, help="checkpoint tag; default: the one in LOAD_DIR/latest")
    parser.add_argument("--extra-steps", type=int, default=1)
    parser.add_argument("--in-job", action="store_true",
                        help="load with reshard.deepspeed.load_checkpoint instead of engine.load_checkpoint")
    parser.add_argument("--also", nargs=4, action="append", default=[], metavar=("VARIANT", "LOAD_DIR", "TRUTH", "VERDICT"),
                        help="judge one more checkpoint in this launch (repeatable)")
    parser.add_argument("--also-in-job", nargs=4, action="append", default=[],
                        metavar=("VARIANT", "LOAD_DIR", "TRUTH", "VERDICT"),
                        help="judge one more checkpoint in this launch, loaded in-job (repeatable)")
    parser.add_argument("--also-module-only", nargs=4, action="append", default=[],
                        metavar=("VARIANT", "LOAD_DIR", "TRUTH", "RESULT"),
                        help="load one more checkpoint in-job without its optimizer states (repeatable)")
    args = parser.parse_args(argv)
    first = (args.variant, args.load_dir, args.truth, args.verdict)
    if None in first and (any(value is not None for value in first)
                          or not (args.also or args.also_in_job or args.also_module_only)):
        parser.error("give --variant, --load-dir, --truth and --verdict together, or only --also / --also-in-job / "
                     "--also-module-only")
    return args


# Relative tolerance of the eval loss when the loading engine runs another ZeRO stage than the
# one that recorded the truth: the state is compared bit for bit, but ZeRO-3 runs nn.Linear through
# its own autograd function (runtime/zero/linear.py `LinearFunctionForZeroStage3`: matmul, then
# the bias added separately) where ZeRO-1/2 run torch's fused addmm, so the same weights give a
# forward that rounds differently (in bf16/fp16 visibly so).
# The same tolerance serves a load at another sequence-parallel size (reshard_proof.ulysses_model):
# the state is again compared bit for bit, but the loss is the mean of the sp slices' means, which
# rounds differently from one mean over the whole sequence (2.5519468 against 2.5519466 in fp32).
CROSS_STAGE_LOSS_RTOL = {"fp32": 1e-5, "bf16": 5e-3, "fp16": 5e-3}


def compare_with_truth(truth: dict, engine_state: dict, client_state: dict | None, loss,
                       loss_rtol: float | None = None) -> Comparison:
    comparison = compare_trees(truth["engine"], engine_state, "engine")
    loaded_client_state = {key: (client_state or {}).get(key, _MISSING) for key in truth["client_state"]}
    comparison.absorb(compare_trees(truth["client_state"], loaded_client_state, "client_state"))
    if loss_rtol is None:
        comparison.absorb(compare_trees(truth["eval_loss"], loss, "eval_loss"))
    elif not torch.allclose(loss.double(), truth["eval_loss"].double(), rtol=loss_rtol, atol=0.0):
        comparison.mismatches.append(f"eval_loss: expected {float(truth['eval_loss'])} within rtol {loss_rtol} "
                                     f"(another ZeRO stage), got {float(loss)}")
    return comparison


def _latest_tag(load_dir: str) -> str | None:
    latest = Path(load_dir) / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def merge_rank_mismatches(per_rank: list[list[str]]) -> list[str]:
    """One line per distinct message, naming the ranks that reported it, in first-seen order."""
    ranks_by_message: dict[str, list[int]] = {}
    for rank, messages in enumerate(per_rank):
        for message in messages:
            ranks_by_message.setdefault(message, []).append(rank)
    return [f"{message} [ranks {','.join(map(str, ranks))}]" for message, ranks in ranks_by_message.items()]


def main(argv=None) -> None:
    args = parse_args(argv)
    init_distributed()
    if args.load_dir is not None:  # else every checkpoint comes with --also (launch.judge_in_shared_launches)
        judge(args)
    for in_job, jobs in ((args.in_job, args.also), (True, args.also_in_job)):
        for variant_name, load_dir, truth_path, verdict_path in jobs:
            judge(argparse.Namespace(**{**vars(args), "variant": variant_name, "load_dir": load_dir,
                                        "truth": truth_path, "verdict": verdict_path, "in_job": in_job}))
    for variant_name, load_dir, truth_path, result_path in args.also_module_only:
        judge_module_only(variant_name, load_dir, truth_path, result_path, seed=args.seed)


def judge_module_only(variant_name: str, load_dir: str, truth_path: str, result_path: str, *, seed: int) -> None:
    """reshard.deepspeed.load_checkpoint with load_optimizer_states=False in a fresh engine of the
    variant. Under ZeRO-3 DeepSpeed then runs zero_to_fp32 on the load directory itself, so the
    in-job path reshards through a temporary staging directory: rank 0 writes to `result_path`
    its module, frozen and client_state mismatches with the truth, how many loads went through
    staging (reshard.deepspeed._load_through_staging, spied on for this load only) and the staging
    directories left behind in the temporary directory. Collective."""
    import glob
    import os
    import tempfile

    import torch.distributed as dist

    import reshard.deepspeed
    from reshard_proof.engine_state import _capture_module_values, _trainable_names
    engine = build_engine(get_variant(variant_name), seed)
    staging = os.path.join(tempfile.gettempdir(), "reshard-injob-staging-*")
    staging_before = set(glob.glob(staging))
    through_staging, original = [], reshard.deepspeed._load_through_staging

    def spy(*args, **kwargs):
        through_staging.append(True)
        return original(*args, **kwargs)
    reshard.deepspeed._load_through_staging = spy
    try:
        _, client_state = reshard.deepspeed.load_checkpoint(engine, load_dir, load_optimizer_states=False)
    finally:
        reshard.deepspeed._load_through_staging = original
    values = _capture_module_values(engine, _trainable_names(engine))
    truth = read_truth(truth_path)
    comparison = compare_trees(truth["engine"]["module"], values["module"], "module")
    comparison.absorb(compare_trees(truth["engine"]["frozen"], values["frozen"], "frozen"))
    comparison.absorb(compare_trees(truth["client_state"], {k: client_state.get(k) for k in truth["client_state"]},
                                    "client_state"))
    staging_after = set(glob.glob(staging))
    if dist.get_rank() == 0:
        write_verdict(result_path, {"mismatches": comparison.mismatches, "checked_tensors": comparison.checked_tensors,
                                    "staging_left": sorted(staging_after - staging_before),
                                    "through_staging": len(through_staging)})
    dist.barrier()


def judge(args: argparse.Namespace) -> None:
    """Load one checkpoint in a fresh engine, compare, train on, write its verdict. Collective."""
    import torch.distributed as dist  # deepspeed.comm <= 0.16 has no all_gather_object

    args.load_dir = node_path(args.load_dir)  # each node's own directory of a node-local checkpoint
    variant = get_variant(args.variant)
    truth = read_truth(args.truth)
    if truth["meta"]["variant"] != variant.name:
        raise SystemExit(f"truth is for variant {truth['meta']['variant']!r}, not {variant.name!r}")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    engine = build_engine(variant, args.seed)

    load_error = None
    # a load must leave torch's weights_only allowlist of the process as it found it
    allowlist_before = set(torch.serialization.get_safe_globals())
    started = time.perf_counter()
    try:
        # frozen params are absent from such checkpoints; the target built them from their own seed
        strict = not variant.exclude_frozen_parameters
        if args.in_job:
            from reshard.deepspeed import load_checkpoint as load_in_job

            load_path, client_state = load_in_job(engine, args.load_dir, tag=args.tag, load_module_strict=strict)
        else:
            load_path, client_state = engine.load_checkpoint(args.load_dir, tag=args.tag, load_module_strict=strict)
        if load_path is None:
            load_error = f"load_checkpoint returned no path for {args.load_dir} (tag {args.tag})"
    except Exception:  # the verdict carries the failure; the run itself completed
        load_error = traceback.format_exc(limit=6)
    load_seconds = time.perf_counter() - started
    allowlist_changes = [None] * world_size
    dist.all_gather_object(allowlist_changes, sorted(repr(entry) for entry in
                                                     set(torch.serialization.get_safe_globals()) ^ allowlist_before))
    errors = [None] * world_size
    dist.all_gather_object(errors, load_error)
    load_errors = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]

    comparison, loss, extra_losses = Comparison(), float("nan"), []
    if not load_errors:
        engine_state = capture_engine_state(engine, master_from=master_route(variant))
        loss_tensor = eval_loss(engine)
        cross_stage = (truth["meta"].get("zero_stage", variant.zero_stage) != variant.zero_stage
                       or truth["meta"].get("sequence_parallel", 0) != variant.sequence_parallel)
        comparison = compare_with_truth(truth, engine_state, client_state, loss_tensor,
                                        CROSS_STAGE_LOSS_RTOL[variant.precision] if cross_stage else None)
        loss = float(loss_tensor)
        extra_losses = train_steps(engine, seed=args.seed, first_step=truth["meta"]["steps"], count=args.extra_steps)

    per_rank_mismatches = [None] * world_size
    dist.all_gather_object(per_rank_mismatches, comparison.mismatches)
    all_extra_losses = [None] * world_size
    dist.all_gather_object(all_extra_losses, extra_losses)

    if rank == 0:
        mismatches = merge_rank_mismatches(per_rank_mismatches)
        finite = all(all_finite(losses) for losses in all_extra_losses)
        if not finite:
            mismatches.append(f"extra steps gave non-finite losses: {all_extra_losses}")
        verdict = {
            "ok": not load_errors and not mismatches,
            "variant": variant.name,
            "in_job": args.in_job,
            "world_size": world_size,
            "source_world_size": truth["meta"]["world_size"],
            "tag": args.tag or _latest_tag(args.load_dir),
            "checked_tensors": comparison.checked_tensors,
            "checked_elements": comparison.checked_elements,
            "mismatch_count": len(mismatches),
            "mismatches": mismatches[:MAX_REPORTED_MISMATCHES],
            "load_error": "\n".join(load_errors) or None,
            "eval_loss": loss if math.isfinite(loss) else None,
            "truth_eval_loss": float(truth["eval_loss"]),
            "extra_step_losses": all_extra_losses,
            "load_seconds": round(load_seconds, 3),
            "allowlist_changed": sorted({entry for changes in allowlist_changes for entry in changes}),
        }
        write_verdict(args.verdict, verdict)
        print(f"[proof.check_load] {variant.name} N={verdict['source_world_size']} -> M={world_size}: "
              f"ok={verdict['ok']} tensors={verdict['checked_tensors']} mismatches={len(mismatches)} "
              f"-> {args.verdict}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
    finish_and_exit()
