"""The consumer epilogue's segment sums (``coda.segment_sum``, coda/dsl_segment.py): a pre-pass over the whole
register accumulator of a tile, before the epilogue's sub-tile loop (``GemmSm90._epilogue``, phase 3b).

Per sub-tile e and register v (thread 0's static coordinates ``c_sub[v]``; the sub-tile's columns start at
e * epi_n), the argument x of every segment sum is evaluated at the element (accumulator, coordinates, VecM / VecN
/ Scalar operands: ``coda.dsl_segment.segment_args``) and added into the running sum of its (row, group): the
group of tile column c is c // (size * (2 in a pairs epilogue)), static because a group is whole 8-column chunks
and a thread's columns are 8 i + 2 (lane % 4) + {0, 1}. The 4 lanes of a quad hold the same rows and the rest of
each chunk: two butterfly shuffles finish the sums. The sub-tile loop then reads them as leaves (``env.segments``).
Groups lie inside the tile and N is whole groups (``N % size``: checked by the call), so a group is all inside
the problem or all outside it: nothing is masked. Costs: one more evaluation of the arguments per element, a few
registers a row and group."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute


def check(epi, cfg) -> bool:
    """Whether ``epi`` has segment sums the kernel forms (ValueError where it cannot, at this config)."""
    if type(epi).__module__ != "coda.dsl":
        return False
    from ..dsl_segment import kernel_problems, segment_nodes
    if not segment_nodes(epi):
        return False
    why = kernel_problems(epi, cfg.tile_n) + (["the epilogue warps (epi_wg) do not run segment sums"]
                                              if cfg.epi_wg else [])
    if why:
        raise ValueError(f"epilogue {epi.name!r}: coda.segment_sum at {cfg.name}: {'; '.join(why)}")
    return True


def prepass(kernel, acc, acc_of, c_sub, n_v, n_epi, sub_tile):
    """{(sub-tile e, register v): {SegmentSum node: its value at the element}}; ``sub_tile(e)`` gives sub-tile
    e's lazy view (``SubTile``, no TileMN buffers)."""
    from ..dsl_segment import segment_args, segment_nodes
    epi, epi_n = kernel.epi, kernel.cfg.epi_n
    nodes = segment_nodes(epi)
    step = 2 if epi.pair_mode else 1  # a pairs epilogue: one argument per column pair, a group of size pairs

    def key(i, e, v):
        return i, c_sub[v][0], (c_sub[v][1] + e * epi_n) // (int(nodes[i].args[1]) * step)

    sums = {}
    for e in range(n_epi):
        lazy = sub_tile(e)
        for v in range(0, n_v, step):
            a = (acc[acc_of[e][v]], acc[acc_of[e][v + 1]]) if epi.pair_mode else acc[acc_of[e][v]]
            xs = segment_args(epi, a, lazy.env(v, pair=bool(epi.pair_mode)))
            for i, x in enumerate(xs):
                k = key(i, e, v)
                sums[k] = cutlass.Float32(x) if k not in sums else sums[k] + x
    for k in sums:
        for off in (1, 2):
            sums[k] = sums[k] + cute.arch.shuffle_sync_bfly(sums[k], offset=off)
    return {(e, v): {node: sums[key(i, e, v)] for i, node in enumerate(nodes)}
            for e in range(n_epi) for v in range(0, n_v, step)}
