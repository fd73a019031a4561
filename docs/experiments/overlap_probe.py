"""Does a memory-bound update hide under attention or a GEMM on a second stream (H100, power-capped)?

Serial vs concurrent: (a) cuDNN SDPA forward + backward at llama-1b's shapes (B 2, 32 / 8 heads, S 4096, D 64, causal,
GQA) x 16, (b) coda.gemm 8192 x 8192 x 2048 x 16, each against torch's fused AdamW over a 128256 x 2048 bf16 weight
(the embedding's update, ~2.4 ms) x 4. Sustained loops (1 s warm), CUDA events; ms per round.
Usage on the GPU: python docs/experiments/overlap_probe.py"""

import torch
import torch.nn.functional as F

import coda
from coda.bench.gemm import sustained_ms as timeit

dev = "cuda"
q = torch.randn(2, 32, 4096, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(2, 8, 4096, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(2, 8, 4096, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
do = torch.randn(2, 32, 4096, 64, device=dev, dtype=torch.bfloat16)
a = torch.randn(8192, 2048, device=dev, dtype=torch.bfloat16)
b = torch.randn(8192, 2048, device=dev, dtype=torch.bfloat16)
c = torch.empty(8192, 8192, device=dev, dtype=torch.bfloat16)
w = torch.nn.Parameter(torch.randn(128256, 2048, device=dev, dtype=torch.bfloat16))
w.grad = torch.randn_like(w)
opt = torch.optim.AdamW([w], lr=1e-4, fused=True)


def attn():
    for _ in range(16):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.backward(do)


def gemm():
    for _ in range(16):
        coda.gemm(a, b, out=c)


def upd():
    for _ in range(4):
        opt.step()


side = torch.cuda.Stream()


def both(main):
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        upd()
    main()
    torch.cuda.current_stream().wait_stream(side)


print(torch.cuda.get_device_name())
for name, main in (("attention fwd+bwd x16", attn), ("coda.gemm 8192x8192x2048 x16", gemm)):
    tm, tu = timeit(main), timeit(upd)
    tb = timeit(lambda: both(main))
    ts = timeit(lambda: (main(), upd()))
    print(f"{name}: alone {tm:.2f} ms; AdamW 262M x4 alone {tu:.2f}; serial {ts:.2f}; concurrent {tb:.2f} "
          f"(hidden {100 * (ts - tb) / tu:.0f} % of the update)")
