"""The epilogue warps (``GemmConfig(epi_wg=True)``): the epilogue runs in warps 1-3 of the producer warpgroup (idle
otherwise: one warp issues the TMA loads) while the two MMA warpgroups start the next tile, so that the epilogue's
memory traffic hides under the mainloop (issue 29; measurements and budgets in docs/NOTES.md, session 22).
PROTOTYPE: compiled for sm_90a on the CPU, not yet run on a GPU. (A fourth warpgroup would make a 512-thread kernel,
which ptxas compiles under 128 registers a thread: too few for a 64 x 256 accumulator.)

Hand-off (per tile; named barriers of the two MMA warpgroups and the 3 epilogue warps, 352 threads):
  MMA warpgroups: wait EMPTY (the epilogue warps have read the previous tile), convert the fp32 accumulator to bf16
    and stmatrix it into the staging buffer -- tile_n / epi_n sub-tile buffers in the epilogue's swizzled sub-tile
    layout, 64 KB for 128 x 256 -- arrive FULL, then the next tile's mainloop.
  Epilogue warps: arrive EMPTY once; per tile wait FULL, run the epilogue, arrive EMPTY unless it was the last.
The epilogue warps work in a SIMT layout: warp w takes rows w, w + 3, ... of the 128-row tile, its 32 lanes 32
consecutive columns of a row at a time; each thread reads its staged value, loads its operands straight from global
memory (TileMN: one element, the warp's 64 contiguous bytes; VecN: its column's; VecM: the row's; Scalars once),
evaluates the epilogue and stores its outputs into global memory (again 64 contiguous bytes a warp), predicated on
the problem's bounds. Nothing else of the epilogue lives in shared memory, so the pipeline
keeps 3 stages (3 x 48 KB + 64 KB). Supported: elementwise, column-pair (a lane takes a pair) and 1 -> 2 epilogues,
extra outputs, per-row reductions (lanes fold, the warp merges) or per-column sums (each lane over its warp's rows);
not both kinds in one epilogue.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.tensor_utils import LayoutEnum

from . import lse
from .epilogue import ODD_OUT, EpiEnv
from .operand_kinds import SCALAR, TILE, VEC_M, VEC_N

BAR_FULL, BAR_EMPTY = 5, 6  # named barriers (1: the shared epilogue, 3-4: ping-pong ordering)
EPI_THREADS = 96  # warps 1-3 of the producer warpgroup
HANDOFF_THREADS = 2 * 128 + EPI_THREADS  # the two MMA warpgroups + the epilogue warps


def check(epi) -> None:
    """ValueError for what the epilogue warps do not run yet."""
    axes = {r.axis for r in epi.reductions}
    if axes == {"n", "m"}:
        raise ValueError(f"epi_wg=True: epilogue {epi.name!r} has both per-row and per-column reductions; the "
                         "epilogue warps run one kind at a time")
    if any(r.axis == "m" and r.op != "sum" for r in epi.reductions):
        raise ValueError(f"epi_wg=True: epilogue {epi.name!r}: per-column reductions are sums")


def staging_bytes(cfg) -> int:
    """Shared memory of the staged bf16 accumulator tile."""
    return cfg.tile_m * cfg.tile_n * 2


def staging_layout(cfg):
    """(tile_m, epi_n, tile_n / epi_n) bf16 sub-tile buffers in the epilogue's swizzled layout."""
    return sm90_utils.make_smem_layout_epi(cutlass.BFloat16, LayoutEnum.ROW_MAJOR, (cfg.tile_m, cfg.epi_n),
                                           cfg.tile_n // cfg.epi_n)


class EpilogueWarpgroup:
    """GemmSm90's part of the hand-off (a mixin: CuTeDSL traces ``self`` of a method as the kernel object)."""

    @cute.jit
    def ewg_stage(self, acc, tiled_mma, etidx, sStage):
        """MMA warpgroups (``etidx`` in [0, 256)): hand the tile's accumulator to the epilogue warps."""
        cfg = self.cfg
        n_epi = cfg.tile_n // cfg.epi_n
        atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), cutlass.BFloat16)
        tiled_c = cute.make_tiled_copy_C_atom(atom, tiled_mma)
        r2s = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, elem_ty_d=cutlass.BFloat16,
                                           elem_ty_acc=cutlass.Float32)
        tiled = cute.make_tiled_copy_S(r2s, tiled_c)
        dst = tiled.get_slice(etidx).partition_D(sStage)
        sub = cute.make_identity_tensor((cfg.tile_m, cfg.epi_n))
        rshape = cute.shape(tiled.get_slice(etidx).partition_S(sub))[:3]
        n_v = cute.size(rshape)
        c_sub = self._static_coords(tiled.get_slice(0).partition_S(sub), n_v)
        acc_of = self._acc_map(tiled_mma, c_sub, n_v, n_epi)
        cute.arch.barrier(barrier_id=BAR_EMPTY, number_of_threads=HANDOFF_THREADS)
        for e in cutlass.range_constexpr(n_epi):
            rOut = cute.make_rmem_tensor(rshape, cutlass.BFloat16)
            for v in cutlass.range_constexpr(n_v):
                rOut[v] = cutlass.BFloat16(acc[acc_of[e][v]])
            cute.copy(tiled, rOut, dst[(None, None, None, e)])
        cute.arch.fence_acq_rel_cta()  # the staged tile is visible to the epilogue warps past FULL
        cute.arch.barrier_arrive(barrier_id=BAR_FULL, number_of_threads=HANDOFF_THREADS)

    @cute.jit
    def ewg_run(self, e_tid, sStage, mD, store_tensors, op_tensors, red_tensors):
        """The epilogue warps' loop over this CTA's tiles (the static schedule's order); ``e_tid`` in [0, 96).
        Warp w takes rows w, w + 3, ...; its 32 lanes take 32 consecutive columns (column pairs) of a row at a
        time, so every global load and store of a warp covers 64 contiguous bytes (bf16) and the staged reads are
        conflict-free. Per-row reductions (rows outer, columns inner): each lane folds its columns into a register
        accumulator, the warp merges the lanes, lane 0 writes the (row, N-tile) partial. Per-column reductions
        (columns outer, rows inner): each lane sums its column over the warp's rows and writes the (column, warp
        slot) partial; warp 0 zeroes the slots of the warps the cooperative layout has and these do not (3..7)."""
        cfg = self.cfg
        M = mD.shape[0]
        # accumulator columns (a 1 -> 2 output has twice as many, a "half" pairs output half as many)
        N = mD.shape[1] // 2 if self.expand else mD.shape[1] * 2 if self.half else mD.shape[1]
        pw = 2 if self.pair_mode else 1  # accumulator columns per lane: a column pair (2j, 2j + 1) in one thread
        scalars = self._read_scalars(op_tensors)
        warp, lane = e_tid // 32, e_tid % 32
        racc = cute.make_rmem_tensor((max(2 * len(self.red_n), len(self.red_m), 1),), cutlass.Float32)  # lse: m, s
        w = self._work(mD)
        t = w["cluster"]
        cute.arch.barrier_arrive(barrier_id=BAR_EMPTY, number_of_threads=HANDOFF_THREADS)  # the buffer is free
        while t < w["n_tiles"]:
            m, n, l = self._tile(w, t)
            cute.arch.barrier(barrier_id=BAR_FULL, number_of_threads=HANDOFF_THREADS)
            if cutlass.const_expr(len(self.red_m) == 0):
                for t_row in cutlass.range(warp, cfg.tile_m, EPI_THREADS // 32):
                    for ri in cutlass.range_constexpr(len(self.red_n)):
                        racc[2 * ri] = self._neutral(self.red_n[ri].op)
                        racc[2 * ri + 1] = cutlass.Float32(0.0)
                    for ch in cutlass.range(cfg.tile_n // (32 * pw)):  # loops: one evaluation in the IR
                        res, row, col, j = self._ewg_step(sStage, store_tensors, op_tensors, scalars, m, n, l,
                                                          t_row, ch, lane, M, N, pw)
                        if (row < M) & (col < N):
                            self._ewg_store(store_tensors, res, row, col, j, l)
                        for ri in cutlass.range_constexpr(len(self.red_n)):
                            self._ewg_fold(racc, ri, cutlass.select_(
                                col < N, cutlass.Float32(res[self.red_n[ri].name]), self._neutral(self.red_n[ri].op)))
                    r_row = m * cfg.tile_m + t_row
                    for ri in cutlass.range_constexpr(len(self.red_n)):
                        val = self._ewg_merge(racc, ri)
                        if (lane == 0) & (r_row < M) & (n * cfg.tile_n < N):
                            red_tensors[ri][r_row, n, l] = val
            else:
                for ch in cutlass.range(cfg.tile_n // (32 * pw)):
                    for ri in cutlass.range_constexpr(len(self.red_m)):
                        racc[ri] = cutlass.Float32(0.0)
                    for t_row in cutlass.range(warp, cfg.tile_m, EPI_THREADS // 32):
                        res, row, col, j = self._ewg_step(sStage, store_tensors, op_tensors, scalars, m, n, l,
                                                          t_row, ch, lane, M, N, pw)
                        if (row < M) & (col < N):
                            self._ewg_store(store_tensors, res, row, col, j, l)
                        for ri in cutlass.range_constexpr(len(self.red_m)):
                            racc[ri] = racc[ri] + cutlass.select_(row < M, cutlass.Float32(res[self.red_m[ri].name]),
                                                                  cutlass.Float32(0.0))
                    jc = (n * cfg.tile_n + (ch * 32 + lane) * pw) // pw
                    if (jc < N // pw) & (m * cfg.tile_m < M):
                        self._ewg_col_partials(red_tensors, racc, jc, m, l, warp)
            t += w["n_clusters"]
            if t < w["n_tiles"]:
                cute.arch.barrier_arrive(barrier_id=BAR_EMPTY, number_of_threads=HANDOFF_THREADS)

    def _ewg_col_partials(self, red_tensors, racc, j, m, l, warp):
        """Column j's per-column partials of this warp (slot m * warps_per_tile + warp), traced inline; the slots no
        epilogue warp has (3 .. warps_per_tile - 1) get zeros, from every warp (the same value: no race)."""
        base = m * self.cfg.warps_per_tile
        for ri in range(len(self.red_m)):
            t = red_tensors[len(self.red_n) + ri]
            t[j, base + warp, l] = racc[ri]
            for slot in range(EPI_THREADS // 32, self.cfg.warps_per_tile):
                t[j, base + slot, l] = cutlass.Float32(0.0)

    def _ewg_step(self, sStage, store_tensors, op_tensors, scalars, m, n, l, t_row, ch, lane, M, N, pw):
        """One element (column pair) of the tile, traced inline: (its results, row, accumulator column, operand
        column)."""
        cfg = self.cfg
        row = m * cfg.tile_m + t_row
        c_loc = (ch * 32 + lane) * pw
        col = n * cfg.tile_n + c_loc  # the accumulator column (of a pair: the even one)
        j = col // pw  # the operands' column: the pair index in a pairs epilogue
        acc = sStage[(t_row, c_loc % cfg.epi_n, c_loc // cfg.epi_n)].to(cutlass.Float32)
        if self.pair_mode:
            acc = (acc, sStage[(t_row, (c_loc + 1) % cfg.epi_n, (c_loc + 1) // cfg.epi_n)].to(cutlass.Float32))
        res = self._ewg_element(acc, op_tensors, scalars, row, cutlass.min(row, M - 1), j,
                                cutlass.min(j, N // pw - 1), l)  # clamped: padded rows / columns are never stored
        return res, row, col, j

    def _ewg_store(self, store_tensors, res, row, col, j, l):
        """Store one element's (column pair's) outputs (traced inline, under the caller's bounds predicate)."""
        if self.expand or self.pair_mode == "full":
            # two values, at output columns 2 col, 2 col + 1 (1 -> 2) or col, col + 1 (2 -> 2)
            c2 = 2 * col if self.expand else col
            store_tensors[0][row, c2, l] = self.out_dtypes[0](res["out"])
            store_tensors[0][row, c2 + 1, l] = self.out_dtypes[0](res[ODD_OUT])
        else:  # one value per element (per pair: at column j of the half-width outputs)
            for k, name in enumerate(self.store_names):
                store_tensors[k][row, j, l] = self.out_dtypes[k](res[name])

    def _ewg_fold(self, racc, ri, x) -> None:
        """Fold one value into reduction ri's accumulator (logsumexp: the online (max, sum) pair)."""
        op = self.red_n[ri].op
        if op == "logsumexp":
            racc[2 * ri], racc[2 * ri + 1] = lse.update((racc[2 * ri], racc[2 * ri + 1]), [x])
        else:
            racc[2 * ri] = self._combine(op, racc[2 * ri], x)

    def _ewg_merge(self, racc, ri):
        """Reduction ri over the warp's 32 lanes (the row's columns of this tile)."""
        op = self.red_n[ri].op
        if op == "logsumexp":
            return lse.finish((racc[2 * ri], racc[2 * ri + 1]), offsets=(1, 2, 4, 8, 16))
        val = racc[2 * ri]
        for off in (1, 2, 4, 8, 16):
            val = self._combine(op, val, cute.arch.shuffle_sync_bfly(val, offset=off))
        return val

    def _read_scalars(self, op_tensors) -> dict:
        """The run-time Scalar operands, read once per kernel (the consumers' epilogue and the epilogue warps)."""
        return {o.name: SCALAR.read(op_tensors[i]) for i, o in enumerate(self.epi.operands) if o.spec is SCALAR}

    def _ewg_element(self, acc, op_tensors, scalars, row, rc, col, cc, l) -> dict:
        """The epilogue at one element or column pair (``acc``: fp32, a pair's two; ``col``: the operands' column,
        ``cc`` it clamped), traced inline: its results by name (fp32)."""
        vals = {}
        for i, o in enumerate(self.epi.operands):
            if o.spec is TILE:
                vals[o.name] = op_tensors[i][rc, cc, l].to(cutlass.Float32)
            elif o.spec is VEC_N:
                vals[o.name] = op_tensors[i][cc].to(cutlass.Float32)
            elif o.spec is VEC_M:
                vals[o.name] = op_tensors[i][rc, l].to(cutlass.Float32)
            else:
                vals[o.name] = scalars[o.name]
        env = EpiEnv(row, col, {k: (lambda k=k: vals[k]) for k in vals})
        return self.epi.visit(acc, env)
