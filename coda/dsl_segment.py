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
evaluated by torch) and the GEMM kernel's consumer epilogue: a pre-pass over the register accumulator before the
sub-tile loop (``coda/kernels/segment.py``; groups of whole 8-column chunks inside a tile, arguments without TileMN
operands, no segment sum inside another's argument, not in the epilogue warps: :func:`kernel_problems`, a
ValueError before any launch otherwise). GPU-verified on the H100 in session 47 (tests/test_dsl_segment_gpu.py).
"""
from __future__ import annotations

import weakref

import sympy as sp

from .dsl import DslEpilogue, Value, _err, _v, operand_symbol


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


def epilogue_segment_sizes(epi) -> tuple:
    """The group sizes of a traced epilogue's segment sums (sorted; () for other epilogues)."""
    if not isinstance(epi, DslEpilogue):
        return ()
    return tuple(sorted({int(node.args[1]) for node in segment_nodes(epi)}))


_NODES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # epilogue -> its segment_nodes (derived state)


def segment_nodes(epi) -> list:
    """The distinct ``SegmentSum`` nodes of a traced epilogue's evaluated expressions (what ``visit`` reads as
    leaves when the kernel formed them), arguments before their users; cached beside the epilogue, not in its
    attributes (the compile cache's key hashes those: ``coda.runtime.keys.code_fingerprint``)."""
    got = _NODES.get(epi)
    if got is None:
        got, seen = [], set()

        def walk(e):
            if e in seen or not isinstance(e, sp.Basic):
                return
            seen.add(e)
            for a in e.args:
                walk(a)
            if isinstance(e, SegmentSum):
                got.append(e)
        for e in epi._cse_out.values():
            walk(e)
        _NODES[epi] = got
    return got


def kernel_problems(epi, tile_n: int) -> list:
    """Why the consumer epilogue's pre-pass cannot form ``epi``'s segment sums at tiles of ``tile_n`` columns ([]:
    it can): a group must be whole 8-column chunks of the accumulator fragment (a thread's columns 8 i + 2 (lane %
    4) + {0, 1}: its group is then static, and the 4 lanes of a quad finish it) inside one tile; the argument
    reads the accumulator, coordinates and VecM / VecN / Scalar operands (TileMN sub-tiles arrive later, through
    their ring); no segment sum inside another's argument."""
    out, width = [], 2 if epi.pair_mode else 1
    tiles = {str(operand_symbol(o.name)): o.name for o in epi.operands if o.kind == "tile"}
    nodes = segment_nodes(epi)
    for node in nodes:
        cols = int(node.args[1]) * width
        if cols % 8 or tile_n % cols:
            out.append(f"a group of {cols} accumulator columns must be a multiple of 8 dividing tile_n={tile_n}")
        read = sorted(tiles[str(x)] for x in node.args[0].free_symbols if str(x) in tiles)
        if read:
            out.append(f"the argument of a segment sum reads TileMN operand(s) {read}")
        if any(other is not node and node.args[0].has(other) for other in nodes):
            out.append("a segment sum inside another's argument")
    return out


def segment_args(epi, acc, env) -> list:
    """The kernel values of the segment sums' arguments at one element (the order of :func:`segment_nodes`)."""
    from ._eval import CuteOps, evaluate
    leaves, ops, memo = epi.kernel_leaves(acc, env), CuteOps(fastmath=epi.fastmath), {}
    return [evaluate(node.args[0], leaves, ops, memo) for node in segment_nodes(epi)]


__all__ = ["SegmentSum", "segment_sum", "epilogue_segment_sizes", "segment_nodes", "segment_args",
           "kernel_problems"]
