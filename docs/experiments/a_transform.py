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
equal to torch's bf16 path at both shapes. The dW GEMM (A = dz^T, MN-major: ldmatrix .trans) needs the same
before the pass can go: the same class with A = z^T (lse and the target per token, read per k-tile) compiles for sm_90a on
the CPU (4 bytes of spills at 168 registers) and ``gpu()`` checks and times it after the dX form -- not yet run on a
GPU (session 35's device time was spent).

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
def carry(acc, lse: coda.VecM, tgt: coda.VecM):
    """The plain product; its operands are read by the mainloop only."""
    return acc


class SoftmaxGradA(GemmSm90):
    """``GemmSm90`` whose A operand (the stored logits, K-major) becomes exp(z - lse) - onehot in registers: the dX
    GEMM, rows = tokens. An MN-major A is the dW GEMM's z^T (``DW``, ldmatrix .trans), rows = vocabulary entries,
    k = tokens: lse and the target come per k position (the VecM operands then hold T <= V values: an
    experiment's shortcut, the kernel has no per-k operand kind)."""

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
        for v in cutlass.range_constexpr(nv):
            r = ctx["m"] * cfg.tile_m + c0[v][0]
            lse2[v] = cutlass.Float32(0.0)
            tgt[v] = cutlass.Int32(-1)
            if cutlass.const_expr(not self.DW):
                if r < rows:
                    lse2[v] = mLse[r, 0] * LOG2E
                    tgt[v] = cutlass.Int32(mTgt[r, 0])
            else:
                tgt[v] = r  # the dW form compares the vocabulary row with each k position's target

        xf = (s2r, sAv, views, bufs, crd, lse2, tgt, nv, k_blocks, mLse, mTgt)
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
        s2r, sAv, views, bufs, crd, lse2, tgt, nv, k_blocks, mLse, mTgt = xf
        for j in cutlass.range_constexpr(k_blocks):
            cute.copy(s2r, sAv[(None, None, j, stage)], views[b][(None, None, j)])
        lo = k * self.cfg.tile_k
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

    @staticmethod
    def _mma(tiled_mma, acc, buf, tCrB, stage, k_blocks):
        """One k-tile's register-A WGMMAs, one commit group (the caller sets ACCUMULATE after it)."""
        warpgroup.fence()
        for j in range(k_blocks):
            cute.gemm(tiled_mma, acc, buf[(None, None, j)], tCrB[(None, None, j, stage)], acc)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()


def compile_only():
    import re
    import subprocess
    import tempfile
    import shutil
    import cutlass.runtime as crt
    from coda.check import fake_args
    for form, majors in (("dX", ("k", "mn")), ("dW", ("mn", "mn"))):
        d = tempfile.mkdtemp()
        (a, b, c), xs = fake_args(carry, "bf16", "bf16", majors)
        cute.compile(SoftmaxGradA(GemmConfig(), carry), a, b, c, 66, crt.make_fake_stream(), *xs,
                     options=f"--gpu-arch=sm_90a --keep-ptx --keep-cubin --dump-dir={d}")
        ptx = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".ptx")][0]
        text = open(ptx).read()
        print(form, "wgmma:", sorted({ln.split()[0] for ln in text.splitlines() if "wgmma.mma_async" in ln}),
              "count", text.count("wgmma.mma_async"), "ldmatrix", sorted(set(re.findall(r"ldmatrix[\w.]+", text))),
              len(re.findall(r"ldmatrix\.", text)), "ex2", text.count("ex2.approx"))
        if shutil.which("ptxas"):
            r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True, text=True)
            print("\n".join(ln for ln in (r.stderr or r.stdout).splitlines() if "registers" in ln or "spill" in ln))


def gpu(M, V, H):
    os.environ["CODA_COMPILE_CACHE"] = "0"  # the carry epilogue's kernel is this module's: never on disk
    import torch
    import coda.kernels.gemm_sm90 as G
    from coda.bench.gemm import median_of_runs
    base = G.GemmSm90
    G.GemmSm90 = lambda cfg, epi, **kw: (SoftmaxGradA if epi is carry else base)(cfg, epi, **kw)  # noqa: E731
    torch.manual_seed(0)
    dev = "cuda"
    z = (torch.randn(M, V, device=dev) * 2).to(torch.bfloat16)
    W = (torch.randn(V, H, device=dev) / 16).to(torch.bfloat16)
    tgt = torch.randint(0, V, (M,), device=dev)
    lse = torch.logsumexp(z.float(), dim=1)
    dz = (torch.softmax(z.float(), dim=1) - torch.nn.functional.one_hot(tgt, V).float()).to(torch.bfloat16)
    ref = torch.mm(dz, W)
    out = torch.full((M, H), float("nan"), device=dev, dtype=torch.bfloat16)
    cfg = GemmConfig()
    run = lambda: coda.gemm(z, W.t(), epilogue=carry, out=out, config=cfg, lse=lse, tgt=tgt.float())  # noqa: E731
    run()
    torch.cuda.synchronize()
    assert not out.isnan().any(), "unwritten elements"
    rows = torch.randperm(M, device=dev)[:64]
    r64 = (torch.softmax(z[rows].double(), 1) - torch.nn.functional.one_hot(tgt[rows], V).double()) @ W.double()
    err = lambda x: ((x.double() - r64).norm() / r64.norm()).item()  # noqa: E731
    print(f"dX {M}x{H}x{V}: error vs float64 rows: ours {err(out[rows]):.2e}, torch bf16 path {err(ref[rows]):.2e}; "
          f"ours vs torch max rel {((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item():.2e}",
          flush=True)
    t_ours = median_of_runs(run, rep_ms=200)
    t_plain = median_of_runs(lambda: coda.gemm(dz, W.t(), config=cfg), rep_ms=200)
    t_cublas = median_of_runs(lambda: torch.mm(dz, W), rep_ms=200)
    print(f"ms: transform in the mainloop {t_ours:.3f}; CODA plain on dz {t_plain:.3f} ({cfg.name}); cuBLAS on dz "
          f"{t_cublas:.3f} (the pass it would remove: ~{2 * 2 * M * V / 2.9e9:.3f} at 2.9 TB/s)", flush=True)
    # the dW form: dW = dz^T x (M tokens = K), A = z^T MN-major; lse / targets per token in V-long VecMs
    x = (torch.randn(M, H, device=dev) / 4).to(torch.bfloat16)
    pad = lambda t: torch.cat([t.float(), t.new_zeros(V - M).float()])  # noqa: E731
    lse_v, tgt_v = pad(lse), pad(tgt)
    dw = torch.full((V, H), float("nan"), device=dev, dtype=torch.bfloat16)
    run_t = lambda: coda.gemm(z.t(), x.t(), epilogue=carry, out=dw, config=cfg, lse=lse_v, tgt=tgt_v)  # noqa: E731
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
    t_ours = median_of_runs(run_t, rep_ms=200)
    t_plain = median_of_runs(lambda: coda.gemm(dz.t(), x.t(), config=cfg), rep_ms=200)
    t_cublas = median_of_runs(lambda: torch.mm(dz.t(), x), rep_ms=200)
    print(f"ms: dW transform in the mainloop {t_ours:.3f}; CODA plain on dz {t_plain:.3f}; cuBLAS {t_cublas:.3f}",
          flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--shape", default="1000,4000,264;8192,128256,2048", help="M,V,H[;M,V,H...]")
    a = ap.parse_args()
    if a.compile:
        compile_only()
    else:
        for shape in a.shape.split(";"):
            gpu(*map(int, shape.split(",")))


if __name__ == "__main__":
    main()
