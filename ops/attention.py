"""``coda.ops.rmsnorm_linear_rope``: attention's input RMSNorm + the fused QKV projection + RoPE as one GEMM.

    h (M, K), r = rsqrt(mean(h^2, -1) + eps), W' = W * gamma (gamma folded into the weight, as ``rmsnorm_linear``)
    y = RoPE(diag(r) (h W'^T))          each column pair (2j, 2j+1) of row m rotated by pos[m] * freq[j]

W is [W_q; W_k; W_v] with the q and k rows in the adjacent-pairs order (``permute_half_split``), ``freq`` 0 on the
v columns (``rope_freqs(d, Hq + 2 Hkv, rotary_heads=Hq + Hkv)``). The epilogue ``rope_rmsnorm`` scales and rotates
the accumulator tile; the normed activation and the unrotated q, k are never written.

Backward (dy, the gradient of y; ``rmsnorm_linear``'s algebra on the gradient before RoPE):
1. dacc = R(-theta) dy: one K = 0 launch of the kernel with the backward of ``rope`` as its epilogue;
2. c = (1/K) sum_n dy y per row from the rotated dy and the saved rotated y (the rotation keeps each pair's dot
   product): the epilogue ``row_dot`` as a K = 0 launch;
3. dX GEMM acc = dacc W with the epilogue ``rmsnorm_dgrad``: dh, the normed activation and dgamma partials;
4. dW = dacc^T n.
Saved: h, gamma, W, r, y (alive anyway: attention's q, k, v are views of it), positions and freqs.

``rmsnorm_linear_rope_qkv`` (what ``FusedAttention`` runs): the same forward returning q, k, v (column blocks of
y), whose backward takes their gradients as the attention backward gives them: steps 1-2 are then one pass of
``coda.kernels.rope_grad`` over dq, dk, dv and q, k, v (no cat of the three gradients into dy, no deinterleaving
copies, one read of each: H100 llama-1b, the four passes it replaces took ~0.2 ms a layer). That pass forms the
accumulator's gradient with r applied, r dacc, and r's gradient dr = sum_n dy y / r, so steps 3-4 need no
normalised activation: dX = (r dacc) W gamma - r^3 dr h / K (``rms_radial``) and dW = ((r dacc)^T h) gamma with
dgamma from the dW GEMM's epilogue (``fold_grads`` / ``adamw_fold``), as in the MLP's gate/up projection
(``ops.mlp.rmsnorm_fold_grads``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from coda.epilogues.rope import rope_rmsnorm, rope_rmsnorm_bias

from coda.epilogues.rmsnorm import rmsnorm_dgrad, rmsnorm_dgrad_residual, row_dot
from coda.kernels.rope_grad import rope_grad

from ._builder import backward_call, backward_op, forward_op
from ._common import (call, check_inputs, check_last_dim_contiguous, epilogue_pass, gemm_for, grad_of, linear_grads,
                      update_args, weight_grad)
from .mlp import residual_add, residual_add_sumsq, rmsnorm_fold_grads
from .rmsnorm_linear import check_eps, check_norm_weight, check_sumsq, normed_operands
from .rope import unrotate

__all__ = ["rmsnorm_linear_rope", "rmsnorm_linear_rope_qkv", "linear_residual"]

ENTRY = "coda.ops.rmsnorm_linear_rope"
LR_ENTRY = "coda.ops.linear_residual"


@forward_op("rmsnorm_linear_rope", backward="rmsnorm_linear_rope_backward", grads=3,
            fake=lambda x, norm_weight, weight, positions, freqs, eps: (
                x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape[0], dtype=torch.float32)),
            # (h, norm_weight, weight, r, y, positions, freqs), then need_weight only
            saved=lambda i, out: (*i[:3], out[1], out[0], *i[3:5]), arrange=lambda extra, needs: (needs[2],))
def _op(x: Tensor, norm_weight: Tensor, weight: Tensor, positions: Tensor, freqs: Tensor,
        eps: float) -> tuple[Tensor, Tensor]:
    """x (M, K), weight (N, K), positions (M,) fp32, freqs (N/2,) fp32 -> y (M, N), r (M,) fp32."""
    return _forward(x, norm_weight, weight, positions, freqs, eps)


def _forward(x, norm_weight, weight, positions, freqs, eps, sumsq=None, blocks=None, bias=None):
    """(y, r); ``blocks``: column counts (even, summing to N) of separate outputs, one GEMM each into its own
    tensor (the rows of the operand b and the column pairs' frequencies sliced), returned as a list for y.
    ``bias`` (N,): added before the rotation (``rope_rmsnorm_bias``, its pairs' two values as VecN operands)."""
    gemm = gemm_for(x.device, ENTRY)
    a, b, r = normed_operands(x, norm_weight, weight, eps, gemm, sumsq)
    if bias is None:
        epi, pairs = rope_rmsnorm, None
    else:  # (2, N/2): the even and the odd columns' biases (float64 on the CPU reference path)
        epi = rope_rmsnorm_bias
        pairs = bias.detach().to(torch.promote_types(bias.dtype, torch.float32)).view(-1, 2).t().contiguous()

    def block(c0, n):
        j = slice(c0 // 2, (c0 + n) // 2)
        extra = {} if pairs is None else {"b_even": pairs[0, j], "b_odd": pairs[1, j]}
        return gemm(a, b[c0:c0 + n], epilogue=epi, r=r, pos=positions, freq=freqs[j], **extra)
    if blocks is None:
        return block(0, weight.shape[0]), r
    ys, c0 = [], 0
    for n in blocks:
        ys.append(block(c0, n))
        c0 += n
    return ys, r


def residual_out(x, residual: bool, copy: bool = True):
    """The QKV ops' residual-stream output: x (a copy under the dispatcher, whose outputs may not alias inputs; x
    itself in eager mode) with ``residual``, else an empty tensor."""
    return (x.clone() if copy else x) if residual else x.new_empty(0)


def _fake_backward(dy, h, norm_weight, weight, r, y, positions, freqs, need_weight):
    dw = weight.new_empty(weight.shape) if need_weight else weight.new_empty(0)
    return h.new_empty(h.shape), norm_weight.new_empty(norm_weight.shape), dw


@backward_op("rmsnorm_linear_rope_backward", fake=_fake_backward)
def _backward_op(dy: Tensor, h: Tensor, norm_weight: Tensor, weight: Tensor, r: Tensor, y: Tensor,
                 positions: Tensor, freqs: Tensor, need_weight: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dh, dgamma, dW; empty unless need_weight). c = (1/K) sum_n dy y comes from the rotated dy and y (the
    rotation preserves each pair's dot product), the dX GEMM from the unrotated gradient."""
    gemm = gemm_for(dy.device, ENTRY)
    K = h.shape[1]
    if h.shape[0] == 0:
        return _no_rows(h, norm_weight, weight, need_weight)
    dy = dy.to(h.dtype).contiguous()
    dacc = unrotate(gemm, dy, positions, freqs)
    c = epilogue_pass(gemm, h, *dy.shape, epilogue=row_dot, dy=dy, y=y)["dot"] / K
    return _dx_dw(gemm, dacc, c, h, norm_weight, weight, r, need_weight)


def _no_rows(h, norm_weight, weight, need_weight):
    """The gradients of an M = 0 call (nothing to launch): zeros."""
    dw = torch.zeros_like(weight) if need_weight else weight.new_empty(0)
    return torch.zeros_like(h), torch.zeros_like(norm_weight), dw


def _dx_dw(gemm, dacc, c, h, norm_weight, weight, r, need_weight, dres=None):
    """Steps 3-4 from the un-rotated gradient dacc and the row dots c: (dh (+ dres), dgamma, dW or an empty
    tensor)."""
    extra = {} if dres is None else {"dres": dres.to(h.dtype).contiguous()}
    res = gemm(dacc, weight.t(), epilogue=rmsnorm_dgrad_residual if extra else rmsnorm_dgrad, out_dtype=h.dtype,
               gamma=norm_weight, h=h, r=r, c=c, **extra)
    dw = weight_grad(dacc, res["normed"], weight, ENTRY) if need_weight else weight.new_empty(0)
    return res["out"], res["dgamma"].to(norm_weight.dtype), dw


def rmsnorm_linear_rope(x: Tensor, norm_weight: Tensor, weight: Tensor, positions: Tensor, freqs: Tensor,
                        eps: float = 1e-6) -> Tensor:
    """``RoPE(RMSNorm(x) @ weight.T)`` in one fused GEMM, autograd included (see the module docstring).

    x (..., K) bfloat16/float16; norm_weight (K,); weight (N, K) of x's dtype with q/k rows in the adjacent-pairs
    order; positions: x.shape[:-1] (or broadcastable), integer positions below 2^24 (not checked here: the module
    that calls this builds them); freqs (N/2,) float32. N, K multiples of 8. Returns (..., N) in x's dtype."""
    K, N, pos = _check(x, norm_weight, weight, positions, freqs, eps)
    y, _ = call("rmsnorm_linear_rope", x.reshape(-1, K), norm_weight, weight, pos, freqs, float(eps))
    return y.reshape(*x.shape[:-1], N)


def _check(x, norm_weight, weight, positions, freqs, eps):
    """The entries' argument rules; returns K, N and the positions as (M,) fp32."""
    check_inputs(ENTRY, x, weight)
    check_eps(ENTRY, eps)
    K, N = x.shape[-1], weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"{ENTRY}: weight must be (N, {K}) for x (..., {K}), got {tuple(weight.shape)}")
    if not (norm_weight.dtype == torch.float64 and x.device.type == "cpu"):  # float64: the CPU reference path
        check_norm_weight(ENTRY, norm_weight, K)
    if N % 2 or tuple(freqs.shape) != (N // 2,) or freqs.dtype != torch.float32:
        raise ValueError(f"{ENTRY}: freqs must be float32 of shape ({N // 2},) (one per column pair), got "
                         f"{freqs.dtype} {tuple(freqs.shape)}")
    check_last_dim_contiguous(ENTRY, (("x", x), ("weight", weight)))
    pos = torch.broadcast_to(positions, x.shape[:-1]).reshape(-1).to(torch.float32)
    return K, N, pos


# ------------------------------------------------------------------------------------------------ q, k, v apart
def _fake_qkv(x, norm_weight, weight, positions, freqs, eps, nq, nk, residual, sumsq=None, slots=None, token=None):
    M, N = x.shape[0], weight.shape[0]
    return (x.new_empty(M, nq), x.new_empty(M, nk), x.new_empty(M, N - nq - nk),
            x.new_empty(x.shape) if residual else x.new_empty(0), x.new_empty(M, dtype=torch.float32))


def _qkv_views(x, norm_weight, weight, positions, freqs, eps, nq, nk, residual, sumsq=None, slots=None, token=None):
    """The eager forward: q, k, v as column blocks (views) of the one GEMM output, x itself as the residual
    stream (``residual``; an empty tensor without), r (from ``sumsq``, x's rows' sums of squares, when given)."""
    y, r = _forward(x, norm_weight, weight, positions, freqs, eps, sumsq)
    return (*torch.split(y, [nq, nk, y.shape[1] - nq - nk], dim=1), residual_out(x, residual, copy=False), r)


def _qkv_backward(ctx, dq, dk, dv, dres=None, _dr=None):
    """dq, dk, dv (any of them None: zeros) and the residual stream's gradient dres (None: none) to x (dh + dres,
    added in the dX GEMM's epilogue), norm_weight, weight."""
    h, norm_weight, weight, r, q, k, v, positions, freqs = ctx.saved_tensors
    need_x, need_gamma, need_w = ctx.needs_input_grad[:3]
    rest = (None,) * (len(ctx.needs_input_grad) - 3)
    if dq is None and dk is None and dv is None:
        return (dres if need_x else None, None, None, *rest)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip((dq, dk, dv), (q, k, v))]
    dh, dgamma, dw = backward_call(ctx, "rmsnorm_linear_rope_qkv_backward", *grads, dres, h, norm_weight, weight, r,
                                   q, k, v, positions, freqs, need_w)
    return (dh if need_x else None, dgamma if need_gamma else None, grad_of(dw) if need_w else None, *rest)


# under the dispatcher (torch.compile, export) a custom op's outputs may not alias its inputs or one another: q, k, v
# come from three GEMMs into their own tensors (the same waves as one GEMM at llama-1b's shapes: 4 + 1 + 1 of 128 x
# 256 tiles on 132 SMs against 6), not from copies of one output's column blocks (strided copies: 1.10 ms a llama-1b
# step on the H200, session 43 call 5); the residual stream x is copied (cheaper than adding its gradient apart)
@forward_op("rmsnorm_linear_rope_qkv", fake=_fake_qkv, backward=_qkv_backward, eager=_qkv_views,
            outputs=lambda i: 4 if i[8] else 3, saved=lambda i, out: (*i[:3], out[4], *out[:3], *i[3:5]),
            slots=10)
def _qkv_op(x: Tensor, norm_weight: Tensor, weight: Tensor, positions: Tensor, freqs: Tensor, eps: float, nq: int,
            nk: int, residual: bool, sumsq: Optional[Tensor] = None, slots: Optional[list[int]] = None,
            token: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x (M, K) -> q (M, nq), k (M, nk), v (M, N - nq - nk), x again (``residual``; else an empty tensor), r (M,).
    ``sumsq`` (M,) fp32: x's rows' sums of squares (r without a pass over x), or None. ``slots``, ``token``:
    ``coda.optim.compile_slots`` of the weight under torch.compile (updated in the backward), else None."""
    blocks = (nq, nk, weight.shape[0] - nq - nk)
    if all(n % 8 == 0 for n in blocks):  # whole column pairs and 16-byte output rows in each block
        (q, k, v), r = _forward(x, norm_weight, weight, positions, freqs, eps, sumsq, blocks=blocks)
        return q, k, v, residual_out(x, residual), r
    out = _qkv_views(x, norm_weight, weight, positions, freqs, eps, nq, nk, residual, sumsq)
    return (*(t.contiguous() for t in out[:3]), out[3].clone(), out[4])


def _fake_qkv_backward(dq, dk, dv, dres, h, norm_weight, weight, r, q, k, v, positions, freqs, need_weight):
    dw = weight.new_empty(weight.shape) if need_weight else weight.new_empty(0)
    return h.new_empty(h.shape), norm_weight.new_empty(norm_weight.shape), dw


@backward_op("rmsnorm_linear_rope_qkv_backward", fake=_fake_qkv_backward, updates=("weight",), update_grads=(2,))
def _qkv_backward_op(dq: Tensor, dk: Tensor, dv: Tensor, dres: Optional[Tensor], h: Tensor, norm_weight: Tensor,
                     weight: Tensor, r: Tensor, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, freqs: Tensor,
                     need_weight: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dh (+ dres), dgamma, dW; empty unless need_weight, or updated in place): one ``rope_grad`` pass gives the
    gradients of the accumulator (r applied) and of r, then ``ops.mlp.rmsnorm_fold_grads``' dX and dW GEMMs (no
    normalised activation written)."""
    if h.shape[0] == 0:
        return _no_rows(h, norm_weight, weight, need_weight)
    grads = [g.to(h.dtype) for g in (dq, dk, dv)]
    dacc, dr = rope_grad(grads, (q, k, v), positions, freqs, r)  # the accumulator's gradient (r applied) and r's
    dh, dgamma, dw = rmsnorm_fold_grads(gemm_for(h.device, ENTRY), dacc, dr, h, norm_weight, weight, r,
                                        (True, True, need_weight), dres, ENTRY)
    return dh, dgamma, weight.new_empty(0) if dw is None else dw


def rmsnorm_linear_rope_qkv(x: Tensor, norm_weight: Tensor, weight: Tensor, positions: Tensor, freqs: Tensor,
                            eps: float, widths, *, residual: bool = False, sumsq: Optional[Tensor] = None):
    """:func:`rmsnorm_linear_rope` returning the output's three column blocks (q, k, v: ``widths`` = (nq, nk), v
    the rest; each a multiple of 8), (..., n_i) each, autograd included; in eager mode views of one GEMM output.
    Their gradients go through one ``coda.kernels.rope_grad`` pass (the module docstring).

    ``residual=True``: also returns x (the residual stream, for :func:`linear_residual`'s ``res``; in eager mode x
    itself, no copy); the gradient arriving on it is added to dx in the dX GEMM's epilogue (no add kernel).

    ``sumsq`` (x.shape[:-1], float32): the sum of squares of each row of x, as the GEMM that wrote x emitted it
    (``coda.ops.mlp(..., return_sumsq=True)``): r comes from it instead of a reduction over x (used where gamma
    is folded into the weight, M > N; no gradient flows through it: the backward differentiates r through x)."""
    K, N, pos, nq, nk, sumsq = check_qkv(f"{ENTRY}_qkv", x, norm_weight, weight, positions, freqs, eps, widths,
                                         residual, sumsq)
    lead = x.shape[:-1]
    q, k, v, xr, _ = call("rmsnorm_linear_rope_qkv", x.reshape(-1, K), norm_weight, weight, pos, freqs, float(eps),
                          nq, nk, residual, sumsq, *update_args(weight, when=torch.is_grad_enabled()))
    parts = tuple(t.reshape(*lead, t.shape[1]) for t in (q, k, v))
    return (*parts, xr.reshape(x.shape)) if residual else parts


def check_qkv(entry, x, norm_weight, weight, positions, freqs, eps, widths, residual, sumsq, v_aligned=False):
    """The QKV ops' argument rules (:func:`_check`'s; the widths (nq, nk) multiples of 8 with nq + nk <= N -- and
    v's width N - nq - nk too with ``v_aligned``: the ops that always write q, k, v by three GEMMs --, ``residual``
    a bool, ``sumsq``); returns K, N, the positions as (M,) fp32, nq, nk and sumsq as (M,)."""
    K, N, pos = _check(x, norm_weight, weight, positions, freqs, eps)
    nq, nk = (int(w) for w in widths)
    if min(nq, nk, N - nq - nk) < 0 or nq % 8 or nk % 8:
        raise ValueError(f"{entry}: widths must be (nq, nk), multiples of 8 with nq + nk <= {N}, got "
                         f"{tuple(widths)}")
    if v_aligned and (N - nq - nk) % 8:
        raise ValueError(f"{entry}: widths {tuple(widths)}: v's width {N - nq - nk} is not a multiple of 8")
    if not isinstance(residual, bool):
        raise TypeError(f"{entry}: residual must be True or False, got {type(residual).__name__}")
    return K, N, pos, nq, nk, check_sumsq(entry, sumsq, x)


# ------------------------------------------------------------------------------------------------ output projection
def _linear_residual_backward(ctx, dy, *_):
    """dy to o (dy W), weight (dy^T o, or updated in backward: ``coda.optim``) and res (dy itself: no copy); none to
    the next norm's weight (``linear_residual_norm``: its outputs hg and ss carry no gradient)."""
    o, weight = ctx.saved_tensors
    need_o, need_w, need_res = ctx.needs_input_grad[:3]
    rest = (None,) * (len(ctx.needs_input_grad) - 3)
    if dy is None:
        return (None, None, None, *rest)
    do, dw = backward_call(ctx, "linear_residual_backward", dy, o, weight, need_o, need_w)
    return (do if need_o else None, grad_of(dw) if need_w else None, dy if need_res else None, *rest)


@backward_op("linear_residual_backward", fake=lambda dy, o, weight, need_o, need_w: (
    o.new_empty(o.shape) if need_o else o.new_empty(0), weight.new_empty(weight.shape) if need_w else weight.new_empty(0)),
    updates=("weight",), update_grads=(1,))
def _linear_residual_backward_op(dy: Tensor, o: Tensor, weight: Tensor, need_o: bool,
                                 need_w: bool) -> tuple[Tensor, Tensor]:
    dy = dy.contiguous()
    do, dw = linear_grads(dy, o, weight, need_o, need_w, LR_ENTRY)
    return (o.new_empty(0) if do is None else do), (weight.new_empty(0) if dw is None else dw)


@forward_op("linear_residual", fake=lambda o, weight, res, *_: o.new_empty(o.shape[0], weight.shape[0]),
            backward=_linear_residual_backward, saved=lambda i, out: i[:2],
            slots=3)
def _linear_residual_op(o: Tensor, weight: Tensor, res: Tensor, slots: Optional[list[int]] = None,
                        token: Optional[Tensor] = None) -> Tensor:
    """res + o W^T (``slots``, ``token``: the weight's update under torch.compile, ``coda.optim.compile_slots``)."""
    return gemm_for(o.device, LR_ENTRY)(o, weight, epilogue=residual_add, res=res)


@forward_op("linear_residual_norm", backward=_linear_residual_backward, saved=lambda i, out: i[:2],
            slots=4,
            fake=lambda o, weight, res, gamma, *_: (o.new_empty(o.shape[0], weight.shape[0]),
                                                o.new_empty(o.shape[0], weight.shape[0]),
                                                o.new_empty(o.shape[0], dtype=torch.float32)))
def _linear_residual_norm_op(o: Tensor, weight: Tensor, res: Tensor, gamma: Tensor, slots: Optional[list[int]] = None,
                             token: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """y = res + o W^T, y * gamma (rounded once) and y's rows' sums of squares (fp32), from one epilogue."""
    out = gemm_for(o.device, LR_ENTRY)(o, weight, epilogue=residual_add_sumsq(o.dtype, scaled=True), res=res,
                                       gamma=gamma)
    return out["out"], out["hg"], out["ss"]


def linear_residual(o: Tensor, weight: Tensor, res: Tensor, *, norm_weight: Optional[Tensor] = None):
    """``res + o @ weight.T`` in one GEMM (the add in its epilogue), autograd included: the attention's output
    projection writing straight into the residual stream. o (..., K), weight (N, K), res (..., N), one dtype (bf16
    / fp16; float32 / float64 on CPU tensors). The gradient of res is dy itself.

    The same as ``coda.ops.linear(o, weight, epilogue=residual_add, res=res)``, as an op of its own: ``linear``'s
    generic path (epilogue by name, operand lists, the derived backward) takes ~40 us more host time a call (CPU
    reference path, 128 vs 170 us; the fused step's forward is host-late under the profiler, though not in the
    timed step: session 25), and its backward forms the acc-free gradient of res from a zero scalar it allocates
    (one more kernel a layer).

    ``norm_weight`` (N,): the next RMSNorm's weight gamma; then returns (y, y * gamma, ss), the product rounded once
    to y's dtype and ss (..., ) float32 the rows' sums of squares of y, all from the same epilogue: what
    :func:`coda.ops.mlp`'s ``normed`` takes instead of a pass over y. No gradient flows through the two extras."""
    check_inputs(LR_ENTRY, o, weight)
    if weight.dim() != 2 or weight.shape[1] != o.shape[-1] or tuple(res.shape) != (*o.shape[:-1], weight.shape[0]):
        raise ValueError(f"{LR_ENTRY}: expected o (..., K), weight (N, K), res (..., N); got {tuple(o.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(res.shape)}")
    if res.dtype != o.dtype or res.device != o.device:
        raise TypeError(f"{LR_ENTRY}: res must have o's dtype and device, got {res.dtype} on {res.device}")
    check_last_dim_contiguous(LR_ENTRY, (("o", o), ("weight", weight), ("res", res)))
    K, N = o.shape[-1], weight.shape[0]
    upd = update_args(weight, when=torch.is_grad_enabled())  # under torch.compile: updated in the backward
    if norm_weight is None:
        y = call("linear_residual", o.reshape(-1, K), weight, res.reshape(-1, N), *upd)
        return y.reshape(*o.shape[:-1], N)
    check_norm_weight(LR_ENTRY, norm_weight, N)
    if norm_weight.device != o.device:
        raise ValueError(f"{LR_ENTRY}: norm_weight is on {norm_weight.device} but o is on {o.device}")
    y, hg, ss = call("linear_residual_norm", o.reshape(-1, K), weight, res.reshape(-1, N), norm_weight, *upd)
    lead = o.shape[:-1]
    return y.reshape(*lead, N), hg.reshape(*lead, N), ss.reshape(lead)
