"""Torch reference for :func:`coda.gemm`: same arguments, same checks, any device (CPU included).

The product is computed in fp32 from upcast operands (no TF32), the epilogue's own reference is applied to the
fp32 accumulator, and the result is cast once to the output dtype -- the numerics the kernel aims at.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from coda._validate import check_gemm_args
from coda.kernels.epilogue import check_call, check_epilogue, half_out

__all__ = ["gemm"]


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
    problem = check_gemm_args(a, b, out=out, out_dtype=out_dtype, half_out=half_out(epilogue))
    if epilogue is None and operands:
        raise TypeError(f"operands {sorted(operands)} were given without an epilogue")
    if epilogue is not None:
        check_call(check_epilogue(epilogue), problem, out, operands)
    with _ieee_fp32(problem.device):
        acc = torch.matmul(a.float(), b.float().transpose(-1, -2))  # zero-size M/N/K handled by torch
    extras = {}
    if epilogue is not None:
        res = epilogue.reference(acc, **operands)
        if isinstance(res, dict):  # CODA epilogues: {"out": ..., extra outputs..., finished reductions...}
            res = dict(res)
            if epilogue.stores_out and "out" not in res:
                raise TypeError("epilogue.reference returned a dict without an 'out' entry")
            acc = res.pop("out", None)
            # each output its own memory, as the kernel's (an fp32 result may otherwise be a view of acc)
            extras = {k: (v.to(problem.out_dtype, memory_format=torch.contiguous_format, copy=True)
                          if k in epilogue.outputs else v) for k, v in res.items()}
            if not epilogue.stores_out:  # no main output: only the extra outputs and reductions
                return extras
        else:
            acc = res
        if not isinstance(acc, torch.Tensor):
            raise TypeError(f"epilogue.reference must return a tensor; got {type(acc).__name__}")
    result = acc.to(problem.out_dtype, copy=bool(extras))
    if out is not None:
        out.copy_(result)
        result = out
    return {"out": result, **extras} if extras else result
