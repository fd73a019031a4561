"""``coda.ops.mlp``: the Llama MLP sub-block ``x + down(SwiGLU(gate_up(RMSNorm(x))))`` from CODA's fused GEMMs, and
``coda.ops.rmsnorm_swiglu``, its first half (``silu(gate(n)) * up(n)``, n = RMSNorm(x) * norm_weight).

Forward (h = x, r = rsqrt(mean(h^2) + eps) per row, gate/up rows interleaved)
    1-2. r and gamma (``ops.rmsnorm_linear.normed_operands``): for M <= 2I one K = 0 launch writes x * gamma
       (M x H) and the rows' sums of squares; for M > 2I, W' = w_gate_up diag(gamma) (2I x H, a K = 0 launch) and
       r from a torch pre-pass. Neither product is saved.
    3. GEMM (x gamma) w_gate_up^T (or x W'^T; the same acc) with the pairs epilogue :func:`rms_swiglu`:
       a = silu(g r) (u r), M x I; with ``save_preact`` (default) the epilogue also stores the pairs' accumulator
       values g, u (two M x I outputs). The normalised activation diag(r) x diag(gamma) is never written.
    4. (mlp) GEMM a W_down^T with the epilogue :func:`residual_add`: y = acc + x, one M x H write.

Backward (dy the gradient of y; for rmsnorm_swiglu, dy is da and steps 1-2 and the residual are skipped)
    1. da = dy W_down (GEMM, ``w_down.t()`` an MN-major view; d(acc + x)/d acc = 1, so nothing is recomputed).
       With the saved pre-activation, steps 1 and 3 are one GEMM: its 1 -> 2 epilogue (``coda.autodiff.on_acc``)
       turns each da_j into dacc's pair (dg_j, du_j) and d_r's partials; da is never written.
    2. dW_down = dy^T a (GEMM on transposed views).
    3. The sympy backward of :func:`rms_swiglu` (with the VecM gradient of r; ``coda.ops.linear``'s program) writes
       dacc (M x 2I interleaved, transient) and d_r = sum_j da_j (partial a_j / partial r) (per row, fp32):
       on the saved g, u as a K = 0 launch (CODA's kernel running only the epilogue: one pass over memory), or
       with ``save_preact=False`` in a GEMM that recomputes them (steps 1-3's operands formed again).
    4. dX GEMM dacc W_gu (the unfolded weight) with the epilogue :func:`rms_radial_residual`: gamma as a column
       scale (dacc W' = (dacc W_gu) diag(gamma)), the norm's radial term (dr/dh = -r^3 h / H) and the residual
       gradient: dx = acc gamma - r^3 d_r h / H + dy; one M x H write, no torch pass.
    5. dW' = dacc^T x (GEMM on transposed views) with the epilogue :func:`fold_grads`: dw_gate_up = dW' gamma and
       dgamma = sum_n dW' w_gate_up (per-column partials), so no 2I x H torch pass.
    GEMMs on transposed views whose contraction (M) is not a multiple of 8 run ``torch.matmul``
    (``ops._common.backward_gemm``; then dw_gate_up and dgamma are torch products). Double backward is not
    supported.

Saved for the backward: x, norm_weight, w_gate_up, w_down (the inputs themselves), r (M floats), (mlp) the
activation a (M x I, the dW_down operand) and (``save_preact``) g, u (M x I each). Never saved: x * gamma, W'
(2I x H), the normalised activation.

torch integration: custom ops ``torch.ops.coda.mlp`` (2-D x; returns (y, a, r, g, u)) and
``coda::rmsnorm_swiglu`` (returns (a, r, g, u); g, u empty without ``save_preact``) with fake implementations;
autograd through the custom op ``coda::mlp_backward``; so
``torch.compile(fullgraph=True)`` keeps them as opaque nodes and ``torch.library.opcheck`` passes.

Device: on a Hopper GPU the fused kernels run; on CPU tensors the same epilogue programs run through
``coda.reference.gemm`` (torch ops, fp32 math); other GPUs raise (``ops/_common.py``).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch import Tensor

import coda
from coda.autodiff import DGRAD, grad_name, on_acc
from coda.epilogues.adamw import adamw_fold

from ._builder import backward_op, forward_op
from ._common import (IN_DTYPES, call, check_last_dim_contiguous, check_tensors, gemm_for, kernel_aligned,
                      linear_grads, save_preact_for, update_args, update_in_backward)
from .gated import check_x_weight_gu
from .gated import fake_preact, forward_preact
from .linear import backward_of, evaluate, saved_preact
from .rmsnorm_linear import check_eps, check_norm_weight, check_sumsq, normed_operands

__all__ = ["mlp", "rmsnorm_swiglu", "rms_swiglu", "residual_add", "residual_add_sumsq"]

_ENTRY = "coda.ops.mlp"


# ------------------------------------------------------------------------------------------------ epilogues
@coda.epilogue
def rms_swiglu(acc, r: coda.VecM):
    """RMSNorm + SwiGLU on the gate/up accumulator acc = h W'^T (W' = weight_gu diag(gamma), rows interleaved):
    out_j = silu(g_j r) (u_j r), r = rsqrt(mean(h^2) + eps) per row. One value per column pair: M x I."""
    g, u = coda.pairs(acc)
    return coda.silu(g * r) * (u * r)


@coda.epilogue
def residual_add(acc, res: coda.TileMN):
    """``acc + res``: a projection that writes straight into the residual stream."""
    return acc + res


@functools.lru_cache(maxsize=None)
def residual_add_sumsq(dtype, scaled: bool = False):
    """``acc + res`` rounded to ``dtype`` (the stored value h) and its per-row sum of squares (fp32 partials per
    N-tile): the next RMSNorm's r from the producer's epilogue instead of a pass over the residual stream
    (``coda.nn``: the down projection's output feeds the next layer's QKV GEMM). ``scaled``: also the extra output
    ``hg`` = h * gamma (a VecN operand ``gamma``; the product rounded once, as ``scale_sumsq`` writes it), the next
    GEMM's A operand (the O projection's output feeds the MLP's gate/up GEMM). One epilogue per dtype and form."""
    if scaled:
        def residual_add_sumsq(acc, res: coda.TileMN, gamma: coda.VecN):
            h = coda.cast(acc + res, dtype)
            return {"out": h, "hg": h * gamma, "ss": coda.reduce_n(h * h)}
    else:
        def residual_add_sumsq(acc, res: coda.TileMN):
            h = coda.cast(acc + res, dtype)
            return {"out": h, "ss": coda.reduce_n(h * h)}
    name = f"residual_add_sumsq_{str(dtype).replace('torch.', '')}{'_gamma' if scaled else ''}"
    residual_add_sumsq.__name__ = residual_add_sumsq.__qualname__ = name
    return coda.epilogue(residual_add_sumsq)


@coda.epilogue
def rms_radial(acc, gamma: coda.VecN, r: coda.VecM, dr: coda.VecM, inv_h: coda.Scalar, h: coda.TileMN):
    """dX GEMM of the gate/up projection on the unfolded weight (acc = dacc W_gu; with W' = W_gu diag(gamma),
    dacc W' = acc * gamma, the gradient of h at fixed r) plus the gradient through r:
    dh = acc gamma + dr * dr/dh = acc gamma - r^3 dr h / H (``inv_h`` = 1/H)."""
    return acc * gamma - r * r * r * dr * inv_h * h


@coda.epilogue
def rms_radial_residual(acc, gamma: coda.VecN, r: coda.VecM, dr: coda.VecM, inv_h: coda.Scalar, h: coda.TileMN,
                        dres: coda.TileMN):
    """:func:`rms_radial` plus the gradient arriving through the residual (mlp: y = x + ...): + dres."""
    return acc * gamma - r * r * r * dr * inv_h * h + dres


@coda.epilogue
def fold_grads(acc, gamma: coda.VecN, w: coda.TileMN):
    """dW GEMM of the folded weight W' = W diag(gamma) (acc = dW' = dacc^T h, 2I x H): dW = acc gamma per column,
    dgamma_k = sum_n acc_nk W_nk (per-column partials; no 2I x H torch pass)."""
    return {"out": acc * gamma, "dgamma": coda.reduce_m(acc * w)}


def rmsnorm_fold_grads(gemm, dacc: Tensor, dr: Optional[Tensor], h: Tensor, norm_weight: Tensor, weight: Tensor,
                       r: Tensor, need: tuple, dres: Optional[Tensor], entry: str):
    """The input RMSNorm's and the folded linear's gradients from the gradients of the GEMM accumulator acc = h (W
    diag(gamma))^T, dacc (M x N, the row scale r applied), and of r, dr (M,): dh = (dacc W) gamma - r^3 dr h / H
    (+ dres: the residual stream's gradient) by ``rms_radial[_residual]`` on the unfolded weight; dW = (dacc^T h)
    gamma and dgamma_k = sum_n (dacc^T h)_nk W_nk from the dW GEMM's epilogue (``fold_grads``, or ``adamw_fold``
    updating W in place under ``coda.optim``). No normalised activation is written. ``need`` = (dh, dgamma, dW);
    returns those three, None where not needed (dW also None when updated in place). dX runs first: it reads the
    weight that the dW GEMM may update."""
    need_x, need_gamma, need_w = need
    dh = dgamma = dw = None
    if need_x:  # on the unfolded weight: gamma is a column scale of the epilogue
        ops = dict(gamma=norm_weight, r=r, dr=dr, inv_h=1.0 / h.shape[1], h=h)
        if dres is not None:
            ops["dres"] = dres.to(h.dtype).contiguous()
        dh = gemm(dacc, weight.t(), epilogue=rms_radial_residual if dres is not None else rms_radial,
                  out_dtype=h.dtype, **ops)
    if need_gamma or need_w:  # dW' = dacc^T h; its epilogue forms dW = dW' gamma and dgamma
        upd = (update_in_backward(weight, dacc.t(), h.t(), entry, adamw_fold, gamma=norm_weight) if need_w
               else None)
        if upd is not None:  # coda.optim: the weight updated in place by the same epilogue (no dW)
            dgamma = upd["dgamma"]
        elif dacc.dtype in IN_DTYPES and kernel_aligned(dacc.t(), h.t()):
            res = gemm(dacc.t(), h.t(), epilogue=fold_grads, out_dtype=weight.dtype, gamma=norm_weight, w=weight)
            dw, dgamma = res["out"], res["dgamma"]
        else:  # M not a multiple of 8 (the transposed views are not 16-byte aligned) or fp32 / fp64 (CPU): as
            dw_fold = torch.matmul(dacc.t(), h)  # backward_gemm's rule
            dw = torch.mul(dw_fold, norm_weight, out=torch.empty_like(weight))
            dgamma = (dw_fold.float() * weight).sum(0)
        dw = dw if need_w else None
        dgamma = dgamma.to(norm_weight.dtype) if need_gamma else None
    return dh, dgamma, dw


@functools.lru_cache(maxsize=None)
def dacc_on_da(which: tuple):
    """rms_swiglu's backward ``which`` on the saved pre-activation, fused into the GEMM da = dy W_down: the 1 -> 2
    epilogue (``coda.autodiff.on_acc``) whose accumulator is da; per element j it reads g_j, u_j and writes the
    pair (dg_j, du_j) of dacc at columns 2j, 2j + 1, plus d_r's row partials."""
    return on_acc(backward_of(rms_swiglu, *which, preact=True), grad_name("out"))


# ------------------------------------------------------------------------------------------------ checks
def _check(entry: str, named, eps) -> None:
    """Every argument rule, before anything is computed; each message names the argument. ``named``: (name, value)
    of x, norm_weight, the interleaved gate/up weight and (mlp) w_down."""
    (_, x), (_, norm_weight), (gu_name, w_gate_up), *down = named
    check_tensors(entry, named)
    check_eps(entry, eps)
    try:  # the rules of x and the interleaved gate/up weight are coda.ops.linear_swiglu's
        check_x_weight_gu(entry, x, w_gate_up)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("weight_gu", gu_name)) from None
    H, inter = x.shape[-1], w_gate_up.shape[0] // 2
    check_norm_weight(entry, norm_weight, H)
    for name, t in named[1:]:
        if t.device != x.device:
            raise ValueError(f"{entry}: {name} is on {t.device} but x is on {x.device}")
    for _, w_down in down:
        if tuple(w_down.shape) != (H, inter):
            raise ValueError(f"{entry}: w_down must be (H, I) = ({H}, {inter}) (x's last dim, half of "
                             f"{gu_name}'s rows), got {tuple(w_down.shape)}")
        if w_down.dtype != x.dtype:
            raise TypeError(f"{entry}: w_down must have x's dtype {x.dtype}, got {w_down.dtype}")
        check_last_dim_contiguous(entry, (("w_down", w_down),))


# ------------------------------------------------------------------------------------------------ custom ops (2-D)
def _gate_up(x, norm_weight, w_gate_up, eps, save_preact, gemm, hg=None, ss=None):
    """(a, g, u, r): the gate/up GEMM; g, u (the pre-activation, M x I each) empty unless ``save_preact``. ``hg``,
    ``ss``: x * gamma and x's rows' sums of squares as x's producer wrote them (``normed_operands``' ``normed``)."""
    a, b, r = normed_operands(x, norm_weight, w_gate_up, eps, gemm, normed=None if hg is None else (hg, ss))
    return (*forward_preact(gemm, a, b, rms_swiglu, save_preact, r=r), r)


def _fake_rmsnorm_swiglu(x, norm_weight, w_gate_up, eps, save_preact):
    return (x.new_empty(x.shape[0], w_gate_up.shape[0] // 2), x.new_empty(x.shape[0], dtype=torch.float32),
            *fake_preact(x, w_gate_up, save_preact))


def _fake_mlp(x, norm_weight, w_gate_up, w_down, eps, save_preact, residual, sumsq, hg=None, ss=None, slots=None,
              token=None):
    M = x.shape[0]
    return (x.new_empty(M, x.shape[1]), x.new_empty(M, w_gate_up.shape[0] // 2),
            x.new_empty(M, dtype=torch.float32), *fake_preact(x, w_gate_up, save_preact),
            x.new_empty(M if residual and sumsq else 0, dtype=torch.float32))


def _fake_backward(dy, x, norm_weight, w_gate_up, w_down, a, r, g, u, need_x, need_gamma, need_gu, need_down,
                   residual):
    like = (x, norm_weight, w_gate_up, x if w_down is None else w_down)
    return tuple(t.new_empty(t.shape if need else (0,))
                 for t, need in zip(like, (need_x, need_gamma, need_gu, need_down and w_down is not None)))


# saved for mlp_backward: x, norm_weight, w_gate_up, w_down, a, r, g, u (rmsnorm_swiglu: no w_down, no a)
@forward_op("rmsnorm_swiglu", fake=_fake_rmsnorm_swiglu, backward="mlp_backward", grads=3,
            saved=lambda i, out: (*i[:3], None, None, *out[1:]), arrange=lambda extra, needs: (*needs, False, False))
def _rmsnorm_swiglu_op(x: Tensor, norm_weight: Tensor, w_gate_up: Tensor, eps: float,
                       save_preact: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x (M, H), w_gate_up (2I, H) interleaved; returns a (M, I), r (M,) fp32 and (save_preact) g, u (M, I)."""
    a, g, u, r = _gate_up(x, norm_weight, w_gate_up, eps, save_preact, gemm_for(x.device, "coda.ops.rmsnorm_swiglu"))
    return a, r, g, u


@forward_op("mlp", fake=_fake_mlp, backward="mlp_backward", grads=4, saved=lambda i, out: (*i[:4], *out[1:5]),
            extra=lambda i: (bool(i[6]),), arrange=lambda extra, needs: (*needs, *extra),  # (needs, residual)
            slots=10)
def _mlp_op(x: Tensor, norm_weight: Tensor, w_gate_up: Tensor, w_down: Tensor, eps: float, save_preact: bool,
            residual: bool, sumsq: bool, hg: Optional[Tensor] = None, ss: Optional[Tensor] = None,
            slots: Optional[list[int]] = None,
            token: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x (M, H); returns y (M, H), the activation a (M, I), r (M,) fp32, (save_preact) g, u (M, I) and (residual and
    sumsq) the rows' sums of squares of y (M,) fp32, from the down projection's epilogue; else empty. ``hg``, ``ss``:
    x * gamma (M, H) and x's rows' sums of squares (M,) fp32 from x's producer, or None. ``slots``, ``token``:
    ``coda.optim.compile_slots`` of (w_gate_up, w_down) under torch.compile (the backward updates them in place),
    else None."""
    gemm = gemm_for(x.device, _ENTRY)
    a, g, u, r = _gate_up(x, norm_weight, w_gate_up, eps, save_preact, gemm, hg, ss)
    if residual and sumsq:
        res = gemm(a, w_down, epilogue=residual_add_sumsq(x.dtype), res=x)
        return res["out"], a, r, g, u, res["ss"]
    y = gemm(a, w_down, epilogue=residual_add, res=x) if residual else gemm(a, w_down)
    return y, a, r, g, u, x.new_empty(0, dtype=torch.float32)


@backward_op("mlp_backward", fake=_fake_backward, updates=("w_gate_up", "w_down"), update_grads=(2, 3))
def _backward_op(dy: Tensor, x: Tensor, norm_weight: Tensor, w_gate_up: Tensor, w_down: Optional[Tensor],
                 a: Optional[Tensor], r: Tensor, g: Optional[Tensor], u: Optional[Tensor], need_x: bool,
                 need_gamma: bool, need_gu: bool, need_down: bool,
                 residual: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dnorm_weight, dw_gate_up, dw_down) of ``mlp`` (w_down, a given; dy (M, H) the gradient of y;
    ``residual``: y includes x) or of ``rmsnorm_swiglu`` (w_down = a = None; dy (M, I) the gradient of a); g, u: the
    saved pre-activation (None: recomputed); a gradient not needed is an empty tensor."""
    gemm = gemm_for(x.device, _ENTRY)
    down = w_down is not None
    dy = dy.contiguous()  # autograd may hand over expanded (stride-0) gradients
    grads = [x.new_empty(0), norm_weight.new_empty(0), w_gate_up.new_empty(0),
             (w_down if down else x).new_empty(0)]
    if x.numel() == 0 or w_gate_up.shape[0] == 0:  # nothing to launch: zeros, and dy through the residual
        full = (dy.clone() if residual else torch.zeros_like(x), torch.zeros_like(norm_weight),
                torch.zeros_like(w_gate_up), torch.zeros_like(w_down) if down else None)
        return tuple(f if need else g_ for f, g_, need in zip(full, grads, (need_x, need_gamma, need_gu, need_down)))
    need_gate_up = need_x or need_gamma or need_gu
    preact = saved_preact(rms_swiglu, g, u)
    which = (("out",), ("r",) if need_x else (), False)
    fused = (down and need_gate_up and preact is not None
             and (x.device.type == "cpu" or (x.dtype in IN_DTYPES and kernel_aligned(dy, w_down.t()))))
    if fused:  # dacc and d_r straight out of da's GEMM (da = dy W_down is never written): the 1 -> 2 epilogue
        res = gemm(dy, w_down.t(), epilogue=dacc_on_da(which), out_dtype=x.dtype, r=r, **preact)
        res = res if isinstance(res, dict) else {"out": res}
        dw_down = linear_grads(dy, a, w_down, False, need_down, _ENTRY)[1]
    else:
        da, dw_down = linear_grads(dy, a, w_down, need_gate_up, need_down, _ENTRY) if down else (dy, None)
    if dw_down is not None:
        grads[3] = dw_down
    if not need_gate_up:
        return tuple(grads)
    if not fused:
        # dacc (M x 2I, interleaved) and d_r: rms_swiglu's sympy backward as coda.ops.linear(..., r=r) runs it, on
        # the saved pre-activation (a K = 0 launch: one memory pass) or on a recomputed one (the forward's operands)
        a_op, b_op = (x, w_gate_up) if preact else normed_operands(x, norm_weight, w_gate_up, None, gemm)[:2]
        res = evaluate(rms_swiglu, which, a_op, b_op, dict(r=r, **{grad_name("out"): da}), preact, x.dtype)
    dx, dgamma, dw = rmsnorm_fold_grads(gemm, res["out"], res.get(DGRAD + "r"), x, norm_weight, w_gate_up, r,
                                        (need_x, need_gamma, need_gu), dy if residual else None, _ENTRY)
    for i, t in ((0, dx), (1, dgamma), (2, dw)):
        grads[i] = grads[i] if t is None else t
    return tuple(grads)


# ------------------------------------------------------------------------------------------------ public entries
def rmsnorm_swiglu(x: Tensor, norm_weight: Tensor, weight_gu: Tensor, eps: float = 1e-6, *,
                   save_preact: bool = True) -> Tensor:
    """``silu(n W_gate^T) * (n W_up^T)`` with ``n = RMSNorm(x) * norm_weight``, as ONE fused GEMM, autograd
    included (module docstring). ``x`` (..., H) bfloat16/float16; ``norm_weight`` (H,) float32/bfloat16/float16;
    ``weight_gu`` (2I, H) interleaved (``coda.ops.interleave_gate_up``), x's dtype. H, I multiples of 8. Returns
    (..., I). ``save_preact``: as in :func:`mlp`."""
    _check("rmsnorm_swiglu", (("x", x), ("norm_weight", norm_weight), ("weight_gu", weight_gu)), eps)
    lead, H = x.shape[:-1], x.shape[-1]
    save = save_preact_for("rmsnorm_swiglu", save_preact, x, norm_weight, weight_gu)
    a = call("rmsnorm_swiglu", x.reshape(math.prod(lead), H), norm_weight, weight_gu, float(eps), save)[0]
    return a.reshape(*lead, weight_gu.shape[0] // 2)


def mlp(x: Tensor, norm_weight: Tensor, w_gate_up: Tensor, w_down: Tensor, eps: float = 1e-6, *,
        save_preact: bool = True, residual: bool = True, return_sumsq: bool = False, normed=None):
    """``x + down(silu(gate(n)) * up(n))`` with ``n = RMSNorm(x) * norm_weight``: two fused GEMMs, autograd included.
    ``residual=False``: ``down(...)`` only (the drop-in for ``LlamaMLP`` in a layer that adds x itself).

    ``x`` (..., H) bfloat16 / float16; ``norm_weight`` (H,) float32 / bfloat16 / float16; ``w_gate_up`` (2I, H)
    with gate/up rows interleaved (``coda.ops.interleave_gate_up``); ``w_down`` (H, I); weights in x's dtype; H and
    I multiples of 8. Returns (..., H). Gradients flow to all four tensors (module docstring).

    ``save_preact=True`` (default) saves the gate/up pre-activation (M x 2I in x's dtype, like the GEMM output
    torch autograd saves) and the backward reads it -- only when autograd records the call (grad mode on and an
    input requiring grad: inference writes no pre-activation); ``False`` saves M x 2I fewer elements and
    recomputes it with one more GEMM (M x 2I x H) in the backward.

    ``return_sumsq=True`` (with ``residual``): returns (y, ss), ss (...,) float32 the sum of squares of each row of
    y as stored (rounded), from the down projection's epilogue -- what the next RMSNorm needs (e.g.
    :func:`rmsnorm_linear_rope_qkv`'s ``sumsq``) without reading y again. No gradient flows through ss.

    ``normed=(xg, ss)``: x * norm_weight as stored (x's shape and dtype) and x's rows' sums of squares (float32), as
    x's producer emitted them (``coda.ops.linear_residual(..., norm_weight=)``): the gate/up GEMM reads xg and takes
    r from ss (no pass over x). Used where M <= 2I (else gamma is folded into the weight and they are ignored); no
    gradient flows through them (the backward differentiates through x and norm_weight as without)."""
    _check("mlp", (("x", x), ("norm_weight", norm_weight), ("w_gate_up", w_gate_up), ("w_down", w_down)), eps)
    for name, flag in (("residual", residual), ("return_sumsq", return_sumsq)):
        if not isinstance(flag, bool):
            raise TypeError(f"coda.ops.mlp: {name} must be True or False, got {type(flag).__name__}")
    if return_sumsq and not residual:
        raise ValueError("coda.ops.mlp: return_sumsq=True needs residual=True (the sums are of x + down(...))")
    lead, H = x.shape[:-1], x.shape[-1]
    M = math.prod(lead)
    hg = ss = None
    if normed is not None:
        if not (isinstance(normed, (tuple, list)) and len(normed) == 2):
            raise TypeError("coda.ops.mlp: normed must be a pair (x * norm_weight, sumsq) or None")
        hg, ss = normed
        if not isinstance(hg, Tensor) or hg.shape != x.shape or hg.dtype != x.dtype or hg.device != x.device:
            raise ValueError(f"coda.ops.mlp: normed[0] must be x * norm_weight: {tuple(x.shape)} {x.dtype} on "
                             f"{x.device}, got {getattr(hg, 'shape', type(hg).__name__)}")
        ss = check_sumsq("coda.ops.mlp (normed[1])", ss, x)
        hg = hg.detach().reshape(M, H).contiguous()
    save = save_preact_for("mlp", save_preact, x, norm_weight, w_gate_up, w_down)
    # under torch.compile the weights coda.optim holds are updated by the backward op's in-place twin
    out = call("mlp", x.reshape(M, H), norm_weight, w_gate_up, w_down, float(eps), save, residual, return_sumsq,
               hg, ss, *update_args(w_gate_up, w_down, when=save))
    y = out[0].reshape(*lead, H)
    return (y, out[5].reshape(lead)) if return_sumsq else y

