"""The epilogue warps (``GemmConfig(epi_wg=True)``): the epilogue runs in warps 1-3 of the producer warpgroup (idle
otherwise: one warp issues the TMA loads) while the two MMA warpgroups start the next tile, so that the epilogue's
work hides under the mainloop (issue 29; measurements in docs/NOTES.md, sessions 22-23). Used by ``coda.optim``'s
dW GEMMs (the AdamW update: 1.01-1.07x cuBLAS's plain dW on the H100); an epilogue whose math per element is heavy
(the fused SwiGLU backward, ~42 instructions and two MUFU an element) is latency-bound in three warps and slower
than the default path. (A fourth warpgroup would make a 512-thread kernel, which ptxas compiles under 128
registers a thread: too few for a 64 x 256 accumulator.)

Hand-off (per tile; named barriers of the two MMA warpgroups and the 3 epilogue warps, 352 threads):
  MMA warpgroups: wait EMPTY (the epilogue warps have read the previous tile), convert the fp32 accumulator to bf16
    and stmatrix it into the staging buffer -- 64-column swizzled sub-tiles, 64 KB for 128 x 256 -- arrive FULL,
    then the next tile's mainloop.
  Epilogue warps: arrive EMPTY once; per tile wait FULL, run the epilogue, arrive EMPTY unless it was the last.
Registers (setmaxnreg): MMA warpgroups MMA_REGS, the producer warpgroup EWG_REGS.

The epilogue warps work in a SIMT layout (``ewg_run``): a lane takes VEC = 8 consecutive accumulator columns of a
row (one 16-byte staged read: a warp's reads of a row are whole bank sweeps), tile_n / 8 lanes a row, row batches
of ``ewg_unroll`` steps. TileMN (16-byte chunks) and float32 VecM operands reach each lane through its own slots of
a shared-memory ring filled by cp.async ``ring_depth`` batches ahead (across tile boundaries, before the next tile's
FULL wait); other operands and a ragged edge's lanes are read directly. Outputs go to global memory as 16-byte
stores, predicated on the problem's bounds. Shared memory: 3 pipeline stages + the staged tile + the ring.
Supported: elementwise, column-pair and 1 -> 2 epilogues, extra and in-place outputs, per-row reductions (lanes
fold, the row's lanes merge) or per-column sums (each lane over its rows, the warp merges); not both kinds in one
epilogue; a 2 -> 2 pairs epilogue with extra outputs (pairs of them) not at all.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum

from . import lse
from .epilogue import ODD_OUT, EpiEnv
from ..config import SMEM_CAPACITY
from .operand_kinds import SCALAR, TILE, VEC_M, VEC_N

BAR_FULL, BAR_EMPTY = 5, 6  # named barriers (1: the shared epilogue, 3-4: ping-pong ordering)
EPI_THREADS = 96  # warps 1-3 of the producer warpgroup
HANDOFF_THREADS = 2 * 128 + EPI_THREADS  # the two MMA warpgroups + the epilogue warps
MMA_REGS, EWG_REGS = 160, 184  # registers a thread (setmaxnreg): MMA warpgroups, the producer / epilogue warpgroup
VEC = 8  # accumulator columns a lane takes of a row: one 16-byte read of the staged bf16 tile
UNROLL = 4  # row steps a batch (fewer where a lane holds more: see ewg_unroll)
RING_MAX = 8  # batches of operand loads in flight per lane (the cp.async ring, see ewg_run)


def ewg_unroll(epi) -> int:
    """Row steps a batch: 4 with at most one TileMN operand and one output per element; else 1 (the lane's loads in
    flight then come from the ring's depth, ring_depth; 168 registers a thread spilled the AdamW update at 2)."""
    tiles = sum(1 for o in epi.operands if o.spec is TILE)
    return 1 if tiles >= 3 else 2 if tiles >= 2 or epi.expand else UNROLL


def ring_ops(epi, tile_bytes, tile_aligned) -> dict:
    """{operand index: bytes a lane copies per row} of the operands that reach the epilogue warps through the
    cp.async ring: 16-byte aligned TileMN operands whose VEC (pairs: VEC / 2) columns are 4, 8 or 16 bytes, and
    VecM operands (counted as float32; a 16-bit one is read directly, its slots unused). ``tile_bytes`` /
    ``tile_aligned``: per TileMN operand in declaration order."""
    out, k = {}, 0
    ne = VEC // 2 if epi.pair_mode else VEC
    for i, o in enumerate(epi.operands):
        if o.spec is TILE:
            if tile_aligned[k] and ne * tile_bytes[k] in (4, 8, 16):
                out[i] = ne * tile_bytes[k]
            k += 1
        elif o.spec is VEC_M:
            out[i] = 4
    return out


def ring_depth(epi, cfg, tile_bytes, tile_aligned, in_bytes: int = 2) -> int:
    """Batches of operand loads in flight per lane (the ring's positions): as many as the shared memory holds beside
    the staged tile and the pipeline stages -- ``cfg.stages``, else 3 of 64 k-elements (6 of 32) -- at most
    RING_MAX; 0 (direct loads) below 2 or without ring operands."""
    lane = sum(ring_ops(epi, tile_bytes, tile_aligned).values()) * ewg_unroll(epi)
    if not lane:
        return 0
    stages = cfg.stages or 3 * 64 // cfg.tile_k
    left = SMEM_CAPACITY - 2048 - staging_bytes(cfg) - stages * cfg.ab_stage_bytes(in_bytes)
    d = min(RING_MAX, left // (EPI_THREADS * lane))
    return d if d >= 2 else 0


def ring_bytes(epi, cfg, tile_bytes, tile_aligned, in_bytes: int = 2) -> int:
    """Shared memory of the ring (each operand's slots 16-byte aligned)."""
    d = ring_depth(epi, cfg, tile_bytes, tile_aligned, in_bytes)
    per = ring_ops(epi, tile_bytes, tile_aligned).values()
    return sum(-(-(b * EPI_THREADS * d * ewg_unroll(epi)) // 16) * 16 for b in per) if d else 0


def check(epi) -> None:
    """ValueError for what the epilogue warps do not run yet."""
    axes = {r.axis for r in epi.reductions}
    if axes == {"n", "m"}:
        raise ValueError(f"epi_wg=True: epilogue {epi.name!r} has both per-row and per-column reductions; the "
                         "epilogue warps run one kind at a time")
    if any(r.axis == "m" and r.op != "sum" for r in epi.reductions):
        raise ValueError(f"epi_wg=True: epilogue {epi.name!r}: per-column reductions are sums")
    if epi.pair_mode == "full" and epi.outputs:
        raise ValueError(f"epi_wg=True: epilogue {epi.name!r}: a 2 -> 2 pairs epilogue with extra outputs runs in "
                         "the consumer warps (epi_wg=False)")


def staging_bytes(cfg) -> int:
    """Shared memory of the staged bf16 accumulator tile."""
    return cfg.tile_m * cfg.tile_n * 2


def staging_n(cfg) -> int:
    """Columns of a staging sub-tile: 64 (128-byte rows: a warp's 16-byte reads of a row cover whole bank sweeps)."""
    return 64 if cfg.tile_n % 64 == 0 else cfg.epi_n


def staging_layout(cfg):
    """(tile_m, 64, tile_n / 64) bf16 sub-tile buffers in the epilogue's swizzled layout (128-byte swizzle)."""
    sn = staging_n(cfg)
    return sm90_utils.make_smem_layout_epi(cutlass.BFloat16, LayoutEnum.ROW_MAJOR, (cfg.tile_m, sn),
                                           cfg.tile_n // sn)


class EpilogueWarpgroup:
    """GemmSm90's part of the hand-off (a mixin: CuTeDSL traces ``self`` of a method as the kernel object)."""

    @cute.jit
    def ewg_stage(self, acc, tiled_mma, etidx, sStage):
        """MMA warpgroups (``etidx`` in [0, 256)): hand the tile's accumulator to the epilogue warps."""
        cfg = self.cfg
        sn = staging_n(cfg)
        n_epi = cfg.tile_n // sn
        atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), cutlass.BFloat16)
        tiled_c = cute.make_tiled_copy_C_atom(atom, tiled_mma)
        r2s = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, elem_ty_d=cutlass.BFloat16,
                                           elem_ty_acc=cutlass.Float32)
        tiled = cute.make_tiled_copy_S(r2s, tiled_c)
        dst = tiled.get_slice(etidx).partition_D(sStage)
        sub = cute.make_identity_tensor((cfg.tile_m, sn))
        rshape = cute.shape(tiled.get_slice(etidx).partition_S(sub))[:3]
        n_v = cute.size(rshape)
        c_sub = self._static_coords(tiled.get_slice(0).partition_S(sub), n_v)
        acc_of = self._acc_map(tiled_mma, c_sub, n_v, n_epi, sn)
        cute.arch.barrier(barrier_id=BAR_EMPTY, number_of_threads=HANDOFF_THREADS)
        for e in cutlass.range_constexpr(n_epi):
            rOut = cute.make_rmem_tensor(rshape, cutlass.BFloat16)
            for v in cutlass.range_constexpr(n_v):
                rOut[v] = cutlass.BFloat16(acc[acc_of[e][v]])
            cute.copy(tiled, rOut, dst[(None, None, None, e)])
        cute.arch.fence_acq_rel_cta()  # the staged tile is visible to the epilogue warps past FULL
        cute.arch.barrier_arrive(barrier_id=BAR_FULL, number_of_threads=HANDOFF_THREADS)

    @cute.jit
    def ewg_run(self, e_tid, sStage, rings, mD, store_tensors, op_tensors, red_tensors):
        """The epilogue warps' loop over this CTA's tiles (the static schedule's order); ``e_tid`` in [0, 96).
        A lane takes VEC consecutive accumulator columns of a row (one 16-byte staged read; its TileMN operands and
        outputs as 16-byte accesses where aligned), ``lpr`` = tile_n / VEC lanes a row, 32 / lpr rows a warp at a
        time; warp w takes row batches w, w + 3, ... of ``unroll`` such steps (ewg_unroll).
        Operand loads run ``depth`` batches ahead (``rings``, ring_depth): each batch the lane issues the cp.async
        copies of its ring operands for the batch depth - 1 ahead (into the next tile's first batches before that
        tile's FULL wait), commits them as one group and waits until the oldest group has landed; a lane reads
        back only the bytes it copied itself (no barrier). Other operands (and a ragged edge's lanes) are read
        directly. Then per row: evaluate, store, fold. Reductions: per-row (each lane folds its columns, the
        row's lanes merge by shuffles, its first lane writes the (row, N-tile) partial) or per-column sums (each
        lane sums its columns over its rows, the warp merges its row groups, the first group writes the (column,
        warp slot) partials; the slots of the warps the cooperative layout has and these do not get zeros)."""
        cfg = self.cfg
        M = mD.shape[0]
        # accumulator columns (a 1 -> 2 output has twice as many, a "half" pairs output half as many)
        N = mD.shape[1] // 2 if self.expand else mD.shape[1] * 2 if self.half else mD.shape[1]
        pw = 2 if self.pair_mode else 1  # accumulator columns per epilogue evaluation (a column pair)
        ne = VEC // pw  # evaluations per lane and row
        sn = staging_n(cfg)
        lpr = cfg.tile_n // VEC
        rpw = 32 // lpr
        nwarps = EPI_THREADS // 32
        unroll, depth = ewg_unroll(self.epi), self.ring_depth
        scalars = self._read_scalars(op_tensors)
        ops = [self._ewg_view(t, o.spec is TILE and self._ewg_tile_aligned(i)) for i, (t, o) in
               enumerate(zip(op_tensors, self.epi.operands))]
        outs = [self._ewg_view(t, True) for t in store_tensors]
        warp, lane = e_tid // 32, e_tid % 32
        r_in, c_loc = lane // lpr, (lane % lpr) * VEC
        rrow = cute.make_rmem_tensor((max(2 * len(self.red_n), 1),), cutlass.Float32)  # lse: m, s
        rcol = cute.make_rmem_tensor((max(ne * len(self.red_m), 1),), cutlass.Float32)
        cur = [self._ewg_frags(ops, ne) for _ in range(unroll)]
        geo = (M, N, pw, ne, rpw, r_in, c_loc, e_tid)
        w = self._work(mD)
        t = w["cluster"]
        b0, step = warp * rpw * unroll, nwarps * rpw * unroll
        # the ring's issue cursor (tile pt, batch pb, position wpos), depth - 1 batches ahead of the evaluation
        # (the cursor's tile coordinates are recomputed only when it moves to the next tile)
        pt, pb, wpos, rpos = t, b0, depth - 1, 0
        m2, n2, l2 = self._tile(w, cutlass.min(pt, w["n_tiles"] - 1))
        for d in cutlass.range_constexpr(depth - 1):
            pt, pb, m2, n2, l2 = self._ewg_ring_step(ops, rings, w, pt, pb, m2, n2, l2, d, b0, step, geo)
        cute.arch.barrier_arrive(barrier_id=BAR_EMPTY, number_of_threads=HANDOFF_THREADS)  # the buffer is free
        while t < w["n_tiles"]:
            m, n, l = self._tile(w, t)
            col = n * cfg.tile_n + c_loc  # the lane's first accumulator column
            j0 = col // pw  # its first operand column
            full = col + VEC <= N
            vecn = self._ewg_vecn(ops, j0, ne, N // pw)  # the lane's VecN values: the same in all its rows
            for k in cutlass.range_constexpr(ne * len(self.red_m)):
                rcol[k] = cutlass.Float32(0.0)
            cute.arch.barrier(barrier_id=BAR_FULL, number_of_threads=HANDOFF_THREADS)
            for b in cutlass.range(b0, cfg.tile_m, step):
                # phase 1: issue the ring's next batch, take this batch's operands, read the staged values
                if cutlass.const_expr(depth > 0):
                    pt, pb, m2, n2, l2 = self._ewg_ring_step(ops, rings, w, pt, pb, m2, n2, l2, wpos, b0, step, geo)
                    wpos = wpos + 1 if wpos + 1 < depth else 0
                    cute.arch.cp_async_wait_group(depth - 1)
                for u in cutlass.range_constexpr(unroll):
                    rc = cutlass.min(m * cfg.tile_m + cutlass.min(b + u * rpw + r_in, cfg.tile_m - 1), M - 1)
                    self._ewg_load(ops, rings, cur[u], rc, j0, full, l, rpos * unroll + u, geo)
                if cutlass.const_expr(depth > 0):
                    rpos = rpos + 1 if rpos + 1 < depth else 0
                staged = []
                for u in cutlass.range_constexpr(unroll):
                    t_row = cutlass.min(b + u * rpw + r_in, cfg.tile_m - 1)
                    f = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
                    cute.autovec_copy(cute.zipped_divide(sStage[(t_row, None, c_loc // sn)], (VEC,))[
                        None, (c_loc % sn) // VEC], f)
                    staged.append(f)
                # phase 2: per row, evaluate, store, fold
                for u in cutlass.range_constexpr(unroll):
                    t_row = b + u * rpw + r_in
                    row = m * cfg.tile_m + t_row
                    ok = (t_row < cfg.tile_m) & (row < M)
                    for ri in cutlass.range_constexpr(len(self.red_n)):
                        rrow[2 * ri] = self._neutral(self.red_n[ri].op)
                        rrow[2 * ri + 1] = cutlass.Float32(0.0)
                    res_frags = [cute.make_rmem_tensor((VEC * 2 if self.expand else VEC if self.pair_mode == "full"
                                                        else ne,), self.out_dtypes[k])
                                 for k in range(len(self.store_names))]
                    for i in cutlass.range_constexpr(ne):
                        acc = staged[u][i * pw].to(cutlass.Float32)
                        if cutlass.const_expr(self.pair_mode):
                            acc = (acc, staged[u][i * pw + 1].to(cutlass.Float32))
                        res = self._ewg_element(acc, ops, vecn, cur[u], i, scalars, row, j0 + i,
                                                cutlass.min(j0 + i, N // pw - 1))
                        self._ewg_pack(res_frags, res, i)
                        inb = j0 + i < N // pw
                        for ri in cutlass.range_constexpr(len(self.red_n)):
                            val = cutlass.Float32(res[self.red_n[ri].name])
                            if cutlass.const_expr(not self.even[1]):  # padded columns: the neutral element
                                val = cutlass.select_(inb, val, self._neutral(self.red_n[ri].op))
                            self._ewg_fold(rrow, ri, val)
                        for ri in cutlass.range_constexpr(len(self.red_m)):
                            rcol[ri * ne + i] = rcol[ri * ne + i] + cutlass.select_(
                                ok, cutlass.Float32(res[self.red_m[ri].name]), cutlass.Float32(0.0))
                    if ok:
                        self._ewg_store(outs, res_frags, row, col, j0, N, full, l)
                    for ri in cutlass.range_constexpr(len(self.red_n)):
                        val = self._ewg_merge(rrow, ri, lpr)
                        if ((lane % lpr) == 0) & ok & (n * cfg.tile_n < N):
                            red_tensors[ri][row, n, l] = val
            if cutlass.const_expr(len(self.red_m) > 0):
                self._ewg_col_partials(red_tensors, rcol, j0, ne, N // pw, m, l, warp, lpr, r_in)
            t += w["n_clusters"]
            if t < w["n_tiles"]:
                cute.arch.barrier_arrive(barrier_id=BAR_EMPTY, number_of_threads=HANDOFF_THREADS)
        if cutlass.const_expr(depth > 0):
            cute.arch.cp_async_wait_group(0)  # the copies issued past the last tile (never read)

    def _ewg_tile_aligned(self, i) -> bool:
        """Whether operand i (a TileMN) is 16-byte aligned (the host's flag, in TileMN declaration order)."""
        k = sum(1 for o in self.epi.operands[:i] if o.spec is TILE)
        return bool(self.tile_aligned[k])

    @staticmethod
    def _ewg_view(t, aligned):
        """An (M, N, L) row-major tensor with its row and batch strides declared multiples of 16 bytes (so that a
        lane's VEC columns are one aligned access); anything else as given."""
        if not aligned or not EpilogueWarpgroup._vectorizable(t):
            return t
        d = 128 // t.element_type.width
        s0, s2 = t.stride[0], t.stride[2]
        s0 = s0 if isinstance(s0, int) else cute.assume(s0, divby=d)
        s2 = s2 if isinstance(s2, int) else cute.assume(s2, divby=d)
        return cute.make_tensor(t.iterator, cute.make_layout(t.shape, stride=(s0, 1, s2)))

    @staticmethod
    def _vectorizable(t) -> bool:
        return isinstance(t.stride[1], int) and t.stride[1] == 1

    @cute.jit
    def _ewg_ring_step(self, ops, rings, w, pt, pb, m2, n2, l2, pos, b0, step, geo):
        """The ring's issue cursor (tile pt at (m2, n2, l2), batch pb): issue its batch into slot ``pos`` (if the
        tile exists), commit the group, move on one batch -- to the cursor's next tile at the end of one."""
        if pt < w["n_tiles"]:
            self._ewg_issue(ops, rings, m2, n2, l2, pb, pos, geo)
        cute.arch.cp_async_commit_group()
        pb += step
        if pb >= self.cfg.tile_m:
            pb = b0
            pt += w["n_clusters"]
            m2, n2, l2 = self._tile(w, cutlass.min(pt, w["n_tiles"] - 1))
        return pt, pb, m2, n2, l2

    @cute.jit
    def _ewg_issue(self, ops, rings, m, n, l, b, pos, geo):
        """Issue the cp.async copies of batch ``b`` of tile (m, n, l) into ring position ``pos``: per row step
        and ring operand, the lane's VEC (pairs: VEC / 2) columns of a TileMN operand (lanes of a ragged edge skip
        it: read directly) or its row's VecM value; rows clamped into the problem."""
        M, N, pw, ne, rpw, r_in, c_loc, e_tid = geo
        col = n * self.cfg.tile_n + c_loc
        for u in cutlass.range_constexpr(ewg_unroll(self.epi)):
            t_row = cutlass.min(b + u * rpw + r_in, self.cfg.tile_m - 1)
            rc = cutlass.min(m * self.cfg.tile_m + t_row, M - 1)
            slot = pos * ewg_unroll(self.epi) + u
            for i, o in enumerate(self.epi.operands):
                if cutlass.const_expr(i in rings):
                    t = ops[i]
                    bits = cute.size(rings[i], mode=[0]) * t.element_type.width
                    atom = cute.make_copy_atom(  # 16 bytes: cp.async.cg (L2 only, the data is used once)
                        cpasync.CopyG2SOp(cpasync.LoadCacheMode.GLOBAL if bits == 128 else
                                          cpasync.LoadCacheMode.ALWAYS), t.element_type, num_bits_per_copy=bits)
                    if cutlass.const_expr(o.spec is TILE):
                        if col + VEC <= N:
                            cute.copy(atom, cute.zipped_divide(t[rc, None, l], (ne,))[None, (col // pw) // ne],
                                      rings[i][None, e_tid, slot])
                    else:
                        cute.copy(atom, cute.zipped_divide(t[rc, None], (1,))[None, l], rings[i][None, e_tid, slot])

    def _ewg_frags(self, ops, ne) -> dict:
        """A row's operand registers: {operand index: fragment} (TileMN: ne values; VecM: one fp32)."""
        out = {}
        for i, o in enumerate(self.epi.operands):
            if o.spec is TILE:
                out[i] = cute.make_rmem_tensor((ne,), ops[i].element_type)
            elif o.spec is VEC_M:
                out[i] = cute.make_rmem_tensor((1,), cutlass.Float32)
        return out

    @cute.jit
    def _ewg_load(self, ops, rings, frags, rc, j0, full, l, slot, geo):
        """A lane's operand values of one row ``rc`` into ``frags``: a ring operand from its ring ``slot`` (a ragged
        edge's TileMN lanes directly); others directly: TileMN one vector load when row-major and the lane's
        columns are whole, else clamped element loads; VecM the row's value."""
        M, N, pw, ne, rpw, r_in, c_loc, e_tid = geo
        n_op = N // pw
        for i, o in enumerate(self.epi.operands):
            t = ops[i]
            if cutlass.const_expr(o.spec is TILE):
                f = frags[i]
                if full:
                    if cutlass.const_expr(i in rings):
                        cute.autovec_copy(rings[i][None, e_tid, slot], f)
                    elif cutlass.const_expr(self._vectorizable(t) and ne * t.element_type.width % 32 == 0):
                        cute.autovec_copy(cute.zipped_divide(t[rc, None, l], (ne,))[None, j0 // ne], f)
                    else:
                        for e in cutlass.range_constexpr(ne):
                            f[e] = t[rc, cutlass.min(j0 + e, n_op - 1), l]
                else:
                    for e in cutlass.range_constexpr(ne):
                        f[e] = t[rc, cutlass.min(j0 + e, n_op - 1), l]
            elif cutlass.const_expr(o.spec is VEC_M):
                if cutlass.const_expr(i in rings):
                    frags[i][0] = rings[i][0, e_tid, slot]
                else:
                    frags[i][0] = t[rc, l].to(cutlass.Float32)

    @cute.jit
    def _ewg_vecn(self, ops, j0, ne, n_op) -> dict:
        """{operand index: the ne values of a VecN operand at the lane's columns j0 .. j0 + ne - 1 (clamped)},
        read once per tile: a lane keeps its columns for all its rows of the tile. (Read per element, as before
        session 45, each was a global load with its address and clamp in every row: the compiler cannot hoist a
        load past the loop's global stores.)"""
        out = {}
        for i, o in enumerate(self.epi.operands):
            # held across the row loop: only where the lane has registers to spare (ewg_unroll > 1; the AdamW
            # update's three TileMN operands leave none: 20 bytes spilled at 168 registers) -- else read per row
            if cutlass.const_expr(o.spec is VEC_N and ewg_unroll(self.epi) > 1):
                f = cute.make_rmem_tensor((ne,), ops[i].element_type)  # 16-bit: two a register
                for e in cutlass.range_constexpr(ne):
                    f[e] = ops[i][cutlass.min(j0 + e, n_op - 1)]
                out[i] = f
        return out

    def _ewg_element(self, acc, ops, vecn, loaded, e, scalars, row, col, cc) -> dict:
        """The epilogue at a lane's evaluation ``e`` of a row (``acc``: fp32, a pair's two; ``col``: the operands'
        column, ``cc`` it clamped), traced inline: its results by name (fp32). ``loaded``: the row's TileMN
        fragments and VecM value (:meth:`_ewg_load`); ``vecn``: the tile's VecN values (:meth:`_ewg_vecn`), else
        they are read here."""
        vals = {}
        for i, o in enumerate(self.epi.operands):
            if o.spec is TILE:
                vals[o.name] = loaded[i][e].to(cutlass.Float32)
            elif o.spec is VEC_M:
                vals[o.name] = loaded[i][0]
            elif o.spec is VEC_N and i in vecn:
                vals[o.name] = vecn[i][e].to(cutlass.Float32)
            elif o.spec is VEC_N:
                vals[o.name] = ops[i][cc].to(cutlass.Float32)
            else:
                vals[o.name] = scalars[o.name]
        env = EpiEnv(row, col, {k: (lambda k=k: vals[k]) for k in vals})
        return self.epi.visit(acc, env)

    def _ewg_fold(self, racc, ri, x) -> None:
        """Fold one value into reduction ri's accumulator (logsumexp: the online (max, sum) pair)."""
        op = self.red_n[ri].op
        if op == "logsumexp":
            racc[2 * ri], racc[2 * ri + 1] = lse.update((racc[2 * ri], racc[2 * ri + 1]), [x])
        else:
            racc[2 * ri] = self._combine(op, racc[2 * ri], x)

    def _ewg_merge(self, racc, ri, lpr):
        """Reduction ri over the ``lpr`` lanes of a row (consecutive lanes: xor offsets below lpr)."""
        op = self.red_n[ri].op
        offs = tuple(o for o in (1, 2, 4, 8, 16) if o < lpr)
        if op == "logsumexp":
            return lse.finish((racc[2 * ri], racc[2 * ri + 1]), offsets=offs)
        val = racc[2 * ri]
        for off in offs:
            val = self._combine(op, val, cute.arch.shuffle_sync_bfly(val, offset=off))
        return val

    def _ewg_pack(self, frags, res, i) -> None:
        """Evaluation i's results into the row's output fragments (a 1 -> 2 or full-pairs output: two values)."""
        if self.expand or self.pair_mode == "full":
            frags[0][2 * i] = self.out_dtypes[0](res["out"])
            frags[0][2 * i + 1] = self.out_dtypes[0](res[ODD_OUT])
        else:
            for k, name in enumerate(self.store_names):
                frags[k][i] = self.out_dtypes[k](res[name])

    @cute.jit
    def _ewg_store(self, outs, frags, row, col, j0, N, full, l) -> None:
        """Store a lane's outputs of one row (traced inline, under the row's bounds predicate): one vector store per
        output when the lane's columns are whole, else element by element within N."""
        for k in cutlass.range_constexpr(len(self.store_names)):
            t, f = outs[k], frags[k]
            w = cute.size(f)
            c0 = 2 * col if self.expand else col if self.pair_mode == "full" else j0  # the output's first column
            lim = 2 * N if self.expand else N if self.pair_mode == "full" else N // (2 if self.pair_mode else 1)
            if full:
                cute.autovec_copy(f, cute.zipped_divide(t[row, None, l], (w,))[None, c0 // w])
            else:
                for e in cutlass.range_constexpr(w):
                    if c0 + e < lim:
                        t[row, c0 + e, l] = f[e]

    @cute.jit
    def _ewg_col_partials(self, red_tensors, rcol, j0, ne, n_op, m, l, warp, lpr, r_in):
        """Per-column partials of this warp: each lane's sums of its columns, merged over the warp's row groups
        (xor offsets lpr, 2 lpr, ...), written by the first group at slot m * warps_per_tile + warp; the slots no
        epilogue warp has (3 .. warps_per_tile - 1) get zeros, from every warp (the same value: no race)."""
        base = m * self.cfg.warps_per_tile
        offs = [o for o in (1, 2, 4, 8, 16) if o >= lpr]
        for ri in cutlass.range_constexpr(len(self.red_m)):
            t = red_tensors[len(self.red_n) + ri]
            for e in cutlass.range_constexpr(ne):
                v = rcol[ri * ne + e]
                for off in cutlass.range_constexpr(len(offs)):
                    v = v + cute.arch.shuffle_sync_bfly(v, offset=offs[off])
                if (r_in == 0) & (j0 + e < n_op):
                    t[j0 + e, base + warp, l] = v
                    for slot in cutlass.range_constexpr(EPI_THREADS // 32, self.cfg.warps_per_tile):
                        t[j0 + e, base + slot, l] = cutlass.Float32(0.0)

    def _read_scalars(self, op_tensors) -> dict:
        """The run-time Scalar operands, read once per kernel (the consumers' epilogue and the epilogue warps)."""
        return {o.name: SCALAR.read(op_tensors[i]) for i, o in enumerate(self.epi.operands) if o.spec is SCALAR}
