"""Compile-only feasibility probe: a register-A (RS) Hopper WGMMA whose A tile is rotated pairwise in registers.

Design question: can a WGMMA take A from registers (``warpgroup.OperandSource.RMEM``) after the consumer threads
loaded the A tile from shared memory (ldmatrix, the WGMMA A-fragment layout) and rotated each pair of adjacent
K-elements (2j, 2j + 1) of row r by a per-(r, j) angle, cos / sin read from a global fp32 table cs[r, j, 2]:

    (x0, x1) -> (c * x0 + s * x1, -s * x0 + c * x1),   c = cs[r, j, 0], s = cs[r, j, 1]

(RoPE applied to A inside the GEMM). An experiment, not library code; not run on a GPU (no correctness check).

The kernel: one CTA, one warpgroup (128 threads); tile M = 64, N = 128 or 256 (``--n``), K = 64; bf16 in, fp32
accumulator.
  A (64 x 64, K-major) and B (N x 64, K-major) -> shared memory, the swizzled layouts of
      ``sm90_utils.make_smem_layout_a/b`` (plain cooperative element copy: the simplest that compiles; the library
      kernel uses TMA)
  A: smem -> registers with ``LdMatrix8x8x16bOp(num_matrices=4)`` through ``make_tiled_copy_A(atom, tiled_mma)``,
      retiled onto ``thr_mma.make_fragment_A`` of the RS tiled MMA (``make_trivial_tiled_mma(..., a_source=
      warpgroup.OperandSource.RMEM)``)
  per register pair: bf16 -> fp32, rotate, -> bf16 (``--vec``: c, s of a pair by one 64-bit load)
  ``warpgroup.fence()``, 4 RS WGMMAs m64nNk16 (one per 16-wide k-block), commit, wait
  accumulator -> global (plain fp32 stores from the accumulator fragment)

Fragment-layout finding (checked at trace time by ``check_pairs`` below, for every thread and value):
  ``tiled_mma.tv_layout_A_tiled`` = ((4,8,4),((2,2,2),(1,1))):((128,1,16),((64,8,512),(0,0))) over the 64 x 16
  k-block, index = m + 64 * k. The first value mode (size 2, stride 64) is +1 in k: registers v = 2p and 2p + 1 of
  a thread hold (m, k) and (m, k + 1) with k even (thread lane % 4 picks k = 2 * (lane % 4) [+ 8]). So every k-pair
  (2j, 2j + 1) sits in ONE thread, in consecutive fragment values (one packed bf16x2 register): the rotation needs
  no shuffles. Per 16-wide k-block a thread holds 2 rows (g, g + 8 of its warp's 16 rows) x 2 pairs (k = 2t, 2t + 1
  and 2t + 8, 2t + 9, t = lane % 4) = 4 pairs; over K = 64, 16 pairs = 32 fp32 table values per thread per k-tile.

Status (CPU compile only, nvidia-cutlass-dsl 4.8.1, ptxas on PATH): compiles, no API obstacles. N = 128: 4
``wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {acc x64}, {%r1, %r2, %r3, %r4}, %rd1, ...`` (A a register
list, B a descriptor), one wgmma.fence before them; the A registers are written by ``cvt.rn.bf16x2.f32`` right
after the rotation's fma / mul / sub; the (c, s) loads are ``ld.global.v2.b32`` (16 a thread) without ``--vec``
already (``--vec`` gives the same PTX). ptxas: 126 registers, 0 spill bytes (118 without the rotation); N = 256:
204 registers, 0 spills. Not checked: results on a GPU, and a pipelined mainloop (a_transform.py has one).

Usage:  CUTE_DSL_ARCH=sm_90a python docs/experiments/rs_rotate_probe.py [--n 128|256] [--vec] [--no-rotate]
        [--dump DIR]
Prints: whether the PTX's wgmma.mma_async take A as a register list ``{...}`` (RS) rather than a 64-bit
descriptor, the wgmma count, a wgmma line, and registers / spill bytes (``ptxas -v`` via coda.check's helper, or
the cubin's .nv.info when no ptxas reads the PTX).
"""
import argparse
import os
import re
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

WG = 128
M, K = 64, 64


def rs_tiled_mma(n):
    """The RS tiled MMA: A from registers (always K-major there), B K-major in smem, fp32 accumulator."""
    return sm90_utils.make_trivial_tiled_mma(
        cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32, (1, 1, 1),
        tiler_mn=(64, n), a_source=warpgroup.OperandSource.RMEM)


def _pairs_local(tv):
    ok = True
    for t in range(WG):
        for p in range(4):
            i0, i1 = cute.crd2idx((t, 2 * p), tv), cute.crd2idx((t, 2 * p + 1), tv)
            m0, k0, m1, k1 = i0 % 64, i0 // 64, i1 % 64, i1 // 64
            ok = ok and m0 == m1 and k1 == k0 + 1 and k0 % 2 == 0
    return ok


@cute.jit
def check_pairs(n: cutlass.Constexpr):
    """Trace time: every (thread, value 2p) / (thread, value 2p + 1) of the WGMMA A fragment holds (m, k) / (m, k + 1)
    with k even, i.e. each rotation pair is thread-local and register-adjacent. Static ints only."""
    tiled_mma = rs_tiled_mma(n)
    tv = tiled_mma.tv_layout_A_tiled  # (thread, value) -> m + 64 * k within one 64 x 16 k-block
    print("tv_layout_A_tiled:", tv)
    ok = _pairs_local(tv)  # a plain Python helper: loops inside @cute.jit would be traced as dynamic loops
    t5 = [(cute.crd2idx((5, v), tv) % 64, cute.crd2idx((5, v), tv) // 64) for v in range(8)]
    print("thread 5's (m, k) per value:", t5)
    print("k-pairs (2j, 2j+1) thread-local in values (2p, 2p+1):", ok)
    # the ldmatrix copy delivers exactly this layout (as rs_wgmma_layout_check.py shows)
    s2r = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), cutlass.BFloat16), tiled_mma)
    same = all(cute.crd2idx((t, v), tv) == cute.crd2idx((t, v), s2r.layout_dst_tv_tiled)
               for t in range(WG) for v in range(8))
    print("ldmatrix dst TV layout == wgmma A TV layout:", same)


class RotateProbe:
    def __init__(self, n=128, rotate=True, vec=False):
        self.N, self.rotate, self.vec = n, rotate, vec

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mCS: cute.Tensor, stream):
        tiled_mma = rs_tiled_mma(self.N)
        tile = (M, self.N, K)
        a_smem = sm90_utils.make_smem_layout_a(LayoutEnum.from_tensor(mA), tile, cutlass.BFloat16, 1)
        b_smem = sm90_utils.make_smem_layout_b(LayoutEnum.from_tensor(mB), tile, cutlass.BFloat16, 1)
        self.kernel(mA, mB, mC, mCS, tiled_mma, cute.slice_(a_smem, (None, None, 0)),
                    cute.slice_(b_smem, (None, None, 0))).launch(grid=[1, 1, 1], block=[WG, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mCS: cute.Tensor, tiled_mma: cute.TiledMma,
               a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()

        @cute.struct
        class Smem:
            sA: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(b_smem)], 1024]

        storage = SmemAllocator().allocate(Smem)
        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)  # (64, 64) swizzled, K-major
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)  # (N, 64) swizzled, K-major

        # ---- global -> smem: cooperative element copy (consecutive threads walk K)
        gA, gB = mA[(None, None, 0)], mB[(None, None, 0)]
        for i in cutlass.range_constexpr(M * K // WG):
            e = i * WG + tidx
            sA[e // K, e % K] = gA[e // K, e % K]
        for i in cutlass.range_constexpr(self.N * K // WG):
            e = i * WG + tidx
            sB[e // K, e % K] = gB[e // K, e % K]
        cute.arch.sync_threads()

        # ---- fragments of the RS tiled MMA
        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = thr_mma.make_fragment_A(thr_mma.partition_shape_A((M, K)))  # rmem bf16 (8, 1, 4)
        tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB))  # smem descriptors
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((M, self.N)), cutlass.Float32)
        tCcA = thr_mma.partition_A(cute.make_identity_tensor((M, K)))  # (row, k) of every A register

        # ---- A: smem -> registers (ldmatrix x4), laid out as the WGMMA A fragment
        s2r = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), cutlass.BFloat16),
                                     tiled_mma)
        thr_s2r = s2r.get_slice(tidx)
        tXsA = thr_s2r.partition_S(sA)
        tXrA = thr_s2r.retile(tCrA)
        k_blocks = cute.size(tCrA, mode=[2])
        for j in cutlass.range_constexpr(k_blocks):
            cute.copy(s2r, tXsA[(None, None, j)], tXrA[(None, None, j)])
            if cutlass.const_expr(self.rotate):
                self.rotate_kblock(tCrA[(None, None, j)], tCcA[(None, None, j)], mCS)

        # ---- RS WGMMA: A from the (rotated) registers, B by descriptor
        cute.arch.fence_proxy("async.shared", space="cta")  # generic-proxy smem writes of B -> wgmma's async reads
        warpgroup.fence()  # the A registers were written: order them before the wgmma
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        for j in cutlass.range_constexpr(k_blocks):
            cute.gemm(tiled_mma, acc, tCrA[(None, None, j)], tCrB[(None, None, j)], acc)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

        # ---- accumulator -> global
        tCgC = thr_mma.partition_C(mC[(None, None, 0)])
        for v in cutlass.range_constexpr(cute.size(acc)):
            tCgC[v] = acc[v]

    @cute.jit
    def rotate_kblock(self, frag: cute.Tensor, crd: cute.Tensor, mCS: cute.Tensor):
        """Values 2p, 2p + 1 of the k-block's fragment: the same row r, k = 2j and 2j + 1 (see check_pairs)."""
        for p in cutlass.range_constexpr(cute.size(frag) // 2):
            r, k = crd[2 * p]
            jj = k // 2
            if cutlass.const_expr(self.vec):
                # (c, s) of the pair: 8 contiguous bytes of cs[r, jj, :] -> one 64-bit load
                cs = cute.make_rmem_tensor((2,), cutlass.Float32)
                cute.autovec_copy(mCS[r, jj, None], cs)
                c, s = cs[0], cs[1]
            else:
                c, s = mCS[r, jj, 0], mCS[r, jj, 1]
            x0 = frag[2 * p].to(cutlass.Float32)
            x1 = frag[2 * p + 1].to(cutlass.Float32)
            frag[2 * p] = (c * x0 + s * x1).to(cutlass.BFloat16)
            frag[2 * p + 1] = (c * x1 - s * x0).to(cutlass.BFloat16)


def fake_args(n):
    bf, f32 = cutlass.BFloat16, cutlass.Float32
    a = make_fake_compact_tensor(bf, (M, K, 1), stride_order=(1, 0, 2), assumed_align=16)  # K-major
    b = make_fake_compact_tensor(bf, (n, K, 1), stride_order=(1, 0, 2), assumed_align=16)  # K-major
    c = make_fake_compact_tensor(f32, (M, n, 1), stride_order=(1, 0, 2), assumed_align=16)
    cs = make_fake_compact_tensor(f32, (M, K // 2, 2), stride_order=(2, 1, 0), assumed_align=16)  # cs[r, j, 2]
    return a, b, c, cs


def operands(line):
    """Top-level comma-separated operands of a PTX instruction line (braces kept together)."""
    body = line.strip().rstrip(";").split(None, 1)[1]
    out, depth, cur = [], 0, ""
    for ch in body:
        depth += ch == "{"
        depth -= ch == "}"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + [cur.strip()]


def build(n=128, rotate=True, vec=False, keep=None):
    from coda.check import _ptxas_v, cubin_resources
    d = keep or tempfile.mkdtemp(prefix="rs_rotate_")
    os.makedirs(d, exist_ok=True)
    cute.compile(RotateProbe(n, rotate, vec), *fake_args(n), crt.make_fake_stream(),
                 options=f"--gpu-arch=sm_90a --keep-ptx --keep-cubin --dump-dir={d}")
    ptx = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".ptx")]
    cubin = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".cubin")]
    assert len(ptx) == 1, ptx
    text = open(ptx[0]).read()
    wg = [ln.strip() for ln in text.splitlines() if "wgmma.mma_async" in ln]
    a_ops = [operands(ln)[1] for ln in wg]
    res = dict(ptx=ptx[0], wgmma=wg, a_reg=bool(wg) and all(a.startswith("{") for a in a_ops), a_ops=a_ops,
               ldmatrix=len(re.findall(r"\bldmatrix\.", text)),
               ld_global=len(re.findall(r"\bld\.global[\w.]*", text)),
               ld_global_kinds=sorted(set(re.findall(r"\bld\.global[\w.]*", text))),
               fma=len(re.findall(r"\bfma\.rn\.f32", text)), mul=len(re.findall(r"\bmul\.(?:rn\.)?f32", text)),
               cvt=sorted({(m, text.count(m)) for m in re.findall(r"\bcvt\.[\w.]+", text)}))
    out = _ptxas_v(ptx[0], "sm_90a")
    if out is not None:
        res["registers"] = int(re.search(r"Used (\d+) registers", out).group(1))
        res["spill_bytes"] = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", out))
        res["spill_check"] = "ptxas -v"
        res["ptxas"] = [ln.strip() for ln in out.splitlines() if "spill" in ln or "Used" in ln]
    else:
        res["registers"], res["spill_bytes"] = cubin_resources(open(cubin[0], "rb").read())
        res["spill_check"] = "cubin .nv.info"
    return res


def main(argv=None):
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=128, choices=[128, 256])
    ap.add_argument("--vec", action="store_true", help="one 64-bit load for a pair's (c, s)")
    ap.add_argument("--no-rotate", action="store_true", help="RS path alone (ldmatrix + register-A WGMMA)")
    ap.add_argument("--dump", default=None, help="keep the PTX / cubin here")
    args = ap.parse_args(argv)
    check_pairs(args.n)
    r = build(args.n, not args.no_rotate, args.vec, args.dump)
    print("PTX:", r["ptx"])
    print("wgmma.mma_async count:", len(r["wgmma"]))
    print("A operand from registers (RS, '{...}' list instead of a descriptor):", r["a_reg"])
    if r["wgmma"]:
        print("  ", r["wgmma"][0][:400])
        print("   A operand:", r["a_ops"][0])
    print(f"ldmatrix: {r['ldmatrix']}  ld.global: {r['ld_global']} {r['ld_global_kinds']}  "
          f"fma.rn.f32: {r['fma']}  mul.f32: {r['mul']}")
    print("cvt:", r["cvt"])
    print(f"registers: {r['registers']}  spill bytes: {r['spill_bytes']} ({r['spill_check']})")
    for ln in r.get("ptxas", []):
        print("  ptxas:", ln)
    return 0 if r["a_reg"] and r["wgmma"] and not r["spill_bytes"] else 1


if __name__ == "__main__":
    sys.exit(main())
