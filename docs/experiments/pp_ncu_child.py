"""The fused da (SwiGLU backward in da = dy W_down, coda.bench.epi_wg's fused_da) launched 3 times under one config
given as GemmConfig fields (argv[1], e.g. "tile_m=128,tile_n=192,pingpong=1,cluster_m=2,epi_n=16"), for Nsight
Compute's source page (docs/experiments/pp_ncu.sh)."""
import sys

import torch

import coda
from coda.bench.epi_wg import problems
from coda.bench.ncu_source import _config

make, epi = problems()[sys.argv[2] if len(sys.argv) > 2 else "fused_da"]
a, b, ops, _ = make()
ops = {k: v for k, v in ops.items() if k in {o.name for o in epi.operands}}
cfg = _config("epi_wg=0," + sys.argv[1])
for _ in range(3):
    coda.gemm(a, b, epilogue=epi, config=cfg, **ops)
torch.cuda.synchronize()
