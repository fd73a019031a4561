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


# -- sched="dynamic" ---------------------------------------------------------------------------------------------
# The static order above drifts: over a few hundred tiles per CTA the clusters fall out of step, the tiles in flight
# spread over several "waves" of the order and their A / B blocks no longer fit the L2 together (H100, 8192 x 128256
# x 4096: 19 GB of DRAM reads against cuBLAS's 8.3; docs/ncu_h100.md). With sched="dynamic" a CTA takes the next
# linear cluster-tile index from a global counter (one atomic add per tile, by the cluster's leader CTA) when its
# producer warp is ready for it, so the tiles in flight are always the next ~P of the order. The producer warp hands
# each index to the consumer warpgroups (and, in a 2-CTA cluster, to the peer CTA) through RING shared-memory slots
# (make_ring); an index >= the tile count ends every loop. The counter is two
# int32 (next tile, finished CTAs), zero at launch: the last CTA to finish resets both for the next launch on the
# same stream (coda.gemm keeps one pair per device and stream).
RING = 4


@cute.jit
def fetch(counter: cute.Tensor):
    """Warp-collective: lane 0 takes the next linear tile index from the counter; every lane returns it."""
    v = cutlass.Int32(0)
    if cute.arch.lane_idx() == 0:
        v = cute.arch.atomic_add(counter.iterator, cutlass.Int32(1), sem="relaxed", scope="gpu")
    return cute.arch.make_warp_uniform(cute.arch.shuffle_sync(v, 0))


def make_ring(smem, counter, n_cta: int, consumers: int, rank):
    """Shared memory of the tile-index ring: RING int32 slots, a full and an empty mbarrier per slot (initialised
    here by thread 0; the kernel's cluster sync fences them). Full: one arrival per phase (the leader's producer
    lane; in the peer CTA its own producer lane arming 4 bytes of st.async). Empty (used in the leader CTA): every
    consumer thread of the cluster, plus the peer's producer lane."""
    full = smem.allocate_array(cutlass.Int64, RING, byte_alignment=8)
    empty = smem.allocate_array(cutlass.Int64, RING, byte_alignment=8)
    ring = smem.allocate_tensor(cutlass.Int32, cute.make_layout(RING), byte_alignment=16)
    _init_ring(full, empty, n_cta * consumers + (n_cta - 1))
    return (full, empty, ring, counter[0], n_cta, rank)


@cute.jit
def _init_ring(full, empty, empty_count: cutlass.Constexpr):
    if cute.arch.thread_idx()[0] == 0:
        for j in cutlass.range_constexpr(RING):
            cute.arch.mbarrier_init(full + j, 1)
            cute.arch.mbarrier_init(empty + j, empty_count)


@cute.jit
def producer_next(sched, state):
    """Producer warp: the next cluster-tile index. The cluster's leader CTA takes it from the counter and publishes
    it in ring slot ``state`` -- in its own shared memory and, by st.async, in its peer's, completing the peer's
    full barrier; the peer's producer arms that barrier, reads the slot and releases it to the leader. ``state`` is
    a consumer-type state (phase 0 first): the leader waits for the slot's empty barrier at the opposite parity.
    The caller advances it in its own loop body."""
    full, empty, ring, counter, n_cta, rank = sched
    t = cutlass.Int32(0)
    if rank == 0:
        t = fetch(counter)
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_wait(empty + state.index, state.phase ^ 1)
            ring[state.index] = t
            if cutlass.const_expr(n_cta > 1):
                cute.arch.store_async_dsmem(ring.iterator + state.index, t, full + state.index, 1)
            cute.arch.mbarrier_arrive(full + state.index)
    else:
        if cutlass.const_expr(n_cta > 1):
            v = cutlass.Int32(0)
            if cute.arch.lane_idx() == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(full + state.index, 4)
                cute.arch.mbarrier_wait(full + state.index, state.phase)
                v = ring[state.index]
                cute.arch.mbarrier_arrive(empty + state.index, peer_cta_rank_in_cluster=0)
            t = cute.arch.shuffle_sync(v, 0)
    return cute.arch.make_warp_uniform(t)


@cute.jit
def consumer_next(sched, state):
    """Consumer thread: the tile index in ring slot ``state``, then release the slot to the leader CTA (the caller
    advances the state)."""
    full, empty, ring, counter, n_cta, rank = sched
    cute.arch.mbarrier_wait(full + state.index, state.phase)
    t = ring[state.index]
    if rank == 0:
        cute.arch.mbarrier_arrive(empty + state.index)
    else:
        if cutlass.const_expr(n_cta > 1):
            cute.arch.mbarrier_arrive(empty + state.index, peer_cta_rank_in_cluster=0)
    return cute.arch.make_warp_uniform(t)


@cute.jit
def ring_drain(sched, state):
    """Producer warp of the leader CTA, after the loop, once per ring slot (the caller advances ``state``): wait
    until the slot's last index was released, so that no remote arrive from the peer CTA lands in shared memory of a
    CTA that has exited."""
    full, empty, ring, counter, n_cta, rank = sched
    if rank == 0:
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_wait(empty + state.index, state.phase ^ 1)


@cute.jit
def finish(counter: cute.Tensor):
    """Producer warp, after its last fetch: count this CTA finished; the last one resets the counter to zero (every
    other CTA's last fetch happened before its own increment, which this acq_rel add observes)."""
    if cute.arch.lane_idx() == 0:
        gx, gy, gz = cute.arch.grid_dim()
        done = cute.arch.atomic_add(counter.iterator + 1, cutlass.Int32(1), sem="acq_rel", scope="gpu")
        if done == gx * gy * gz - 1:
            cute.arch.atomic_exch(counter.iterator, cutlass.Int32(0), sem="relaxed", scope="gpu")
            cute.arch.atomic_exch(counter.iterator + 1, cutlass.Int32(0), sem="relaxed", scope="gpu")
