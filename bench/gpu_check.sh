#!/usr/bin/env bash
# The NCCL path and in-job loads on a CUDA machine (one GPU): for each checkpoint trained on 2
# CPU ranks (real DeepSpeed, truth recorded), reshard 2 -> 1 with `torchrun -m reshard --backend
# nccl`, load it in a CUDA engine with plain load_checkpoint, and load the 2-rank original through
# reshard.deepspeed.load_checkpoint (in-job, over the job's NCCL group); every fp32 master and
# optimizer-state element is compared with the truth (reshard_proof.check_load).
#
#   bash bench/gpu_check.sh CHECKS_DIR OUT_DIR     # CHECKS_DIR/<variant>/{ckpt,truth.pt}
#
# The eval loss is computed on the GPU and the truth's on the CPU, so it is reported, not required
# to match bit for bit; everything else must. With one GPU the offline job has one worker (no
# exchange); the in-job load runs over the job's NCCL group.
#
# Where the save's optimizer is Adam (every variant but MoE here), its `reshard export --format dcp`
# is also loaded into an FSDP2 model and torch AdamW on the GPU over NCCL (reshard_proof.fsdp2_judge
# --device cuda): every parameter and moment against the truth, then one more step against torch
# AdamW on the CPU (a CUDA kernel that rounds differently shows there, and only there).
set -uo pipefail
checks=$1; out=$2; work=$(mktemp -d)
export DS_ACCELERATOR=cuda RESHARD_PROOF_BACKEND=nccl PYTHONUNBUFFERED=1
# reshard and its proof harness (tests/reshard_proof, never installed) from this checkout
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$repo:$repo/tests${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, torch.cuda.get_device_name(0))"
run() { python3 -m torch.distributed.run --standalone --nproc_per_node=1 "$@"; }
for dir in "$checks"/*/; do
  v=$(basename "$dir")
  start=$(date +%s.%N)
  run -m reshard "$dir/ckpt" "$work/$v" --target-dp 1 --backend nccl --quiet || echo "RESHARD FAILED $v"
  end=$(date +%s.%N)
  echo "$v: offline reshard 2->1 took $(python3 -c "print(round($end - $start, 2))") s (whole command)"
  run -m reshard_proof.check_load --variant "$v" --load-dir "$work/$v" --truth "$dir/truth.pt" \
      --verdict "$out/$v-native.json" || echo "CHECK FAILED $v native"
  run -m reshard_proof.check_load --variant "$v" --load-dir "$dir/ckpt" --truth "$dir/truth.pt" \
      --verdict "$out/$v-injob.json" --in-job || echo "CHECK FAILED $v in-job"
  case $v in *moe*) continue ;; esac
  python3 -m reshard export "$dir/ckpt" "$work/$v-dcp" --format dcp --quiet || echo "DCP EXPORT FAILED $v"
  run -m reshard_proof.fsdp2_judge --device cuda --case "$work/$v-dcp" "$dir/truth.pt" "$out/$v-dcp-fsdp2.json" \
      || echo "CHECK FAILED $v dcp"
done
python3 - "$out" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    v = json.loads(path.read_text())
    real = [m for m in v.get("mismatches", []) if not m.startswith("eval_loss")]
    if "checks" in v:  # a DCP export judged in FSDP2 (reshard_proof.fsdp2_judge)
        step = [m for m in real if m.startswith("after one more step")]
        print(f"{path.stem:28s} {v['checks']} checks, mismatches before the step: {len(real) - len(step)} "
              f"{[m for m in real if m not in step][:3]}, in the step: {len(step)} {step[:2]}")
        continue
    print(f"{path.stem:28s} checked {v.get('checked_tensors')} tensors, mismatches besides eval_loss: "
          f"{len(real)} {real[:3]} load_error={v.get('load_error')!r}")
PY
