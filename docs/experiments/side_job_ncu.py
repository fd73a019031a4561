"""GPU, under ncu: the logits GEMM of a 2048-row chunk plain, with an empty side job and with the whole side job
(one call each after a warm-up round), for ``ncu -k regex:GemmSm90 --launch-skip 4 --launch-count 3``.
Usage: ncu ... python docs/experiments/side_job_ncu.py UNROLL REGS PREFETCH
Needs ``git apply docs/experiments/side_job.patch`` (session 40: the side job is not in the library)."""
import sys

import torch

import coda
from coda.epilogues.cross_entropy import ce_forward_logits
from coda.kernels import ce_grad

unroll, regs, pf = (int(v) for v in sys.argv[1:4])
dev = torch.device("cuda")
R, H, V = 2048, 2048, 128256
W = (torch.randn(V, H, device=dev) / H ** 0.5).to(torch.bfloat16)
x = torch.randn(2 * R, H, device=dev).to(torch.bfloat16)
epi = ce_forward_logits(torch.bfloat16)
z = torch.empty((2 * R, V), device=dev, dtype=torch.bfloat16)
z0, z1 = z[:R], z[R:]
lse0 = coda.gemm(x[:R], W, epilogue=epi, out=z0)["lse"]  # GemmSm90 launch 1
tgt = torch.randint(0, V, (R,), device=dev)
scale = torch.full((R,), 1.0 / R, device=dev)
job = ce_grad.side_job(torch.bfloat16, unroll=unroll, regs=regs, prefetch=pf)
full = (job, ce_grad.side_tensors(z0, lse0, tgt, scale))
empty = (job, ce_grad.side_tensors(z0[:0], lse0[:0], tgt[:0], scale[:0]))
for _ in range(2):  # launches 2-4 (warm-up), 5-7 (profiled): plain, empty side job, whole side job
    coda.gemm(x[R:], W, epilogue=epi, out=z1)
    coda.gemm(x[R:], W, epilogue=epi, out=z1, side=empty)
    coda.gemm(x[R:], W, epilogue=epi, out=z1, side=full)
torch.cuda.synchronize()
print("done")
