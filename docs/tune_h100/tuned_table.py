"""Issue 5: tuned vs default config (and cuBLAS) per shape / epilogue, in one process, interleaved re-timing."""
import json, os, sys, time, statistics
import torch
import coda
from coda.autotune import tuner
from coda.config import default_config
import coda.epilogues.rmsnorm, coda.epilogues.cross_entropy
import coda.epilogues as E
from coda.epilogues.gated import swiglu

@coda.epilogue
def bias_gelu(acc, bias: coda.VecN):
    return coda.gelu(acc + bias)

which = sys.argv[1]
dev = "cuda"; bf = torch.bfloat16
def ops_for(name, M, N):
    if name == "identity": return None, {}
    if name == "bias_gelu": return bias_gelu, {"bias": torch.randn(N, device=dev)}
    if name == "swiglu": return swiglu, {}
    if name == "ce_forward": return E.cross_entropy.ce_forward, {"t": torch.randint(0, N, (M,), device=dev).float()}
    if name == "rmsnorm_scale": return E.rmsnorm.rmsnorm_scale, {"r": torch.rand(M, device=dev) + 0.5}
cases = {"gemm": [("identity", s) for s in ((8192, 8192, 8192), (8192, 4096, 4096), (8192, 28672, 4096),
                                            (8192, 4096, 14336), (8192, 128256, 4096))],
         "fused": [("bias_gelu", (8192, 28672, 4096)), ("swiglu", (8192, 28672, 4096)),
                   ("rmsnorm_scale", (8192, 28672, 4096)), ("ce_forward", (8192, 128256, 4096))]}[which]
rows = []
for name, (M, N, K) in cases:
    a = torch.randn(M, K, device=dev, dtype=bf); b = torch.randn(N, K, device=dev, dtype=bf) / 64
    epi, ops = ops_for(name, M, N)
    t0 = time.perf_counter()
    res = tuner.tune(a, b, epi, operands=ops, progress=False)
    ts = time.perf_counter() - t0
    nrot = max(1, int(4 * 50e6 // (a.numel() * 2 + b.numel() * 2)) + 1)
    As = [a] + [a.clone() for _ in range(nrot - 1)]; Bs = [b] + [b.clone() for _ in range(nrot - 1)]
    i = [0]
    def rot(f):
        def g():
            i[0] = (i[0] + 1) % nrot
            return f(As[i[0]], Bs[i[0]])
        return g
    fns = {"cublas": rot(lambda x, y: torch.mm(x, y.t())),
           "default": rot(lambda x, y: coda.gemm(x, y, epilogue=epi, config=res.default, **ops)),
           "tuned": rot(lambda x, y: coda.gemm(x, y, epilogue=epi, config=res.best, **ops))}
    meds = {k: [] for k in fns}
    for r in range(5):
        for k, f in fns.items():
            meds[k].append(tuner.bench(f))
    m = {k: statistics.median(v) for k, v in meds.items()}
    row = dict(epilogue=name, shape=[M, N, K], default=res.default.name, tuned=res.best.name, tune_s=round(ts, 1),
               candidates=len(res.rows), **{f"{k}_ms": round(v, 4) for k, v in m.items()},
               tflops_tuned=round(2 * M * N * K / m["tuned"] / 1e9, 1),
               tuned_over_default=round(m["tuned"] / m["default"], 3), default_over_cublas=round(m["default"] / m["cublas"], 3),
               tuned_over_cublas=round(m["tuned"] / m["cublas"], 3))
    rows.append(row); print(json.dumps(row), flush=True); open(os.environ.get("OUT", ".") + f"/tuned_{which}.jsonl", "a").write(json.dumps(row) + "\n")
    del As, Bs
out = os.environ.get("OUT", ".")
json.dump(rows, open(f"{out}/tuned_{which}.json", "w"), indent=1)
