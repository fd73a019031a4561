"""CPU: compile the logits GEMM (the CE fast mode's ce_forward_logits epilogue, 128 x 256 cooperative) with the
ce_grad side job for sm_90a at each (unroll, producer registers, prefetch) variant; print registers / spills
(ptxas -v). Usage: CUTE_DSL_ARCH=sm_90a python docs/experiments/side_job_compile.py
Needs ``git apply docs/experiments/side_job.patch`` (session 40: the side job is not in the library)."""
import torch

from coda.check import compile_variant
from coda.config import GemmConfig
from coda.epilogues.cross_entropy import ce_forward_logits
from coda.kernels import ce_grad

VARIANTS = [(1, 40, 2), (2, 40, 2), (2, 56, 2), (2, 56, 0), (4, 72, 0), (4, 72, 2), (2, 48, 2)]
cfg = GemmConfig(tile_m=128, tile_n=256)
epi = ce_forward_logits(torch.bfloat16)
for unroll, regs, pf in VARIANTS:
    job = ce_grad.side_job(torch.bfloat16, unroll=unroll, regs=regs, prefetch=pf)
    row = compile_variant(cfg, epi, side=(job, ce_grad.side_fake_tensors()), count=("prefetch.global",))
    print(f"unroll {unroll} regs {regs} prefetch {pf}:", {k: row[k] for k in ("ok", "registers", "spill_bytes",
                                                                             "count", "error")}, flush=True)
