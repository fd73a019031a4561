"""The epilogue's view of one sub-tile of ``GemmSm90`` (``kernels/gemm_sm90.py``, phase 3b), traced lazily: the
coordinates and operand values of its accumulator registers (:class:`SubTile`, what ``OperandKind.load`` receives
as ``lazy``), and which registers form a column pair (:func:`column_pair`)."""
from __future__ import annotations

from .epilogue import EpiEnv


def column_pair(c_static, v):
    """The first register w of v's column pair when registers (w, w + 1), w = v & ~1, hold columns (c, c + 1) of
    one row with c even (thread 0's static coordinates; the accumulator fragment's 2-element runs, the same for
    every thread since a thread's first column is even): then a TileMN operand's two values are one 32-bit read and
    a 1 -> 2 epilogue's four outputs one 64-bit write. Else None."""
    w = v - v % 2
    if w + 1 >= len(c_static):
        return None
    (r0, c0), (r1, c1) = c_static[w], c_static[w + 1]
    return w if r0 == r1 and c1 == c0 + 1 and c0 % 2 == 0 else None


class SubTile:
    """Coordinates and operand values of one epilogue sub-tile, traced only when an epilogue uses them and
    once per distinct value: register v's coordinates are register 0's (one coordinate computation per
    sub-tile) plus v's static offset, read from thread 0's static coordinates. That holds for every thread
    because the coordinate partition of an identity tensor is affine in (thread, register) -- checked on a
    few threads at trace time. VecN values are shared by the registers of one column, VecM by one row
    (most of the epilogue's IR was per-element coordinate and clamp arithmetic before)."""

    def __init__(self, kernel, cSub, c_static, op_tensors, M, N, local):
        self.cSub, self.c_static, self.M, self.N = cSub, c_static, M, N
        self.ops = list(zip(kernel.epi.operands, op_tensors))
        # (register 0's sub-tile-local coordinates, the sub-tile's first column in the tile, staged
        # {name: (smem, slot)}, run-time scalars {name: value}, TMA-loaded TileMN {name: the sub-tile's ring buffer})
        self.lbase, self.col0, self.staged, self.scalars, self.tiles = local
        self.memo = {}
        self.segments = None  # register v -> {SegmentSum node: value} (kernels/segment.py's pre-pass), if any

    def partner(self, v):
        return column_pair(self.c_static, v)

    def shared(self, key, make):
        """``make()``'s value, traced once per ``key`` in this sub-tile (values registers share)."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def coord(self, v, i):
        """Mode i (0 row, 1 column, 2 batch) of register v's global coordinate."""
        base = self.shared(("base",), lambda: self.cSub[0])
        d = 0 if i == 2 else self.c_static[v][i] - self.c_static[0][i]
        return base[i] if d == 0 else self.shared(("c", i, d), lambda: base[i] + d)

    def local(self, v, i, sub: bool = False):
        """Mode i (0 row, 1 column) of register v's coordinate inside the CTA tile (the sub-tile: sub)."""
        d = self.c_static[v][i] - self.c_static[0][i] + (self.col0 if i == 1 and not sub else 0)
        return self.lbase[i] if d == 0 else self.shared(("l", i, d), lambda: self.lbase[i] + d)

    def env(self, v, pair: bool = False):
        """The EpiEnv of register v (of the pair starting at v: column index j = col // 2)."""
        rs, cs = self.c_static[v]
        row = lambda: self.coord(v, 0)  # noqa: E731
        col = ((lambda: self.shared(("j", cs), lambda: self.coord(v, 1) // 2)) if pair
               else (lambda: self.coord(v, 1)))
        n_cols = self.N // 2 if pair else self.N
        loaders = {}
        for op, t in self.ops:
            # the kind's value at register v (staged in shared memory, a scalar, a TileMN ring or global),
            # shared by the registers of one memo key (a VecN column, a VecM row)
            loaders[op.name] = (lambda op=op, t=t: self.shared(
                ("op", op.name) + op.spec.memo_key(rs, cs),
                lambda: op.spec.load(self, op, t, v, pair, row, col, n_cols)))
        return EpiEnv(row, col, loaders, self.segments(v) if self.segments is not None else None)
