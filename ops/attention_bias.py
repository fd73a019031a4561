"""``coda.ops.rmsnorm_linear_rope_bias_qkv``: :func:`coda.ops.rmsnorm_linear_rope_qkv` with q/k/v biases (Qwen2)
added inside the same GEMMs' epilogues, before RoPE, forward and backward (issue 30).

Forward (the one normed operand a = h, b = W diag(gamma), r the input norm's row scale; three GEMMs into q, k, v):
    y = RoPE(r acc + bias)       ``epilogues.rope.rope_rmsnorm_bias`` (bias's pairs as two VecN operands)
with W's and the bias's q / k rows in the adjacent-pairs order (``coda.fuse`` permutes both once), frequencies 0
on v (so v = r acc_v + b_v).

Backward (dq, dk, dv as the attention backward gives them): one ``coda.kernels.rope_grad.rope_grad_bias`` pass
un-rotates them (dn = R(-theta) dy), applies r (dacc = r dn), forms r's gradient dr = (sum(dy y) - sum(dn b)) / r
(y minus the rotated bias is the rotated r acc; the rotation keeps pairs' dot products) and the bias's gradient
(column sums of dn: CTA partials in a fixed order, summed on the host); then ``ops.mlp.rmsnorm_fold_grads``' dX
and dW GEMMs, as for ``rmsnorm_linear_rope_qkv``. No bias add, RoPE or norm kernel in either direction.

Saved: what ``rmsnorm_linear_rope_qkv`` saves (h, gamma, W, r, q, k, v, positions, freqs) and the bias.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from coda.kernels.rope_grad import rope_grad_bias

from ._builder import backward_call, backward_op, forward_op
from ._common import call, gemm_for, grad_of, update_args
from .attention import _forward as qkv_forward
from .attention import _no_rows, check_qkv, residual_out
from .mlp import rmsnorm_fold_grads

__all__ = ["rmsnorm_linear_rope_bias_qkv"]

ENTRY = "coda.ops.rmsnorm_linear_rope_bias_qkv"


def _fake(x, norm_weight, weight, bias, positions, freqs, eps, nq, nk, residual, sumsq=None, slots=None,
          token=None):
    M, N = x.shape[0], weight.shape[0]
    return (x.new_empty(M, nq), x.new_empty(M, nk), x.new_empty(M, N - nq - nk),
            x.new_empty(x.shape) if residual else x.new_empty(0), x.new_empty(M, dtype=torch.float32))


def _forward(x, norm_weight, weight, bias, positions, freqs, eps, nq, nk, residual, sumsq=None, slots=None,
             token=None, copy_x=True):
    """q, k, v, x (``residual``: a copy, or x itself in eager mode; else empty), r: one GEMM a part."""
    blocks = (nq, nk, weight.shape[0] - nq - nk)
    ys, r = qkv_forward(x, norm_weight, weight, positions, freqs, eps, sumsq, blocks=blocks, bias=bias)
    return (*ys, residual_out(x, residual, copy_x), r)


def _backward(ctx, dq, dk, dv, dres=None, *_):
    """dq, dk, dv (None: zeros) and the residual stream's gradient to x, gamma, W and the bias."""
    h, norm_weight, weight, bias, r, q, k, v, positions, freqs = ctx.saved_tensors
    needs = ctx.needs_input_grad
    rest = (None,) * (len(needs) - 4)
    if dq is None and dk is None and dv is None:
        return (dres if needs[0] else None, None, None, None, *rest)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip((dq, dk, dv), (q, k, v))]
    dh, dgamma, dw, db = backward_call(ctx, "rmsnorm_linear_rope_bias_qkv_backward", *grads, dres, h, norm_weight,
                                       weight, bias, r, q, k, v, positions, freqs, needs[2])
    return (dh if needs[0] else None, dgamma if needs[1] else None, grad_of(dw) if needs[2] else None,
            db if needs[3] else None, *rest)


@forward_op("rmsnorm_linear_rope_bias_qkv", fake=_fake, backward=_backward,
            eager=lambda *a: _forward(*a, copy_x=False), outputs=lambda i: 4 if i[9] else 3,
            saved=lambda i, out: (*i[:4], out[4], *out[:3], *i[4:6]), slots=11)
def _op(x: Tensor, norm_weight: Tensor, weight: Tensor, bias: Tensor, positions: Tensor, freqs: Tensor, eps: float,
        nq: int, nk: int, residual: bool, sumsq: Optional[Tensor] = None, slots: Optional[list[int]] = None,
        token: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x (M, K) -> q (M, nq), k (M, nk), v (M, N - nq - nk), x again (``residual``) or empty, r (M,)."""
    return _forward(x, norm_weight, weight, bias, positions, freqs, eps, nq, nk, residual, sumsq)


def _fake_backward(dq, dk, dv, dres, h, norm_weight, weight, bias, r, q, k, v, positions, freqs, need_weight):
    dw = weight.new_empty(weight.shape) if need_weight else weight.new_empty(0)
    return h.new_empty(h.shape), norm_weight.new_empty(norm_weight.shape), dw, bias.new_empty(bias.shape)


@backward_op("rmsnorm_linear_rope_bias_qkv_backward", fake=_fake_backward, updates=("weight",), update_grads=(2,))
def _backward_op(dq: Tensor, dk: Tensor, dv: Tensor, dres: Optional[Tensor], h: Tensor, norm_weight: Tensor,
                 weight: Tensor, bias: Tensor, r: Tensor, q: Tensor, k: Tensor, v: Tensor, positions: Tensor,
                 freqs: Tensor, need_weight: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dh (+ dres), dgamma, dW (empty unless need_weight, or updated in place), dbias)."""
    if h.shape[0] == 0:
        return (*_no_rows(h, norm_weight, weight, need_weight), torch.zeros_like(bias))
    grads = [g.to(h.dtype) for g in (dq, dk, dv)]
    wdt = torch.promote_types(h.dtype, torch.float32)  # (float64 on the CPU reference path)
    dacc, dr, db = rope_grad_bias(grads, (q, k, v), positions, freqs, r, bias.detach().to(wdt))
    dh, dgamma, dw = rmsnorm_fold_grads(gemm_for(h.device, ENTRY), dacc, dr, h, norm_weight, weight, r,
                                        (True, True, need_weight), dres, ENTRY)
    return dh, dgamma, weight.new_empty(0) if dw is None else dw, db.to(bias.dtype)


def rmsnorm_linear_rope_bias_qkv(x: Tensor, norm_weight: Tensor, weight: Tensor, bias: Tensor, positions: Tensor,
                                 freqs: Tensor, eps: float, widths, *, residual: bool = False,
                                 sumsq: Optional[Tensor] = None):
    """:func:`coda.ops.rmsnorm_linear_rope_qkv` with ``bias`` (N,) (q's, k's and v's biases in ``weight``'s row
    order: q / k in the adjacent-pairs order) added before RoPE, in the QKV GEMMs' epilogues and in the backward's
    one pass (the module docstring). Returns q, k, v (and x with ``residual``), (..., n_i) each, autograd to x,
    norm_weight, weight and bias."""
    K, N, pos, nq, nk, sumsq = check_qkv(ENTRY, x, norm_weight, weight, positions, freqs, eps, widths, residual,
                                         sumsq, v_aligned=True)
    if not isinstance(bias, Tensor) or tuple(bias.shape) != (N,) or not bias.dtype.is_floating_point:
        raise ValueError(f"{ENTRY}: bias must be a floating-point tensor of shape ({N},)")
    if bias.device != x.device:
        raise ValueError(f"{ENTRY}: bias is on {bias.device} but x is on {x.device}")
    lead = x.shape[:-1]
    q, k, v, xr, _ = call("rmsnorm_linear_rope_bias_qkv", x.reshape(-1, K), norm_weight, weight, bias, pos, freqs,
                          float(eps), nq, nk, residual, sumsq, *update_args(weight, when=torch.is_grad_enabled()))
    parts = tuple(t.reshape(*lead, t.shape[1]) for t in (q, k, v))
    return (*parts, xr.reshape(x.shape)) if residual else parts
