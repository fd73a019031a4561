"""Segmented row reductions in the epilogue DSL: ``coda.segment_sum(x, size)``.

Per element, the sum of ``x`` over its row's aligned group of ``size`` columns (in a pairs epilogue, of ``size``
pairs): columns ``[size * (c // size), size * (c // size) + size)``. Unlike ``coda.reduce_n`` (one value per row,
only returned), the result is a value of every element of the group and may be used in arithmetic -- a per-head RMS
norm of q and k inside the QKV projection's epilogue (Qwen3's QK-norm: a head's ``head_dim`` columns lie inside one
output tile) is ``x * rsqrt(segment_sum(x * x, head_dim) / head_dim + eps)``. The epilogue's columns must be whole
groups (``N % size == 0``: ValueError at the call).

Reverse mode needs one rule: every element of a group reads the same sum, so the adjoint of the argument is the
segment sum of the node's adjoint (``coda.autodiff._gradients``): the backward of a segment-sum epilogue is again a
segment-sum epilogue, derived by the same sympy machinery. A ``coda.where`` whose taken branch depends on the
differentiated value through a segment sum has no elementwise forward-mode derivative: its backward raises
ValueError.

Where it runs: the torch reference (``coda.reference.gemm``, ``coda.ops`` on CPU tensors, every backward program
evaluated by torch). The GEMM kernel has no lowering yet (a pre-pass over the register accumulator before the
epilogue's sub-tile loop: the design is in docs/NOTES.md, session 45, "Next"): ``coda.gemm`` refuses such an
epilogue with ValueError before any launch, and ``coda.check`` reports the kernel build as failed.
"""
from __future__ import annotations

import sympy as sp

from .dsl import DslEpilogue, Value, _err, _v


class SegmentSum(sp.Function):
    """``SegmentSum(x, size)``: the sum of ``x`` over the element's aligned group of ``size`` columns."""
    nargs = 2

    @classmethod
    def eval(cls, x, size):
        return None  # never rewritten: the traced math stays as written (coda.dsl._node)

    def _eval_is_extended_real(self):
        return True

    def fdiff(self, argindex=1):  # not elementwise: coda.autodiff handles the node itself
        raise ValueError("coda.segment_sum has no elementwise derivative (reverse mode: coda.autodiff._gradients)")


def segment_sum(x, size: int) -> Value:
    """Per element, the sum of ``x`` over the element's aligned group of ``size`` columns of its row (a pairs
    epilogue: ``size`` pairs); usable in arithmetic. See the module docstring."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise _err(f"coda.segment_sum: size must be a positive int (columns a group), got {size!r}")
    return Value(SegmentSum(_v(x), sp.Integer(size)))


def torch_segment_sum(torch, x, size: int, grid):
    """The torch value of ``SegmentSum(x, size)`` over an element grid of shape ``grid`` (..., M, N)."""
    n = grid[-1]
    if n % size:
        raise ValueError(f"coda.segment_sum: groups of {size} columns do not tile the epilogue's {n} columns "
                         f"(N % size must be 0)")
    x = torch.broadcast_to(x, grid)
    return x.unflatten(-1, (n // size, size)).sum(-1, keepdim=True).expand(*grid[:-1], n // size, size).flatten(-2)


def segment_sizes(exprs) -> tuple:
    """The group sizes of the segment sums in ``exprs`` (each distinct subexpression visited once)."""
    seen, sizes, stack = set(), set(), list(exprs)
    while stack:
        e = stack.pop()
        if e in seen:
            continue
        seen.add(e)
        if isinstance(e, SegmentSum):
            sizes.add(int(e.args[1]))
        if isinstance(e, sp.Basic):
            stack.extend(e.args)
    return tuple(sorted(sizes))


def epilogue_segment_sizes(epi) -> tuple:
    """:func:`segment_sizes` of a traced epilogue's outputs and reductions (cached on it); () for other epilogues."""
    if not isinstance(epi, DslEpilogue):
        return ()
    got = epi.__dict__.get("_segment_sizes")
    if got is None:
        got = epi.__dict__["_segment_sizes"] = segment_sizes(
            [*epi.exprs.values(), *(e for (_, _, e) in epi.red_specs.values())])
    return got


def check_kernel(epi) -> None:
    """ValueError where ``coda.gemm``'s kernel would have to run an epilogue with segment sums (not built yet)."""
    sizes = epilogue_segment_sizes(epi)
    if sizes:
        raise ValueError(f"epilogue {epi.name!r} uses coda.segment_sum (groups of {', '.join(map(str, sizes))}), "
                         "which the GEMM kernel does not run yet: evaluate it with coda.reference.gemm (CPU tensors "
                         "take that path in coda.ops)")


__all__ = ["SegmentSum", "segment_sum", "segment_sizes", "epilogue_segment_sizes", "check_kernel"]
