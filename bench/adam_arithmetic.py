"""One Adam step by DeepSpeedCPUAdam (DeepSpeed's C++ kernel, ZeRO-Offload's optimizer) beside torch.optim.AdamW.

    DS_ACCELERATOR=cpu python bench/adam_arithmetic.py      # builds the cpu_adam op the first time (minutes)

Same state (step 3, moments, parameters ~ N(0, 1)), same gradient, same hyperparameters; prints how
many parameters come out bit-identical and the largest difference. Why they differ
(deepspeed/ops/csrc/includes/cpu_adam.h `Step_AVX`): the kernel forms the denominator as one fused
multiply-add, sqrt(v) * (1 / sqrt(1 - beta2^t)) + eps, applies decoupled weight decay as
p + p * (-lr * wd) and the update as p + (m / denom) * (-lr / (1 - beta1^t)), each an FMA; torch
AdamW divides sqrt(v) by sqrt(1 - beta2^t), multiplies p by (1 - lr * wd) and uses addcdiv. Each
rounds differently, so a state moved from a ZeRO-Offload run continues under torch AdamW within tens of ulp
per step at most here, not bit for bit (docs/moving-to-fsdp2.md).
"""
import time

import torch
t0 = time.time()
from deepspeed.ops.adam import DeepSpeedCPUAdam
torch.manual_seed(0)
n = 1 << 16
for wd, adamw in ((0.1, True), (0.0, True)):
    p0 = torch.randn(n); g = torch.randn(n) * 1e-2
    m0 = torch.randn(n) * 1e-3; v0 = torch.rand(n) * 1e-5
    a = torch.nn.Parameter(p0.clone()); a.grad = g.clone()
    b = torch.nn.Parameter(p0.clone()); b.grad = g.clone()
    ta = torch.optim.AdamW([a], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    ta.state[a] = {"step": torch.tensor(3.0), "exp_avg": m0.clone(), "exp_avg_sq": v0.clone()}
    tb = DeepSpeedCPUAdam([b], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, adamw_mode=adamw)
    tb.state[b] = {"step": 3, "exp_avg": m0.clone(), "exp_avg_sq": v0.clone()}
    ta.step(); tb.step()
    d = (a.detach() - b.detach()).abs()
    ulp = (a.detach().view(torch.int32) - b.detach().view(torch.int32)).abs()
    same = (d == 0).float().mean().item()
    ma = (ta.state[a]["exp_avg"] - tb.state[b]["exp_avg"]).abs().max().item()
    mv = (ta.state[a]["exp_avg_sq"] - tb.state[b]["exp_avg_sq"]).abs().max().item()
    print(f"wd={wd}: params equal {same:.4f}, max |diff| {d.max().item():.3e}, max ulp {ulp.max().item()}, "
          f"exp_avg max diff {ma:.3e}, exp_avg_sq max diff {mv:.3e}")
print("seconds", time.time() - t0)
