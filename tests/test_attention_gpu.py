"""GPU: ``coda.ops.rmsnorm_linear_rope`` on the H100 vs float64 (2x torch bf16's error), NaN-poisoned outputs,
and the fused attention block against the stock one."""
import math

import pytest
import torch

from coda.epilogues.rope import rope_freqs
from coda.kernels.rope_grad import rope_grad, rope_grad_reference
from coda.ops import rmsnorm_linear_rope, rmsnorm_linear_rope_qkv

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _unfused(x, g, w, pos, fr, eps=1e-6):
    """The stock computation in x's dtype: RMSNorm (fp32 inside), GEMM, RoPE in fp32 math on the GEMM's output."""
    xf = x.float()
    n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * g.to(x.dtype)
    z = (n @ w.T).float() if x.dtype != torch.float64 else n @ w.T
    th = pos.to(z.dtype)[:, None] * fr.to(z.dtype)[None]
    out = torch.empty_like(z)
    a, b = z[:, 0::2], z[:, 1::2]
    out[:, 0::2], out[:, 1::2] = a * th.cos() - b * th.sin(), a * th.sin() + b * th.cos()
    return out.to(x.dtype)


@pytest.mark.parametrize("M,K,nh,nkv,d", [(1000, 512, 8, 2, 64), (8192, 2048, 32, 8, 64), (77, 256, 4, 4, 32)])
def test_matches_float64_2x_rule(M, K, nh, nkv, d):
    g = torch.Generator(device=DEV).manual_seed(M)
    N = (nh + 2 * nkv) * d
    x = torch.randn(M, K, generator=g, device=DEV).to(torch.bfloat16)
    gam = (1 + 0.1 * torch.randn(K, generator=g, device=DEV)).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g, device=DEV) / math.sqrt(K)).to(torch.bfloat16)
    pos = torch.randint(0, 8192, (M,), generator=g, device=DEV)
    fr = rope_freqs(d, nh + 2 * nkv, rotary_heads=nh + nkv, base=500000.0, device=DEV)
    up = torch.randn(M, N, generator=g, device=DEV, dtype=torch.float64)

    def grads(fn, dtype):
        ts = [t.detach().to(dtype).clone().requires_grad_() for t in (x, gam, w)]
        y = fn(*ts, pos, fr)
        (y.double() * up).sum().backward()
        return [y.double()] + [t.grad.double() for t in ts]

    def qkv(x, g, w, pos, fr):  # q, k, v apart: their gradients through the rope_grad kernel
        q, k, v = rmsnorm_linear_rope_qkv(x, g, w, pos, fr, 1e-6, (nh * d, nkv * d))
        return torch.cat((q, k, v), -1)

    want = grads(_unfused, torch.float64)
    theirs = grads(_unfused, torch.bfloat16)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    for fn in (rmsnorm_linear_rope, qkv):
        ours = grads(fn, torch.bfloat16)
        errs = {name: (rel(a, b), rel(c, b), bool(torch.isfinite(a).all()))
                for name, a, b, c in zip(("y", "dx", "dgamma", "dw"), ours, want, theirs)}
        assert all(e[2] and e[0] <= 2 * e[1] + 1e-4 for e in errs.values()), (fn, errs)


@pytest.mark.parametrize("M,widths,strided", [(8192, (2048, 512, 512), True), (1001, (256, 64, 64), False),
                                               (7, (8, 8, 16), True)])
def test_rope_grad_kernel_matches_the_reference(M, widths, strided):
    """The kernel vs its float64 reference: dacc and dr within bf16 rounding, every element written (outputs come
    from fresh buffers; NaN input rows stay NaN, as torch's arithmetic gives), gradients taken as column blocks of
    one buffer (row stride N, as the attention backward's views) or contiguous, positions up to 131071."""
    g = torch.Generator(device=DEV).manual_seed(M)
    N = sum(widths)
    big = torch.randn(M, N, generator=g, device=DEV).to(torch.bfloat16)
    grads = list(big.split(widths, 1)) if strided else [t.contiguous() for t in big.split(widths, 1)]
    ys = [torch.randn(M, n, generator=g, device=DEV).to(torch.bfloat16) for n in widths]
    grads[0][M // 2, 3] = float("nan")
    pos = torch.randint(0, 131072, (M,), generator=g, device=DEV).float()
    fr = rope_freqs(64 if widths[0] >= 64 else 8, N // (64 if widths[0] >= 64 else 8),
                    rotary_heads=(widths[0] + widths[1]) // (64 if widths[0] >= 64 else 8), base=500000.0,
                    device=DEV)
    r = torch.rand(M, generator=g, device=DEV) + 0.05  # the rows' norm scale
    dacc, c = rope_grad(grads, ys, pos, fr, r)
    want_d, want_c = rope_grad_reference([t.double() for t in grads], [t.double() for t in ys], pos, fr, r.double())
    row = M // 2
    assert torch.isnan(dacc[row, 2:4]).all() and torch.isnan(c[row])  # the NaN's pair and its row's dot
    keep = torch.ones(M, dtype=torch.bool, device=DEV)
    keep[row] = False
    assert torch.isfinite(dacc[keep]).all() and torch.isfinite(c[keep]).all()
    err = (dacc[keep].double() - want_d[keep]).abs().max().item()
    assert err <= 2 ** -7 * want_d[keep].abs().max().item(), err  # bf16 rounding of the output
    # dr: fp32 sums of N products in another order than the reference's, over r: bounded by the terms' magnitude
    scale = (torch.cat(grads, 1).double() * torch.cat(ys, 1).double()).abs().sum(1) / r.double()
    assert ((c[keep].double() - want_c[keep]).abs() <= 1e-4 * scale[keep] + 1e-6).all()


def test_fused_block_vs_stock_and_timing():
    """One Llama-1B attention block (input norm + attention + o_proj), bf16, B=2, T=4096: the fused block's output
    and input gradient agree with the stock block's (both vs each other: bf16 noise), and both are timed."""
    import copy
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from llama_model import LlamaConfig, LlamaDecoderLayer, LlamaModel
    from triton.testing import do_bench

    from coda.nn import DeferredRMSNorm
    from coda.nn_attention import FusedAttention
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=4096)
    layer = LlamaDecoderLayer(cfg).to(DEV, torch.bfloat16)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    inv = LlamaModel(cfg).inv_freq.to(DEV)
    fused = copy.deepcopy(layer)
    d = DeferredRMSNorm.from_norm(fused.input_layernorm)
    fused.self_attn, fused.input_layernorm = FusedAttention.from_stock(fused.self_attn, inv, d), d
    x = torch.randn(2, 4096, 2048, device=DEV, dtype=torch.bfloat16)
    pos = torch.arange(4096, device=DEV, dtype=torch.float32)
    fr = torch.outer(pos, inv)
    emb = torch.cat((fr, fr), -1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)

    def block(lay):
        def run():
            xs = x.detach().requires_grad_()
            out = xs + lay.self_attn(lay.input_layernorm(xs), cos, sin)
            out.backward(torch.ones_like(out))
            return out, xs.grad
        return run

    (a, ga), (b, gb) = block(layer)(), block(fused)()
    assert ((a - b).float().norm() / a.float().norm()).item() < 2e-2
    assert ((ga - gb).float().norm() / ga.float().norm()).item() < 5e-2
    t_stock, t_fused = do_bench(block(layer), warmup=10, rep=100), do_bench(block(fused), warmup=10, rep=100)
    print(f"attention block fwd+bwd (1b dims, 2 x 4096): stock {t_stock:.2f} ms, fused {t_fused:.2f} ms")
    q = torch.randn(2, 32, 4096, 64, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(2, 8, 4096, 64, device=DEV, dtype=torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    t_gqa = do_bench(lambda: sdpa(q, k, k, is_causal=True, enable_gqa=True))
    t_rep = do_bench(lambda: sdpa(q, k.repeat_interleave(4, 1), k.repeat_interleave(4, 1), is_causal=True))
    print(f"SDPA forward: enable_gqa {t_gqa:.3f} ms, repeat_interleave {t_rep:.3f} ms")
    assert t_gqa < 1.5 * t_rep  # enable_gqa did not fall back to the math kernel
