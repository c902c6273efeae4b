"""Run DeepSpeed's own zero_to_fp32 consolidation on a checkpoint and compare it with the truth.

    python -m reshard_proof.zero_to_fp32_check CKPT_DIR TRUTH.pt [--tag TAG]

Single process, no torchrun. zero_to_fp32 reads `param_shapes`, `partition_count`,
`group_paddings`, `param_alignment_paddings`, `frozen_param_*` and `shared_params`, which
load_checkpoint never checks, so a resharded checkpoint must pass this too.

What zero_to_fp32 returns, and so what is expected (deepspeed/utils/zero_to_fp32.py):
trainable params as fp32 (bitwise equal to the truth's masters); frozen params in the module
dtype for stage 2/3 unless excluded at save (stage 1 saves no frozen_param_shapes, so none);
persistent buffers upcast to fp32 when floating; each tied alias as its owner's tensor.
It cannot read BF16_Optimizer checkpoints (their optimizer state has no `zero_stage`): the result
is then a single line starting with UNSUPPORTED, never an empty (passing) list.
"""

import argparse
import contextlib
import io
import sys
from pathlib import Path

import torch

from reshard_proof.bitwise import compare_trees
from reshard_proof.truth_file import read_truth

UNSUPPORTED = "UNSUPPORTED"


def _tag_dir(ckpt_dir: Path, tag: str | None) -> Path:
    if tag is None:
        tag = (ckpt_dir / "latest").read_text().strip()
    return ckpt_dir / tag


def _has_zero_stage(tag_dir: Path) -> bool:
    optim_files = sorted(tag_dir.glob("*_optim_states.pt"))
    if not optim_files:
        raise FileNotFoundError(f"no *_optim_states.pt under {tag_dir}")
    # DeepSpeed's own pickled classes (loss scaler, enums) need a full unpickler; only our own files.
    state = torch.load(optim_files[0], map_location="cpu", mmap=True, weights_only=False)
    return "zero_stage" in state["optimizer_state_dict"]


def check_zero_to_fp32(ckpt_dir, truth_path, tag: str | None = None, stage: int | None = None) -> list[str]:
    """Mismatches between get_fp32_state_dict_from_zero_checkpoint(ckpt_dir) and the truth.
    `stage`: the checkpoint's ZeRO stage when it is not the truth's (written by --target-stage)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt_dir = Path(ckpt_dir)
    tag_dir = _tag_dir(ckpt_dir, tag)
    if not _has_zero_stage(tag_dir):
        return [f"{UNSUPPORTED}: zero_to_fp32 cannot read {tag_dir}: its optimizer_state_dict has no "
                f"'zero_stage' (a BF16_Optimizer checkpoint)"]
    truth = read_truth(truth_path)
    engine, meta = truth["engine"], truth["meta"]

    # it prints progress for every group and a tqdm bar
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        consolidated = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag_dir.name)

    expected = {name: entry["fp32"] for name, entry in engine["master"].items()}
    if (stage or meta["zero_stage"]) >= 2 and not meta["exclude_frozen_parameters"]:
        expected.update(engine["frozen"])
    for name, buffer in engine["buffers"].items():
        expected[name] = buffer.float() if buffer.is_floating_point() else buffer
    for alias, owner in engine["tied"].items():
        expected[alias] = expected[owner]
    mismatches = compare_trees(expected, dict(consolidated), "zero_to_fp32").mismatches
    for alias, owner in engine["tied"].items():
        if alias in consolidated and owner in consolidated and consolidated[alias] is not consolidated[owner]:
            mismatches.append(f"zero_to_fp32[{alias!r}]: not the same tensor as its owner {owner!r}")
    return mismatches


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt_dir")
    parser.add_argument("truth")
    parser.add_argument("--tag", default=None)
    args = parser.parse_args(argv)
    mismatches = check_zero_to_fp32(args.ckpt_dir, args.truth, args.tag)
    print("\n".join(mismatches) if mismatches else "zero_to_fp32 matches the truth")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
