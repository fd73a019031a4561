"""``coda.ops.layernorm_linear``: ``F.linear(F.layer_norm(x, (K,), gamma, beta, eps), weight)`` as one GEMM whose
epilogue applies the norm (``coda.epilogues.layernorm``: the algebra). The worked example of docs/DESIGN.md section 7
("an epilogue and ``coda.ops.linear``"): this file, the epilogue, the export in ``ops/__init__.py`` and the tests.

Forward: mu, r per row from a torch pass over x (fp32 statistics, as torch's layer_norm; only x and the two
vectors are saved for their backward); W' = W diag(gamma) (N x K elements, the weight's dtype), c = W' row sums,
b = W beta (fp32); then ``coda.ops.linear(x, W', epilogue=
layernorm_scale, r=, mu=, c=, shift=)``. Backward: ``coda.ops.linear``'s derived program (dacc and the operands'
gradients; one recompute GEMM, or with ``save_preact`` a K = 0 pass), torch autograd for the statistics and the
folded weight. The normalised activation (M x K) is never materialised.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from coda.epilogues.layernorm import layernorm_scale

from ._common import check_tensors
from .linear import linear

__all__ = ["layernorm_linear"]

_ENTRY = "coda.ops.layernorm_linear"


class _RowStats(torch.autograd.Function):
    """(mean, rsqrt(var + eps)) per row of x, in fp32 (fp64 for fp64 x), saving only x and the two vectors (autograd
    through ``x.float().var()`` would save an fp32 copy of x: twice x's bytes). Backward: dmu/dx = 1/K,
    dr/dx = -r^3 (x - mu) / K."""

    @staticmethod
    def forward(ctx, x, eps):
        xs = x.to(torch.promote_types(x.dtype, torch.float32))
        mu = xs.mean(-1)
        r = torch.rsqrt((xs - mu.unsqueeze(-1)).square().mean(-1) + eps)
        ctx.save_for_backward(x, mu, r)
        return mu, r

    @staticmethod
    def backward(ctx, dmu, dr):
        x, mu, r = ctx.saved_tensors
        K = x.shape[-1]
        dx = torch.zeros_like(x, dtype=mu.dtype)
        if dmu is not None:
            dx += (dmu / K).unsqueeze(-1)
        if dr is not None:
            dx += (-dr * r.pow(3) / K).unsqueeze(-1) * (x.to(mu.dtype) - mu.unsqueeze(-1))
        return dx.to(x.dtype), None


def layernorm_linear(x: Tensor, weight: Tensor, norm_weight: Tensor, norm_bias: Optional[Tensor] = None,
                     eps: float = 1e-5, *, save_preact: bool = False) -> Tensor:
    """``layer_norm(x) @ weight.T`` in one fused GEMM, autograd included (module docstring). ``x`` (..., K),
    ``weight`` (N, K) of x's dtype (bfloat16 / float16 on a Hopper GPU; any float dtype on the CPU reference path),
    ``norm_weight`` / ``norm_bias`` (K,) (``norm_bias`` None: no shift). Returns (..., N)."""
    check_tensors(_ENTRY, [("x", x), ("weight", weight), ("norm_weight", norm_weight)]
                  + ([("norm_bias", norm_bias)] if norm_bias is not None else []))
    K = x.shape[-1]
    for name, t in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        if t is not None and tuple(t.shape) != (K,):
            raise ValueError(f"{_ENTRY}: {name} must have shape ({K},) (x's last dim), got {tuple(t.shape)}")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"{_ENTRY}: eps must be a positive number, got {eps!r}")
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"{_ENTRY}: weight must be (N, {K}) (x's last dim), got {tuple(weight.shape)}")
    stat = torch.promote_types(x.dtype, torch.float32)  # fp32 statistics (fp64 on the float64 reference path)
    mu, r = _RowStats.apply(x, float(eps))
    w_fold = weight * norm_weight.to(weight.dtype)
    c = w_fold.to(stat).sum(-1)
    b = weight.to(stat) @ norm_bias.to(stat) if norm_bias is not None else c.new_zeros(c.shape)
    return linear(x, w_fold, epilogue=layernorm_scale, save_preact=save_preact, r=r, mu=mu, c=c, shift=b)
