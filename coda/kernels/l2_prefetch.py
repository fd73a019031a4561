"""L2 prefetch of an epilogue's TileMN operands by the producer warp (``GemmConfig.l2_prefetch``, issue 29).

An epilogue that streams M x N operands (the AdamW update's p, m, v; a residual; the SwiGLU backward's
pre-activation) loads them after the tile's mainloop: where no next tile's mainloop runs beside it (the last wave,
or a few-tile GEMM) those loads wait on DRAM. With ``l2_prefetch = P`` the producer warp, which only issues TMA loads,
splits the tile's operand rows into P chunks and prefetches chunk j (``prefetch.global.L2``, one 128-byte line per
lane and instruction, rows and columns inside the problem) after issuing k-tile ``k_tiles - P + j``: the lines
arrive in L2 while the last k-tiles' MMAs run, and the epilogue's loads (the TMA ring or the epilogue warps'
cp.async ring) then hit L2. A prefetch is a hint: nothing waits for it, results do not depend on it.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def chunk(cfg: cutlass.Constexpr, op_cols: cutlass.Constexpr, tensors: list, m, n, l, j, lane):
    """Chunk ``j`` (0 .. P - 1; negative: none yet) of tile (m, n, l)'s rows of each TileMN operand in ``tensors``
    ((M, N, L) views whose tile is ``tile_m`` x ``op_cols * tile_n / epi_n`` columns: a pairs epilogue's operands
    have one column per pair) into L2; ``lane``: 0-31 in the producer warp."""
    if j >= 0:
        rows = cfg.tile_m // cfg.l2_prefetch
        width = op_cols * (cfg.tile_n // cfg.epi_n)  # the operand's columns in one tile
        for i in cutlass.range_constexpr(len(tensors)):
            t = tensors[i]
            per_line = 1024 // t.element_type.width  # elements of a 128-byte line
            lines = (width + per_line - 1) // per_line
            for q in cutlass.range_constexpr((rows * lines + 31) // 32):
                idx = lane + q * 32
                row = m * cfg.tile_m + j * rows + idx // lines
                col = n * width + (idx % lines) * per_line
                if idx < rows * lines and row < t.shape[0] and col < t.shape[1]:
                    ptr = t.iterator + cute.crd2idx((row, col, l), t.layout)
                    cute.arch.prefetch(ptr.llvm_ptr, cache_level="L2")
