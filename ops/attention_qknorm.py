"""``coda.ops.rmsnorm_linear_rope_qknorm_qkv``: :func:`coda.ops.rmsnorm_linear_rope_qkv` with Qwen3's QK-norm (a
per-head RMSNorm of q and k between the projection and RoPE) inside the same GEMMs, forward and backward (issue 30).

Forward (the one normed operand a = h, b = W diag(gamma), r the input norm's row scale; three GEMMs into q, k, v):
    q, xq = RoPE(headnorm(x) w_q), x       x = r acc_q         ``epilogues.rope.rope_qknorm(d, save_x=True)``
    k, xk likewise with w_k;   v = r acc_v                      ``rope_rmsnorm`` (frequencies 0 on v)
where headnorm(x) = x rsqrt(mean over the head's d columns of x^2 + eps): the head's sum of squares is a
``coda.segment_sum`` over its d / 2 column pairs, inside one tile (d divides tile_n). The norm weights w_q, w_k
(the model's ``q_norm.weight`` / ``k_norm.weight``, (d,) in the half-split order) go in as the pairs' even / odd
values in the adjacent-pairs order (``epilogues.rope.pairs_order``), as W_q / W_k's rows are.

Backward (dq, dk, dv as the attention backward gives them): one ``coda.kernels.rope_grad.rope_grad_qknorm`` pass
un-rotates them, applies each head norm's backward (dx = s w dn - x s^3 sum(x w dn) / d, s the head's rsqrt formed
again from xq / xk) and r, and gives dr = sum(dx x) / r and the norm weights' gradients (sums over rows and heads,
CTA partials); then ``ops.mlp.rmsnorm_fold_grads``' dX and dW GEMMs, as for ``rmsnorm_linear_rope_qkv``. No
normalised activation and no standalone norm or RoPE kernel in either direction.

Saved: h, gamma, W, w_q, w_k, r, xq, xk, v, positions, freqs. xq and xk (M x (nq + nk), x's dtype) are what the
QK-norm adds to ``rmsnorm_linear_rope_qkv``'s memory: the stock Qwen3 attention saves q and k before its norms too
(and the normed ones for RoPE's product). Head sizes: a multiple of 8 that divides 256 (the backward pass's lanes);
:func:`supported` says why not.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from coda.epilogues.rope import half_split_order, norm_weight_pairs, pairs_order, rope_qknorm, rope_rmsnorm
from coda.kernels.rope_grad import rope_grad_qknorm

from ._builder import backward_call, backward_op, forward_op
from ._common import call, gemm_for, grad_of, update_args
from .attention import _no_rows, check_qkv, residual_out
from .mlp import rmsnorm_fold_grads
from .rmsnorm_linear import check_eps, normed_operands

__all__ = ["rmsnorm_linear_rope_qknorm_qkv", "pairs_order", "supported"]

ENTRY = "coda.ops.rmsnorm_linear_rope_qknorm_qkv"


def supported(head_dim: int, nq: int, nk: int) -> Optional[str]:
    """Why q / k widths ``nq`` / ``nk`` of heads of ``head_dim`` cannot take this op (None: they can)."""
    if head_dim % 8 or 256 % head_dim:
        return f"head_dim {head_dim} is not a multiple of 8 dividing 256"
    if nq % head_dim or nk % head_dim or nq <= 0 or nk <= 0:
        return f"q / k widths {nq}, {nk} are not whole heads of {head_dim}"
    return None


def _fake(x, norm_weight, weight, q_norm_weight, k_norm_weight, positions, freqs, eps, qk_eps, nq, nk, head_dim,
          residual, sumsq=None, slots=None, token=None):
    M, N = x.shape[0], weight.shape[0]
    return (x.new_empty(M, nq), x.new_empty(M, nk), x.new_empty(M, N - nq - nk),
            x.new_empty(x.shape) if residual else x.new_empty(0), x.new_empty(M, dtype=torch.float32),
            x.new_empty(M, nq), x.new_empty(M, nk))


def _forward(x, norm_weight, weight, q_norm_weight, k_norm_weight, positions, freqs, eps, qk_eps, nq, nk, head_dim,
             residual, sumsq=None, slots=None, token=None, copy_x=True):
    """q, k, v, x (``residual``: a copy, or x itself in eager mode; else empty), r, xq, xk."""
    gemm = gemm_for(x.device, ENTRY)
    a, b, r = normed_operands(x, norm_weight, weight, eps, gemm, sumsq)
    parts = []
    for c0, n, w in ((0, nq, q_norm_weight), (nq, nk, k_norm_weight)):
        w_even, w_odd = norm_weight_pairs(w, n // head_dim)
        parts.append(gemm(a, b[c0:c0 + n], epilogue=rope_qknorm(head_dim, save_x=True), r=r, pos=positions,
                          freq=freqs[c0 // 2:(c0 + n) // 2], w_even=w_even, w_odd=w_odd, eps=qk_eps))
    v = gemm(a, b[nq + nk:], epilogue=rope_rmsnorm, r=r, pos=positions, freq=freqs[(nq + nk) // 2:])
    return parts[0]["out"], parts[1]["out"], v, residual_out(x, residual, copy_x), r, parts[0]["x"], parts[1]["x"]


def _backward(ctx, dq, dk, dv, dres=None, *_):
    """dq, dk, dv (None: zeros) and the residual stream's gradient to x, gamma, W and the two norm weights."""
    h, norm_weight, weight, qn, kn, r, xq, xk, v, positions, freqs = ctx.saved_tensors
    qk_eps, head_dim = ctx.coda_extra
    needs = ctx.needs_input_grad
    rest = (None,) * (len(needs) - 5)
    if dq is None and dk is None and dv is None:
        return (dres if needs[0] else None, None, None, None, None, *rest)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip((dq, dk, dv), (xq, xk, v))]
    out = backward_call(ctx, "rmsnorm_linear_rope_qknorm_qkv_backward", *grads, dres, h, norm_weight, weight, qn, kn,
                        r, xq, xk, v, positions, freqs, qk_eps, head_dim, needs[2])
    dh, dgamma, dw, dqn, dkn = out
    return (dh if needs[0] else None, dgamma if needs[1] else None, grad_of(dw) if needs[2] else None,
            dqn if needs[3] else None, dkn if needs[4] else None, *rest)


@forward_op("rmsnorm_linear_rope_qknorm_qkv", fake=_fake, backward=_backward,
            eager=lambda *a: _forward(*a, copy_x=False), outputs=lambda i: 4 if i[12] else 3,
            saved=lambda i, out: (*i[:5], out[4], out[5], out[6], out[2], *i[5:7]),
            extra=lambda i: (i[8], i[11]), slots=14)
def _op(x: Tensor, norm_weight: Tensor, weight: Tensor, q_norm_weight: Tensor, k_norm_weight: Tensor,
        positions: Tensor, freqs: Tensor, eps: float, qk_eps: float, nq: int, nk: int, head_dim: int, residual: bool,
        sumsq: Optional[Tensor] = None, slots: Optional[list[int]] = None, token: Optional[Tensor] = None
        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x (M, K) -> q (M, nq), k (M, nk), v (M, N - nq - nk), x again (``residual``) or empty, r (M,), xq, xk (the
    pre-norm values, saved for the backward)."""
    return _forward(x, norm_weight, weight, q_norm_weight, k_norm_weight, positions, freqs, eps, qk_eps, nq, nk,
                    head_dim, residual, sumsq)


def _fake_backward(dq, dk, dv, dres, h, norm_weight, weight, qn, kn, r, xq, xk, v, positions, freqs, qk_eps,
                   head_dim, need_weight):
    dw = weight.new_empty(weight.shape) if need_weight else weight.new_empty(0)
    return h.new_empty(h.shape), norm_weight.new_empty(norm_weight.shape), dw, qn.new_empty(qn.shape), \
        kn.new_empty(kn.shape)


@backward_op("rmsnorm_linear_rope_qknorm_qkv_backward", fake=_fake_backward, updates=("weight",), update_grads=(2,))
def _backward_op(dq: Tensor, dk: Tensor, dv: Tensor, dres: Optional[Tensor], h: Tensor, norm_weight: Tensor,
                 weight: Tensor, qn: Tensor, kn: Tensor, r: Tensor, xq: Tensor, xk: Tensor, v: Tensor,
                 positions: Tensor, freqs: Tensor, qk_eps: float, head_dim: int,
                 need_weight: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dh (+ dres), dgamma, dW (empty unless need_weight, or updated in place), d q_norm.weight, d k_norm.weight)."""
    if h.shape[0] == 0:
        return (*_no_rows(h, norm_weight, weight, need_weight), torch.zeros_like(qn), torch.zeros_like(kn))
    grads = [g.to(h.dtype) for g in (dq, dk, dv)]
    wdt = torch.promote_types(h.dtype, torch.float32)  # (float64 on the CPU reference path)
    wn = torch.cat((pairs_order(qn.detach()), pairs_order(kn.detach()))).to(wdt)
    dacc, dr, dwn = rope_grad_qknorm(grads, (xq, xk), v, positions, freqs, r, wn, qk_eps, head_dim)
    dh, dgamma, dw = rmsnorm_fold_grads(gemm_for(h.device, ENTRY), dacc, dr, h, norm_weight, weight, r,
                                        (True, True, need_weight), dres, ENTRY)
    return (dh, dgamma, weight.new_empty(0) if dw is None else dw, half_split_order(dwn[0]).to(qn.dtype),
            half_split_order(dwn[1]).to(kn.dtype))


def rmsnorm_linear_rope_qknorm_qkv(x: Tensor, norm_weight: Tensor, weight: Tensor, q_norm_weight: Tensor,
                                   k_norm_weight: Tensor, positions: Tensor, freqs: Tensor, eps: float, qk_eps: float,
                                   widths, head_dim: int, *, residual: bool = False, sumsq: Optional[Tensor] = None):
    """:func:`coda.ops.rmsnorm_linear_rope_qkv` with the per-head RMSNorms of q and k (weights ``q_norm_weight`` /
    ``k_norm_weight`` (head_dim,), the model's half-split order; epsilon ``qk_eps``) applied before RoPE, in the
    QKV GEMMs' epilogues and in the backward's one pass (the module docstring). Returns q, k, v (and x with
    ``residual``), (..., n_i) each, autograd to x, norm_weight, weight and both norm weights."""
    K, N, pos, nq, nk, sumsq = check_qkv(ENTRY, x, norm_weight, weight, positions, freqs, eps, widths, residual,
                                         sumsq, v_aligned=True)
    check_eps(ENTRY, qk_eps)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"{ENTRY}: head_dim must be a positive int, got {head_dim!r}")
    why = supported(head_dim, nq, nk)
    if why:
        raise ValueError(f"{ENTRY}: widths {tuple(widths)}: {why}")
    for name, t in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if not isinstance(t, Tensor) or tuple(t.shape) != (head_dim,) or not t.dtype.is_floating_point:
            raise ValueError(f"{ENTRY}: {name} must be a floating-point tensor of shape ({head_dim},)")
        if t.device != x.device:
            raise ValueError(f"{ENTRY}: {name} is on {t.device} but x is on {x.device}")
    lead = x.shape[:-1]
    q, k, v, xr, *_ = call("rmsnorm_linear_rope_qknorm_qkv", x.reshape(-1, K), norm_weight, weight, q_norm_weight,
                           k_norm_weight, pos, freqs, float(eps), float(qk_eps), nq, nk, head_dim, residual, sumsq,
                           *update_args(weight, when=torch.is_grad_enabled()))
    parts = tuple(t.reshape(*lead, t.shape[1]) for t in (q, k, v))
    return (*parts, xr.reshape(x.shape)) if residual else parts
