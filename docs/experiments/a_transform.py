"""The cross entropy's dX GEMM on the stored logits: the softmax gradient formed in registers (RS WGMMA).

The fast cross entropy stores the logits z (M x V bf16), then a memory-bound pass (ce_grad, 1.43 ms a llama-1b
step) turns them into dz = softmax(z) - onehot for GEMMs 2 (dX = dz W) and 3 (dW = dz^T x). Here the dX GEMM
reads z itself: each k-block of the A tile goes from shared memory into registers (ldmatrix, the WGMMA A-fragment
layout), becomes exp(z - lse[row]) - [col == target[row]] in fp32 (ex2 + FFMA + a compare), back to bf16, and
feeds a register-A WGMMA (``GemmSm90`` with ``_tiled_mma`` / ``_mainloop`` overridden; the producer, the TMA
pipeline and the epilogue are the library's). Two register buffers: while k-tile t's WGMMAs run, k-tile t + 1 is
loaded and transformed into the other. The design study: docs/NOTES.md session 32 ("The A-operand transform");
MUFU work per A element: one ex2 per N-tile (H / tile_n = 8).

H100 80GB HBM3, session 35, 8192 x 2048 x 128256 (llama-1b's LM head dX), ms: one buffer, a commit group and a
wait per k-block (call 12): 8.077 vs 5.758 for CODA's plain dX on a precomputed dz; two buffers (call 13): 7.703
vs 5.887 (cuBLAS 6.015); + the one-hot compare only in k-tiles that hold one of the thread's rows' targets
(call 14): 6.958 vs 6.029 (cuBLAS 5.968), +0.93 ms against the ~1.45 ms pass it would remove. Errors vs float64
equal to torch's bf16 path at both shapes.

Session 36 (H100 80GB HBM3, the same shape, ms: ours vs CODA's plain GEMM on a precomputed dz in the same run;
errors vs float64 equal to torch's bf16 path every time, every output written):
- the exp form's dW (A = z^T MN-major, ldmatrix .trans; lse / target per value): 14.98 vs 5.71; dX 6.68 vs 5.72.
- ``IdentityA`` (ldmatrix + register-A WGMMAs, no transform): dX 5.787 vs 5.695, dW 5.823 vs 5.706 -- the RS path
  itself costs ~2 %; the rest is the transform's instructions and their latency.
- ``ScaledGradA`` (A holds e = exp(z - m_t), m_t the row maximum of its 256-column block; a table s = exp(m_t -
  lse); the transform a multiply): fp32 multiply, table read per value 6.985 vs 5.805 (dW 14.94); ``ScaledPackedA``
  (one bf16x2 FMA per two values, no conversions) 6.440 vs 5.857; + the two rows' scales loaded a k-tile ahead
  6.189 / 6.297 / 6.478 / 6.012 vs 5.910 / 5.765 / 5.973 / 5.745 (+0.27 to +0.53, four machines). dW with
  per-token scale pairs (bf16, st-major table, 32-bit loads a k-tile ahead, the one-hot by a warp vote over the
  k-tile's 64 targets): 7.641 -> 9.216 (per-CTA vote: 6 % of k-tiles took the fp32 path) -> 9.175 (per-warp vote)
  -> 7.627 (targets prefetched too) -> 7.181 vs 5.791 (prefetch buffers by k-tile parity, offsets hoisted).
- ncu at 8192 x 2048 x 32768 (scaled packed, clocks held by ncu): dX 1.62 ms / 232 M instructions vs plain 1.51 /
  109 M; dW 2.45 / 377 M vs 1.51 / 115 M, its warps stalled on long scoreboard 4.7 per issue (the target loads)
  before the targets were prefetched (``a_transform_ncu.sh``).
- ``WriteDzA`` (the dX form also stores dz, each k-tile by one of its row block's CTAs, 32-bit stores from the
  registers): 6.800 vs 5.824 -- the stores cost +0.7 over the transform.
- ``WriteDzSmemA`` (the writer CTA stmatrix's the transformed k-tile over its A stage, a named barrier, 16-byte
  row chunks to dz): 6.510 vs 5.785 (cuBLAS 6.022), dz equal to torch's softmax - onehot within 6e-5.
So against the softmax-gradient pass (ce_grad, 1.45 ms): dX + dW transforms +1.66 (no gain); the dX transform
storing dz through shared memory for a plain dW +0.73: ~0.7 ms a step, once the forward stores e = exp(z - m_t)
and the M x V / 256 table of m_t (the logits epilogue: a row maximum over the tile's registers before its
sub-tiles, a DSL addition). Not built yet.

lse and the targets reach the mainloop as VecM operands of the epilogue ``carry`` (fp32; which adds nothing).
Usage: ``CUTE_DSL_ARCH=sm_90a python docs/experiments/a_transform.py --compile`` (CPU: PTX, registers, spills);
on the GPU ``python docs/experiments/a_transform.py``: dX against torch (softmax - onehot in float32, then bf16,
then torch.mm) and float64 rows, and the time against CODA's plain dX GEMM on a precomputed dz."""
import argparse
import os

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, warp, warpgroup

import coda
from coda.config import GemmConfig
from coda.kernels.gemm_sm90 import GemmSm90

LOG2E = 1.4426950408889634


@coda.epilogue
def carry(acc, lse: coda.VecM, tgt: coda.VecM, dzo: coda.VecM):
    """The plain product; its operands are read by the mainloop only."""
    return acc


class SoftmaxGradA(GemmSm90):
    """``GemmSm90`` whose A operand (the stored logits, K-major) becomes exp(z - lse) - onehot in registers: the dX
    GEMM, rows = tokens. An MN-major A is the dW GEMM's z^T (``DW``, ldmatrix .trans), rows = vocabulary entries,
    k = tokens: lse and the target come per k position (the VecM operands then hold T <= V values: an
    experiment's shortcut, the kernel has no per-k operand kind)."""

    IDENTITY = False  # IdentityA: ldmatrix into registers and register-A WGMMAs, no transform (timing)
    WRITE_DZ = False  # WriteDzA: the scaled packed dX form also stores dz (for a plain dW GEMM)
    PACKED = False  # ScaledPackedA: the scaled form's multiply in bf16x2
    SCALED = False  # A holds the logits z; ScaledGradA: exponentials e = exp(z - m_t) and a scale table

    def _tiled_mma(self, a_layout, b_layout):
        self.DW = not a_layout.is_k_major_a()  # read at trace time by _mainloop / _load_transform
        if self.cfg.pingpong or self.cfg.epi_wg:
            raise ValueError("cooperative tiles without epilogue warps only (an experiment)")
        return sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, OperandMajorMode.K, b_layout.sm90_mma_major_mode(), self.acc_dtype,
            self.atom_layout, tiler_mn=(64, self.cfg.tile_n), a_source=warpgroup.OperandSource.RMEM)

    @cute.jit
    def _mainloop(self, mainloop, read, release, k_tiles, k_blocks, tiled_mma, acc, tCrA, tCrB, ctx):
        """Double-buffered by k-tile: while the WGMMAs of k-tile t run, k-tile t + 1 is loaded into the other
        register buffer and transformed; wait_group(1) retires k-tile t - 1 (its stage released) first."""
        cfg = self.cfg
        thr = tiled_mma.get_slice(ctx["tidx"])
        shape_a = thr.partition_shape_A((cfg.tile_m, cfg.tile_k))
        bufs = (thr.make_fragment_A(shape_a), thr.make_fragment_A(shape_a))  # (V, MMA_M, k_blocks) bf16 each
        s2r = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(self.DW, 4), cutlass.BFloat16),
                                     tiled_mma)
        thr_s2r = s2r.get_slice(ctx["tidx"])
        sAv = thr_s2r.partition_S(ctx["sA"])  # (CPY, CPY_M, CPY_K, stage)
        views = (thr_s2r.retile(bufs[0]), thr_s2r.retile(bufs[1]))
        crd = thr.partition_A(cute.make_identity_tensor((cfg.tile_m, cfg.tile_k)))  # (row, col) in the tile
        # this thread's rows: the same in every k-block; lse * log2(e) and the target per fragment value
        mLse, mTgt = ctx["ops"][0], ctx["ops"][1]
        nv = cute.size(bufs[0][(None, None, 0)])
        lse2 = cute.make_rmem_tensor((nv,), cutlass.Float32)
        tgt = cute.make_rmem_tensor((nv,), cutlass.Int32)
        c0 = crd[(None, None, 0)]
        rows = mLse.shape[0]
        rowoff = cute.make_rmem_tensor((nv,), cutlass.Int32)  # scaled dX: the row's offset in the scale table
        rowi = cute.make_rmem_tensor((nv,), cutlass.Int32)  # WRITE_DZ: the row, -1 past the last
        for v in cutlass.range_constexpr(nv):
            r = ctx["m"] * cfg.tile_m + c0[v][0]
            lse2[v] = cutlass.Float32(0.0)
            tgt[v] = cutlass.Int32(-1)
            rowoff[v] = cutlass.Int32(0)
            rowi[v] = cutlass.Int32(-1)
            if cutlass.const_expr(not self.DW):
                if r < rows:
                    lse2[v] = mLse[r, 0] * LOG2E
                    tgt[v] = cutlass.Int32(mTgt[r, 0])
                    rowoff[v] = r * ((k_tiles + 3) // 4)
                    rowi[v] = r
            else:
                tgt[v] = r  # the dW form compares the vocabulary row with each k position's target
        # scaled dX: the two distinct rows' scales (values 0, 1 / 4, 5: row g; 2, 3 / 6, 7: row g + 8), loaded one
        # k-tile ahead (scn), and the k-tile of each row's target
        scn = cute.make_rmem_tensor((2,), cutlass.Float32)
        tkt = cute.make_rmem_tensor((2,), cutlass.Int32)
        if cutlass.const_expr(self.SCALED and not self.DW):
            assert nv == 8, nv
            for i in cutlass.range_constexpr(2):
                scn[i] = mLse[rowoff[2 * i], 0]
                tkt[i] = tgt[2 * i] // cfg.tile_k
        # scaled dW: this tile's vocabulary rows lie in one 256-row block of the scale table's columns
        st_dw = (ctx["m"] * cfg.tile_m) // 256
        n_st = (rows + 255) // 256
        # packed dW: the next k-tile's scale pairs (32-bit: two bf16 tokens each), prefetched; the tile's first row
        m0 = ctx["m"] * cfg.tile_m
        # one prefetch buffer per register buffer (k-tile parity): k-tile t reads pres[t % 2] and fills the other
        pres = (cute.make_rmem_tensor((2 * k_blocks + 2,), cutlass.Int32),  # + the k-tile's two targets
                cute.make_rmem_tensor((2 * k_blocks + 2,), cutlass.Int32))
        offs = cute.make_rmem_tensor((2 * k_blocks,), cutlass.Int32)  # the thread's token pairs / 2, k-tile-invariant
        for j in cutlass.range_constexpr(k_blocks):
            offs[2 * j] = crd[(None, None, j)][0][1] // 2
            offs[2 * j + 1] = crd[(None, None, j)][4][1] // 2
        tab32 = cute.make_tensor(cute.recast_ptr(mLse.iterator, dtype=cutlass.Int32),
                                 cute.make_layout(n_st * k_tiles * cfg.tile_k // 2))
        pre = (pres, offs)
        # WRITE_DZ: the dX form also stores dz (k-tiles t with t % n_cols == n: each written once, spread evenly)
        dz32 = cute.make_tensor(cute.recast_ptr(ctx["ops"][2].iterator, dtype=cutlass.Int32),
                                cute.make_layout(rows * k_tiles * cfg.tile_k))
        wz = (dz32, rowi, ctx["n"], ctx["n_cols"], k_tiles * cfg.tile_k)  # dz's row stride: whole k-tiles
        if cutlass.const_expr(self.WRITE_DZ == "smem"):
            # the transformed k-tile back into its shared-memory stage (stmatrix: the ldmatrix copy's inverse), then
            # 16-byte row chunks to global memory (dz: rows x k_tiles * tile_k bf16, rows a multiple of tile_m)
            r2s = cute.make_tiled_copy_A(cute.make_copy_atom(warp.StMatrix8x8x16bOp(self.DW, 4), cutlass.BFloat16),
                                         tiled_mma)
            thr_r2s = r2s.get_slice(ctx["tidx"])
            sAd = thr_r2s.partition_D(ctx["sA"])
            rv = (thr_r2s.retile(bufs[0]), thr_r2s.retile(bufs[1]))
            kp = k_tiles * cfg.tile_k
            gdz = cute.make_tensor(cute.recast_ptr(ctx["ops"][2].iterator, dtype=cutlass.BFloat16),
                                   cute.make_layout((rows, kp), stride=(kp, 1)))
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16, num_bits_per_copy=128)
            s2g = cute.make_tiled_copy_tv(atom, cute.make_layout((32, 8), stride=(8, 1)), cute.make_layout((1, 8)))
            thr_s2g = s2g.get_slice(ctx["tidx"])
            src = thr_s2g.partition_S(ctx["sA"])  # (CPY, CPY_M, CPY_K, stage)
            dst = thr_s2g.partition_D(cute.local_tile(gdz, (cfg.tile_m, cfg.tile_k), (ctx["m"], None)))
            wz = (wz, (r2s, sAd, rv, s2g, src, dst))
        if cutlass.const_expr(self.SCALED and self.PACKED and self.DW):
            self._scale_pairs(pres[0], offs, tab32, mTgt, st_dw * (k_tiles * cfg.tile_k), 0, k_blocks)

        xf = dict(s2r=s2r, sAv=sAv, views=views, bufs=bufs, crd=crd, lse2=lse2, tgt=tgt, nv=nv, k_blocks=k_blocks,
                  mLse=mLse, mTgt=mTgt, rowoff=rowoff, st_dw=st_dw, n_st=n_st, scn=scn, tkt=tkt, k_tiles=k_tiles,
                  m0=m0, pre=pre, tab32=tab32, wz=wz)  # what the k-tile transforms read
        mainloop.consumer_wait(read)
        self._load_transform(xf, 0, read.index, 0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        for i in range(k_tiles // 2):  # k-tiles 2i (buffer 0) and 2i + 1 (buffer 1)
            self._mma(tiled_mma, acc, bufs[0], tCrB, read.index, k_blocks)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.wait_group(1)  # k-tile 2i - 1 has retired: buffer 1 and its stage are free
            if i > 0:
                mainloop.consumer_release(release)
                release.advance()
            read.advance()
            mainloop.consumer_wait(read)
            self._load_transform(xf, 1, read.index, 2 * i + 1)
            self._mma(tiled_mma, acc, bufs[1], tCrB, read.index, k_blocks)
            warpgroup.wait_group(1)  # k-tile 2i has retired
            mainloop.consumer_release(release)
            release.advance()
            if 2 * i + 2 < k_tiles:
                read.advance()
                mainloop.consumer_wait(read)
                self._load_transform(xf, 0, read.index, 2 * i + 2)
        if k_tiles % 2 == 1:  # the last k-tile, in buffer 0
            self._mma(tiled_mma, acc, bufs[0], tCrB, read.index, k_blocks)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.wait_group(1)
            if k_tiles > 1:
                mainloop.consumer_release(release)
                release.advance()
        warpgroup.wait_group(0)
        mainloop.consumer_release(release)
        release.advance()
        read.advance()
        return read, release

    @cute.jit
    def _load_transform(self, xf, b, stage, k):
        """k-tile k (in shared-memory ``stage``) into register buffer ``b`` as exp(z - lse) - onehot. dX form: the
        one-hot compare runs only where one of the thread's rows has its target in this k-tile (rarely: 1 in V /
        64). dW form: lse and the target of each value's k position (token) read per k-tile (L1)."""
        s2r, sAv, views, bufs, crd, lse2 = xf["s2r"], xf["sAv"], xf["views"], xf["bufs"], xf["crd"], xf["lse2"]
        tgt, nv, k_blocks, mLse, mTgt = xf["tgt"], xf["nv"], xf["k_blocks"], xf["mLse"], xf["mTgt"]
        for j in cutlass.range_constexpr(k_blocks):
            cute.copy(s2r, sAv[(None, None, j, stage)], views[b][(None, None, j)])
        lo = k * self.cfg.tile_k
        if cutlass.const_expr(self.IDENTITY):
            return  # the register-A path alone: ldmatrix, no transform (wrong results; timing only)
        if cutlass.const_expr(self.SCALED):
            self._scale_transform(xf, b, k, lo)
            if cutlass.const_expr(self.DW):
                pass
            elif cutlass.const_expr(self.WRITE_DZ == "smem"):
                self._write_dz_smem(xf, b, k, stage)
            elif cutlass.const_expr(self.WRITE_DZ is True):
                self._write_dz(xf, b, k, lo)
            return
        if cutlass.const_expr(self.DW):
            last = mLse.shape[0] - 1
            for j in cutlass.range_constexpr(k_blocks):
                frag = bufs[b][(None, None, j)]
                cj = crd[(None, None, j)]
                for v in cutlass.range_constexpr(nv):
                    tok = cutlass.min(lo + cj[v][1], last)
                    e = cute.arch.exp2(frag[v].to(cutlass.Float32) * LOG2E - mLse[tok, 0] * LOG2E)
                    one = cutlass.select_(cutlass.Int32(mTgt[tok, 0]) == tgt[v], cutlass.Float32(1.0),
                                          cutlass.Float32(0.0))
                    frag[v] = (e - one).to(cutlass.BFloat16)
        else:
            hit = cutlass.Boolean(False)
            for v in cutlass.range_constexpr(nv):
                hit = hit | ((tgt[v] >= lo) & (tgt[v] < lo + self.cfg.tile_k))
            if hit:
                for j in cutlass.range_constexpr(k_blocks):
                    frag = bufs[b][(None, None, j)]
                    cj = crd[(None, None, j)]
                    for v in cutlass.range_constexpr(nv):
                        e = cute.arch.exp2(frag[v].to(cutlass.Float32) * LOG2E - lse2[v])
                        one = cutlass.select_(lo + cj[v][1] == tgt[v], cutlass.Float32(1.0), cutlass.Float32(0.0))
                        frag[v] = (e - one).to(cutlass.BFloat16)
            else:
                for j in cutlass.range_constexpr(k_blocks):
                    frag = bufs[b][(None, None, j)]
                    for v in cutlass.range_constexpr(nv):
                        frag[v] = cute.arch.exp2(frag[v].to(cutlass.Float32) * LOG2E - lse2[v]).to(
                            cutlass.BFloat16)

    @cute.jit
    def _scale_transform(self, xf, b, k, lo):
        """The stored-exponential form: A holds e = exp(z - m_t) (m_t the row's maximum over its 256-column block t
        of the logits), the table (``lse`` operand's memory, rows x T fp32) s = exp(m_t - lse): dz = e s - onehot,
        a multiply per element (no MUFU)."""
        bufs, crd, tgt, nv, k_blocks, mTab = xf["bufs"], xf["crd"], xf["tgt"], xf["nv"], xf["k_blocks"], xf["mLse"]
        mTgt, rowoff, st_dw, n_st, scn, tkt = xf["mTgt"], xf["rowoff"], xf["st_dw"], xf["n_st"], xf["scn"], xf["tkt"]
        k_tiles = xf["k_tiles"]
        if cutlass.const_expr(self.DW and self.PACKED):
            self._scale_transform_dw(xf, b, k, lo)
        elif cutlass.const_expr(self.DW):
            last = mTgt.shape[0] - 1
            for j in cutlass.range_constexpr(k_blocks):
                frag = bufs[b][(None, None, j)]
                cj = crd[(None, None, j)]
                for v in cutlass.range_constexpr(nv):
                    tok = cutlass.min(lo + cj[v][1], last)
                    sc = mTab[tok * n_st + st_dw, 0]
                    one = cutlass.select_(cutlass.Int32(mTgt[tok, 0]) == tgt[v], cutlass.Float32(1.0),
                                          cutlass.Float32(0.0))
                    frag[v] = (frag[v].to(cutlass.Float32) * sc - one).to(cutlass.BFloat16)
        else:
            sc = cute.make_rmem_tensor((nv,), cutlass.Float32)
            for v in cutlass.range_constexpr(nv):
                sc[v] = scn[(v // 2) % 2]
            hit = (tkt[0] == k) | (tkt[1] == k)
            # the next k-tile's scales (tile_k 64: four k-tiles a 256-column block), loaded under this transform
            st = cutlass.min(k + 1, k_tiles - 1) // 4
            for i in cutlass.range_constexpr(2):
                scn[i] = mTab[rowoff[2 * i] + st, 0]
            if hit:
                for j in cutlass.range_constexpr(k_blocks):
                    frag = bufs[b][(None, None, j)]
                    cj = crd[(None, None, j)]
                    for v in cutlass.range_constexpr(nv):
                        one = cutlass.select_(lo + cj[v][1] == tgt[v], cutlass.Float32(1.0), cutlass.Float32(0.0))
                        frag[v] = (frag[v].to(cutlass.Float32) * sc[v] - one).to(cutlass.BFloat16)
            elif cutlass.const_expr(self.PACKED):  # bf16x2 multiplies: no conversions (v, v + 1: one row, k, k + 1)
                scb = cute.make_rmem_tensor((nv,), cutlass.BFloat16)
                for v in cutlass.range_constexpr(nv):
                    scb[v] = sc[v].to(cutlass.BFloat16)
                zero = cutlass.BFloat16(0.0)
                for j in cutlass.range_constexpr(k_blocks):
                    frag = bufs[b][(None, None, j)]
                    for v in cutlass.range_constexpr(0, nv, 2):
                        p0, p1 = cute.arch.fma_packed_bf16x2((frag[v], frag[v + 1]), (scb[v], scb[v + 1]),
                                                             (zero, zero))
                        frag[v] = p0
                        frag[v + 1] = p1
            else:
                for j in cutlass.range_constexpr(k_blocks):
                    frag = bufs[b][(None, None, j)]
                    for v in cutlass.range_constexpr(nv):
                        frag[v] = (frag[v].to(cutlass.Float32) * sc[v]).to(cutlass.BFloat16)

    @cute.jit
    def _write_dz(self, xf, b, k, lo):
        """Store the transformed k-tile (dz) from registers when this CTA is the k-tile's writer (k % n_cols ==
        n): 32-bit stores of the fragment's (k, k + 1) pairs; rows past M and columns past V skipped."""
        bufs, crd, nv, k_blocks, wz = xf["bufs"], xf["crd"], xf["nv"], xf["k_blocks"], xf["wz"]
        dz32, rowi, n, n_cols, V = wz
        if k % n_cols == n:
            for j in cutlass.range_constexpr(k_blocks):
                w32 = cute.recast_tensor(bufs[b][(None, None, j)], cutlass.Int32)
                cj = crd[(None, None, j)]
                for v in cutlass.range_constexpr(0, nv, 2):
                    col = lo + cj[v][1]
                    if (rowi[v] >= 0) & (col < V):
                        dz32[(rowi[v] * V + col) // 2] = w32[v // 2]

    @cute.jit
    def _write_dz_smem(self, xf, b, k, stage):
        """``_write_dz`` through shared memory: the writer CTA's threads stmatrix the transformed fragments over the
        A tile of ``stage`` (the WGMMAs read A from registers; each thread overwrites what it loaded), meet at a
        named barrier, and copy the tile to dz in 16-byte chunks of whole rows (coalesced)."""
        (dz32, rowi, n, n_cols, kp), (r2s, sAd, rv, s2g, src, dst) = xf["wz"]
        if k % n_cols == n:
            for j in cutlass.range_constexpr(xf["k_blocks"]):
                cute.copy(r2s, rv[b][(None, None, j)], sAd[(None, None, j, stage)])
            cute.arch.barrier(barrier_id=7, number_of_threads=2 * 128)
            cute.copy(s2g, src[(None, None, None, stage)], dst[(None, None, None, k)])

    @cute.jit
    def _scale_pairs(self, pre, offs, tab32, mTgt, base, lo, k_blocks):
        """Load the scale pairs of k-tile ``lo``'s tokens (2t, 2t + 1 and 2t + 8, 2t + 9 of each k-block: ``offs``)
        into ``pre``: 32-bit loads of two adjacent bf16 table entries; then the lane's two of its 64 targets."""
        row = (base + lo) // 2
        for i in cutlass.range_constexpr(2 * k_blocks):
            pre[i] = tab32[row + offs[i]]
        lane = cute.arch.lane_idx()
        pre[2 * k_blocks] = cutlass.Int32(mTgt[lo + lane, 0])
        pre[2 * k_blocks + 1] = cutlass.Int32(mTgt[lo + 32 + lane, 0])

    @cute.jit
    def _scale_transform_dw(self, xf, b, k, lo):
        """The packed dW form: A = e^T (rows: vocabulary entries of one 256-row block st, k: tokens); the table
        (bf16, st-major: T x k_tiles * tile_k) gives a token pair's scales as one 32-bit word, prefetched a k-tile
        ahead; values (v, v + 1) are tokens (k, k + 1) of one row, values v and v + 2 the same tokens of rows g and
        g + 8. The one-hot: each lane reads two of the k-tile's 64 targets and the warp votes whether any lies in
        the warp's 16 rows; only then (rarely) the fp32 path with per-value compares."""
        bufs, crd, tgt, nv, k_blocks, mTgt = xf["bufs"], xf["crd"], xf["tgt"], xf["nv"], xf["k_blocks"], xf["mTgt"]
        st_dw, k_tiles, pre, tab32 = xf["st_dw"], xf["k_tiles"], xf["pre"], xf["tab32"]
        cfg = self.cfg
        (pres, offs), cur = pre, pre[0][b]
        sc = cute.recast_tensor(cur, cutlass.BFloat16)  # per k-block tokens 2t, 2t+1, 2t+8, 2t+9 (then 2 targets)
        lane = cute.arch.lane_idx()
        t0 = cur[2 * k_blocks]
        t1 = cur[2 * k_blocks + 1]
        wr = tgt[0] - lane // 4  # this warp's 16 rows (lane's rows: wr + lane / 4 and + 8)
        inr = ((t0 >= wr) & (t0 < wr + 16)) | ((t1 >= wr) & (t1 < wr + 16))
        hit = cute.arch.vote_any_sync(inr)
        if k + 1 < k_tiles:  # the next k-tile's scales, under this one's WGMMAs
            self._scale_pairs(pres[1 - b], offs, tab32, mTgt, st_dw * (k_tiles * cfg.tile_k), lo + cfg.tile_k,
                              k_blocks)
        zero = cutlass.BFloat16(0.0)
        if hit:
            for j in cutlass.range_constexpr(k_blocks):
                frag = bufs[b][(None, None, j)]
                cj = crd[(None, None, j)]
                for v in cutlass.range_constexpr(nv):
                    tok = lo + cj[v][1]
                    one = cutlass.select_(cutlass.Int32(mTgt[tok, 0]) == tgt[v], cutlass.Float32(1.0),
                                          cutlass.Float32(0.0))
                    sv = sc[4 * j + (v % 2) + 2 * (v // 4)]
                    frag[v] = (frag[v].to(cutlass.Float32) * sv.to(cutlass.Float32) - one).to(cutlass.BFloat16)
        else:
            for j in cutlass.range_constexpr(k_blocks):
                frag = bufs[b][(None, None, j)]
                for v in cutlass.range_constexpr(0, nv, 2):
                    q = 4 * j + 2 * (v // 4)
                    p0, p1 = cute.arch.fma_packed_bf16x2((frag[v], frag[v + 1]), (sc[q], sc[q + 1]), (zero, zero))
                    frag[v] = p0
                    frag[v + 1] = p1

    @staticmethod
    def _mma(tiled_mma, acc, buf, tCrB, stage, k_blocks):
        """One k-tile's register-A WGMMAs, one commit group (the caller sets ACCUMULATE after it)."""
        warpgroup.fence()
        for j in range(k_blocks):
            cute.gemm(tiled_mma, acc, buf[(None, None, j)], tCrB[(None, None, j, stage)], acc)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()


class ScaledGradA(SoftmaxGradA):
    """A holds e = exp(z - m_t) (bf16), the ``lse`` operand's memory the table s = exp(m_t - lse) (fp32, rows x
    ceil(V / 256): the VecM view is its first rows values): the transform is a multiply."""
    SCALED = True


class ScaledPackedA(ScaledGradA):
    """The scaled form with the multiply as one bf16x2 FMA per two values (s rounded to bf16)."""
    PACKED = True


class WriteDzA(ScaledPackedA):
    """The scaled packed dX form that also stores dz (the ``dzo`` operand's memory, M x V bf16), each k-tile by one
    of the row block's CTAs, so that the dW GEMM can run plain on it."""
    WRITE_DZ = True


class WriteDzSmemA(ScaledPackedA):
    """``WriteDzA`` with the dz stores through the A stage in shared memory (coalesced 16-byte rows)."""
    WRITE_DZ = "smem"


class IdentityA(SoftmaxGradA):
    """The register-A mainloop without a transform: what the RS path costs by itself (its results are z W)."""
    IDENTITY = True


PTX_COUNTS = ("cvt.rn.bf16.f32", "cvt.rn.bf16x2.f32", "cvt.f32.bf16", "fma.rn.bf16x2", "stmatrix", "st.global.v4",
              "st.global.b32", "bar.sync")


def compile_only(cls):
    import re
    import subprocess
    import tempfile
    import shutil
    import cutlass.runtime as crt
    from coda.check import fake_args
    for form, majors in (("dX", ("k", "mn")), ("dW", ("mn", "mn"))):
        d = tempfile.mkdtemp()
        (a, b, c), xs = fake_args(carry, "bf16", "bf16", majors)
        cute.compile(cls(GemmConfig(), carry), a, b, c, 66, crt.make_fake_stream(), *xs,
                     options=f"--gpu-arch=sm_90a --keep-ptx --keep-cubin --dump-dir={d}")
        ptx = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".ptx")][0]
        text = open(ptx).read()
        wgmma = sorted({ln.split()[0] for ln in text.splitlines() if "wgmma.mma_async" in ln})
        print(cls.__name__, form, "wgmma:", wgmma,
              "count", text.count("wgmma.mma_async"), "ldmatrix", sorted(set(re.findall(r"ldmatrix[\w.]+", text))),
              len(re.findall(r"ldmatrix\.", text)), "ex2", text.count("ex2.approx"),
              "cvt", {c: text.count(c) for c in PTX_COUNTS})
        if shutil.which("ptxas"):
            r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True, text=True)
            print("\n".join(ln for ln in (r.stderr or r.stdout).splitlines()
                            if any(w in ln for w in ("registers", "spill", "arning", "erformance", "wgmma"))))


def gpu(M, V, H, cls, ncu=False):
    os.environ["CODA_COMPILE_CACHE"] = "0"  # the carry epilogue's kernel is this module's: never on disk
    import torch
    import coda.kernels.gemm_sm90 as G
    from coda.bench.gemm import median_of_runs
    base = G.GemmSm90
    G.GemmSm90 = lambda cfg, epi, **kw: (cls if epi is carry else base)(cfg, epi, **kw)  # noqa: E731
    torch.manual_seed(0)
    dev = "cuda"
    z = (torch.randn(M, V, device=dev) * 2).to(torch.bfloat16)
    W = (torch.randn(V, H, device=dev) / 16).to(torch.bfloat16)
    tgt = torch.randint(0, V, (M,), device=dev)
    lse = torch.logsumexp(z.float(), dim=1)
    dz = (torch.softmax(z.float(), dim=1) - torch.nn.functional.one_hot(tgt, V).float()).to(torch.bfloat16)
    ref = torch.mm(dz, W)
    a_dx, lse_dx = z, lse
    if cls.SCALED:  # e = exp(z - m_t) per 256-column block t, the table s = exp(m_t - lse)
        T = -(-V // 256)
        zp = torch.nn.functional.pad(z.float(), (0, T * 256 - V), value=-float("inf")).view(M, T, 256)
        m_t = zp.amax(dim=2)
        a_dx = torch.exp(zp - m_t[:, :, None]).view(M, T * 256)[:, :V].to(torch.bfloat16).contiguous()
        tab = torch.exp(m_t - lse[:, None]).contiguous()  # (M, T) fp32
        lse_dx = tab.view(-1)[:M]
    out = torch.full((M, H), float("nan"), device=dev, dtype=torch.bfloat16)
    cfg = GemmConfig()
    v64 = -(-V // 64) * 64
    # WriteDzA's dz (row stride v64: whole k-tiles; rows padded to whole tiles: WriteDzSmemA writes whole tiles)
    dz_out = torch.full((-(-M // 128) * 128, v64), float("nan"), device=dev, dtype=torch.bfloat16)
    run = lambda: coda.gemm(a_dx, W.t(), epilogue=carry, out=out, config=cfg, lse=lse_dx, tgt=tgt.float(),  # noqa
                            dzo=dz_out.view(-1)[:M])
    run()
    torch.cuda.synchronize()
    assert not out.isnan().any(), "unwritten elements"
    if cls.WRITE_DZ:
        d = dz_out[:M, :V]
        assert not d.isnan().any(), "unwritten dz elements"
        print(f"dz stored: max |ours - torch| {(d.float() - dz.float()).abs().max().item():.2e} (max |dz| "
              f"{dz.float().abs().max().item():.2e})", flush=True)
    rows = torch.randperm(M, device=dev)[:64]
    r64 = (torch.softmax(z[rows].double(), 1) - torch.nn.functional.one_hot(tgt[rows], V).double()) @ W.double()
    err = lambda x: ((x.double() - r64).norm() / r64.norm()).item()  # noqa: E731
    print(f"dX {M}x{H}x{V}: error vs float64 rows: ours {err(out[rows]):.2e}, torch bf16 path {err(ref[rows]):.2e}; "
          f"ours vs torch max rel {((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item():.2e}",
          flush=True)
    t_ours = median_of_runs(run, rep_ms=200) if not ncu else 0.0
    t_plain = median_of_runs(lambda: coda.gemm(dz, W.t(), config=cfg), rep_ms=200) if not ncu else 0.0
    t_cublas = median_of_runs(lambda: torch.mm(dz, W), rep_ms=200) if not ncu else 0.0
    print(f"ms: transform in the mainloop {t_ours:.3f}; CODA plain on dz {t_plain:.3f} ({cfg.name}); cuBLAS on dz "
          f"{t_cublas:.3f} (the pass it would remove: ~{2 * 2 * M * V / 2.9e9:.3f} at 2.9 TB/s)", flush=True)
    # the dW form: dW = dz^T x (M tokens = K), A = z^T MN-major; lse / targets per token in V-long VecMs
    x = (torch.randn(M, H, device=dev) / 4).to(torch.bfloat16)
    pad = lambda t: torch.cat([t.float(), t.new_zeros(V - M).float()])  # noqa: E731
    lse_v, tgt_v = pad(lse), pad(tgt)
    a_dw = z
    if cls.PACKED:  # the table st-major in bf16, tokens padded to whole k-tiles: a token pair's scales adjacent
        m64 = -(-M // 64) * 64
        tab_t = torch.zeros(T, m64, device=dev, dtype=torch.bfloat16)
        tab_t[:, :M] = tab.t().to(torch.bfloat16)
        a_dw, lse_v = a_dx, tab_t.view(-1)[:V]
    elif cls.SCALED:
        a_dw, lse_v = a_dx, tab.view(-1)[:V]  # the fp32 (token, block) table: M x T >= V values at these shapes
    dw = torch.full((V, H), float("nan"), device=dev, dtype=torch.bfloat16)
    no_dz = torch.zeros(V, device=dev, dtype=torch.bfloat16)  # the dW form stores no dz (carry's operand)
    run_t = lambda: coda.gemm(a_dw.t(), x.t(), epilogue=carry, out=dw, config=cfg, lse=lse_v, tgt=tgt_v,  # noqa
                              dzo=no_dz)
    run_t()
    torch.cuda.synchronize()
    assert not dw.isnan().any(), "unwritten elements (dW)"
    ref_t = torch.mm(dz.t(), x)
    vs = torch.randperm(V, device=dev)[:64]
    p_cols = (torch.softmax(z.float(), dim=1)[:, vs].double()
              - (tgt[:, None] == vs[None, :]).double())
    w64 = p_cols.t() @ x.double()
    err_t = lambda t: ((t.double() - w64).norm() / w64.norm()).item()  # noqa: E731
    print(f"dW {V}x{H}x{M}: error vs float64 rows: ours {err_t(dw[vs]):.2e}, torch bf16 path {err_t(ref_t[vs]):.2e}",
          flush=True)
    if ncu:  # one launch each of: the dX transform, the plain dX, the dW transform, the plain dW
        coda.gemm(dz, W.t(), config=cfg)
        coda.gemm(dz.t(), x.t(), config=cfg)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        run()
        coda.gemm(dz, W.t(), config=cfg)
        run_t()
        coda.gemm(dz.t(), x.t(), config=cfg)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return
    t_ours = median_of_runs(run_t, rep_ms=200)
    t_plain = median_of_runs(lambda: coda.gemm(dz.t(), x.t(), config=cfg), rep_ms=200)
    t_cublas = median_of_runs(lambda: torch.mm(dz.t(), x), rep_ms=200)
    print(f"ms: dW transform in the mainloop {t_ours:.3f}; CODA plain on dz {t_plain:.3f}; cuBLAS {t_cublas:.3f}",
          flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--scaled", action="store_true", help="A holds exp(z - m_t), a per-(row, 256 columns) scale")
    ap.add_argument("--packed", action="store_true", help="with --scaled: bf16x2 multiplies")
    ap.add_argument("--ncu", action="store_true", help="one launch of each kernel between profiler start / stop")
    ap.add_argument("--write-dz", action="store_true", help="with --scaled --packed: the dX form stores dz")
    ap.add_argument("--write-dz-smem", action="store_true", help="--write-dz through shared memory")
    ap.add_argument("--identity", action="store_true", help="no transform: time the register-A path alone")
    ap.add_argument("--shape", default="1000,4000,264;8192,128256,2048", help="M,V,H[;M,V,H...]")
    a = ap.parse_args()
    cls = next(c for flag, c in ((a.identity, IdentityA), (a.write_dz_smem, WriteDzSmemA), (a.write_dz, WriteDzA),
                                 (a.scaled and a.packed, ScaledPackedA), (a.scaled, ScaledGradA), (True, SoftmaxGradA))
               if flag)
    if a.compile:
        compile_only(cls)
    else:
        for shape in a.shape.split(";"):
            gpu(*map(int, shape.split(",")), cls, a.ncu)


if __name__ == "__main__":
    main()
