"""FlashAttention-4's CuTeDSL Hopper kernels against cuDNN SDPA at the llama-1b step's attention (B 2, S 4096, 32 / 8
heads, d 64, causal, bf16): does an FA3-class kernel have room here (docs/experiments/attention_study.md)?

The peer kernels come from the wheels in .device/fa4 (git-ignored, 5.3 MB, downloaded in session 37: flash-attn-4
4.0.0b36, quack-kernels 0.6.5, apache-tvm-ffi and torch-c-dlpack-ext for cp312, einops) installed with --no-deps
into a scratch directory beside the device's cutlass-dsl 4.8.1 (FlashAttention is never imported into a process that
runs CODA's kernels; this one uses only coda.bench.power's sampler). Times (median of 5 interleaved rounds of
do_bench medians, ms) forward, and forward + backward, the outputs and gradients compared (max |difference|
relative to max |cuDNN's|), then each sustained for 3 s with nvidia-smi's mean power: the energy per call under the
cap. The wheels and the cutlass-dsl bundle together exceed the 64 MiB carry, so two calls back to back (a warm
machine keeps ignored paths): carry [".device/fa4"] and run
    pip install -q --no-deps --target .device/fa_env .device/fa4/*.whl
then carry [".device/cutlass-dsl-4.8.1"] and run
    source .device/cutlass-dsl-4.8.1/setup.sh; PYTHONPATH=.device/fa_env python docs/experiments/fa_vs_cudnn.py"""
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from coda.bench import power  # (the sampler only: no CODA kernel runs in this process)
from flash_attn.cute.interface import flash_attn_func

B, S, HQ, HKV, D = 2, 4096, 32, 8, 64
bf = dict(device="cuda", dtype=torch.bfloat16)
torch.manual_seed(0)
q, k, v = (torch.randn(B, S, h, D, **bf).requires_grad_(True) for h in (HQ, HKV, HKV))  # FA's (B, S, H, d)
do = torch.randn(B, S, HQ, D, **bf)


def cudnn(q, k, v):  # SDPA takes (B, H, S, d): transposed views, no copies
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True)
    return o.transpose(1, 2)


def fa(q, k, v):
    return flash_attn_func(q, k, v, causal=True)[0]


IMPLS = {"cuDNN": cudnn, "FA4-cute": fa}


def fwd_bwd(f):
    def run():
        o = f(q, k, v)
        return (o, *torch.autograd.grad(o, (q, k, v), do))
    return run


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


ref = fwd_bwd(cudnn)()
got = fwd_bwd(fa)()
print("FA4-cute vs cuDNN, max |diff| / max |cuDNN|: " + ", ".join(f"{n} {rel(a, b):.2e}" for n, a, b in
                                                                   zip(("o", "dq", "dk", "dv"), got, ref)))
flops = 4 * B * HQ * S * S * D // 2  # causal forward
res = {(n, w): [] for n in IMPLS for w in ("fwd", "fwd+bwd")}
for _ in range(5):
    for n, f in IMPLS.items():
        with torch.no_grad():
            res[(n, "fwd")].append(do_bench(lambda: f(q, k, v), warmup=10, rep=50))
        res[(n, "fwd+bwd")].append(do_bench(fwd_bwd(f), warmup=10, rep=50))
print(torch.cuda.get_device_name(), "ms (median of 5 rounds); TFLOP/s counting the backward as 2.5 forwards")
for w, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
    print(w + ": " + "; ".join(f"{n} {statistics.median(res[(n, w)]):.4f} ms "
                                f"({mult * flops / statistics.median(res[(n, w)]) / 1e9:.0f} TFLOP/s)"
                                for n in IMPLS))

sampler = power.Sampler(power.smi_id(torch.cuda.current_device()))
for n, f in IMPLS.items():
    time.sleep(1.0)
    run = fwd_bwd(f)
    run()
    torch.cuda.synchronize()
    t0, calls = time.time(), 0
    while time.time() - t0 < 3.0:
        run()
        calls += 1
    torch.cuda.synchronize()
    t1 = time.time()
    got = power.window(sampler.samples, t0 + 1.0, t1) or {"w": 0.0, "mhz": 0.0}
    w, mhz = got["w"], got["mhz"]
    per = (t1 - t0) / calls
    print(f"{n} sustained fwd+bwd: {per * 1e3:.3f} ms/call, {w:.0f} W, {mhz:.0f} MHz, {w * per:.3f} J/call")
