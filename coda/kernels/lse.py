"""Online logsumexp of the epilogue's per-row reductions (``reduce_n(x, "logsumexp")``), in base 2.

Each thread keeps a (max m, sum s of exp(x - m)) pair per row across the sub-tiles of a tile (:func:`update`), then
the four lanes that share a row merge theirs (:func:`finish`), giving ln(sum exp(x)) of the (row, N-tile): one
partial, finished across N-tiles by ``kernels.epilogue.finish_reduction``.
"""
import math

import cutlass
import cutlass.cute as cute

LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453


def _safe(m):
    # the shift for exp2(x - m): 0 where m is infinite -- all -inf so far gives exp2(-inf) = 0, a +inf max gives
    # exp2(+inf) = inf (torch: logsumexp of a row with +inf is +inf), never inf - inf = NaN; NaN stays NaN
    return cutlass.select_((m == -math.inf) | (m == math.inf), cutlass.Float32(0.0), m)


def update(state, xs):
    """Fold the values xs of one row into ``state`` (None before the first sub-tile)."""
    m_sub = xs[0]
    for x in xs[1:]:
        m_sub = cute.arch.fmax(m_sub, x, nan=True)
    if state is None:
        m_new, s = m_sub, cutlass.Float32(0.0)
    else:
        m_old, s_old = state
        m_new = cute.arch.fmax(m_old, m_sub, nan=True)
        s = s_old * cute.math.exp2((m_old - _safe(m_new)) * LOG2E, fastmath=True)
    ms = _safe(m_new)
    for x in xs:  # (x - m) first: exact for x near m at any magnitude (x log2e - m log2e would lose it:
        s = s + cute.math.exp2((x - ms) * LOG2E, fastmath=True)  # at |x| ~ 1e10 by ~1e3, tests/reliability)
    return (m_new, s)


def finish(state, offsets=(1, 2)):
    """Merge the pairs of the lanes that hold one row (butterfly ``offsets``: the 4 lanes of a quad by default);
    returns ln(sum exp(x)) of the row's part of the tile."""
    m, s = state
    for off in offsets:
        mo = cute.arch.shuffle_sync_bfly(m, offset=off)
        so = cute.arch.shuffle_sync_bfly(s, offset=off)
        mn = cute.arch.fmax(m, mo, nan=True)
        ms = _safe(mn)
        s = (s * cute.math.exp2((m - ms) * LOG2E, fastmath=True)
             + so * cute.math.exp2((mo - ms) * LOG2E, fastmath=True))
        m = mn
    return m + cute.math.log2(s, fastmath=True) * LN2
