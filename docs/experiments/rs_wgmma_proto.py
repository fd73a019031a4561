"""Compile-only prototype: Hopper RS WGMMA (A from registers) with an elementwise A-operand transform.

An experiment, not library code (session 32, docs/NOTES.md "The A-operand transform"): the design study for forming
the cross entropy's softmax gradient while GEMMs 2 and 3 load the stored logits, which would remove the
softmax-gradient pass (ce_grad). Not run on a GPU; the layouts are checked by rs_wgmma_layout_check.py.

One warpgroup (128 threads), one CTA:
  A tile (64 x K, bf16) and B tile (N x K, bf16) -> shared memory (plain element copy from global)
  A: smem -> registers in the WGMMA A-fragment layout (ldmatrix, .trans when A is MN-major in smem)
  transform in fp32: e = exp(z - c[row]) - (col == tgt[row]), back to bf16
  RS WGMMA m64nNk16 (fp32 accumulate), accumulator -> global.

Run:  CUTE_DSL_ARCH=sm_90a python proto.py [--a-major k|mn] [--n 128] [--k 64] [--no-transform]
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass
import cutlass.cute as cute
import cutlass.runtime as crt
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, warp, warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

WG = 128
LOG2E = 1.4426950408889634


class RSProto:
    def __init__(self, n=128, k=64, transform=True, pipelined=False, packed=False):
        self.packed = packed  # ex2.approx.ftz.bf16x2 on element pairs (half the MUFU ops, bf16-rounded input)
        self.M, self.N, self.K = 64, n, k
        self.transform = transform
        self.pipelined = pipelined  # mainloop shape: runtime k-tile loop, one commit group per k-block

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mRow: cute.Tensor, mTgt: cute.Tensor,
                 k_tiles: cutlass.Int32, stream):
        a_layout = LayoutEnum.from_tensor(mA)   # ROW_MAJOR = K-major, COL_MAJOR = M-major
        b_layout = LayoutEnum.from_tensor(mB)
        self.a_mn_major = not a_layout.is_k_major_a()
        # RS: the MMA atom's A is always K-major (registers have no majorness; wgmma's imm-trans-a is only for
        # descriptor A); B keeps its smem majorness
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, b_layout.sm90_mma_major_mode(),
            cutlass.Float32, (1, 1, 1), tiler_mn=(64, self.N), a_source=warpgroup.OperandSource.RMEM)
        tile = (self.M, self.N, self.K)
        a_smem = sm90_utils.make_smem_layout_a(a_layout, tile, cutlass.BFloat16, 1)
        b_smem = sm90_utils.make_smem_layout_b(b_layout, tile, cutlass.BFloat16, 1)
        self.kernel(mA, mB, mC, mRow, mTgt, k_tiles, self.tiled_mma,
                    cute.slice_(a_smem, (None, None, 0)), cute.slice_(b_smem, (None, None, 0))).launch(
            grid=[1, 1, 1], block=[WG, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mRow: cute.Tensor, mTgt: cute.Tensor,
               k_tiles: cutlass.Int32, tiled_mma: cute.TiledMma, a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()

        @cute.struct
        class Smem:
            sA: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(b_smem)], 1024]

        storage = SmemAllocator().allocate(Smem)
        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)   # (64, K), swizzled
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)   # (N, K), swizzled

        # ---- global -> smem (plain element copy; the real kernel uses TMA)
        gA = mA[(None, None, 0)]
        gB = mB[(None, None, 0)]
        for i in cutlass.range_constexpr(self.M * self.K // WG):
            e = i * WG + tidx
            r, c = e % self.M, e // self.M   # consecutive threads walk M (coalesced for M-major, fine for a proto)
            if cutlass.const_expr(not self.a_mn_major):
                r, c = e // self.K, e % self.K
            sA[r, c] = gA[r, c]
        for i in cutlass.range_constexpr(self.N * self.K // WG):
            e = i * WG + tidx
            sB[e // self.K, e % self.K] = gB[e // self.K, e % self.K]
        cute.arch.sync_threads()

        # ---- fragments
        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = thr_mma.make_fragment_A(thr_mma.partition_shape_A((self.M, self.K)))   # rmem bf16 (V, MMA_M, MMA_K)
        tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB))                       # smem descriptors
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.M, self.N)), cutlass.Float32)
        tCcA = thr_mma.partition_A(cute.make_identity_tensor((self.M, self.K)))       # (row, col) of each A reg

        # ---- A: smem -> registers with ldmatrix laid out as the wgmma A fragment
        s2r_atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=self.a_mn_major, num_matrices=4),
                                       cutlass.BFloat16)
        s2r = cute.make_tiled_copy_A(s2r_atom, tiled_mma)
        thr_s2r = s2r.get_slice(tidx)
        tXsA = thr_s2r.partition_S(sA)      # (CPY, CPY_M, CPY_K)
        tXrA = thr_s2r.retile(tCrA)         # the same registers, viewed in the copy's layout
        k_blocks = cute.size(tCrA, mode=[2])

        if cutlass.const_expr(not self.pipelined):
            for j in cutlass.range_constexpr(k_blocks):
                cute.copy(s2r, tXsA[(None, None, j)], tXrA[(None, None, j)])
                self.transform_kblock(tCrA, tCcA, j, mRow, mTgt, 0)
            # ---- RS WGMMA
            cute.arch.fence_proxy("async.shared", space="cta")   # generic-proxy smem writes (B) -> wgmma reads
            warpgroup.fence()
            tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
            for j in cutlass.range_constexpr(k_blocks):
                cute.gemm(tiled_mma, acc, tCrA[(None, None, j)], tCrB[(None, None, j)], acc)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
        else:
            # mixed-input style: per k-block, ldmatrix + transform of block j while the wgmma of block j-1 runs;
            # one commit group per k-block and wait_group(1) before a block's registers are rewritten (PTX: A regs
            # of an in-flight wgmma must not be touched). (Here every k-tile re-reads the same smem tile.)
            cute.arch.fence_proxy("async.shared", space="cta")
            tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
            for kt in cutlass.range(k_tiles, unroll=1):
                for j in cutlass.range_constexpr(k_blocks):
                    cute.copy(s2r, tXsA[(None, None, j)], tXrA[(None, None, j)])
                    self.transform_kblock(tCrA, tCcA, j, mRow, mTgt, kt * self.K)
                    warpgroup.fence()
                    cute.gemm(tiled_mma, acc, tCrA[(None, None, j)], tCrB[(None, None, j)], acc)
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                    warpgroup.commit_group()
                    warpgroup.wait_group(1)
            warpgroup.wait_group(0)

        # ---- accumulator -> global
        tCgC = thr_mma.partition_C(mC[(None, None, 0)])
        for v in cutlass.range_constexpr(cute.size(acc)):
            tCgC[v] = acc[v]


    @cute.jit
    def transform_kblock(self, tCrA, tCcA, j, mRow, mTgt, col0):
        """dz = exp(z - c[row]) - [col == tgt[row]] on k-block j of the A fragment, in fp32, back to bf16."""
        if cutlass.const_expr(self.transform and self.packed):
            frag = tCrA[(None, None, j)]
            crd = tCcA[(None, None, j)]
            for p in cutlass.range_constexpr(cute.size(frag) // 2):   # registers 2p, 2p+1: same row, columns c, c+1
                row, col = crd[2 * p]
                c = mRow[row] * LOG2E
                x0 = frag[2 * p].to(cutlass.Float32) * LOG2E - c
                x1 = frag[2 * p + 1].to(cutlass.Float32) * LOG2E - c
                e0, e1 = cute.arch.exp2_packed_bf16x2((x0.to(cutlass.BFloat16), x1.to(cutlass.BFloat16)))
                t = mTgt[row] - col - col0
                one = cutlass.BFloat16(1.0)
                zero = cutlass.BFloat16(0.0)
                d0, d1 = cute.arch.sub_packed_bf16x2((e0, e1), (cutlass.select_(t == 0, one, zero),
                                                                cutlass.select_(t == 1, one, zero)))
                frag[2 * p] = d0
                frag[2 * p + 1] = d1
        elif cutlass.const_expr(self.transform):
            frag = tCrA[(None, None, j)]
            crd = tCcA[(None, None, j)]
            for v in cutlass.range_constexpr(cute.size(frag)):
                row, col = crd[v]
                z = frag[v].to(cutlass.Float32)
                e = cute.arch.exp2((z - mRow[row]) * LOG2E)
                e = e - cutlass.select_(col + col0 == mTgt[row], cutlass.Float32(1.0), cutlass.Float32(0.0))
                frag[v] = e.to(cutlass.BFloat16)


def fake_args(a_major, n, k):
    bf, f32 = cutlass.BFloat16, cutlass.Float32
    # A (M, K, L): "k" -> K contiguous; "mn" -> M contiguous (dz^T as the dW GEMM's A)
    a = make_fake_compact_tensor(bf, (64, k, 1), stride_order=(1, 0, 2) if a_major == "k" else (0, 1, 2),
                                 assumed_align=16)
    b = make_fake_compact_tensor(bf, (n, k, 1), stride_order=(1, 0, 2), assumed_align=16)
    c = make_fake_compact_tensor(f32, (64, n, 1), stride_order=(1, 0, 2), assumed_align=16)
    row = make_fake_compact_tensor(f32, (64,), assumed_align=16)
    tgt = make_fake_compact_tensor(cutlass.Int32, (64,), assumed_align=16)
    return a, b, c, row, tgt


def build(a_major="k", n=128, k=64, transform=True, keep=None, pipelined=False, packed=False):
    d = keep or tempfile.mkdtemp(prefix="rs_proto_")
    os.makedirs(d, exist_ok=True)
    cute.compile(RSProto(n, k, transform, pipelined, packed), *fake_args(a_major, n, k), cutlass.Int32(1),
                 crt.make_fake_stream(),
                 options=f"--gpu-arch=sm_90a --keep-ptx --keep-cubin --dump-dir={d}")
    ptx = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".ptx")][0]
    text = open(ptx).read()
    res = dict(ptx=ptx, wgmma=[ln.strip() for ln in text.splitlines() if "wgmma.mma_async" in ln],
               ldmatrix=sorted({m for m in re.findall(r"ldmatrix\.[\w.]+", text)}),
               ldmatrix_n=len(re.findall(r"ldmatrix\.", text)), ex2=text.count("ex2.approx"))
    cubin = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".cubin")]
    if shutil.which("nvdisasm") and cubin:   # SASS instructions between consecutive HGMMAs (one k-block)
        sass = subprocess.run(["nvdisasm", "-c", cubin[0]], capture_output=True, text=True).stdout
        ins = [m.group(1) for m in re.finditer(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)]
        hg = [i for i, op in enumerate(ins) if op.startswith("HGMMA")]
        res["hgmma"] = [ins[i] for i in hg[:1]]
        res["sass_between_hgmma"] = [b - a - 1 for a, b in zip(hg, hg[1:])]
    ptxas = shutil.which("ptxas")
    if ptxas:
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True, text=True)
        res["ptxas"] = (r.stderr or r.stdout).strip()
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--a-major", default="k", choices=["k", "mn"])
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--no-transform", action="store_true")
    ap.add_argument("--dump", default=None)
    ap.add_argument("--pipelined", action="store_true")
    ap.add_argument("--packed-ex2", action="store_true")
    a = ap.parse_args()
    r = build(a.a_major, a.n, a.k, not a.no_transform, a.dump, a.pipelined, a.packed_ex2)
    print("PTX:", r["ptx"])
    print("wgmma count:", len(r["wgmma"]))
    for ln in r["wgmma"][:2]:
        print("  ", ln[:300])
    print("ldmatrix kinds:", r["ldmatrix"], "count:", r["ldmatrix_n"], "ex2.approx:", r["ex2"])
    print("SASS:", r.get("hgmma"), "instructions between HGMMAs:", r.get("sass_between_hgmma"))
    print(r.get("ptxas", "no ptxas"))
