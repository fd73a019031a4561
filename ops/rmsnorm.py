"""``coda.ops.rmsnorm``: a standalone RMSNorm (Llama's) from CODA's K = 0 passes, forward and backward.

For a norm whose consumer is not one of CODA's GEMMs -- the final norm before the LM head's cross entropy, whose fast
mode needs the normalised activation n itself (its dW GEMM reads it) -- instead of torch's chain of fp32 ops
(the upcast, square, mean, rsqrt, two products, the downcast, and as many again in autograd's backward: ~0.85 ms in a
llama-1b step on the H100, session 29)::

    r = rsqrt(mean(x^2, -1) + eps)           (fp32, one value per row)
    n = x r gamma                            (one product in fp32, rounded once to x's dtype; Llama rounds x r first)

Forward: r from one torch reduction over x (``vector_norm``), then one K = 0 launch of the epilogue
:func:`rms_apply` (reads x, writes n). Backward (dn the incoming gradient)::

    s = sum_k dn_k gamma_k x_k               (per row: one K = 0 launch of :func:`rms_row_dot`)
    dx = r (dn gamma - x r c),  c = r s / K  (one K = 0 launch of :func:`rmsnorm_backward`, which also emits
    dgamma = sum_m dn x r                     dgamma's per-column partials)

Saved: x, gamma and r (M floats); not n. torch integration as the other ops: custom ops ``coda::rmsnorm`` and
``coda::rmsnorm_backward`` with fake implementations. On CPU tensors the same epilogue programs run through
``coda.reference.gemm``; other GPUs raise (``ops/_common.py``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

import coda

from coda.epilogues.rmsnorm import _dgrad

from ._builder import backward_op, forward_op
from ._common import IN_DTYPES, call, check_last_dim_contiguous, check_tensors, epilogue_pass, gemm_for
from .rmsnorm_linear import check_eps, check_norm_weight, check_sumsq, row_rsqrt, row_sumsq

__all__ = ["rmsnorm", "rms_apply", "rms_row_dot", "rmsnorm_backward"]

_ENTRY = "coda.ops.rmsnorm"


@coda.epilogue
def rms_apply(acc, h: coda.TileMN, r: coda.VecM, gamma: coda.VecN):
    """n = h r gamma (a K = 0 pass: the accumulator is not used)."""
    return h * r * gamma


@coda.epilogue
def rms_row_dot(acc, dn: coda.TileMN, h: coda.TileMN, gamma: coda.VecN):
    """s = sum_k dn h gamma per row (fp32; a K = 0 pass)."""
    return {"s": coda.reduce_n(dn * h * gamma)}


@coda.epilogue
def rmsnorm_backward(acc, dn: coda.TileMN, h: coda.TileMN, r: coda.VecM, c: coda.VecM, gamma: coda.VecN):
    """dh = r (dn gamma - h r c) and dgamma = sum_m dn h r (per-column partials; a K = 0 pass): the RMSNorm
    backward of ``epilogues/rmsnorm.py`` on dn, without its normed output."""
    res = _dgrad(dn, gamma, h, r, c)
    del res["normed"]
    return res


def rmsnorm(x: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-6, *, sumsq=None) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * norm_weight`` (statistics in fp32, the product rounded once), autograd
    included. ``x``: (..., K), bfloat16 or float16, K a multiple of 8; ``norm_weight``: (K,), float32, bfloat16 or
    float16. Returns (..., K) in x's dtype; gradients flow to x and norm_weight. ``sumsq`` (x.shape[:-1], float32):
    x's rows' sums of squares as the GEMM that wrote x emitted them (``coda.ops.mlp(return_sumsq=True)``): r from
    them instead of a reduction over x (no gradient flows through them)."""
    _check(x, norm_weight, eps)
    sumsq = check_sumsq("rmsnorm", sumsq, x)
    lead, K = x.shape[:-1], x.shape[-1]
    n, _ = call("rmsnorm", x.reshape(math.prod(lead), K), norm_weight, float(eps), sumsq)
    return n.reshape(*lead, K)


def _check(x, norm_weight, eps) -> None:
    """Every argument rule, before anything is computed; each message names the argument."""
    check_tensors("rmsnorm", [("x", x), ("norm_weight", norm_weight)])
    check_eps("rmsnorm", eps)
    if x.dim() < 1:
        raise ValueError("rmsnorm: x must be (..., K), got a 0-d tensor")
    K = x.shape[-1]
    check_norm_weight("rmsnorm", norm_weight, K)
    if x.dtype not in IN_DTYPES:
        raise TypeError(f"rmsnorm: x must be bfloat16 or float16, got {x.dtype}")
    if norm_weight.device != x.device:
        raise ValueError(f"rmsnorm: norm_weight is on {norm_weight.device} but x is on {x.device}; both must be on "
                         "one device")
    if K % 8:
        raise ValueError(f"rmsnorm: x: K = x.shape[-1] = {K} must be a multiple of 8 (the kernel reads and writes "
                         "16-byte rows)")
    check_last_dim_contiguous("rmsnorm", [("x", x)])


def _fake_backward(dn, x, norm_weight, r, need_x, need_gamma):
    return (x.new_empty(x.shape) if need_x else x.new_empty(0),
            norm_weight.new_empty(norm_weight.shape) if need_gamma else norm_weight.new_empty(0))


@backward_op("rmsnorm_backward", fake=_fake_backward)
def _backward(dn: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, r: torch.Tensor, need_x: bool,
              need_gamma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dgamma) (an empty tensor where not needed)."""
    M, K = x.shape
    if M == 0 or K == 0:
        return (torch.zeros_like(x) if need_x else x.new_empty(0),
                torch.zeros_like(norm_weight) if need_gamma else norm_weight.new_empty(0))
    gemm = gemm_for(x.device, _ENTRY)
    dn = dn.contiguous()  # autograd may hand over expanded (stride-0) gradients
    c = r * epilogue_pass(gemm, x, M, K, epilogue=rms_row_dot, dn=dn, h=x, gamma=norm_weight)["s"] / K
    res = epilogue_pass(gemm, x, M, K, epilogue=rmsnorm_backward, out_dtype=x.dtype, dn=dn, h=x, r=r, c=c,
                        gamma=norm_weight)
    return (res["out"] if need_x else x.new_empty(0),
            res["dgamma"].to(norm_weight.dtype) if need_gamma else norm_weight.new_empty(0))


def _fake(x, norm_weight, eps, sumsq=None):
    return x.new_empty(x.shape), x.new_empty(x.shape[0], dtype=torch.float32)


@forward_op("rmsnorm", fake=_fake, backward="rmsnorm_backward", grads=2,
            saved=lambda inputs, out: (inputs[0], inputs[1], out[1]))
def _rmsnorm_op(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                sumsq: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (n (M, K), r (M,) fp32); ``sumsq`` (M,) fp32: x's rows' sums of squares, or None."""
    M, K = x.shape
    r = row_rsqrt(row_sumsq(x, sumsq), K, eps)
    if M == 0 or K == 0:
        return x.new_empty(x.shape), r
    gemm = gemm_for(x.device, _ENTRY)  # a non-Hopper GPU raises here, before anything runs
    n = epilogue_pass(gemm, x, M, K, epilogue=rms_apply, out_dtype=x.dtype, h=x, r=r, gamma=norm_weight)
    return n, r
