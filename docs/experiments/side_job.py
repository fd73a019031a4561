"""GPU: the logits GEMM of one row chunk with the previous chunk's softmax-gradient pass as its side job
(coda.kernels.gemm_sm90 "Side job", coda.kernels.ce_grad.CeGradSide) against the two kernels one after another.

Correctness: the side job's dz equals the standalone kernel's bit for bit, the GEMM's logits and logsumexp equal
the plain GEMM's (every element written: outputs poisoned with NaN first). Timing (triton do_bench, median):
logits(chunk) alone, ce_grad(chunk) alone, both in sequence, logits + side job.
Usage: python docs/experiments/side_job.py [--rows 2048,4096] [--hidden 2048] [--vocab 128256]
Needs ``git apply docs/experiments/side_job.patch`` (session 40: the side job is not in the library)."""
import argparse

import torch
from triton.testing import do_bench as _do_bench

import coda
from coda.epilogues.cross_entropy import ce_forward_logits
from coda.kernels import ce_grad

ap = argparse.ArgumentParser()
ap.add_argument("--rows", default="2048,4096")
ap.add_argument("--hidden", type=int, default=2048)
ap.add_argument("--vocab", type=int, default=128256)
ap.add_argument("--config", default=None, help="a GemmConfig expression for the logits GEMM")
ap.add_argument("--variants", default="2,56,2", help="side jobs: unroll,regs,prefetch;...")
ap.add_argument("--graph", action="store_true", help="time 10 calls captured in one CUDA graph (no host overhead)")
a = ap.parse_args()


def do_bench(fn, warmup=50, rep=400):
    """triton's do_bench (median ms), or with --graph: 10 calls captured in one CUDA graph, per call."""
    if not a.graph:
        return _do_bench(fn, warmup=warmup, rep=rep)
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    return _do_bench(g.replay, warmup=warmup // 10 + 1, rep=rep) / 10
dev = torch.device("cuda")
torch.manual_seed(0)
H, V = a.hidden, a.vocab
cfg = eval(a.config, {"GemmConfig": coda.GemmConfig}) if a.config else None
W = (torch.randn(V, H, device=dev) / H ** 0.5).to(torch.bfloat16)
print(torch.cuda.get_device_name(), f"H={H} V={V} config={cfg}")
for R in [int(r) for r in a.rows.split(",")]:
    x = torch.randn(2 * R, H, device=dev).to(torch.bfloat16)
    epi = ce_forward_logits(torch.bfloat16)
    z = torch.full((2 * R, V), float("nan"), device=dev, dtype=torch.bfloat16)
    z0, z1 = z[:R], z[R:]
    lse0 = coda.gemm(x[:R], W, epilogue=epi, out=z0, config=cfg)["lse"]
    tgt = torch.randint(0, V, (R,), device=dev)
    tgt[::7] = -1
    scale = torch.full((R,), 1.0 / R, device=dev)
    zsave = z0.clone()
    ref = z0.clone()
    ce_grad.softmax_grad_(ref, lse0, tgt, scale)
    plain1 = torch.full_like(z1, float("nan"))
    lse_plain = coda.gemm(x[R:], W, epilogue=epi, out=plain1, config=cfg)["lse"]
    t_gemm = do_bench(lambda: coda.gemm(x[R:], W, epilogue=epi, out=z1, config=cfg), warmup=50, rep=400)
    t_grad = do_bench(lambda: ce_grad.softmax_grad_(z0, lse0, tgt, scale), warmup=50, rep=400)

    def seq():
        coda.gemm(x[R:], W, epilogue=epi, out=z1, config=cfg)
        ce_grad.softmax_grad_(z0, lse0, tgt, scale)
    t_seq = do_bench(seq, warmup=50, rep=400)
    t_mm = do_bench(lambda: torch.mm(x[R:], W.t()), warmup=50, rep=400)
    print(f"R={R}: logits {t_gemm:.3f} ms (torch.mm {t_mm:.3f}), ce_grad {t_grad:.3f}, sequence {t_seq:.3f}",
          flush=True)
    for var in a.variants.split(";"):
        unroll, regs, pf = (int(v) for v in var.split(","))
        job = ce_grad.side_job(torch.bfloat16, unroll=unroll, regs=regs, prefetch=pf)
        z0.copy_(zsave)
        side = (job, ce_grad.side_tensors(z0, lse0, tgt, scale))
        z1.fill_(float("nan"))
        lse1 = coda.gemm(x[R:], W, epilogue=epi, out=z1, config=cfg, side=side)["lse"]
        torch.cuda.synchronize()
        ok = (torch.equal(z0, ref), torch.equal(z1, plain1), torch.equal(lse1, lse_plain))
        empty = (job, ce_grad.side_tensors(z0[:0], lse0[:0], tgt[:0], scale[:0]))
        half = (job, ce_grad.side_tensors(z0[:R // 2], lse0[:R // 2], tgt[:R // 2], scale[:R // 2]))
        t_side = do_bench(lambda: coda.gemm(x[R:], W, epilogue=epi, out=z1, config=cfg, side=side), warmup=50,
                          rep=400)
        t_empty = do_bench(lambda: coda.gemm(x[R:], W, epilogue=epi, out=z1, config=cfg, side=empty), warmup=50,
                           rep=400)
        t_half = do_bench(lambda: coda.gemm(x[R:], W, epilogue=epi, out=z1, config=cfg, side=half), warmup=50,
                          rep=400)
        t_tiny = do_bench(lambda: coda.gemm(x[R:R + 128], W, epilogue=epi, out=z1[:128], config=cfg, side=side),
                          warmup=20, rep=200)
        print(f"  side unroll {unroll} regs {regs} prefetch {pf}: bitwise dz/logits/lse {ok}; with side job "
              f"{t_side:.3f} ms (saves {t_seq - t_side:+.3f} vs the sequence), empty job {t_empty:.3f}, half the "
              f"rows {t_half:.3f}; under a 128-row GEMM {t_tiny:.3f}", flush=True)
