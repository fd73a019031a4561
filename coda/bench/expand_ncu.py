"""``ncu ... python -m coda.bench.expand_ncu CFG...``: the SwiGLU backward fused into da's GEMM (llama-1b: 8192 x
8192 x 2048) once per config ("tm,tn,pp,cm,sched,epi_n,stages"), each inside an NVTX range named by the config, for
Nsight Compute's counters (tensor-pipe activity, DRAM throughput) next to cuBLAS's plain da GEMM."""
import sys

import torch

import coda
from coda.config import GemmConfig
from coda.ops.mlp import dacc_on_da


def main(argv):
    M, H, I = 8192, 2048, 8192
    bf = dict(device="cuda", dtype=torch.bfloat16)
    dy, wd, g, u = torch.randn(M, H, **bf), torch.randn(H, I, **bf), torch.randn(M, I, **bf), torch.randn(M, I, **bf)
    ops = dict(r=torch.rand(M, device="cuda") + 0.5, _preact_even=g, _preact_odd=u)
    prog = dacc_on_da((("out",), ("r",), False))
    cfgs = []
    for text in argv:
        tm, tn, pp, cm, sched, en, st = text.split(",")
        cfgs.append((text, GemmConfig(tile_m=int(tm), tile_n=int(tn), pingpong=pp == "pp", cluster_m=int(cm),
                                      sched=sched, epi_n=int(en), stages=None if st == "-" else int(st))))
    for _, cfg in cfgs:  # compile and warm up outside the profiled ranges
        coda.gemm(dy, wd.t(), epilogue=prog, config=cfg, **ops)
    torch.mm(dy, wd)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("cublas")
    torch.mm(dy, wd)
    torch.cuda.nvtx.range_pop()
    for name, cfg in cfgs:
        torch.cuda.nvtx.range_push(name)
        coda.gemm(dy, wd.t(), epilogue=prog, config=cfg, **ops)
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
