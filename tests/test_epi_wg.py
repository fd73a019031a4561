"""GemmConfig(epi_wg=True), the epilogue warps (kernels/epilogue_wg.py): config rules, the shared-memory plan, what it
refuses, and that its kernels compile for sm_90a on this CPU (the GPU checks: tests/test_epi_wg_gpu.py)."""
import pytest

import coda
from coda.config import GemmConfig
from coda.kernels.epilogue import IDENTITY, smem_plan


def test_config_rules():
    assert GemmConfig(epi_wg=True).problems() == []
    assert GemmConfig(epi_wg=True).name.endswith("_ewg")
    for bad in (dict(pingpong=True), dict(tile_m=256, tile_n=128), dict(sched="dynamic")):
        assert any("epi_wg" in p for p in GemmConfig(epi_wg=True, **bad).problems()), bad


def test_smem_plan_keeps_three_stages():
    """The staged bf16 tile (64 KB at 128 x 256) and the operand ring beside the stages: 3 of 48 KB."""
    @coda.epilogue
    def resid(acc, h: coda.TileMN, g: coda.VecN):
        return acc * g + h
    from coda.kernels.epilogue_wg import ring_bytes, ring_depth
    cfg = GemmConfig(epi_wg=True)
    plan = smem_plan(resid, cfg, [2], [2], [True])
    # h through the cp.async ring: 16 bytes a lane and row step, 4 steps a batch, 96 lanes, as deep as fits
    assert ring_depth(resid, cfg, [2], [True]) == 2 and ring_bytes(resid, cfg, [2], [True]) == 2 * 4 * 96 * 16
    assert (plan.stages, plan.extra_smem, plan.tma_flags) == (3, 128 * 256 * 2 + 2 * 4 * 96 * 16, (False,))
    assert smem_plan(resid, cfg, [2], [2], [False]).extra_smem == 128 * 256 * 2  # read directly: no ring


def test_refuses_row_and_column_reductions_together():
    from coda.kernels.gemm_sm90 import GemmSm90

    @coda.epilogue
    def both(acc):
        return {"out": acc, "cs": coda.reduce_m(acc), "rs": coda.reduce_n(acc)}
    with pytest.raises(ValueError, match="one kind at a time"):
        GemmSm90(GemmConfig(epi_wg=True), both)


@pytest.mark.parametrize("tile_n", [256, 128])
def test_compiles_for_sm90(tile_n):
    pytest.importorskip("cutlass")
    from coda.check import compile_variant
    from coda.epilogues.adamw import adamw

    @coda.epilogue
    def radial(acc, gamma: coda.VecN, r: coda.VecM, inv_h: coda.Scalar, h: coda.TileMN):
        return acc * gamma - r * r * r * inv_h * h
    from coda.epilogues.cross_entropy import ce_forward
    from coda.ops.mlp import dacc_on_da
    fused_da = dacc_on_da((("out",), ("r",), False))  # 1 -> 2 with a per-row reduction (the MLP backward's)
    from coda.epilogues.gated import swiglu
    from coda.autodiff import with_preact
    from coda.ops.mlp import fold_grads  # per-column sums (dgamma)
    from coda.ops.mlp import rms_swiglu  # with its pre-activation stores: pairs "half" + two extra outputs
    from hook_epilogues import rotate
    for epi, majors in ((IDENTITY, ("k", "k")), (radial, ("k", "k")), (adamw, ("mn", "mn")), (fused_da, ("k", "mn")),
                        (ce_forward, ("k", "k")), (swiglu, ("k", "k")), (with_preact(rms_swiglu), ("k", "k")),
                        (rotate, ("k", "k")), (fold_grads, ("mn", "mn"))):
        row = compile_variant(GemmConfig(tile_n=tile_n, epi_wg=True), epi, majors=majors,
                              count=("ld.shared.v4", "st.global.v4"))
        assert row["ok"], row
        assert row["count"]["ld.shared.v4"] > 0, row  # the staged tile read 16 bytes a lane
        if epi is not ce_forward:  # (the CE forward stores nothing but its row partials)
            assert row["count"]["st.global.v4"] > 0, row


def test_bench_problems_are_ones_the_epilogue_warps_take():
    """coda.bench.epi_wg's problems (the step's heavy epilogues) pass epi_wg's epilogue check."""
    from coda.bench.epi_wg import problems
    from coda.kernels import epilogue_wg
    probs = problems()
    assert {"fused_da", "swiglu_fwd", "radial", "adamw", "da_simple", "da_loads"} <= set(probs)
    for _, epi in probs.values():
        epilogue_wg.check(epi)


def test_ncu_source_summary():
    """coda.bench.ncu_source's reading of Nsight Compute's source page: instructions by stall samples, reasons."""
    from coda.bench.ncu_source import summarize
    head = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_barrier",'
            '"stall_long_sb","stall_barrier (Not Issued)"')
    out = ('"Kernel Name","k",\n' + head + '\n"0x1","  BAR.SYNC 5","30","10","30","0","30"\n'
           '"0x2","  FADD R1, R2, R3","10","2,048","0","8","0"\n')
    lines = summarize(out, top=2)
    assert lines[0] == "40 stall samples over 2 instructions"
    assert "75.0%" in lines[1] and "BAR.SYNC 5" in lines[1] and "barrier 100%" in lines[1]
    assert "2048" in lines[2] and "long_sb 80%" in lines[2]
    assert lines[3] == "per reason: barrier 75.0%, long_sb 20.0%"


def test_ring_plan():
    """Which operands reach the epilogue warps through the cp.async ring, and how deep it is."""
    from coda.kernels.epilogue_wg import RING_MAX, ring_bytes, ring_depth, ring_ops

    @coda.epilogue
    def two(acc, h: coda.TileMN, r: coda.VecM, g: coda.VecN, s: coda.Scalar):
        return acc * g * s + h * r

    @coda.epilogue
    def paired(acc, h: coda.TileMN):
        e, o = coda.pairs(acc)
        return e * o + h
    cfg, narrow = GemmConfig(epi_wg=True), GemmConfig(tile_n=128, epi_wg=True)
    assert ring_ops(two, [2], [True]) == {0: 16, 1: 4}  # VecN / Scalar are read directly
    assert ring_ops(two, [2], [False]) == {1: 4}  # an unaligned TileMN is read directly
    assert ring_ops(two, [4], [True]) == {1: 4}  # 8 fp32 columns are 32 bytes: more than one cp.async
    assert ring_ops(paired, [2], [True]) == {0: 8}  # a pair's operand: 4 values a lane
    assert ring_depth(IDENTITY, cfg, [], []) == 0 and ring_bytes(IDENTITY, cfg, [], []) == 0
    # 128 x 256: 3 stages of 48 KB + 64 KB staged leave ~17 KB; 20 bytes x 4 row steps x 96 lanes a batch
    assert ring_depth(two, cfg, [2], [True]) == 2
    assert ring_depth(two, narrow, [2], [True]) == RING_MAX  # 128 x 128: room for the deepest ring
    plan = smem_plan(two, narrow, [2], [2], [True])
    assert plan.stages >= 3 and plan.extra_smem == 128 * 128 * 2 + ring_bytes(two, narrow, [2], [True])


def test_epi_wg_config_is_the_optimizers():
    from coda.config import epi_wg_config
    from coda.optim import update_config
    assert epi_wg_config() == update_config() and epi_wg_config().epi_wg and not epi_wg_config().problems()
    assert not update_config(k_zero=True).epi_wg
