"""The persistent kernel's work schedule: which output tiles (and, with stream-K, which k-ranges of them) each
cluster computes, in which order; and the stream-K fixup.

Tile order. The grid is ``min(T, max active clusters)`` persistent clusters; T = (cluster rows) x (cluster columns)
x L cluster tiles, no padding. Linear tile index i -> cluster tile: with ``raster="m"`` the cluster columns form
groups of ``swizzle`` (the last group may be narrower); inside a group the index walks along n, then down m, so
the clusters running at once share a few A row-blocks and B column-blocks in L2. ``raster="n"``: the same with m
and n exchanged. (CUTLASS's scheduler pads the grid to whole swizzle groups instead: at N = 1024 with 256-column
tiles, 4 real columns became 8, half the tiles computed and thrown away.)

Stream-K (``GemmConfig.streamk``) for the last wave. With T = W * P + R on P clusters, a data-parallel schedule runs
W full waves and one partial wave of R tiles: for 8192^3 with 256 x 256 cluster tiles, 15.5 waves, 3 % of the time
with a third of the SMs idle. "Data-parallel + one stream-K wave" (CUTLASS's hybrid):

- the first (W - 1) * P tiles are data-parallel: cluster c takes tiles c, c + P, ... (all k-tiles);
- the last P + R tiles are one range of S = (P + R) * k_tiles k-iterations, cut into P contiguous, equal pieces:
  cluster c takes iterations [c * S / P, (c + 1) * S / P). A piece holds at least k_tiles iterations, so each
  tile is covered by at most two pieces: c's *head* segment (k-tiles [0, e), the last thing c does) and c + 1's
  *tail* segment ([e, k_tiles), the first thing c + 1 does after its whole tiles).
- fixup: the tail's CTA writes its fp32 accumulator to workspace slot (c + 1, CTA rank) and raises that slot's
  flag (release); the head's CTA waits for the flag (acquire) -- long set, since the tail was computed first --,
  adds the partial to its registers (always head + tail: deterministic), resets the flag for the next launch and
  runs the epilogue. Only the head runs the epilogue of a split tile: the epilogue hook is unchanged.

Data-parallel at run time when there is no partial wave (R = 0), fewer tiles than clusters (W = 0) or fewer than 2
k-tiles. :func:`schedule` and :func:`tile_order` mirror the kernel's arithmetic in Python for the CPU tests.

Workspace per (device, stream): one tile_m x tile_n fp32 slot and one int32 flag per persistent CTA, flags zero
between launches. A thread stores its accumulator registers at ``slot * tile + i * threads + thread`` (a warp
writes 128 contiguous bytes per register).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

# the 32-bit iteration arithmetic: (cluster + 1) * (P + R) * k_tiles and n_tiles * k_tiles stay below 2^31
MAX_K_TILES = 1 << 14  # K <= 1M
MAX_ITERS = 1 << 30


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


@cute.jit
def plan(k_tiles, n_tiles, cluster, n_clusters, enabled: cutlass.Constexpr):
    """(data-parallel tiles of this cluster, first and last + 1 stream-K iteration of this cluster)."""
    t_dp = n_tiles
    begin = cutlass.Int32(0)
    end = cutlass.Int32(0)
    if cutlass.const_expr(enabled):
        waves = n_tiles // n_clusters
        rest = n_tiles - waves * n_clusters
        if (waves >= 1) & (rest > 0) & (k_tiles >= 2) & (k_tiles <= MAX_K_TILES) & (n_tiles <= MAX_ITERS // k_tiles):
            t_dp = (waves - 1) * n_clusters
            span = (n_clusters + rest) * k_tiles
            begin = t_dp * k_tiles + cluster * span // n_clusters
            end = t_dp * k_tiles + (cluster + 1) * span // n_clusters
    n_dp = (t_dp - cluster + n_clusters - 1) // n_clusters  # >= 0: cluster < n_clusters
    return n_dp, begin, end


@cute.jit
def unit(u, n_dp, pos, end, cluster, n_clusters, k_tiles):
    """This cluster's u-th work unit: (tile linear index, first k-tile, last k-tile + 1, next stream-K position)."""
    t = cluster + u * n_clusters
    kb = cutlass.Int32(0)
    ke = k_tiles
    nxt = pos
    if u >= n_dp:
        t = pos // k_tiles
        kb = pos - t * k_tiles
        ke = end - t * k_tiles
        if ke > k_tiles:
            ke = k_tiles
        nxt = t * k_tiles + ke
    return t, kb, ke, nxt


@cute.jit
def store_partial(acc, ws, flags, slot, etidx, n_threads: cutlass.Constexpr, bar):
    """Tail segment: this CTA's accumulator -> workspace slot, then raise the slot's flag (CUTLASS's pattern:
    barrier, then one thread fences and stores with release semantics)."""
    n = cute.size(acc)
    base = slot * (n * n_threads) + etidx
    for i in cutlass.range_constexpr(n):
        ws[base + i * n_threads] = acc[i]
    bar.arrive_and_wait()
    if etidx == 0:
        cute.arch.fence_acq_rel_gpu()
        cute.arch.store(flags.iterator + slot, cutlass.Int32(1), sem="release", scope="gpu")


@cute.jit
def add_partial(acc, ws, flags, slot, etidx, n_threads: cutlass.Constexpr, bar):
    """Head segment: wait for the tail's flag, add its partial to the accumulator, reset the flag."""
    if etidx == 0:
        ready = cute.arch.load(flags.iterator + slot, cutlass.Int32, sem="acquire", scope="gpu")
        while ready == 0:
            ready = cute.arch.load(flags.iterator + slot, cutlass.Int32, sem="acquire", scope="gpu")
    bar.arrive_and_wait()
    n = cute.size(acc)
    base = slot * (n * n_threads) + etidx
    for i in cutlass.range_constexpr(n):
        acc[i] = acc[i] + ws[base + i * n_threads]
    if etidx == 0:  # nobody else reads the flag in this launch; the next launch is stream-ordered after this one
        flags[slot] = cutlass.Int32(0)


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


def schedule(n_tiles: int, n_clusters: int, k_tiles: int, enabled: bool = True) -> list[list[tuple]]:
    """Python mirror of :func:`plan` / :func:`unit`: per cluster, its units ``(tile, k_begin, k_end)`` in order."""
    out = []
    for c in range(n_clusters):
        t_dp, begin, end = n_tiles, 0, 0
        waves, rest = divmod(n_tiles, n_clusters)
        if enabled and waves >= 1 and rest > 0 and 2 <= k_tiles <= MAX_K_TILES and n_tiles <= MAX_ITERS // k_tiles:
            t_dp = (waves - 1) * n_clusters
            span = (n_clusters + rest) * k_tiles
            begin = t_dp * k_tiles + c * span // n_clusters
            end = t_dp * k_tiles + (c + 1) * span // n_clusters
        n_dp = (t_dp - c + n_clusters - 1) // n_clusters
        units, u, pos = [], 0, begin
        while u < n_dp or pos < end:
            if u < n_dp:
                units.append((c + u * n_clusters, 0, k_tiles))
            else:
                t = pos // k_tiles
                kb, ke = pos - t * k_tiles, min(k_tiles, end - t * k_tiles)
                units.append((t, kb, ke))
                pos = t * k_tiles + ke
            u += 1
        out.append(units)
    return out
