"""GPU: ``coda.kernels.embedding_adamw`` on Hopper -- the kernel's in-place p, m, v against the float64 update
(2x the error of torch's 16-bit path, rows without tokens decayed as the formula says), the llama-1b embedding
(V 128256, H 2048, 8192 tokens) against the torch reference, and a CUDA graph capture replayed on new data. The CPU
side (compile, launch plan, the reference vs torch.optim.AdamW, the op): tests/test_embedding.py."""
import pytest
import torch

from coda.kernels import embedding_adamw as ea
from coda.kernels.embedding_adamw import embedding_adamw

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _hyper(t, lr=1e-2, b1=0.9, b2=0.95, eps=1e-8, wd=0.1):
    """The kernel's (8,) float32 hyper-parameters (``epilogues.adamw.HYPER``'s order) of AdamW step ``t``."""
    vals = [b1, 1 - b1, b2, 1 - b2, 1 / (1 - b2 ** t) ** 0.5, eps, lr / (1 - b1 ** t), 1 - lr * wd]
    return torch.tensor(vals, dtype=torch.float32, device=DEV)


def _ids(T, V, g, pad=None):
    """T ids in [0, V) with many repeats (a third of the tokens on 3 hot rows, the rest in the lower half of the
    rows: the upper half gets no token), every 7th token the padding row."""
    ids = torch.randint(0, V // 2, (T,), device=DEV, generator=g)
    ids[: T // 3] = torch.randint(0, 3, (T // 3,), device=DEV, generator=g)
    if pad is not None:
        ids[1::7] = pad
    return ids[torch.randperm(T, device=DEV, generator=g)]


def _state(V, H, dtype, g):
    """p, m, v of ``dtype``: fresh random values, |m| >= 1e-3 and v >= 1e-3 (normal in fp16: their decay by
    b1 / b2 shows in every element)."""
    p = torch.randn(V, H, device=DEV, generator=g)
    m = torch.randn(V, H, device=DEV, generator=g) * 0.1
    m = m + torch.where(m < 0, -1e-3, 1e-3)
    v = torch.rand(V, H, device=DEV, generator=g) * 0.01 + 1e-3
    return p.to(dtype), m.to(dtype), v.to(dtype)


def _err(x, ref):
    return (x.double() - ref).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_float64_2x_rule(dtype):
    """V 1000 (not a multiple of the CTA's 8 rows), H 136 (a multiple of 8, not of a warp's 256 columns), 517
    tokens with many repeats and a padding row: p, m, v (every element) within 2x the error of the same update in
    torch (fp32 math on the 16-bit tensors, rounded to them) against float64, plus 1e-6; no NaN; the rows without
    tokens (and the padding row) only decayed: m' = b1 m, v' = b2 v, p' = p decay - step m' / (sqrt(v') c2 + eps)
    to the dtype's rounding."""
    g = torch.Generator(device=DEV).manual_seed(0)
    V, H, T, pad, t = 1000, 136, 517, 7, 3
    ids = _ids(T, V, g, pad)
    dy = torch.randn(T, H, device=DEV, generator=g).to(dtype)
    p, m, v = _state(V, H, dtype, g)
    hyper = _hyper(t)
    p0, m0, v0 = p.clone(), m.clone(), v.clone()
    ref = [x.double() for x in (p, m, v)]  # the update in float64 (the same float32 hyper-parameter values)
    ea._reference(dy.double(), ids, *ref, hyper.double(), pad)
    torch_16 = [x.clone() for x in (p, m, v)]  # torch's rounding: fp32 math, results rounded to the dtype
    ea._reference(dy, ids, *torch_16, hyper, pad)
    assert embedding_adamw(dy, ids, p, m, v, hyper, padding_idx=pad) is None
    torch.cuda.synchronize()
    for name, ours, theirs, r in zip("pmv", (p, m, v), torch_16, ref):
        assert ours.dtype == dtype and not torch.isnan(ours).any(), name
        e, e_torch = _err(ours, r), _err(theirs, r)
        assert e <= 2 * e_torch + 1e-6, f"{name}: ours {e:.3g} vs torch {e_torch:.3g}"

    used = torch.zeros(V, dtype=torch.bool, device=DEV)
    used[ids] = True
    used[pad] = False
    idle = ~used
    assert idle[pad] and idle[V // 2:].all() and used[:3].all() and int(idle.sum()) > V // 2
    eps = torch.finfo(dtype).eps  # one unit in the last place, relative
    assert (m[idle] != m0[idle]).all() and (v[idle] != v0[idle]).all()  # decayed, every element
    h = hyper.double()
    b1, b2, c2, e_, step, decay = h[0], h[2], h[4], h[5], h[6], h[7]
    m2, v2 = b1 * m0[idle].double(), b2 * v0[idle].double()
    p2 = p0[idle].double() * decay - step * m2 / (v2.sqrt() * c2 + e_)
    torch.testing.assert_close(m[idle].double(), m2.to(dtype).double(), rtol=eps, atol=0)
    torch.testing.assert_close(v[idle].double(), v2.to(dtype).double(), rtol=eps, atol=0)
    torch.testing.assert_close(p[idle].double(), p2.to(dtype).double(), rtol=eps, atol=1e-5)
    # the rows with tokens took their gradient: m' differs from the decay alone
    assert (m[used].double() - b1 * m0[used].double()).abs().mean() > 0.01


def test_llama_1b_embedding():
    """The llama-1b embedding's update (V 128256, H 2048, 8192 tokens, bf16) against the torch reference (fp32
    math on the same bf16 tensors) to bf16 rounding."""
    g = torch.Generator(device=DEV).manual_seed(1)
    V, H, T, t = 128256, 2048, 8192, 5
    ids = torch.randint(0, V, (T,), device=DEV, generator=g)
    ids[: T // 4] = torch.randint(0, 64, (T // 4,), device=DEV, generator=g)  # frequent tokens
    dy = (torch.randn(T, H, device=DEV, generator=g) * 0.01).to(torch.bfloat16)
    p, m, v = _state(V, H, torch.bfloat16, g)
    hyper = _hyper(t)
    want = [x.clone() for x in (p, m, v)]
    ea._reference(dy, ids, *want, hyper, None)
    embedding_adamw(dy, ids, p, m, v, hyper)
    torch.cuda.synchronize()
    for name, got, ref in zip("pmv", (p, m, v), want):
        assert not torch.isnan(got).any(), name
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-3, msg=name)


def test_cuda_graph_capture_replays_like_eager():
    """Captured once after a warm-up call (the compile and the launch plan), the graph replayed twice on new
    tokens, gradients and hyper-parameters copied into its static inputs equals two eager calls on copies
    (bitwise: no atomics, a deterministic sort); the host side (sort, searchsorted) is in the graph too."""
    g = torch.Generator(device=DEV).manual_seed(2)
    V, H, T, pad = 1000, 136, 517, 7
    dtype = torch.bfloat16

    def inputs(t):
        return _ids(T, V, g, pad), torch.randn(T, H, device=DEV, generator=g).to(dtype), _hyper(t)

    p, m, v = _state(V, H, dtype, g)
    eager = [x.clone() for x in (p, m, v)]
    s_ids, s_dy, s_hyper = inputs(1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, on scratch copies of the same shapes
        embedding_adamw(s_dy, s_ids, p.clone(), m.clone(), v.clone(), s_hyper, padding_idx=pad)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        embedding_adamw(s_dy, s_ids, p, m, v, s_hyper, padding_idx=pad)
    torch.cuda.synchronize()
    assert torch.equal(p, eager[0]) and torch.equal(m, eager[1])  # capturing ran nothing
    for t in (1, 2):
        ids, dy, hyper = inputs(t)
        s_ids.copy_(ids)
        s_dy.copy_(dy)
        s_hyper.copy_(hyper)
        graph.replay()
        embedding_adamw(dy.clone(), ids.clone(), *eager, hyper.clone(), padding_idx=pad)
        torch.cuda.synchronize()
        for name, a, b in zip("pmv", (p, m, v), eager):
            assert not torch.isnan(a).any(), name
            assert torch.equal(a, b), f"step {t}: {name} differs from eager"
