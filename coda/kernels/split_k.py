"""In-kernel split-K (``GemmConfig.splits = S > 1``): for few output tiles with a long K (issue 29: 512 x 512 x
32768, 1024 x 2816 x 8192, 6144 x 768 x 16384 left most SMs idle), each cluster tile's k-tiles are cut into S
contiguous ranges, and the persistent schedule runs S work units per cluster tile instead of one.

Units. Linear unit u = t * S + s: cluster tile t (schedule.py's order), split s, k-tiles [s k / S, (s + 1) k / S)
of the k = ceil(K / tile_k) k-tiles (every range non-empty: the host requires k >= S). Cluster c takes units c, c +
P, c + 2P, ... as it takes tiles without splits; the producer loads a unit's k-range, the consumers run it.

Fixup (the pattern of the stream-K fixup of e616492, measured exact on the H100 then): splits 0 .. S - 2 store their
fp32 accumulator to a workspace slot and raise the slot's flag (barrier of the consumer threads, then one thread
fences and stores the flag with release semantics); split S - 1 -- the only one that runs the epilogue, so the
epilogue and its TileMN / VecN loads are unchanged -- waits for each flag in turn (acquire), adds the partials in
split order (deterministic: the same sum on every run) and resets the flags to zero for the next launch.
Slot of (cluster tile t, split s < S - 1, CTA rank r in the cluster): (t (S - 1) + s) * cluster size + r. A thread
stores its accumulator registers at ``slot * tile + i * threads + thread`` (a warp writes 128 contiguous bytes per
register).

No deadlock: a waiting unit waits only for units with a smaller index, every cluster runs its units in increasing
order, non-final splits never wait, and the persistent grid (at most the clusters that fit at once) is resident.

Host side (``coda.gemm``): the workspace (fp32, units' slots) and the flags (int32, zero between launches) are the
kernel's last two tensor arguments, one pair per device and stream. :func:`k_range` and :func:`slots` mirror the
kernel's arithmetic in Python for the CPU tests and the host's buffer sizes.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def unit(u, splits: cutlass.Constexpr, k_tiles):
    """Linear unit u -> (cluster tile, split, first k-tile, last k-tile + 1)."""
    t = u // splits
    s = u - t * splits
    return t, s, s * k_tiles // splits, (s + 1) * k_tiles // splits


@cute.jit
def store_partial(acc, ws, flags, slot, etidx, n_threads: cutlass.Constexpr, bar):
    """A non-final split: this CTA's accumulator -> workspace slot, then raise the slot's flag."""
    n = cute.size(acc)
    base = slot * (n * n_threads) + etidx
    for i in cutlass.range_constexpr(n):
        ws[base + i * n_threads] = acc[i]
    bar.arrive_and_wait()
    if etidx == 0:
        cute.arch.fence_acq_rel_gpu()
        cute.arch.store(flags.iterator + slot, cutlass.Int32(1), sem="release", scope="gpu")


@cute.jit
def add_partials(acc, ws, flags, slot0, count: cutlass.Constexpr, stride, etidx, n_threads: cutlass.Constexpr,
                 bar):
    """The final split: for the ``count`` slots slot0, slot0 + stride, ... in order, wait for the slot's flag, add
    its partial to the accumulator and reset the flag. (A run-time loop over the slots: unrolled, the loads of
    several partials were scheduled together and spilled the 128 x 256 tile's registers.)"""
    n = cute.size(acc)
    for j in range(count):
        slot = slot0 + j * stride
        if etidx == 0:
            ready = cute.arch.load(flags.iterator + slot, cutlass.Int32, sem="acquire", scope="gpu")
            while ready == 0:
                ready = cute.arch.load(flags.iterator + slot, cutlass.Int32, sem="acquire", scope="gpu")
        bar.arrive_and_wait()
        base = slot * (n * n_threads) + etidx
        for i in cutlass.range_constexpr(n):
            acc[i] = acc[i] + ws[base + i * n_threads]
        if etidx == 0:  # nobody else reads this flag in this launch; the next launch is stream-ordered after this one
            flags[slot] = cutlass.Int32(0)


def k_range(s: int, splits: int, k_tiles: int) -> tuple:
    """Python mirror of :func:`unit`'s k-range of split s."""
    return s * k_tiles // splits, (s + 1) * k_tiles // splits


def slot(tile: int, s: int, rank: int, splits: int, cluster_size: int) -> int:
    """Python mirror of the kernel's workspace slot of (cluster tile, non-final split s, CTA rank)."""
    return (tile * (splits - 1) + s) * cluster_size + rank


def slots(cluster_tiles: int, splits: int, cluster_size: int) -> int:
    """Workspace slots (and flags) of a launch: one per non-final split of every cluster tile and CTA."""
    return cluster_tiles * (splits - 1) * cluster_size
