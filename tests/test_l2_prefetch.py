"""GemmConfig.l2_prefetch on the CPU (issue 29): the field's rules, its name and stored form, the
CODA_L2_PREFETCH switch (only GEMMs with TileMN operands and a mainloop take it, coda.gemm compiles them under their
own kernel key), and the sm_90a kernel: the producer warp's prefetch.global.L2 instructions are there with the
field and absent without it, at the same registers and no spills."""
import dataclasses

import pytest
import torch

import coda
from coda.config import GemmConfig, l2_prefetch_env
from coda.runtime import precompile as pc
from coda.runtime.rules import config_from_dict, config_problem, config_to_dict
from test_precompile import BF, bias_silu_row, cpu_gemm  # noqa: F401 (fixture)

DYN = GemmConfig(tile_m=128, tile_n=128, cluster_m=2, sched="dynamic", epi_n=32)


@coda.epilogue
def scaled_residual(acc, r: coda.TileMN, s: coda.Scalar):
    return acc * s + r


def test_field_rules_name_and_stored_form():
    assert GemmConfig(l2_prefetch=16).problems() == [] and GemmConfig(l2_prefetch=64).problems() == []
    for bad in (3, -1, 256):  # not a power of two, negative, more chunks than the tile's rows (128)
        assert any("l2_prefetch" in p for p in GemmConfig(l2_prefetch=bad).problems()), bad
    assert GemmConfig(tile_m=64, tile_n=128, pingpong=True, l2_prefetch=64).problems() == []
    assert GemmConfig(tile_m=64, tile_n=128, pingpong=True, l2_prefetch=128).problems()
    assert GemmConfig().name == "128x256_coop_c2x1_rm8" and GemmConfig(l2_prefetch=16).name.endswith("_pf16")
    assert "l2_prefetch" not in config_to_dict(GemmConfig())  # stored entries read as before
    d = config_to_dict(GemmConfig(l2_prefetch=8))
    assert d["l2_prefetch"] == 8 and config_from_dict(d) == GemmConfig(l2_prefetch=8) and config_problem(d) is None
    assert "l2_prefetch" in config_problem({**d, "l2_prefetch": 3})


def test_environment_switch(monkeypatch):
    cfg = GemmConfig()
    monkeypatch.delenv("CODA_L2_PREFETCH", raising=False)
    assert l2_prefetch_env(cfg, True, False) is cfg
    monkeypatch.setenv("CODA_L2_PREFETCH", "16")
    assert l2_prefetch_env(cfg, True, False).l2_prefetch == 16
    assert l2_prefetch_env(cfg, False, False) is cfg and l2_prefetch_env(cfg, True, True) is cfg  # no TileMN; K = 0
    assert l2_prefetch_env(dataclasses.replace(cfg, l2_prefetch=4), True, False).l2_prefetch == 16  # overridden
    monkeypatch.setenv("CODA_L2_PREFETCH", "0")  # off, also where the config sets it (a shipped entry)
    assert l2_prefetch_env(dataclasses.replace(cfg, l2_prefetch=4), True, False).l2_prefetch == 0
    assert l2_prefetch_env(cfg, True, False) is cfg
    for bad in ("3", "x", "-2"):
        monkeypatch.setenv("CODA_L2_PREFETCH", bad)
        with pytest.raises(ValueError, match="CODA_L2_PREFETCH"):
            l2_prefetch_env(cfg, True, False)


def _recipe_key(epi, ops, a, b):
    with pc.recording() as rec:
        coda.gemm(a, b, epilogue=epi, **ops)
    (r,) = rec.recipes
    return r.key


def test_gemm_compiles_the_prefetching_kernel_under_its_own_key(cpu_gemm, monkeypatch):
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(256, 64, generator=g).to(BF), torch.randn(128, 64, generator=g).to(BF)
    res = dict(r=torch.randn(256, 128, generator=g).to(BF), s=torch.tensor([0.5]))
    vec = dict(bias=torch.randn(128, generator=g), r=torch.randn(256, generator=g), s=torch.tensor([0.5]))
    monkeypatch.delenv("CODA_L2_PREFETCH", raising=False)
    plain_res, plain_vec = _recipe_key(scaled_residual, res, a, b), _recipe_key(bias_silu_row, vec, a, b)
    monkeypatch.setenv("CODA_L2_PREFETCH", "16")
    assert _recipe_key(scaled_residual, res, a, b) != plain_res  # another kernel: the prefetching one
    assert _recipe_key(bias_silu_row, vec, a, b) == plain_vec  # no TileMN operand: the same kernel


@pytest.mark.parametrize("cfg", [DYN, GemmConfig(epi_wg=True)], ids=["128x128_dyn", "epi_wg"])
def test_kernel_prefetches_with_the_field_only(cfg, monkeypatch):
    from coda.check import compile_variant
    from coda.epilogues.adamw import adamw
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    rows = [compile_variant(c, adamw, majors=("m", "m"), count=("prefetch.global.L2",))
            for c in (cfg, dataclasses.replace(cfg, l2_prefetch=16))]
    for r in rows:
        assert r["ok"], r["error"]
        assert r["spill_bytes"] == 0
    assert rows[0]["count"]["prefetch.global.L2"] == 0 and rows[1]["count"]["prefetch.global.L2"] > 0
    assert rows[1]["registers"] <= rows[0]["registers"] + 8
