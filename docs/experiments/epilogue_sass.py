"""Static SASS of the llama-1b step's fused GEMMs under their shipped configs, beside the plain GEMM (identity) under
the same config, compiled for sm_90a on the CPU (``nvdisasm`` on PATH): the instructions each epilogue adds, by
class -- the instruction side of the energy a fused kernel spends over the plain GEMM (session 37: under the
power cap a kernel's cost in the step is its energy). Static counts: the consumer epilogue's sub-tile loop is
unrolled (per tile), the epilogue warps' row loop is not (per loop body).
Usage: CUTE_DSL_ARCH=sm_90a python docs/experiments/epilogue_sass.py

Session 37 (9e9fd4f's kernels; SASS of the kernel, plain under the same config, the epilogue's addition): fused da
(64 x 256 ping-pong, a thread's tile share 128 elements) 5664 vs 1536 (+4128: ~32 an element -- FMUL 1536, FADD 386,
SHF 392, LDS 144, MUFU 256, FFMA 256, IADD 178, LOP 136, PRMT 129, FSEL 128); logits (128 x 256, 128 an element
share) 2552 vs 1224 (+1328: MUFU 152, FMUL 154, FADD 264, FSEL 148, FMNMX 130); down fwd + residual + sum of squares
3584 vs 2080 (+1504); QKV + RoPE (128 x 128 ping-pong) 2464 vs 1232 (+1232: FMUL 576, FFMA 320, MUFU 128); the
epilogue-warp kernels (loop bodies, not per tile): gate/up fwd +1312, MLP dX +1592, gate/up dW + AdamW +1656, down
dW + AdamW +1504, mostly IMAD (addressing) 399-567. All compile without spills.
Session 38 (fastmath AdamW; BSSY / CALL / BRA added: per-element branches serialize a thread's elements, as the
IEEE division and square root did): no CALL in any of them now; BSSY only in the epilogue-warp kernels' ragged-edge
and tile-boundary code (gate/up fwd 45 vs 16 plain, MLP dX 59 vs 16, the AdamW dW kernels 37 vs 12)."""
import functools

import torch

from coda.autodiff import with_preact
from coda.check import compile_variant
from coda.config import GemmConfig, epi_wg_config
from coda.epilogues.adamw import adamw, adamw_fold
from coda.epilogues.cross_entropy import ce_forward_logits
from coda.epilogues.rope import rope_rmsnorm
from coda.kernels.epilogue import IDENTITY
from coda.ops.mlp import dacc_on_da, residual_add_sumsq, rms_radial_residual, rms_swiglu

PP = dict(pingpong=True, sched="static")
PROBLEMS = [  # name, epilogue, shipped config (autotune/shipped/h100_sxm.json or coda.optim.update_config), majors
    ("fused da (SwiGLU bwd)", dacc_on_da((("out",), ("r",), False)),
     GemmConfig(tile_m=64, tile_n=256, cluster_m=2, **PP), ("k", "mn")),
    ("gate/up fwd", with_preact(rms_swiglu), GemmConfig(cluster_m=1, cluster_n=2, epi_wg=True), ("k", "k")),
    ("MLP dX (radial)", rms_radial_residual, GemmConfig(epi_wg=True), ("k", "mn")),
    ("gate/up dW + AdamW", adamw_fold, epi_wg_config(), ("mn", "mn")),
    ("down dW + AdamW", adamw, epi_wg_config(), ("mn", "mn")),
    ("logits", ce_forward_logits(torch.bfloat16), GemmConfig(), ("k", "k")),
    ("down fwd + residual", residual_add_sumsq(torch.bfloat16), GemmConfig(sched="dynamic"), ("k", "k")),
    ("QKV + RoPE", rope_rmsnorm, GemmConfig(tile_m=128, tile_n=128, cluster_m=1, cluster_n=2, **PP), ("k", "k")),
]
KEYS = ("BSSY", "CALL", "BRA", "MUFU", "FFMA", "FMUL", "FADD", "FSEL", "FSETP", "FMNMX", "F2F", "F2FP", "PRMT", "IMAD", "IADD", "LOP", "ISETP",
        "SHF", "LDS", "STS", "LDG", "STG", "LDSM", "STSM", "SHFL", "BAR", "HGMMA")


@functools.lru_cache(maxsize=None)  # the plain GEMM of a config and layout: compiled once
def census(cfg, epi, majors):
    r = compile_variant(cfg, epi, majors=majors, sass=True)
    s = r.get("sass", {})
    return r, s.get("total", 0), {k: sum(v for op, v in s.items() if op.startswith(k)) for k in KEYS}


for name, epi, cfg, majors in PROBLEMS:
    r, tot, by = census(cfg, epi, majors)
    _, tot0, by0 = census(cfg, IDENTITY, majors)
    extra = {k: by[k] - by0[k] for k in KEYS if by[k] != by0[k]}
    print(f"{name} [{cfg.name}]: ok {r['ok']} spills {r['spill_bytes']}; SASS {tot} vs plain {tot0} (+{tot - tot0}); "
          f"added: {extra}", flush=True)
