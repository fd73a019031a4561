"""``coda.ops.mlp``: the Llama MLP sub-block ``x + down(SwiGLU(gate_up(RMSNorm(x))))`` from CODA's fused GEMMs.

- :func:`rmsnorm_swiglu`: RMSNorm, the gate/up projection and ``silu(g) * u`` as ONE GEMM -- ``coda.ops.linear``
  with the pairs epilogue :func:`rms_swiglu` (``silu(g r) (u r)``, r = rsqrt(mean(x^2) + eps) a per-row operand
  from a light fp32 pre-pass, gamma folded into the interleaved gate/up weight). Neither the normalised activation
  (M x H) nor gate/up (M x 2I) is written.
- :func:`mlp`: then the down projection with the residual added in its epilogue (:func:`residual_add`: one M x H
  write; its backward needs no recompute GEMM since d(acc + x)/d acc = 1).

Gaps (composed around): ``coda.ops.linear`` gives no gradient to operands of pairs epilogues, so the norm's radial
term is :class:`_RMSNormGrad`, a torch row reduction on the bf16 dX rather than inside the dX GEMM's epilogue.
Not a ``torch.library`` custom op itself (its pieces are autograd Functions), so ``torch.compile`` may graph-break.
"""
from __future__ import annotations

import torch
from torch import Tensor

import coda

from ._common import check_tensors
from .linear import linear


@coda.epilogue
def rms_swiglu(acc, r: coda.VecM):
    """RMSNorm + SwiGLU on the gate/up accumulator acc = h W'^T (W' = weight_gu diag(gamma), rows interleaved):
    out_j = silu(g_j r) (u_j r), r = rsqrt(mean(h^2) + eps) per row. One value per column pair: M x I."""
    g, u = coda.pairs(acc)
    return coda.silu(g * r) * (u * r)


class _RMSNormGrad(torch.autograd.Function):
    """Identity on h in forward; in backward adds the gradient through r = rsqrt(mean(h^2) + eps), which the GEMM
    treated as a constant: with d the gradient of h at fixed r (the dX GEMM's output), the total is
    dh = d - (r^2 / H) <d, h> h per row (fp32 math, one read of d and h)."""

    @staticmethod
    def forward(ctx, h, r):
        ctx.save_for_backward(h, r)
        return h.view_as(h)

    @staticmethod
    def backward(ctx, d):
        h, r = ctx.saved_tensors
        hf, df = h.float(), d.float()
        c = (df * hf).sum(-1, keepdim=True) * (r * r).unsqueeze(-1) / h.shape[-1]
        return (df - c * hf).to(d.dtype), None


def rmsnorm_swiglu(x: Tensor, norm_weight: Tensor, weight_gu: Tensor, eps: float = 1e-6) -> Tensor:
    """``silu(n W_gate^T) * (n W_up^T)`` with ``n = RMSNorm(x) * norm_weight``, as ONE fused GEMM (forward), autograd
    included. ``x`` (..., H) bfloat16/float16; ``weight_gu`` (2I, H) interleaved (``coda.ops.interleave_gate_up``),
    x's dtype; ``norm_weight`` (H,). Returns (..., I).

    Composition: r (fp32, per row) in torch; W' = weight_gu * norm_weight (one N x K elementwise product per call,
    like ``coda.ops.rmsnorm_linear``); ``coda.ops.linear(x, W', epilogue=rms_swiglu, r=r)``. Backward: ops.linear's
    (recompute GEMM -> dacc, dX GEMM, dW' GEMM), torch autograd of the fold (dweight_gu = dW' gamma,
    dgamma = sum_n dW' weight_gu) and :class:`_RMSNormGrad` for the radial term.

    Gaps in the ops (reported, not patched here): ``coda.ops.rmsnorm_linear`` takes no ``epilogue=`` (so it
    cannot apply the SwiGLU pairs), and ``coda.ops.linear`` gives no gradient to operands of pairs epilogues (so the
    norm's radial term is this torch step, on the bf16 dX rather than inside the dX GEMM's fp32 epilogue)."""
    r = torch.rsqrt(x.detach().float().pow(2).mean(-1) + eps)
    w = torch.mul(weight_gu, norm_weight).to(x.dtype)
    return linear(_RMSNormGrad.apply(x, r), w, epilogue=rms_swiglu, r=r)


@coda.epilogue
def residual_add(acc, res: coda.TileMN):
    """``acc + res``: a projection that writes straight into the residual stream."""
    return acc + res


def mlp(x: Tensor, norm_weight: Tensor, w_gate_up: Tensor, w_down: Tensor, eps: float = 1e-6) -> Tensor:
    """``x + down(silu(gate(n)) * up(n))`` with ``n = RMSNorm(x) * norm_weight``: two fused GEMMs, autograd included.

    ``x`` (..., H) bfloat16 / float16; ``norm_weight`` (H,); ``w_gate_up`` (2I, H) with gate/up rows interleaved
    (``coda.ops.interleave_gate_up``); ``w_down`` (H, I). Returns (..., H)."""
    check_tensors("mlp", (("x", x), ("norm_weight", norm_weight), ("w_gate_up", w_gate_up), ("w_down", w_down)))
    H = x.shape[-1]
    if norm_weight.shape != (H,) or w_gate_up.dim() != 2 or w_gate_up.shape[1] != H or w_gate_up.shape[0] % 2:
        raise ValueError(f"mlp: expected norm_weight ({H},) and w_gate_up (2I, {H}); got norm_weight "
                         f"{tuple(norm_weight.shape)}, w_gate_up {tuple(w_gate_up.shape)}")
    inter = w_gate_up.shape[0] // 2
    if w_down.shape != (H, inter):
        raise ValueError(f"mlp: expected w_down ({H}, {inter}) (H, I); got {tuple(w_down.shape)}")
    a = rmsnorm_swiglu(x, norm_weight, w_gate_up, eps)
    return linear(a, w_down, epilogue=residual_add, res=x)
