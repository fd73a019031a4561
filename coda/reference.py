"""Torch reference for :func:`coda.gemm`: same arguments, same checks, any device (CPU included).

The product is computed in fp32 from upcast operands (no TF32), the epilogue's own reference is applied to the
fp32 accumulator, and the result is cast once to the output dtype -- the numerics the kernel aims at.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from coda._validate import GemmProblem, check_gemm_args
from coda.kernels.epilogue import check_call, check_epilogue, out_flags

__all__ = ["gemm", "gemm_wide"]


@contextlib.contextmanager
def _ieee_fp32(device: torch.device):
    """Disable TF32 for fp32 matmuls on CUDA while the reference runs."""
    if device.type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        saved = matmul.fp32_precision
        matmul.fp32_precision = "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = saved
    else:
        saved = matmul.allow_tf32
        matmul.allow_tf32 = False
        try:
            yield
        finally:
            matmul.allow_tf32 = saved


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    epilogue=None,
    out: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    **operands,
) -> torch.Tensor:
    """``epilogue(a @ b.T)`` in fp32, cast to ``out_dtype``; ``F.linear`` semantics, optionally batched.

    ``a``: (M, K) or (L, M, K); ``b``: (N, K) or (L, N, K). ``epilogue``: None (identity) or an object whose
    ``reference(acc_fp32, **operands)`` returns the fp32 result tensor (or a dict; an epilogue with
    ``stores_out = False`` returns only its extra outputs and reductions, and takes no ``out``). Raises the same errors as
    :func:`coda.gemm`. With ``out``, the result is written into it (only after every check passed and the
    result was computed) and ``out`` is returned.
    """
    problem = check_gemm_args(a, b, out=out, out_dtype=out_dtype, **out_flags(epilogue))
    if epilogue is None and operands:
        raise TypeError(f"operands {sorted(operands)} were given without an epilogue")
    if epilogue is not None:
        check_call(check_epilogue(epilogue), problem, out, operands)
    return _compute(a, b, epilogue, out, problem.out_dtype, torch.float32, operands)


WIDE_DTYPES = (torch.float32, torch.float64)


def gemm_wide(a: torch.Tensor, b: torch.Tensor, *, epilogue=None, out: Optional[torch.Tensor] = None,
              out_dtype: Optional[torch.dtype] = None, **operands):
    """:func:`gemm` that also takes float32 / float64 ``a`` and ``b`` (both the same dtype) -- what ``coda.ops`` run
    on CPU tensors (the reference path), so that ``torch.autograd.gradcheck`` works on an op with a custom epilogue.

    16-bit inputs go to :func:`gemm` (every check of ``coda.gemm``). Wide inputs are checked for what the math needs
    (ranks, shapes, devices, the epilogue's operands; no alignment or layout rules: torch reads any layout) and
    computed in their own precision (float64 stays float64); ``out_dtype`` is any floating dtype (default
    ``a.dtype``), epilogue operands may be float64 too."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and (a.dtype in WIDE_DTYPES or b.dtype in WIDE_DTYPES)):
        return gemm(a, b, epilogue=epilogue, out=out, out_dtype=out_dtype, **operands)
    if out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor or None; got {type(out).__name__}")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype; got a {a.dtype} and b {b.dtype}".replace("torch.", ""))
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else a.dtype
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise TypeError(f"out_dtype: expected a floating dtype; got {out_dtype!r}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on the same device; got a on {a.device} and b on {b.device}")
    problem = _wide_problem(a, b, out_dtype, **out_flags(epilogue))
    if out is not None:
        if out.dtype != out_dtype or tuple(out.shape) != problem.out_shape or out.device != a.device:
            raise ValueError(f"out: expected shape {problem.out_shape}, dtype {out_dtype} on {a.device}; got "
                             f"{tuple(out.shape)}, {out.dtype} on {out.device}")
    if epilogue is None and operands:
        raise TypeError(f"operands {sorted(operands)} were given without an epilogue")
    if epilogue is not None:  # float64 operands are checked as float32 (the kernel's widest), used as they are
        checked = {k: v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.float64 else v
                   for k, v in operands.items()}
        check_call(check_epilogue(epilogue), problem, out, checked)
    return _compute(a, b, epilogue, out, out_dtype, torch.promote_types(a.dtype, torch.float32), operands)


def _wide_problem(a, b, out_dtype, half_out: bool = False, wide_out: bool = False) -> GemmProblem:
    """The ranks and shapes of :func:`check_gemm_args` (no dtype, alignment or layout rules)."""
    if a.dim() not in (2, 3) or b.dim() not in (2, 3) or (b.dim() == 3 and a.dim() == 2):
        raise ValueError(f"a: (M, K) or (L, M, K) and b: (N, K) or (L, N, K) (3-D only with a 3-D a); got a "
                         f"{tuple(a.shape)} and b {tuple(b.shape)}")
    batched, b_broadcast = a.dim() == 3, a.dim() == 3 and b.dim() == 2
    L, (M, K), (N, Kb) = (a.shape[0] if batched else None), a.shape[-2:], b.shape[-2:]
    if batched and not b_broadcast and b.shape[0] != L:
        raise ValueError(f"b: batch size L must match a's; got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if K != Kb:
        raise ValueError(f"a and b must have the same K (last dim); got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if half_out and N % 2:
        raise ValueError(f"b: N={N} (b.shape[-2]) must be even for an epilogue over column pairs (coda.pairs)")
    empty = M == 0 or N == 0 or (batched and L == 0)
    return GemmProblem(L=L, M=M, N=N, K=K, in_dtype=a.dtype, out_dtype=out_dtype, batched=batched, device=a.device,
                       b_broadcast=b_broadcast, half_out=half_out, wide_out=wide_out, empty_result=empty,
                       zero_k=K == 0 and not empty)


def _compute(a, b, epilogue, out, out_dtype, acc_dtype, operands):
    """The checked call's result: ``epilogue(a @ b.T)`` in ``acc_dtype``, cast to ``out_dtype``. Autocast is off
    here: the reference computes the same with and without ``torch.autocast``."""
    with _ieee_fp32(a.device), no_autocast(a.device):
        return _compute_plain(a, b, epilogue, out, out_dtype, acc_dtype, operands)


def no_autocast(device: torch.device):
    """Autocast off for ``device`` (a no-op context where autocast does not exist, e.g. meta tensors)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _compute_plain(a, b, epilogue, out, out_dtype, acc_dtype, operands):
    acc = torch.matmul(a.to(acc_dtype), b.to(acc_dtype).transpose(-1, -2))  # zero-size M/N/K handled by torch
    extras = {}
    if epilogue is not None:
        res = epilogue.reference(acc, **operands)
        if isinstance(res, dict):  # CODA epilogues: {"out": ..., extra outputs..., finished reductions...}
            res = dict(res)
            if epilogue.stores_out and "out" not in res:
                raise TypeError("epilogue.reference returned a dict without an 'out' entry")
            acc = res.pop("out", None)
            # each output its own memory, as the kernel's (an fp32 result may otherwise be a view of acc)
            extras = {k: (v.to(out_dtype, memory_format=torch.contiguous_format, copy=True)
                          if k in epilogue.outputs else v) for k, v in res.items()}
            for k in getattr(epilogue, "inplace", ()):  # written back into the operand, as the kernel does
                extras[k] = operands[k].copy_(res[k])
            if not epilogue.stores_out:  # no main output: only the extra outputs and reductions
                return extras
        else:
            acc = res
        if not isinstance(acc, torch.Tensor):
            raise TypeError(f"epilogue.reference must return a tensor; got {type(acc).__name__}")
    result = acc.to(out_dtype, copy=bool(extras))
    if out is not None:
        out.copy_(result)
        result = out
    return {"out": result, **extras} if extras else result
