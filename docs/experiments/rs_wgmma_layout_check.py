"""Trace-time check: the (m, k) element that ldmatrix (.trans for MN-major smem) delivers into each register of
the RS WGMMA A fragment equals the (m, k) the WGMMA expects there. Uses identity (coordinate) tensors only."""
import os, sys
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
import cutlass, cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, warp, warpgroup
from cutlass.tensor_utils import LayoutEnum

M, N, K = 64, 128, 64

@cute.jit
def check(mn_major: cutlass.Constexpr):
    tiled_mma = sm90_utils.make_trivial_tiled_mma(
        cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32, (1, 1, 1),
        tiler_mn=(64, N), a_source=warpgroup.OperandSource.RMEM)
    atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=mn_major, num_matrices=4), cutlass.BFloat16)
    s2r = cute.make_tiled_copy_A(atom, tiled_mma)
    print("mma tv_layout_A_tiled:", tiled_mma.tv_layout_A_tiled)
    print("copy layout_src_tv_tiled:", s2r.layout_src_tv_tiled, " layout_dst_tv_tiled:", s2r.layout_dst_tv_tiled)
    # evaluate both (thread, value) -> linear (m, k) index maps over the whole warpgroup (static ints)
    a, b = tiled_mma.tv_layout_A_tiled, s2r.layout_dst_tv_tiled
    same = all(cute.crd2idx((t, v), a) == cute.crd2idx((t, v), b) for t in range(128) for v in range(8))
    print("mn_major" if mn_major else "k_major", ": copy dst TV layout == wgmma A TV layout:", same)


check(False)
check(True)
