"""``coda.ops.rmsnorm_linear``: ``RMSNorm(x [+ residual]) @ weight.T`` as one GEMM + epilogue, forward and backward.

The rewrite (issue 4; algebra and its sympy checks: ``coda.epilogues.rmsnorm``, tests/test_rmsnorm_linear.py)::

    h = x (+ residual)                       r = rsqrt(mean(h^2, -1) + eps)          (fp32, one value per row)
    y = diag(r) (h W'^T),  W' = weight * norm_weight  (gamma folded into the weight)

Forward
    1. h = x + residual (only with a residual; in x's dtype, like the unfused module).
    2. gamma goes to the cheaper GEMM operand (:func:`normed_operands`; in a full model the producer GEMM of h
       emits the sum-of-squares partials instead, docs/DESIGN.md, and this op stands alone):
       - M <= N: one K = 0 launch of the epilogue ``scale_sumsq`` reads h once and writes h * gamma (M x K, rounded
         once to h's dtype) and the per-row sum of squares, so r = rsqrt(ss / K + eps) comes from the same pass;
       - M > N: W' = weight * norm_weight (:func:`fold`, the epilogue ``fold_gamma`` as a K = 0 launch: one read
         and one write of the N x K weight) and r from a light torch pre-pass (fp32, one read of h).
       Neither product is saved (the backward uses h and the unfolded weight).
    3. One GEMM: y = ((h * gamma) W^T) * r, epilogue ``rmsnorm_scale`` (r a VecM operand). The normalised
       activation is never written.

Backward (the incoming dy; dh_out, the gradient arriving on the returned residual stream h, if any)
    1. c = (1/K) sum_n dy * y per row (fp32): the epilogue ``row_dot`` as a K = 0 launch (CODA's kernel doing only
       the epilogue: one read of dy and of the saved output y, per-tile row partials).
    2. dX GEMM: acc = dy W (``weight.t()``, an MN-major view: no copy), epilogue ``rmsnorm_dgrad`` (or
       ``rmsnorm_dgrad_residual``, which adds dh_out): dh = r (acc gamma - h r c), the normed activation
       n = h r gamma (M x K extra output) and dgamma = sum_m acc h r (per-column partials, no atomics).
    3. dW GEMM: dweight = dy^T n on transposed views (``ops._common.weight_grad``: CODA's kernel, or
       ``torch.matmul`` when M is not a multiple of 8), skipped when weight needs no gradient.
    Wide linears (N > 2.5 K, :func:`split_backward`) skip step 1: c = (r / K) sum_k h (acc gamma)_k comes from the
    dX GEMM itself (``rmsnorm_dgrad_split``: acc as fp32 M x K and row partials of sum h acc gamma), then one
    K = 0 pass (``rmsnorm_dgrad_finish[_residual]``) forms dh, n and dgamma: ~10 K instead of 4 N bytes per row,
    and y is not saved.
    dx = dresidual = dh. Double backward is not supported.

Saved for the backward: h (x itself without a residual), r (M floats), the output y (M x N, for c; not for a
wide linear); not the normed activation (M x K), which the backward re-forms.

torch integration: the op is the custom op ``torch.ops.coda.rmsnorm_linear`` (2-D x; returns (y, h or an empty
tensor, r)) with a fake (meta) implementation and an autograd formula whose backward is the custom op
``torch.ops.coda.rmsnorm_linear_backward``; so ``torch.compile(fullgraph=True)`` keeps both as opaque nodes and
``torch.library.opcheck`` passes.

Device: on a Hopper GPU the fused kernels run; on CPU tensors the same epilogue programs run through
``coda.reference.gemm`` (torch ops, fp32 math); other GPUs raise (``ops/_common.py``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from coda.epilogues.rmsnorm import (fold_gamma, rmsnorm_dgrad, rmsnorm_dgrad_finish, rmsnorm_dgrad_finish_residual,
                                    rmsnorm_dgrad_residual, rmsnorm_dgrad_split, rmsnorm_scale, row_dot, scale_sumsq)

from ._builder import backward_op, forward_op
from ._common import (call, check_last_dim_contiguous, check_tensors, epilogue_pass, gemm_for, grad_of,
                      weight_grad)

__all__ = ["rmsnorm_linear"]

_ENTRY = "coda.ops.rmsnorm_linear"
_IN_DTYPES = (torch.bfloat16, torch.float16)
_GAMMA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rmsnorm_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                   residual: Optional[torch.Tensor] = None):
    """``RMSNorm(h) @ weight.T`` with ``h = x`` (or ``x + residual``), autograd included.

    ``RMSNorm(h) = h * rsqrt(mean(h^2, -1) + eps) * norm_weight`` (Llama's, statistics in fp32).
    ``x``: (..., K), bfloat16 or float16; ``norm_weight``: (K,), float32, bfloat16 or float16; ``weight``: (N, K)
    like ``nn.Linear.weight``, x's dtype; ``residual``: None or a tensor like x; ``eps`` > 0.
    K and N must be multiples of 8 (the kernel's 16-byte rows).

    Returns ``y`` (..., N) in x's dtype; with a residual, ``(y, h)`` where ``h = x + residual`` (..., K) is the
    residual stream for the next block (pre-norm transformers: ``y, h = rmsnorm_linear(attn_out, g, w, residual=h)``).
    Gradients flow to x, residual, norm_weight and weight (and from both outputs back to x and residual)."""
    _check(x, norm_weight, weight, eps, residual)
    lead, K, N = x.shape[:-1], x.shape[-1], weight.shape[0]
    M = math.prod(lead)
    res2 = None if residual is None else residual.reshape(M, K)
    y, h, _ = call("rmsnorm_linear", x.reshape(M, K), norm_weight, weight, res2, float(eps))
    y = y.reshape(*lead, N)
    return y if residual is None else (y, h.reshape(*lead, K))


def _check(x, norm_weight, weight, eps, residual) -> None:
    """Every argument rule, before anything is computed; each message names the argument."""
    named = [("x", x), ("norm_weight", norm_weight), ("weight", weight)]
    if residual is not None:
        named.append(("residual", residual))
    check_tensors("rmsnorm_linear", named)
    check_eps("rmsnorm_linear", eps)
    if x.dim() < 1:
        raise ValueError("rmsnorm_linear: x must be (..., K), got a 0-d tensor")
    K = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"rmsnorm_linear: weight must be (N, K) with K={K} (x's last dim), got "
                         f"{tuple(weight.shape)}")
    check_norm_weight("rmsnorm_linear", norm_weight, K)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rmsnorm_linear: residual must have x's shape {tuple(x.shape)}, got "
                         f"{tuple(residual.shape)}")
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"rmsnorm_linear: x must be bfloat16 or float16, got {x.dtype}")
    for name, t in named[2:]:
        if t.dtype != x.dtype:
            raise TypeError(f"rmsnorm_linear: {name} must have x's dtype {x.dtype}, got {t.dtype}")
    for name, t in named[1:]:
        if t.device != x.device:
            raise ValueError(f"rmsnorm_linear: {name} is on {t.device} but x is on {x.device}; all tensors must "
                             "be on one device")
    for name, size, what in (("x", K, "K = x.shape[-1]"), ("weight", weight.shape[0], "N = weight.shape[0]")):
        if size % 8:
            raise ValueError(f"rmsnorm_linear: {name}: {what} = {size} must be a multiple of 8 (the kernel reads "
                             "and writes 16-byte rows)")
    check_last_dim_contiguous("rmsnorm_linear", named)


def check_eps(entry: str, eps) -> None:
    """``eps``: a Python number, finite and > 0 (``TypeError`` / ``ValueError`` naming it)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{entry}: eps must be a Python number, got {type(eps).__name__}")
    if not 0 < eps < math.inf:  # also rejects nan (no math.isfinite: torch.compile traces this check)
        raise ValueError(f"{entry}: eps must be a finite number > 0, got {eps}")


def check_norm_weight(entry: str, norm_weight: torch.Tensor, K: int) -> None:
    """The RMSNorm weight: shape (K,), K = x's last dim; float32, bfloat16 or float16."""
    if tuple(norm_weight.shape) != (K,):
        raise ValueError(f"{entry}: norm_weight must have shape ({K},) (x's last dim), got "
                         f"{tuple(norm_weight.shape)}")
    if norm_weight.dtype not in _GAMMA_DTYPES:
        raise TypeError(f"{entry}: norm_weight must be float32, bfloat16 or float16, got {norm_weight.dtype}")


def check_sumsq(entry: str, sumsq, x: torch.Tensor) -> Optional[torch.Tensor]:
    """A ``sumsq`` argument (the rows' sums of squares of x, float32, shape x.shape[:-1], on x's device: what the
    GEMM that wrote x emitted, e.g. ``coda.ops.mlp(return_sumsq=True)``) as the ops take it: detached, (M,)
    contiguous; None stays None. ``TypeError`` / ``ValueError`` naming it otherwise."""
    if sumsq is None:
        return None
    if not isinstance(sumsq, torch.Tensor) or sumsq.dtype != torch.float32 or sumsq.device != x.device:
        raise TypeError(f"{entry}: sumsq must be a float32 tensor on x's device, got "
                        f"{getattr(sumsq, 'dtype', type(sumsq).__name__)}")
    if tuple(sumsq.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{entry}: sumsq must have shape {tuple(x.shape[:-1])} (x's rows), got {tuple(sumsq.shape)}")
    return sumsq.detach().reshape(-1).contiguous()


def fold(weight: torch.Tensor, norm_weight: torch.Tensor, gemm) -> torch.Tensor:
    """W' = weight * norm_weight (gamma per column; fp32 product rounded once to weight's dtype), a new contiguous
    N x K tensor: the epilogue ``fold_gamma`` as a K = 0 launch of ``gemm`` (one pass over the weight)."""
    return epilogue_pass(gemm, weight, *weight.shape, epilogue=fold_gamma, out_dtype=weight.dtype, w=weight,
                         gamma=norm_weight)


def row_rsqrt(ss: torch.Tensor, K: int, eps: float) -> torch.Tensor:
    """r = rsqrt(ss / K + eps) from the rows' sums of squares ``ss`` (fp32): one new vector, then in place on it."""
    return ss.mul(1.0 / max(K, 1)).add_(eps).rsqrt_()


def row_sumsq(h: torch.Tensor, sumsq: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rows' sums of squares of h (M, K) in fp32: ``sumsq`` when h's producer emitted them, else one torch
    reduction over h."""
    return sumsq if sumsq is not None else torch.linalg.vector_norm(h, dim=-1, dtype=torch.float32).square_()


def normed_operands(h: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: Optional[float], gemm,
                    sumsq: Optional[torch.Tensor] = None, normed: Optional[tuple] = None):
    """(a, b, r) with diag(r) (a b^T) = RMSNorm(h) weight^T, r = rsqrt(mean(h^2, -1) + eps) (fp32, per row; None
    when ``eps`` is None: a backward that recomputes the product with the saved r).

    gamma scales whichever operand costs less memory traffic: the activation when M <= N (a = h * gamma and the
    sum of squares from one K = 0 launch, ``scale_sumsq``), else the weight (b = :func:`fold`, r from a torch
    reduction over h, or ``sumsq``: the rows' sums of squares of h as its producer's epilogue emitted them, e.g.
    ``coda.ops.mlp(return_sumsq=True)``). Either product is rounded once to the operands' dtype. ``normed`` = (h *
    gamma, sums of squares) as h's producer emitted them (``coda.ops.linear_residual(norm_weight=)``) stand in for
    the M <= N branch's ``scale_sumsq`` pass (the other branch reads h itself and ignores them)."""
    M, K = h.shape
    if 0 < M <= weight.shape[0] and normed is not None:
        (a, ss), b = normed, weight
    elif 0 < M <= weight.shape[0]:
        res = epilogue_pass(gemm, h, M, K, epilogue=scale_sumsq, out_dtype=h.dtype, h=h, gamma=norm_weight)
        a, b, ss = res["out"], weight, res["ss"]
    else:
        a, b = h, fold(weight, norm_weight, gemm)
        ss = None if eps is None else row_sumsq(h, sumsq)
    return a, b, (None if eps is None else row_rsqrt(ss, K, eps))


# ---------------------------------------------------------------------------------------- the custom ops (2-D)
def split_backward(N: int, K: int) -> bool:
    """Whether the backward gets c from the dX GEMM (fp32 M x K round trip, ~10 K bytes per row) instead of a pass
    over dy and the saved y (4 N bytes per row): for N > 2.5 K; then y is not saved either."""
    return 2 * N > 5 * K


def _fake_backward(dy, dh_out, h, norm_weight, weight, r, y, need_weight):
    dw = weight.new_empty(weight.shape) if need_weight else weight.new_empty(0)
    return h.new_empty(h.shape), norm_weight.new_empty(norm_weight.shape), dw


@backward_op("rmsnorm_linear_backward", fake=_fake_backward)
def _rmsnorm_linear_backward_op(dy: torch.Tensor, dh_out: Optional[torch.Tensor], h: torch.Tensor,
                                norm_weight: torch.Tensor, weight: torch.Tensor, r: torch.Tensor,
                                y: Optional[torch.Tensor],
                                need_weight: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns dh (M, K) (including dh_out), dnorm_weight (K,), dweight (N, K; empty unless need_weight).
    ``y`` None: the split backward (:func:`split_backward`)."""
    gemm = gemm_for(dy.device, _ENTRY)
    M, K = h.shape
    if M == 0 or K == 0:  # nothing to compute: zero gradients without launching anything
        dh = torch.zeros_like(h) if dh_out is None else dh_out.clone()
        dw = torch.zeros_like(weight) if need_weight else weight.new_empty(0)
        return dh, torch.zeros_like(norm_weight), dw
    dy = dy.contiguous()  # autograd may hand over expanded (stride-0) gradients
    dres = {} if dh_out is None else {"dres": dh_out.contiguous()}
    if y is None:  # c from the dX GEMM's own tile, then one K = 0 pass for dh and the normed activation
        part = gemm(dy, weight.t(), epilogue=rmsnorm_dgrad_split, out_dtype=torch.float32, gamma=norm_weight, h=h)
        c = r * part["s"] / K
        res = epilogue_pass(gemm, h, M, K, epilogue=rmsnorm_dgrad_finish_residual if dres else rmsnorm_dgrad_finish,
                            out_dtype=h.dtype, t=part["out"], h=h, r=r, c=c, gamma=norm_weight, **dres)
    else:
        c = epilogue_pass(gemm, h, *dy.shape, epilogue=row_dot, dy=dy, y=y)["dot"] / K  # one pass over dy and y
        res = gemm(dy, weight.t(), epilogue=rmsnorm_dgrad_residual if dres else rmsnorm_dgrad, out_dtype=h.dtype,
                   gamma=norm_weight, h=h, r=r, c=c, **dres)  # acc = dy W
    dw = weight_grad(dy, res["normed"], weight, _ENTRY) if need_weight else weight.new_empty(0)
    return res["out"], res["dgamma"].to(norm_weight.dtype), dw


def _fake(x, norm_weight, weight, residual, eps):
    M, K = x.shape
    h = x.new_empty(M, K) if residual is not None else x.new_empty(0)
    return x.new_empty(M, weight.shape[0]), h, x.new_empty(M, dtype=torch.float32)


def _saved(inputs, output):
    """h (x itself without a residual), norm_weight, weight, r, y (None for a split backward)."""
    x, norm_weight, weight, residual, _ = inputs
    y, h, r = output
    keep_y = not split_backward(weight.shape[0], weight.shape[1])
    return h if residual is not None else x, norm_weight, weight, r, y if keep_y else None


def _backward(ctx, dy, dh_out, _dr):
    """Both outputs' gradients to x, norm_weight, weight, residual: dh goes to x and to the residual."""
    h, norm_weight, weight, r, y = ctx.saved_tensors
    need_x, need_gamma, need_w, need_res = ctx.needs_input_grad[:4]
    has_residual, = ctx.coda_extra
    if dy is None:  # only the residual stream h received a gradient
        dy = h.new_zeros(h.shape[0], weight.shape[0])
    if not has_residual:
        dh_out = None
    dh, dgamma, dw = call("rmsnorm_linear_backward", dy, dh_out, h, norm_weight, weight, r, y, need_w, ctx=ctx)
    return (dh if need_x else None, dgamma if need_gamma else None, grad_of(dw) if need_w else None,
            dh if need_res else None, None)


# y and h differentiable (r is not); the backward maps dh onto both x and the residual
@forward_op("rmsnorm_linear", fake=_fake, backward=_backward, outputs=2, saved=_saved,
            extra=lambda inputs: (inputs[3] is not None,))
def _rmsnorm_linear_op(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                       residual: Optional[torch.Tensor], eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual (M, K); returns y (M, N), h = x + residual (M, K; an empty tensor without residual), r (M,)."""
    gemm = gemm_for(x.device, _ENTRY)  # a non-Hopper GPU raises here, before anything runs
    h = x if residual is None else x + residual
    a, b, r = normed_operands(h, norm_weight, weight, eps, gemm)
    y = gemm(a, b, epilogue=rmsnorm_scale, r=r)
    return y, (h if residual is not None else x.new_empty(0)), r
