"""CPU (CI): every GEMM variant and the epilogue hook's features compile for sm_90a, use WGMMA and do not spill."""
import os
import sys

import pytest

from coda.check import compile_variant, main
from coda.config import GemmConfig, all_configs
from coda.kernels.epilogue import Epilogue, Operand, Reduction
from hook_epilogues import stats_epilogue


@pytest.mark.parametrize("cfg", list(all_configs()), ids=lambda c: c.name)
def test_every_variant_compiles(cfg):
    row = compile_variant(cfg, in_dtype="bf16", out_dtype="bf16")
    assert row["ok"], row
    assert row["wgmma"] > 0 and row["spill_bytes"] == 0


@pytest.mark.parametrize("dtypes", [("fp16", "fp16"), ("bf16", "fp32"), ("fp16", "bf16")])
def test_dtypes_compile(dtypes):
    row = compile_variant(GemmConfig(), in_dtype=dtypes[0], out_dtype=dtypes[1])
    assert row["ok"], row


class BiasRowsumColmax(Epilogue):
    name = "bias_rowsum_colmax"
    operands = (Operand("bias", "vec_n"), Operand("scale", "vec_m"))
    outputs = ("pre",)
    reductions = (Reduction("rs", "n", "sum"), Reduction("cm", "m", "max"))

    def visit(self, acc, env):
        y = acc * env["scale"] + env["bias"]
        return {"out": y, "pre": acc, "rs": y * y, "cm": y}


@pytest.mark.parametrize("cfg", [GemmConfig(), GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=1)],
                         ids=lambda c: c.name)
def test_epilogue_hook_compiles(cfg):
    row = compile_variant(cfg, BiasRowsumColmax())
    assert row["wgmma"] > 0, row
    assert row["error"] == "" or "spills" in row["error"], row  # compiled; spills are reported, not fatal here


def test_check_cli_rejects_other_arch(capsys):
    assert main(["--arch", "sm_80"]) == 2


@pytest.mark.parametrize("which", ["stats", "ce_forward", "ce_forward_smooth"])
def test_reduction_epilogues_do_not_spill(which):
    """Reduction values are masked along the reduced axis only (one predicate per element): before, the row and
    column predicates of every element spilled 152 bytes (README stats) and 48 (ce_forward_smooth) on the default
    128x256 tile."""
    from coda.epilogues import cross_entropy
    epi = stats_epilogue() if which == "stats" else getattr(cross_entropy, which)
    row = compile_variant(GemmConfig(), epi)
    assert row["ok"] and row["spill_bytes"] == 0, row


@pytest.mark.parametrize("ptxas", ["missing", "too_old"])
def test_cubin_fallback_agrees_with_ptxas_and_sees_a_stack_frame(monkeypatch, tmp_path, ptxas):
    """Where no ptxas reads the DSL's PTX (the device: CUDA 13.0's ptxas, PTX .version 9.4) the registers and stack
    frame come from the DSL's own cubin. Here both are read for one kernel: they agree (the DSL's compiler and the
    installed ptxas may differ by version, so registers within 8). A cubin whose FRAME_SIZE attribute is patched
    to 48 bytes is reported as 48 spilled bytes."""
    import struct
    import coda.check as check
    cfg = GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=1)
    by_ptxas = compile_variant(cfg)
    assert by_ptxas["ok"], by_ptxas
    if by_ptxas["spill_check"] == "cubin":  # the device: its ptxas is older than the PTX, so the cubin was read
        pytest.skip("no ptxas here reads the DSL's PTX: nothing to compare the cubin's reading with")
    assert by_ptxas["spill_check"] == "ptxas -v", by_ptxas
    kept = []
    real = check.cubin_resources

    def keep(elf):
        kept.append(elf)
        return real(elf)
    monkeypatch.setattr(check, "cubin_resources", keep)
    if ptxas == "missing":
        monkeypatch.setattr(check.shutil, "which", lambda name: None)  # no ptxas on PATH
    else:  # a ptxas that predates the PTX's .version, as on the device
        fake = tmp_path / "ptxas"
        fake.write_text("#!/bin/sh\necho \"ptxas fatal   : Unsupported .version 9.4; current version is '9.0'\" >&2\n"
                        "exit 255\n")
        fake.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    by_cubin = compile_variant(cfg)
    assert by_cubin["spill_check"] == "cubin" and by_cubin["ok"], by_cubin
    assert by_cubin["spill_bytes"] == 0 and abs(by_cubin["registers"] - by_ptxas["registers"]) <= 8, (by_cubin,
                                                                                                     by_ptxas)
    elf = bytearray(kept[0])
    frames = [p for p, fmt, attr, _ in check.nv_info_attributes(bytes(elf))
              if fmt == 4 and attr == check.EIATTR_FRAME_SIZE]
    assert frames
    for p in frames:
        struct.pack_into("<I", elf, p + 8, 48)
    assert real(bytes(elf)) == (by_cubin["registers"], 48)
    with pytest.raises(ValueError, match="ELF"):
        real(b"not an elf")


def test_whole_tiles_drop_the_reduction_masks():
    """With M and N multiples of the tile (``even``), the reductions' per-element selects of the neutral element go
    (the fast cross entropy's logits epilogue: its logsumexp over a row), registers stay within the budget."""
    import torch

    from coda.epilogues.cross_entropy import ce_forward_logits
    rows = [compile_variant(GemmConfig(), ce_forward_logits(torch.bfloat16), count=("selp",), even=even)
            for even in ((False, False), (True, True))]
    for row in rows:
        assert row["ok"] and row["spill_bytes"] == 0, row
    masked, even = (r["count"]["selp"] for r in rows)
    assert even + 64 <= masked, (masked, even)  # a thread's 128 x 256 / 256 = 128 elements, a select each


def test_whole_tile_flags_skip_pairs_and_plain_epilogues():
    """``coda.gemm.whole_tiles``: the flags for a per-row reducing epilogue of one value per element; none for the
    identity, per-column sums or a 1 -> 2 epilogue (ptxas spilled without their masks)."""
    import importlib

    import torch

    from coda.epilogues.cross_entropy import ce_forward_logits
    from coda.kernels.epilogue import IDENTITY
    from coda.ops.mlp import dacc_on_da
    G = importlib.import_module("coda.gemm")  # the module (``coda.gemm`` is the function)
    cfg = GemmConfig()
    assert G.whole_tiles(ce_forward_logits(torch.bfloat16), cfg, 2816, 128256) == (False, True)  # 501 N-tiles
    assert G.whole_tiles(ce_forward_logits(torch.bfloat16), cfg, 1024, 1000) == (False, False)
    from coda.ops.mlp import fold_grads
    assert G.whole_tiles(fold_grads, cfg, 8192, 8192) is None  # per-column sums keep their masks
    assert G.whole_tiles(IDENTITY, cfg, 2816, 128256) is None
    assert G.whole_tiles(dacc_on_da((("out",), ("r",), False)), cfg, 8192, 8192) is None


@pytest.mark.parametrize("name", ["epilogues.rmsnorm:rmsnorm_dgrad", "epilogues.rmsnorm:rmsnorm_dgrad_residual",
                                  "epilogues.rmsnorm:rmsnorm_dgrad_split", "epilogues.rmsnorm:row_dot",
                                  "epilogues.rmsnorm:scale_sumsq", "ops.rmsnorm:rms_row_dot",
                                  "ops.rmsnorm:rmsnorm_backward", "ops.mlp:fold_grads",
                                  "epilogues.cross_entropy:ce_forward_smooth", "epilogues.adamw:adamw_fold"])
def test_reducing_epilogues_on_whole_tiles_do_not_spill(name):  # ~5 s each
    """The library's reducing epilogues on whole tiles, with the ``even`` flags ``coda.gemm`` gives them, on the
    heuristic's tile (the one a K = 0 pass gets too): no spills within the 168-register budget."""
    import importlib

    from coda.config import default_config
    mod, attr = name.split(":")
    epi = getattr(importlib.import_module("coda." + mod), attr)
    cfg = default_config(8192, 2048, 2048)
    even = importlib.import_module("coda.gemm").whole_tiles(epi, cfg, 8192, 2048) or (False, False)
    row = compile_variant(cfg, epi, even=even)
    assert row["ok"] and row["spill_bytes"] == 0, row


def test_fastmath_epilogue_divides_and_roots_without_ieee_branches():
    """``@coda.epilogue(fastmath=True)`` (session 38): division and square root by div.approx.ftz / sqrt.approx.ftz
    (no per-element range-check branches), in the key; without it the IEEE-rounded instructions. The AdamW
    update (epilogues/adamw.py, fastmath) compiles without spills in the epilogue warps, as shipped."""
    import coda
    from coda.config import epi_wg_config
    from coda.epilogues.adamw import adamw, adamw_fold

    def f(acc, d: coda.VecN, s: coda.TileMN):
        return acc / d + coda.sqrt(s * s + acc)
    fast, ieee = coda.epilogue(f, fastmath=True), coda.epilogue(f)
    assert fast.key() != ieee.key() and fast.fastmath and not ieee.fastmath
    count = ("div.rn", "sqrt.rn", "div.approx.ftz", "sqrt.approx.ftz")
    rf, ri = (compile_variant(GemmConfig(), e, count=count) for e in (fast, ieee))
    assert rf["ok"] and ri["ok"], (rf, ri)
    assert rf["count"]["div.rn"] == rf["count"]["sqrt.rn"] == 0 < rf["count"]["div.approx.ftz"], rf["count"]
    assert rf["count"]["sqrt.approx.ftz"] > 0 and ri["count"]["div.rn"] > 0 and ri["count"]["sqrt.rn"] > 0, ri
    for epi in (adamw, adamw_fold):
        row = compile_variant(epi_wg_config(), epi, majors=("mn", "mn"), count=count)
        assert row["ok"] and row["spill_bytes"] == 0 and row["count"]["div.rn"] == 0, row
