"""Can the backward's dW GEMMs (with coda.optim's AdamW epilogue) run beside cuDNN's attention backward?

Attention at llama-1b's shapes (B 2, 32 / 8 heads, S 4096, D 64, causal, GQA; hdim 64 runs far under the tensor
peak) leaves tensor-core time that a GEMM on a second stream might use. For each candidate (the o / qkv / down /
gate-up dW GEMM of a layer, and o + qkv together) the median time of: attention backward alone, the dW alone, both
in order on one stream, both on two streams (the dW queued on a side stream first). Burst (do_bench) and sustained
(16 layers' worth in a loop after 1 s warm, CUDA events), ms. Usage on the GPU: python docs/experiments/attn_overlap.py"""
import torch
import torch.nn.functional as F
from triton.testing import do_bench

import coda
from coda.bench.gemm import sustained_ms
from coda.epilogues.adamw import HYPER, adamw
from coda.optim import update_config

T, H, I, KV = 8192, 2048, 8192, 512
bf = dict(device="cuda", dtype=torch.bfloat16)
h = torch.tensor([0.9, 0.1, 0.95, 0.05, 1.2, 1e-8, 1e-4, 1.0], device="cuda").unsqueeze(1).repeat(1, 4)
hyper = {n: h[i, :1] for i, n in enumerate(HYPER)}

q = torch.randn(2, 32, 4096, 64, **bf, requires_grad=True)
k = torch.randn(2, 8, 4096, 64, **bf, requires_grad=True)
v = torch.randn(2, 8, 4096, 64, **bf, requires_grad=True)
do = torch.randn(2, 32, 4096, 64, **bf)
o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def attn_bwd():
    torch.autograd.grad(o, (q, k, v), do, retain_graph=True)


def dw(N, K):
    dy, x = torch.randn(T, N, **bf), torch.randn(T, K, **bf)
    p, m, v_ = torch.randn(N, K, **bf), torch.zeros(N, K, **bf), torch.zeros(N, K, **bf)
    cfg = update_config(False, (N, K))
    return lambda: coda.gemm(dy.t(), x.t(), epilogue=adamw, out=p, p=p, m=m, v=v_, config=cfg, **hyper)


o_dw, qkv_dw, down_dw, gu_dw = dw(H, H), dw(H + 2 * KV, H), dw(H, I), dw(2 * I, H)
CANDS = {"o dW": [o_dw], "qkv dW": [qkv_dw], "o + qkv dW": [o_dw, qkv_dw], "down dW": [down_dw],
         "gate/up dW": [gu_dw]}
side = torch.cuda.Stream()


def serial(ws):
    def run():
        for w in ws:
            w()
        attn_bwd()
    return run


def concurrent(ws):
    def run():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for w in ws:
                w()
        attn_bwd()
        torch.cuda.current_stream().wait_stream(side)
    return run


def sustained(fn):
    return sustained_ms(lambda: [fn() for _ in range(16)], secs=1.5) / 16


print(torch.cuda.get_device_name(), "ms; burst = do_bench median, sust = 16 in a loop, per item", flush=True)
ta = do_bench(attn_bwd, rep=300)
print(f"attention backward alone: burst {ta:.3f} sust {sustained(attn_bwd):.3f}", flush=True)
for name, ws in CANDS.items():
    for w in ws:
        w()
    tw = do_bench(lambda: [w() for w in ws], rep=200)
    for mode in ("burst", "sust"):
        t = (lambda f: do_bench(f, rep=300)) if mode == "burst" else sustained
        ts, tc = t(serial(ws)), t(concurrent(ws))
        print(f"{name:11s} {mode:5s}: dW alone {tw:.3f}, serial {ts:.3f}, concurrent {tc:.3f} "
              f"(saves {ts - tc:+.3f} = {100 * (ts - tc) / tw:.0f} % of the dW)", flush=True)
