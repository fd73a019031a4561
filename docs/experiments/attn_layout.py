"""Does cuDNN's SDPA run faster on head-major q / k / v than on FusedAttention's strided views (issue 30: "q/k/v
written so that SDPA takes them without a transpose copy")? Layouts, all (B, H, T, d) views, no copy timed:
  views      -- the packed projection (B, T, (Hq + 2 Hkv) d) split per head: strides (T*3072, d, 3072, 1)
  headmajor  -- one (B, Hq + 2 Hkv, T, d) tensor split along heads: strides (48*T*d, T*d, d, 1)
  contiguous -- three separate contiguous (B, H, T, d) tensors (stock's q, k, v after its RoPE kernel)
causal, enable_gqa, cuDNN backend (what the step runs); forward alone and forward + backward; medians of 5 interleaved
rounds of do_bench medians, ms. Usage on the GPU: python docs/experiments/attn_layout.py"""
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

B, T, HQ, HKV, D = 2, 4096, 32, 8, 64
bf = dict(device="cuda", dtype=torch.bfloat16)
torch.manual_seed(0)


def make(layout):
    if layout == "views":
        p = torch.randn(B, T, (HQ + 2 * HKV) * D, **bf).requires_grad_(True)
        q, k, v = torch.split(p, [HQ * D, HKV * D, HKV * D], dim=-1)
        return p, tuple(x.reshape(B, T, -1, D).transpose(1, 2) for x in (q, k, v))
    if layout == "headmajor":
        p = torch.randn(B, HQ + 2 * HKV, T, D, **bf).requires_grad_(True)
        return p, tuple(torch.split(p, [HQ, HKV, HKV], dim=1))
    ts = [torch.randn(B, h, T, D, **bf).requires_grad_(True) for h in (HQ, HKV, HKV)]
    return ts, tuple(ts)


dy = torch.randn(B, HQ, T, D, **bf)
cases = {}
for layout in ("views", "headmajor", "contiguous"):
    leaf, (q, k, v) = make(layout)

    def fwd(q=q, k=k, v=v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def fwd_bwd(q=q, k=k, v=v, leaf=leaf):
        o = fwd(q, k, v)
        torch.autograd.grad(o, [q, k, v], dy)
    cases[layout] = (fwd, fwd_bwd)
    print(layout, [tuple(t.stride()) for t in (q, k, v)], flush=True)

ref = None
for layout, (fwd, _) in cases.items():
    o = fwd().float()
    ref = o if ref is None else ref
    print(layout, "max |o - views' o| =", (o - ref).abs().max().item() if layout != "views" else 0.0)
res = {(lay, w): [] for lay in cases for w in ("fwd", "fwd+bwd")}
for _ in range(5):
    for layout, (fwd, fb) in cases.items():
        res[(layout, "fwd")].append(do_bench(fwd, warmup=10, rep=50))
        res[(layout, "fwd+bwd")].append(do_bench(fb, warmup=10, rep=50))
print(torch.cuda.get_device_name(), "ms (median of 5 rounds)")
for w in ("fwd", "fwd+bwd"):
    base = statistics.median(res[("views", w)])
    print(w + ": " + "; ".join(f"{lay} {statistics.median(res[(lay, w)]):.4f} "
                                f"({statistics.median(res[(lay, w)]) / base:.3f})" for lay in cases))
