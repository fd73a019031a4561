"""The fast cross entropy on stored exponentials: the softmax gradient formed inside the dX GEMM (no ce_grad pass).

The fast mode (``ops/cross_entropy_fast.py``) stores the logits z (M x V, 16-bit), turns them into dz = softmax -
onehot with one memory-bound pass (``coda.kernels.ce_grad``: a read and a write of M x V, 1.43 ms of a llama-1b step
on the H100) and runs dX = dz W and dW = dz^T x on dz. Here the pass is gone (docs/experiments/a_transform.py has
the measurements that chose this design):

1. **Logits** (:class:`LogitsExpSm90`, epilogue ``ce_exp_logits``): after the mainloop, each 128 x 256 tile's
   accumulator becomes e = exp(z - m_t) in registers, m_t the row's maximum over the tile's valid columns (a
   register pass and two quad shuffles), and the tile writes (m_t, s_t = sum of e) per row to two M x T tables (T =
   the number of 256-column tiles, fp32); the library's epilogue stores e (in (0, 1], 16-bit). The host finishes
   lse = log sum_t s_t exp(m_t) and the scale table s[r, t] = exp(m_t - lse_r) (1 + 2 zl lse_r) g_r.
2. **dX** (:class:`SoftmaxGradDxSm90`, epilogue ``ce_exp_dx``): the mainloop loads each k-tile of e from shared
   memory into registers (ldmatrix, the WGMMA A-fragment layout), multiplies it by the row's scale (one bf16x2 FMA
   per two values; the scales of the next k-tile are loaded under this one's WGMMAs), subtracts g_r at the target
   column (only in the k-tiles that hold one of the thread's rows' targets, in fp32), and issues register-A WGMMAs,
   double-buffered by k-tile. The k-tile's writer CTA (k mod the number of column blocks == its column block: each
   k-tile once) also stores dz: stmatrix over its A stage, a named barrier, 16-byte row chunks to global memory --
   the dW GEMM then runs plain on dz (in the backward, with the weight's update).

dz = e s - g [v == t] = (p (1 + 2 zl lse) - [v == t]) g: the fast mode's gradient without label smoothing or soft-
capping (those keep the ce_grad path). Every product is rounded once more than the pass's (e and s to bf16): errors
vs float64 equal to torch's bf16 path in the experiment (1.67e-3 at 8192 x 2048 x 128256).

The tables and dz reach the kernels through VecM operands whose memory is larger than their M values (the kernel
indexes past M): ``mt`` / ``st`` / ``s`` are views of the first M values of an M x T fp32 table, ``dz`` of a
ceil(M / 128) * 128 x V8 buffer (V8: V rounded up to whole 64-column k-tiles). The epilogues are kernel-only
(``reference`` raises). Constraints: 128 x 256 cooperative tiles without epilogue warps, 64-deep k-tiles, bf16.
"""
import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, warp, warpgroup

from .gemm_sm90 import GemmSm90

LOG2E = 1.4426950408889634
SEG = 256  # columns per table entry: the logits GEMM's tile_n
BAR_DZ = 7  # named barrier of the dX kernel's dz store (1: epilogue, 3-4: ping-pong, 5-6: epilogue warps)


def _check(cfg, k_major_a: bool = True):
    if cfg.tile_m != 128 or cfg.tile_n != SEG or cfg.pingpong or cfg.epi_wg or cfg.tile_k != 64 or not k_major_a:
        raise ValueError(f"coda.kernels.ce_exp: 128 x 256 x 64 cooperative tiles without epilogue warps and a "
                         f"K-major A only, got {cfg.name} (tile_k {cfg.tile_k})")


class LogitsExpSm90(GemmSm90):
    """The logits GEMM whose accumulator leaves the mainloop as e = exp(z - m_t), with (m_t, s_t) per row written
    to the ``mt`` / ``st`` tables (operands 0, 1)."""

    @cute.jit
    def _mainloop(self, mainloop, read, release, k_tiles, k_blocks, tiled_mma, acc, tCrA, tCrB, ctx):
        read, release = GemmSm90._mainloop(self, mainloop, read, release, k_tiles, k_blocks, tiled_mma, acc, tCrA,
                                           tCrB, ctx)
        self._exponentials(tiled_mma, acc, ctx)
        return read, release

    @cute.jit
    def _exponentials(self, tiled_mma, acc, ctx):
        """acc <- exp(acc - m) per row (m: the row's maximum over the tile's columns < N, NaN-propagating), the
        row's (m, sum) to the tables by the first thread of each quad. Accumulator values v, v + 1 / v + 4, ...
        are one row (g), v + 2, v + 3 the row g + 8 (the WGMMA C layout, one 64-row MMA per warpgroup)."""
        cfg = self.cfg
        _check(cfg)
        M, N = ctx["mn"]
        crd = tiled_mma.get_slice(ctx["tidx"]).partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
        n0 = ctx["n"] * cfg.tile_n
        nv = cute.size(acc)
        mx = cute.make_rmem_tensor((2,), cutlass.Float32)
        sm = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            mx[i] = cutlass.Float32(-math.inf)
            sm[i] = cutlass.Float32(0.0)
        for v in cutlass.range_constexpr(nv):
            i = (v // 2) % 2
            mx[i] = cutlass.select_(n0 + crd[v][1] < N, cute.arch.fmax(mx[i], acc[v], nan=True), mx[i])
        for i in cutlass.range_constexpr(2):
            for off in cutlass.range_constexpr(1, 3):  # the quad's four threads hold the row's columns
                mx[i] = cute.arch.fmax(mx[i], cute.arch.shuffle_sync_bfly(mx[i], offset=off), nan=True)
        for v in cutlass.range_constexpr(nv):
            i = (v // 2) % 2
            e = cutlass.select_(n0 + crd[v][1] < N, cute.arch.exp2(acc[v] * LOG2E - mx[i] * LOG2E),
                                cutlass.Float32(0.0))
            acc[v] = e
            sm[i] = sm[i] + e
        for i in cutlass.range_constexpr(2):
            for off in cutlass.range_constexpr(1, 3):
                sm[i] = sm[i] + cute.arch.shuffle_sync_bfly(sm[i], offset=off)
        mT, sT = ctx["ops"][0], ctx["ops"][1]
        if ctx["tidx"] % 4 == 0:
            for i in cutlass.range_constexpr(2):
                r = ctx["m"] * cfg.tile_m + crd[2 * i][0]
                if r < M:
                    mT[r * ctx["n_cols"] + ctx["n"], 0] = mx[i]
                    sT[r * ctx["n_cols"] + ctx["n"], 0] = sm[i]


class SoftmaxGradDxSm90(GemmSm90):
    """dX = dz W on A = e (operands: ``s`` the scale table, ``t`` the targets, ``c`` the one-hot coefficients g_r,
    ``dz`` the dz buffer), dz formed in registers and stored once per k-tile (module docstring, phase 2)."""

    def _tiled_mma(self, a_layout, b_layout):
        _check(self.cfg, a_layout.is_k_major_a())
        return sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, OperandMajorMode.K, b_layout.sm90_mma_major_mode(), self.acc_dtype,
            self.atom_layout, tiler_mn=(64, self.cfg.tile_n), a_source=warpgroup.OperandSource.RMEM)

    @cute.jit
    def _mainloop(self, mainloop, read, release, k_tiles, k_blocks, tiled_mma, acc, tCrA, tCrB, ctx):
        """Double-buffered by k-tile: while the WGMMAs of k-tile t run, k-tile t + 1 is loaded into the other
        register buffer and transformed; wait_group(1) retires k-tile t - 1 (its stage released) first."""
        cfg = self.cfg
        tidx = ctx["tidx"]
        thr = tiled_mma.get_slice(tidx)
        shape_a = thr.partition_shape_A((cfg.tile_m, cfg.tile_k))
        bufs = (thr.make_fragment_A(shape_a), thr.make_fragment_A(shape_a))  # (V, MMA_M, k_blocks) bf16 each
        s2r = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), cutlass.BFloat16),
                                     tiled_mma)
        r2s = cute.make_tiled_copy_A(cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), cutlass.BFloat16),
                                     tiled_mma)
        thr_s2r, thr_r2s = s2r.get_slice(tidx), r2s.get_slice(tidx)
        crd = thr.partition_A(cute.make_identity_tensor((cfg.tile_m, cfg.tile_k)))  # (row, col) in the tile
        mS, mT, mC, mDz = ctx["ops"]
        M = ctx["mn"][0]
        n_seg = (k_tiles + 3) // 4  # table columns: 256 / tile_k = 4 k-tiles each
        # this thread's two rows (fragment values 0, 1 / 4, 5: row g; 2, 3 / 6, 7: row g + 8): the target, the
        # one-hot coefficient, the table row, the k-tile of the target, and the scales loaded a k-tile ahead
        nv = cute.size(bufs[0][(None, None, 0)])
        tgt = cute.make_rmem_tensor((2,), cutlass.Int32)
        cof = cute.make_rmem_tensor((2,), cutlass.Float32)
        toff = cute.make_rmem_tensor((2,), cutlass.Int32)
        tkt = cute.make_rmem_tensor((2,), cutlass.Int32)
        scn = cute.make_rmem_tensor((2,), cutlass.Float32)
        c0 = crd[(None, None, 0)]
        for i in cutlass.range_constexpr(2):
            r = ctx["m"] * cfg.tile_m + c0[2 * i][0]
            tgt[i], cof[i], toff[i] = cutlass.Int32(-1), cutlass.Float32(0.0), cutlass.Int32(0)
            if r < M:
                tgt[i], cof[i], toff[i] = cutlass.Int32(mT[r, 0]), mC[r, 0], r * n_seg
            tkt[i] = cutlass.select_(tgt[i] >= 0, tgt[i] // cfg.tile_k, cutlass.Int32(-1))
            scn[i] = mS[toff[i], 0]
        # the dz store: the A stage's tile (swizzled) written back by stmatrix, then 16-byte row chunks to dz
        kp = k_tiles * cfg.tile_k
        gdz = cute.make_tensor(cute.recast_ptr(mDz.iterator, dtype=cutlass.BFloat16),
                               cute.make_layout((M, kp), stride=(kp, 1)))
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16, num_bits_per_copy=128)
        s2g = cute.make_tiled_copy_tv(atom, cute.make_layout((32, 8), stride=(8, 1)), cute.make_layout((1, 8)))
        thr_s2g = s2g.get_slice(tidx)
        xf = dict(s2r=s2r, r2s=r2s, s2g=s2g, src=thr_s2r.partition_S(ctx["sA"]),
                  views=(thr_s2r.retile(bufs[0]), thr_s2r.retile(bufs[1])), sAd=thr_r2s.partition_D(ctx["sA"]),
                  rviews=(thr_r2s.retile(bufs[0]), thr_r2s.retile(bufs[1])),
                  s_src=thr_s2g.partition_S(ctx["sA"]),
                  s_dst=thr_s2g.partition_D(cute.local_tile(gdz, (cfg.tile_m, cfg.tile_k), (ctx["m"], None))),
                  bufs=bufs, crd=crd, nv=nv, k_blocks=k_blocks, k_tiles=k_tiles, tgt=tgt, cof=cof, toff=toff,
                  tkt=tkt, scn=scn, mS=mS, writer=(ctx["n"], ctx["n_cols"]))

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
        """k-tile k (shared-memory ``stage``) into register buffer ``b`` as dz = e s - g [col == t]; then, in the
        k-tile's writer CTA, dz to global memory."""
        bufs, nv, k_blocks, tgt, cof, scn = xf["bufs"], xf["nv"], xf["k_blocks"], xf["tgt"], xf["cof"], xf["scn"]
        for j in cutlass.range_constexpr(k_blocks):
            cute.copy(xf["s2r"], xf["src"][(None, None, j, stage)], xf["views"][b][(None, None, j)])
        lo = k * self.cfg.tile_k
        sc = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            sc[i] = scn[i]
        hit = (xf["tkt"][0] == k) | (xf["tkt"][1] == k)
        nxt = cutlass.min(k + 1, xf["k_tiles"] - 1) // 4  # the next k-tile's table column, loaded now
        for i in cutlass.range_constexpr(2):
            scn[i] = xf["mS"][xf["toff"][i] + nxt, 0]
        if hit:  # fp32, with the one-hot (p_t close to 1 needs it)
            for j in cutlass.range_constexpr(k_blocks):
                frag = bufs[b][(None, None, j)]
                cj = xf["crd"][(None, None, j)]
                for v in cutlass.range_constexpr(nv):
                    i = (v // 2) % 2
                    one = cutlass.select_(lo + cj[v][1] == tgt[i], cof[i], cutlass.Float32(0.0))
                    frag[v] = (frag[v].to(cutlass.Float32) * sc[i] - one).to(cutlass.BFloat16)
        else:  # one bf16x2 FMA per two values (v, v + 1: one row, columns k, k + 1)
            scb = cute.make_rmem_tensor((2,), cutlass.BFloat16)
            for i in cutlass.range_constexpr(2):
                scb[i] = sc[i].to(cutlass.BFloat16)
            zero = cutlass.BFloat16(0.0)
            for j in cutlass.range_constexpr(k_blocks):
                frag = bufs[b][(None, None, j)]
                for v in cutlass.range_constexpr(0, nv, 2):
                    i = (v // 2) % 2
                    p0, p1 = cute.arch.fma_packed_bf16x2((frag[v], frag[v + 1]), (scb[i], scb[i]), (zero, zero))
                    frag[v] = p0
                    frag[v + 1] = p1
        n, n_cols = xf["writer"]
        if k % n_cols == n:  # this CTA stores the k-tile's dz: over its A stage (each thread what it loaded)
            for j in cutlass.range_constexpr(k_blocks):
                cute.copy(xf["r2s"], xf["rviews"][b][(None, None, j)], xf["sAd"][(None, None, j, stage)])
            cute.arch.barrier(barrier_id=BAR_DZ, number_of_threads=2 * 128)
            cute.copy(xf["s2g"], xf["s_src"][(None, None, None, stage)], xf["s_dst"][(None, None, None, k)])

    @staticmethod
    def _mma(tiled_mma, acc, buf, tCrB, stage, k_blocks):
        """One k-tile's register-A WGMMAs, one commit group (the caller sets ACCUMULATE after it)."""
        warpgroup.fence()
        for j in range(k_blocks):
            cute.gemm(tiled_mma, acc, buf[(None, None, j)], tCrB[(None, None, j, stage)], acc)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
