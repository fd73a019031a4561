"""CPU: the shared-memory plan (``coda.kernels.epilogue.smem_plan``) is what the kernel computed inline before it
(``GemmSm90.__call__`` up to session 11), the kernel uses it, and the autotuner's pruning agrees with it."""
import dataclasses
import itertools
import re

import pytest

import coda
from coda.autotune import space
from coda.config import GemmConfig, all_configs
from coda.epilogues import cross_entropy, gated
from coda.kernels.epilogue import (IDENTITY, SmemPlan, smem_plan, staged_smem_bytes, tile_ring,
                                   tile_tma_plan)
from hook_epilogues import Everything, gated_tiles, stats_epilogue


EPILOGUES = {
    "identity": IDENTITY,
    "ce_forward": cross_entropy.ce_forward,  # stores no output (stores_out False), a VecM operand
    "swiglu": gated.swiglu,  # pairs, half-width output
    "accumulate": cross_entropy.accumulate,  # one TileMN operand
    "stats": stats_epilogue(),  # VecM operand, per-row and per-column reductions
    "everything": Everything(),  # VecN, VecM, TileMN, scalar operands, an extra output, reductions
    "gated_tiles": gated_tiles,  # half-width pairs with two TileMN operands, an extra output, reductions
}
WIDTH = {"bf16": 16, "fp16": 16, "fp32": 32}


def old_kernel_plan(epi, cfg, out_widths, tile_widths, tile_aligned, ab_width):
    """The oracle: ``GemmSm90.__call__``'s inline code before smem_plan (commit 302687d), on element widths in
    bits. Returns (flags, ring, extra_smem, epi_stages, ab_stage); raises what it raised."""
    half = epi.pair_mode == "half"
    out_b = [w // (16 if half else 8) for w in out_widths]
    in_b = ab_width // 8
    tile_b = [w // 8 for w in tile_widths]
    flags, _ = tile_tma_plan(epi, cfg, tile_aligned, tile_b, out_b, in_b)
    chosen_b = [b for f, b in zip(flags, tile_b) if f]
    ring = tile_ring(epi, cfg, chosen_b, out_b, in_b)
    extra_smem = staged_smem_bytes(epi, cfg, chosen_b, ring)
    epi_stages = cfg.epi_buffers(out_b, extra_smem, in_b)
    ab_stage = cfg.derive_stages(out_b, extra_smem=extra_smem, in_bytes=in_b, epi_stages=epi_stages)
    return tuple(flags), ring, extra_smem, epi_stages, ab_stage


def kernel_outputs(epi, out_dtype):
    """Element widths of the tile outputs the kernel stores (store_ts): D unless stores_out is False, extras."""
    return [WIDTH[out_dtype]] * (int(epi.stores_out) + len(epi.outputs))


def _configs():
    """Every built variant, its K = 0 form (stages=2) and its epi_n = 64 form."""
    for cfg in all_configs():
        yield cfg
        yield dataclasses.replace(cfg, stages=2)
        yield dataclasses.replace(cfg, epi_n=64)


@pytest.mark.parametrize("name", list(EPILOGUES))
def test_plan_is_the_kernels_old_inline_computation(name):
    epi = EPILOGUES[name]
    n_tiles = sum(o.kind == "tile" for o in epi.operands)
    seen = dict(rings=set(), bufs=set(), flags=set(), errors=0, cases=0)
    for cfg, ab, out, tdt in itertools.product(_configs(), ("bf16", "fp32"), ("bf16", "fp32"), ("bf16", "fp32")):
        out_w = kernel_outputs(epi, out)
        tile_w = [WIDTH[tdt]] * n_tiles
        for aligned in {(True,) * n_tiles, (False,) * n_tiles, tuple(i % 2 == 0 for i in range(n_tiles))}:
            seen["cases"] += 1
            try:
                want = old_kernel_plan(epi, cfg, out_w, tile_w, aligned, WIDTH[ab])
            except ValueError as e:
                with pytest.raises(ValueError) as got:
                    smem_plan(epi, cfg, [w // 8 for w in out_w], [w // 8 for w in tile_w], aligned, WIDTH[ab] // 8)
                assert str(got.value) == str(e)
                seen["errors"] += 1
                continue
            # called as GemmSm90.__call__ calls it: element sizes in bytes (width // 8)
            plan = smem_plan(epi, cfg, [w // 8 for w in out_w], [w // 8 for w in tile_w], aligned, WIDTH[ab] // 8)
            assert isinstance(plan, SmemPlan)
            got = (plan.tma_flags, plan.ring, plan.extra_smem, plan.epi_buffers, plan.stages)
            assert got == want, (cfg.name, ab, out, tdt, aligned)
            assert plan.out_bytes == tuple(w // (16 if epi.pair_mode == "half" else 8) for w in out_w)
            seen["rings"].add(plan.ring)
            seen["bufs"].add(plan.epi_buffers)
            seen["flags"].add(plan.tma_flags)
    assert seen["cases"] >= 18 * 3 * 8
    # both output-buffer depths occur (the comparison is not vacuous); no tile output: 4 buffers of nothing
    assert seen["bufs"] == ({2, 4} if epi.stores_out or epi.outputs else {4})
    if n_tiles:  # deepened rings and operands read element by element both occur
        assert {2, 4} <= seen["rings"] and any(not all(f) for f in seen["flags"])


def test_plan_counts_half_width_outputs_at_half_size_and_no_main_output_without_stores_out():
    cfg = GemmConfig(tile_m=64, tile_n=256, pingpong=True, cluster_m=1, epi_n=64)
    assert smem_plan(gated.swiglu, cfg, [2], [], [], 2).out_bytes == (1,)
    assert smem_plan(IDENTITY, cfg, [2], [], [], 2).out_bytes == (2,)
    assert smem_plan(cross_entropy.ce_forward, cfg, [], [], [], 2).out_bytes == ()
    # the half-width output frees a stage's worth of shared memory: 5 stages of 64x256 instead of 4
    assert smem_plan(gated.swiglu, cfg, [2], [], [], 2).stages == 5
    assert smem_plan(IDENTITY, cfg, [2], [], [], 2).stages == 4
    with pytest.raises(ValueError, match="alignment flags"):
        smem_plan(cross_entropy.accumulate, cfg, [2], [2], [], 2)


# ------------------------------------------------------------------------------------ the autotuner's pruning
def old_config_reason_smem(cfg, epi, in_b, out_b):
    """Session 11's config_reason shared-memory rules: a main output always, full width, ring-2 rings, 2 buffers."""
    out_bytes = [out_b] * (1 + len(epi.outputs))
    n_tiles = sum(o.kind == "tile" for o in epi.operands)
    _, extra = tile_tma_plan(epi, cfg, [True] * n_tiles, [4] * n_tiles, out_bytes, in_b)
    try:
        stages = cfg.derive_stages(out_bytes, extra_smem=extra, in_bytes=in_b)
    except ValueError:
        return "shared memory"
    if cfg.stages is not None:
        if stages == dataclasses.replace(cfg, stages=None).derive_stages(out_bytes, extra_smem=extra, in_bytes=in_b):
            return "duplicate"
    return None


def _kernel_stages(cfg, epi, out):
    """What the kernel's old inline code derives for these dtypes (bf16 A/B, fp32 TileMN operands, aligned)."""
    n_tiles = sum(o.kind == "tile" for o in epi.operands)
    return old_kernel_plan(epi, cfg, kernel_outputs(epi, out), [32] * n_tiles, (True,) * n_tiles, 16)


# (epilogue, out dtype, config): the old rules pruned or mislabelled it; the kernel builds it
NOW_KEPT = [
    # half-width pairs output counted at full width: 2 x 128 x 64 x 4 B per warpgroup, one stage too many
    ("swiglu", "fp32", GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=1, stages=4, epi_n=64)),
    # ce_forward stores no output, the old rule counted a bf16 D
    ("ce_forward", "bf16", GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=1, stages=6, epi_n=64)),
    # "duplicate" because the old rule derived stages=None with this config's ring-less plan; the kernel's
    # stages=None TMA-loads the TileMN operand (3 stages), stages=4 reads it element by element
    ("accumulate", "bf16", GemmConfig(tile_m=64, tile_n=256, pingpong=True, cluster_m=1, stages=4, epi_n=64)),
]


@pytest.mark.parametrize("name,out,cfg", NOW_KEPT, ids=lambda x: getattr(x, "name", x))
def test_configs_the_old_rules_pruned_or_mislabelled_are_kept(name, out, cfg):
    epi = EPILOGUES[name]
    assert old_config_reason_smem(cfg, epi, 2, 4 if out == "fp32" else 2) is not None  # the old finding
    assert space.config_reason(cfg, epi, "bfloat16", out) is None
    plan = space.kernel_smem_plan(cfg, epi, "bfloat16", out)
    assert plan.stages == cfg.stages == _kernel_stages(cfg, epi, out)[-1]
    derived = space.kernel_smem_plan(dataclasses.replace(cfg, stages=None), epi, "bfloat16", out)
    assert derived != plan


def test_the_old_rules_called_a_kernel_that_fits_too_big_now_a_duplicate():
    # swiglu 64x256 ping-pong: stages=None derives 5 stages (half-width output); the old rule said 5 do not fit
    cfg = GemmConfig(tile_m=64, tile_n=256, pingpong=True, cluster_m=1, stages=5, epi_n=64)
    assert old_config_reason_smem(cfg, gated.swiglu, 2, 2) == "shared memory"
    assert space.config_reason(cfg, gated.swiglu) == "duplicate: stages=5 is what stages=None derives"
    assert space.config_reason(dataclasses.replace(cfg, stages=4), gated.swiglu) is None


@pytest.mark.parametrize("name,out,cfg", [
    ("swiglu", "bf16", GemmConfig(tile_m=64, tile_n=256, pingpong=True, cluster_m=1, stages=6, epi_n=64)),
    ("ce_forward", "bf16", GemmConfig(stages=5)),  # 5 x 48 KB of 128x256 stages
    ("accumulate", "fp32", GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=1, stages=7)),
], ids=lambda x: getattr(x, "name", x))
def test_configs_that_do_not_fit_are_still_pruned_with_a_reason(name, out, cfg):
    epi = EPILOGUES[name]
    r = space.config_reason(cfg, epi, "bfloat16", out)
    assert r.startswith("shared memory: ") and f"{cfg.stages} stages need" in r and "epilogue buffers" in r, r
    with pytest.raises(ValueError):
        _kernel_stages(cfg, epi, out)


@pytest.mark.parametrize("name", ["swiglu", "ce_forward", "accumulate", "gated_tiles", "stats"])
def test_pruning_agrees_with_the_kernel_over_the_whole_space(name):
    """config_reason prunes for shared memory exactly where the kernel's (old inline) computation raises, and calls
    a config a duplicate exactly where the kernel would build the same plan as with stages=None."""
    epi = EPILOGUES[name]
    for out in ("bf16", "fp32"):
        for cfg in space.enumerate_space():
            if cfg.problems() or (cfg.tile_m, cfg.tile_n, cfg.pingpong) not in space.VERIFIED_TILES:
                continue
            r = space.config_reason(cfg, epi, "bfloat16", "bfloat16" if out == "bf16" else "float32")
            try:
                plan = _kernel_stages(cfg, epi, out)
            except ValueError:
                assert r is not None and r.startswith("shared memory"), (cfg.name, out, r)
                continue
            if cfg.stages is not None and plan == _kernel_stages(dataclasses.replace(cfg, stages=None), epi, out):
                assert r is not None and r.startswith("duplicate"), (cfg.name, out, r)
            else:
                assert r is None, (cfg.name, out, r)


# ------------------------------------------------------------------------------------- the kernel builds them
def _compile_recording(monkeypatch, cfg, epi, in_dtype="bf16", out_dtype="bf16", force_stages=None):
    """``coda.check.compile_variant``, recording the GemmSm90 object and the host IR of the compiled kernel.
    ``force_stages``: replace the plan's stage count (a negative control of the shared-memory check)."""
    import cutlass.cute as cute

    import coda.kernels.gemm_sm90 as g
    from coda.check import compile_variant
    made, irs = [], []
    real_cls, real_compile, real_plan = g.GemmSm90, cute.compile, g.smem_plan

    class Recorded(real_cls):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    def compile_and_keep(*a, **k):
        fn = real_compile(*a, **k)
        irs.append(str(fn.ir_module))
        return fn

    monkeypatch.setattr(g, "GemmSm90", Recorded)
    monkeypatch.setattr(cute, "compile", compile_and_keep)
    if force_stages:
        monkeypatch.setattr(g, "smem_plan", lambda *a, **k: dataclasses.replace(real_plan(*a, **k),
                                                                                 stages=force_stages))
    row = compile_variant(cfg, epi, in_dtype, out_dtype)
    monkeypatch.undo()
    return row, made, irs


def smem_exceeds(ir: str) -> bool:
    """Whether the host code keeps CuTeDSL's launch check "shared memory exceeds current GPU arch" (the check
    folds away when the kernel's allocated shared memory is a constant within the arch's capacity)."""
    names = re.findall(r"llvm\.mlir\.global internal constant @(\S+)\(\"[^\"]*exceeds current GPU arch", ir)
    assert names, "CuTeDSL's shared-memory launch check not found in the host IR"
    return any(f"addressof @{n} " in ir for n in names)


BUILDS = NOW_KEPT + [
    # K = 0 form of accumulate: the TileMN ring deepens to 8 sub-tiles, 4 output buffers
    ("accumulate", "bf16", GemmConfig(stages=2)),
]


@pytest.mark.parametrize("name,out,cfg", BUILDS, ids=lambda x: getattr(x, "name", x))
def test_kept_configs_build_with_the_plan_and_fit(monkeypatch, name, out, cfg):
    epi = EPILOGUES[name]
    row, made, irs = _compile_recording(monkeypatch, cfg, epi, "bf16", out)
    assert row["ok"] and row["wgmma"] > 0 and row["spill_bytes"] == 0, row
    (k,), (ir,) = made, irs
    n_tiles = sum(o.kind == "tile" for o in epi.operands)
    # compile_variant's TileMN operands are of the output dtype
    flags, ring, _, epi_stages, ab_stage = old_kernel_plan(epi, cfg, kernel_outputs(epi, out),
                                                           [WIDTH[out]] * n_tiles, (True,) * n_tiles, 16)
    assert (k.ab_stage, k.epi_stages, k.ring) == (ab_stage, epi_stages, ring)
    assert k.tma_tiles == [i for i, f in zip(k.tiles, flags) if f]
    assert k.ld_bufs == ring * (2 if cfg.pingpong else 1)
    assert not smem_exceeds(ir)
    if cfg.stages == 2:
        assert k.ring == 8 and k.epi_stages == 4


def test_the_shared_memory_check_sees_an_overflow(monkeypatch):
    """Negative control of smem_exceeds: one stage more than the plan of 128x256 (4 stages, 48 KB each) does not
    fit."""
    row, _, (ir,) = _compile_recording(monkeypatch, GemmConfig(), IDENTITY, force_stages=5)
    assert row["wgmma"] > 0, row
    assert smem_exceeds(ir)
