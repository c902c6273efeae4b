"""Train an MoE checkpoint (native DeepSpeed MoE or AutoEP) at (world, ep), or judge loads of it at another (world, ep).

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=4 -m reshard_proof.moe_run train \
        --variant moe_z2_fp32 --ep 2 --save-dir /tmp/ck --truth /tmp/ck.truth.pt
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 -m reshard_proof.moe_run check \
        --variant moe_z2_fp32 --ep 1 --truth /tmp/ck.truth.pt \
        --load-dir /tmp/out1 --verdict /tmp/v1.json [--load-dir /tmp/out2 --verdict /tmp/v2.json ...] \
        [--in-job-load-dir /tmp/ck --in-job-verdict /tmp/v3.json]   # reshard.deepspeed.load_checkpoint
        [--universal-load-dir /tmp/u --universal-verdict /tmp/v4.json]  # ds_to_universal output, load_universal
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 -m reshard_proof.moe_run train --ep 2 \
        --save moe_z2_fp32 /tmp/a /tmp/a.truth.pt --save autoep_z2_fp32 /tmp/b /tmp/b.truth.pt   # several, one launch
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=2 -m reshard_proof.moe_run check --ep 1 \
        --job moe_z2_fp32 /tmp/ck.truth.pt native /tmp/out1 /tmp/v1.json \
        --job autoep_z2_fp32 /tmp/ae.truth.pt in_job /tmp/ae /tmp/v2.json   # loads of several sources, one launch
        --job moe_z0_fp32 /tmp/z0.truth.pt in_job:4096 /tmp/z0 /tmp/v3.json   # in-job, memory_budget=4096

Experts live on one expert-parallel rank each, so no rank's view is the whole truth: every rank
captures its own view (reshard_proof.engine_state), expert names are rewritten from the LOCAL
expert index to the GLOBAL one (local expert j on EP rank e is global expert e * n_local + j,
moe/experts.py + engine.py `_save_moe_checkpoint`), and the views of all ranks are merged: a
name held by several ranks (dense parameters, expert-data-parallel replicas) must agree bit for
bit. AutoEP holds a rank's experts fused, `experts.w1 [E/ep, F, H]`: each fused parameter is
cut into its experts, named `experts.w1.{global id}` as in DeepSpeed's expert files (engine.py
`_save_moe_checkpoint`; module_inject/auto_ep_layer.py: EP rank e holds experts e*E/ep ..). `check` builds a fresh engine from another seed per load directory (several loads per
launch), loads with plain `engine.load_checkpoint`, and compares the merged view with the truth:
every element of the fp32 masters and optimizer states, module values, counters, scheduler,
hyperparameters (expert groups are named `ep_size_{ep}` by DeepSpeed, so the name is expected
to follow the engine's ep), buffers and client_state; the eval loss must be close (the expert
all-to-all changes summation order across ep sizes), then one more step must be finite.
A universal load (DeepSpeed's `load_universal` of a ds_to_universal.py output, the oracle) is
judged on the fp32 masters and optimizer states only: DeepSpeed's universal path does not
restore buffers or client_state. What else differs from the truth is reported as
`beyond_masters` in its verdict.
"""

import argparse
import math
import re
import time
import traceback


from reshard_proof.bitwise import Comparison, compare_trees
from reshard_proof.client_state import make_client_state
from reshard_proof.engine_setup import (
    all_finite,
    build_engine,
    eval_loss,
    finish_and_exit,
    init_distributed,
    train_steps,
)
from reshard_proof.engine_state import MASTER_FROM_GETTERS, capture_engine_state
from reshard_proof.truth_file import read_truth, write_truth
from reshard_proof.variants import get_variant
from reshard_proof.verdict_file import MAX_REPORTED_MISMATCHES, write_verdict

EXPERT_SLOT = ".deepspeed_moe.experts.deepspeed_experts."
EVAL_LOSS_RTOL = {"fp32": 1e-5, "bf16": 2e-2}


def global_expert_names(engine) -> dict[str, str]:
    """{local prefix: global prefix} of every expert this rank holds, e.g.
    "moe.1.deepspeed_moe.experts.deepspeed_experts.0." -> "...deepspeed_experts.2." on EP rank 1."""
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    renames = {}
    for name, module in engine.module.named_modules():
        if isinstance(module, MoE):
            ep_rank = groups._get_expert_parallel_rank(module.expert_group_name)
            for local in range(module.num_local_experts):
                renames[f"{name}{EXPERT_SLOT}{local}."] = f"{name}{EXPERT_SLOT}{ep_rank * module.num_local_experts + local}."
    return renames


def _globalize(names: dict, renames: dict[str, str]) -> dict:
    pattern = re.compile("^(" + "|".join(re.escape(k) for k in renames) + ")") if renames else None
    return {(pattern.sub(lambda m: renames[m[1]], name) if pattern else name): value for name, value in names.items()}


def autoep_fused_experts(engine) -> dict[str, tuple[int, int]]:
    """{fused expert parameter name: (first global expert, local experts)} of this rank's AutoEP layers."""
    try:
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    except ImportError:
        return {}
    fused = {}
    for name, module in engine.module.named_modules():
        if isinstance(module, AutoEPMoELayer):
            prefix = f"{name}." if name else ""
            for wname in ("w1", "w2", "w3"):
                fused[f"{prefix}experts.{wname}"] = (module.ep_rank * module.num_local_experts,
                                                      module.num_local_experts)
    return fused


def _split_fused(values: dict, fused: dict[str, tuple[int, int]]) -> dict:
    """Fused AutoEP entries (a tensor, or a master {"fp32", "state", "scalars"}) cut per global expert."""
    out = {}
    for name, value in values.items():
        if name not in fused:
            out[name] = value
            continue
        first, count = fused[name]
        for local in range(count):
            if isinstance(value, dict):
                out[f"{name}.{first + local}"] = {"fp32": value["fp32"][local].clone(),
                                                  "state": {k: v[local].clone() for k, v in value["state"].items()},
                                                  "scalars": value["scalars"]}
            else:
                out[f"{name}.{first + local}"] = value[local].clone()
    return out


def merged_engine_state(engine) -> dict:
    """This job's view of the engine under global expert names, merged over every rank. Collective."""
    import deepspeed.comm as dist

    state = capture_engine_state(engine, master_from=MASTER_FROM_GETTERS)
    renames = global_expert_names(engine)
    fused = autoep_fused_experts(engine)
    for key in ("master", "module"):
        state[key] = _split_fused(_globalize(state[key], renames), fused)
    # AutoEPMoELayer counts the tokens each rank routed in a non-persistent buffer
    # (auto_ep_layer.py, `tokens_per_expert`): per-rank traffic statistics, never saved.
    state["non_persistent_buffers"] = {name: value for name, value in state["non_persistent_buffers"].items()
                                       if not (fused and name.endswith(".tokens_per_expert"))}
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, state)
    merged = dict(views[0])
    for key in ("master", "module"):
        union = {}
        for rank, view in enumerate(views):
            for name, value in view[key].items():
                if name in union:
                    problems = compare_trees(union[name], value, f"{key}.{name} rank{rank} vs first holder").mismatches
                    if problems:
                        raise RuntimeError("ranks holding the same parameter disagree:\n" + "\n".join(problems[:10]))
                else:
                    union[name] = value
        merged[key] = dict(sorted(union.items()))
    rest = {k: v for k, v in views[0].items() if k not in ("master", "module", "param_groups")}
    for rank, view in enumerate(views[1:], start=1):
        other = {k: v for k, v in view.items() if k not in ("master", "module", "param_groups")}
        problems = compare_trees(rest, other, f"engine rank0 vs rank{rank}").mismatches
        if problems:
            raise RuntimeError("dense engine state differs across ranks:\n" + "\n".join(problems[:10]))
    return merged


def _common(argv_parser: argparse.ArgumentParser, required: bool = True) -> None:
    argv_parser.add_argument("--variant", required=required)
    argv_parser.add_argument("--ep", type=int, required=True, help="expert-parallel size of the engine")
    argv_parser.add_argument("--truth", required=required)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    train = sub.add_parser("train")
    _common(train, required=False)
    train.add_argument("--save-dir")
    train.add_argument("--save", nargs=3, action="append", default=[], metavar=("VARIANT", "SAVE_DIR", "TRUTH"),
                       help="train and save one more source in this launch, from a fresh engine")
    train.add_argument("--steps", type=int, default=3)
    train.add_argument("--seed", type=int, default=0)
    check = sub.add_parser("check")
    _common(check, required=False)
    check.add_argument("--job", nargs=5, action="append", default=[],
                       metavar=("VARIANT", "TRUTH", "HOW", "LOAD_DIR", "VERDICT"),
                       help="one more load of any source in this launch (HOW: native, in_job or universal), "
                            "in a fresh engine of VARIANT at --ep, judged against TRUTH")
    check.add_argument("--load-dir", action="append", default=[])
    check.add_argument("--verdict", action="append", default=[])
    check.add_argument("--in-job-load-dir", action="append", default=[],
                       help="load with reshard.deepspeed.load_checkpoint (resharding in the job) instead")
    check.add_argument("--in-job-verdict", action="append", default=[])
    check.add_argument("--universal-load-dir", action="append", default=[],
                       help="a ds_to_universal.py output, loaded with checkpoint.load_universal")
    check.add_argument("--universal-verdict", action="append", default=[])
    check.add_argument("--seed", type=int, default=1)
    check.add_argument("--extra-steps", type=int, default=1)
    args = parser.parse_args(argv)
    if args.mode == "check" and (len(args.load_dir) != len(args.verdict)
                                 or len(args.in_job_load_dir) != len(args.in_job_verdict)
                                 or len(args.universal_load_dir) != len(args.universal_verdict)):
        parser.error("give one --verdict per --load-dir, --in-job-verdict per --in-job-load-dir and "
                     "--universal-verdict per --universal-load-dir")
    if args.mode == "train" and (args.save_dir is not None) != bool(args.variant and args.truth):
        parser.error("--save-dir goes with --variant and --truth")
    if args.mode == "check":
        if (args.load_dir or args.in_job_load_dir or args.universal_load_dir) and not (args.variant and args.truth):
            parser.error("--load-dir, --in-job-load-dir and --universal-load-dir need --variant and --truth")
        if any(not re.fullmatch(r"native|in_job(:\d+)?|universal", how) for _, _, how, _, _ in args.job):
            parser.error("a --job's HOW is native, in_job, in_job:BYTES or universal")
    return args


def train(args) -> None:
    """Train, save and record the truth of each source (--variant/--save-dir/--truth, then each
    --save), every one from a fresh engine at --ep over this job's ranks."""
    saves = ([(args.variant, args.save_dir, args.truth)] if args.save_dir else []) + [tuple(s) for s in args.save]
    for variant_name, save_dir, truth_path in saves:
        train_one(args, get_variant(variant_name), save_dir, truth_path)


def train_one(args, variant, save_dir: str, truth_path: str) -> None:
    import deepspeed.comm as dist

    engine = build_engine(variant, args.seed, ep=args.ep)
    losses = train_steps(engine, seed=args.seed, first_step=0, count=args.steps)
    tag = f"global_step{engine.global_steps}"
    client_state = make_client_state()
    engine.save_checkpoint(save_dir, tag=tag, client_state=client_state)
    dist.barrier()
    state = merged_engine_state(engine)
    loss = eval_loss(engine)
    if dist.get_rank() == 0:
        write_truth(truth_path, {
            "meta": {"variant": variant.name, "world_size": dist.get_world_size(), "ep": args.ep, "seed": args.seed,
                     "steps": args.steps, "tag": tag, "optimizer_class": type(engine.optimizer).__name__,
                     "precision": variant.precision, "train_losses": losses},
            "engine": state, "client_state": client_state, "eval_loss": loss})
        print(f"[proof.moe_run] trained {variant.name} world={dist.get_world_size()} ep={args.ep} "
              f"eval_loss={loss.item():.6f} -> {truth_path}", flush=True)
    dist.barrier()


def _expected_param_groups(truth_groups: list[dict], ep: int) -> list[dict]:
    """DeepSpeed names expert groups `ep_size_{ep}` (moe/utils.py): the name follows the engine."""
    return [dict(group, name=f"ep_size_{ep}") if group.get("moe") else group for group in truth_groups]


def check_one(variant, args, truth: dict, load_dir: str, how: str) -> dict:
    """`how`: "native" (engine.load_checkpoint), "in_job" (reshard.deepspeed.load_checkpoint; "in_job:BYTES"
    with memory_budget=BYTES, its summary line and the rounds it names in the verdict) or "universal"
    (engine.load_checkpoint with checkpoint.load_universal)."""
    import contextlib
    import dataclasses
    import io

    import deepspeed.comm as dist

    how, _, budget = how.partition(":")
    in_job, universal = how == "in_job", how == "universal"
    printed = io.StringIO()
    engine = build_engine(dataclasses.replace(variant, load_universal=universal), args.seed, ep=args.ep)
    load_error, started = None, time.perf_counter()
    try:
        if in_job:
            from reshard.deepspeed import load_checkpoint as load_in_job
            with contextlib.redirect_stdout(printed):  # its summary line (rounds) goes into the verdict too
                load_path, client_state = load_in_job(engine, load_dir,
                                                      **({"memory_budget": int(budget)} if budget else {}))
            print(printed.getvalue(), end="", flush=True)
        else:
            load_path, client_state = engine.load_checkpoint(load_dir)
        if load_path is None:
            load_error = f"load_checkpoint returned no path for {load_dir}"
    except Exception:
        load_error, client_state = traceback.format_exc(limit=6), None
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, load_error)
    load_errors = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    comparison, loss, extra, beyond_masters = Comparison(), float("nan"), [], []
    if not load_errors:
        state = merged_engine_state(engine)
        expected = dict(truth["engine"], param_groups=_expected_param_groups(truth["engine"]["param_groups"], args.ep))
        if universal:
            comparison = compare_trees(expected["master"], state["master"], "engine.master")
            # what DeepSpeed's universal path does not restore, reported beside the verdict
            beyond_masters = compare_trees(expected, state, "engine").mismatches
        else:
            comparison = compare_trees(expected, state, "engine")
            loaded = {key: (client_state or {}).get(key, "<missing>") for key in truth["client_state"]}
            comparison.absorb(compare_trees(truth["client_state"], loaded, "client_state"))
        loss = float(eval_loss(engine))
        truth_loss = float(truth["eval_loss"])
        if not math.isclose(loss, truth_loss, rel_tol=EVAL_LOSS_RTOL[variant.precision]):
            comparison.mismatches.append(f"eval_loss {loss!r} is not close to the truth's {truth_loss!r}")
        extra = train_steps(engine, seed=args.seed, first_step=truth["meta"]["steps"], count=args.extra_steps)
        if not all_finite(extra):
            comparison.mismatches.append(f"extra steps gave non-finite losses {extra}")
    return {"ok": not load_errors and not comparison.mismatches, "variant": variant.name,
            "world_size": dist.get_world_size(), "ep": args.ep, "load_dir": load_dir, "in_job": in_job, "how": how,
            "source_world_size": truth["meta"]["world_size"], "source_ep": truth["meta"]["ep"],
            "checked_tensors": comparison.checked_tensors, "checked_elements": comparison.checked_elements,
            "mismatch_count": len(comparison.mismatches),
            "mismatches": comparison.mismatches[:MAX_REPORTED_MISMATCHES],
            "beyond_masters": beyond_masters[:MAX_REPORTED_MISMATCHES],
            "load_error": "\n".join(load_errors) or None, "eval_loss": loss if math.isfinite(loss) else None,
            "truth_eval_loss": float(truth["eval_loss"]), "extra_step_losses": extra,
            "load_seconds": round(time.perf_counter() - started, 3), "memory_budget": int(budget) if budget else None,
            "in_job_rounds": int(rounds[-1]) if (rounds := re.findall(r"in-job in (\d+) round", printed.getvalue()))
            else None}


def check(args) -> None:
    """Each load in a fresh engine of its own variant (native MoE, AutoEP, any ZeRO stage and
    precision, all at --ep over this job's ranks), judged against its own truth."""
    import deepspeed.comm as dist

    loads = [(args.variant, args.truth, d, v, "native") for d, v in zip(args.load_dir, args.verdict)]
    loads += [(args.variant, args.truth, d, v, "in_job") for d, v in zip(args.in_job_load_dir, args.in_job_verdict)]
    loads += [(args.variant, args.truth, d, v, "universal")
              for d, v in zip(args.universal_load_dir, args.universal_verdict)]
    loads += [(variant, truth, d, v, how) for variant, truth, how, d, v in args.job]
    truths: dict[str, dict] = {}
    for variant_name, truth_path, load_dir, verdict_path, how in loads:
        variant = get_variant(variant_name)
        if truth_path not in truths:
            truths[truth_path] = read_truth(truth_path)
        truth = truths[truth_path]
        if truth["meta"]["variant"] != variant.name:
            raise SystemExit(f"{truth_path} is the truth of {truth['meta']['variant']!r}, not {variant.name!r}")
        verdict = check_one(variant, args, truth, load_dir, how)
        # A mismatch seen by one rank only is merged by the all_gather inside merged_engine_state;
        # the verdict is rank 0's.
        if dist.get_rank() == 0:
            write_verdict(verdict_path, verdict)
            print(f"[proof.moe_run] {variant.name} world={truth['meta']['world_size']} ep={truth['meta']['ep']} -> "
                  f"world={verdict['world_size']} ep={args.ep}: ok={verdict['ok']} "
                  f"tensors={verdict['checked_tensors']} -> {verdict_path}", flush=True)
        dist.barrier()


def main(argv=None) -> None:
    args = parse_args(argv)
    init_distributed()
    (train if args.mode == "train" else check)(args)


if __name__ == "__main__":
    main()
    finish_and_exit()
