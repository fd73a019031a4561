"""The persistent kernel's tile schedule: which output tiles each cluster computes, in which order.

The grid is ``min(T, max active clusters)`` persistent clusters P; T = (cluster rows) x (cluster columns) x L
cluster tiles, no padding. Cluster c takes the linear tiles c, c + P, c + 2P, ... (a ping-pong warpgroup every
other one of them). Linear index -> cluster tile: with ``raster="m"`` the cluster columns form groups of
``swizzle`` (the last group may be narrower); inside a group the index walks along n, then down m, so the clusters
running at once share a few A row-blocks and B column-blocks in L2. ``raster="n"``: the same with m and n
exchanged. This is the order of CUTLASS's persistent scheduler, whose swizzled layout pads the cluster columns to
whole groups instead -- and the padding tiles were computed: at N = 1024 with 256-column tiles, 8 column tiles for
4 (2.5x cuBLAS's time for 8192 x 1024 x 1024 on the H100; 1.02x with this order).

:func:`tile_order` mirrors :func:`tile_coord` in Python for the CPU tests.

(A stream-K last wave -- equal k-ranges over all clusters, partials fixed up through a workspace -- was built and
measured in commit e616492 and removed: exact, but slower, because clusters at different k positions lose the L2
reuse of the lockstep waves: 8192 x 4096 x 14336 took 1.17x cuBLAS's time instead of 1.01x, L2 hit rate 57 % vs
76 %, DRAM reads 2.32 vs 1.05 GB.)
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def tile_coord(i, rows, cols, swizzle: cutlass.Constexpr, raster_m: cutlass.Constexpr):
    """Linear cluster-tile index -> (cluster row, cluster column, batch) for ``rows`` x ``cols`` cluster tiles."""
    per_l = rows * cols
    l = i // per_l
    i = i - l * per_l
    if cutlass.const_expr(raster_m):
        major, minor = cols, rows  # groups of `swizzle` columns, walked column-fastest then down the rows
    else:
        major, minor = rows, cols
    g = i // (swizzle * minor)
    width = major - g * swizzle
    if width > swizzle:
        width = swizzle
    local = i - g * (swizzle * minor)
    slow = local // width
    fast = g * swizzle + local - slow * width
    m, n = (slow, fast) if cutlass.const_expr(raster_m) else (fast, slow)
    return m, n, l


def tile_order(rows: int, cols: int, L: int, swizzle: int, raster_m: bool) -> list[tuple]:
    """Python mirror of :func:`tile_coord` for every linear index."""
    out = []
    for i in range(rows * cols * L):
        l, i = divmod(i, rows * cols)
        major, minor = (cols, rows) if raster_m else (rows, cols)
        g, local = divmod(i, swizzle * minor)
        width = min(swizzle, major - g * swizzle)
        slow, fast = divmod(local, width)
        fast += g * swizzle
        out.append((slow, fast, l) if raster_m else (fast, slow, l))
    return out
