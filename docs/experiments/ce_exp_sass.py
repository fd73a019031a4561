"""Static SASS of f3f1fb8's stored-exponential kernels (``coda.kernels.ce_exp``, reverted in 01e04d5) beside the
kernels they replace, compiled for sm_90a on the CPU (``nvdisasm`` on PATH): which instructions each adds.

Usage: ``git worktree add /tmp/wt f3f1fb8 && cd /tmp/wt && pip install -e . --no-deps && CUTE_DSL_ARCH=sm_90a python
/path/to/ce_exp_sass.py`` (then reinstall the main tree). Session 36 (counts per kernel, not per tile):
exp_logits 6544 instructions (MUFU 134, FFMA 128, FMNMX 130, F2FP 64), ce_forward_logits 6832 (MUFU 158, FMUL 154,
FADD 264, FMNMX 130), identity 4160; exp_dx 4928 (HFMA2 48, F2FP 115, LDSM 12, STSM 28, STG 12, LDG 16), identity
(MN-major B) 3056. The logits kernel is leaner than the one it replaced: the step's missing 0.7 ms is not in its
instruction count."""
import torch
from coda.check import compile_variant
from coda.config import GemmConfig
from coda.epilogues.cross_entropy import ce_exp_logits, ce_exp_dx, ce_forward_logits
from coda.kernels.epilogue import Epilogue
cnt = ("ex2.approx", "shfl.sync", "stmatrix", "st.global", "fma.rn.bf16x2", "bar.sync")
rows = []
for name, epi, cfg, majors in (("exp_logits", ce_exp_logits, GemmConfig(sched="dynamic"), ("k", "k")),
                               ("ce_forward_logits", ce_forward_logits(torch.bfloat16), GemmConfig(sched="dynamic"), ("k", "k")),
                               ("identity", Epilogue(), GemmConfig(sched="dynamic"), ("k", "k")),
                               ("exp_dx", ce_exp_dx, GemmConfig(), ("k", "mn")),
                               ("identity_dx", Epilogue(), GemmConfig(), ("k", "mn"))):
    r = compile_variant(cfg, epi, majors=majors, count=cnt, sass=True)
    sass = r.get("sass", {})
    keys = ("MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "SHFL", "STS", "LDS", "STG", "LDG", "HFMA2", "F2FP", "PRMT", "BAR", "WARPGROUP", "HGMMA", "STSM", "LDSM", "BRA")
    print(name, r["ok"], r["registers"], r["spill_bytes"], "total", sum(sass.values()) if sass else None,
          {k: sum(v for op, v in sass.items() if op.startswith(k)) for k in keys}, flush=True)
