"""Half-depth stages (GemmConfig.tile_k = 32) on the llama-1b step's heavy GEMMs, H100: each problem of
``coda.bench.epi_wg`` under its shipped config ("default") and variants, timed in ROUNDS interleaved rounds
(do_bench medians, L2 flushed) so that clock drift between variants averages out; prints per variant the mean of
the rounds' medians and its ratio to the default's. Usage: python docs/experiments/s47_k32.py [ROUNDS]
(session 47)."""
import dataclasses
import sys

import torch
from triton.testing import do_bench

import coda
from coda.bench.epi_wg import problems
from coda.config import GemmConfig

C = GemmConfig
VARIANTS = {
    "fused_da": {"pp64 k32": C(tile_m=64, tile_n=256, pingpong=True, tile_k=32),
                 "pp64 k32 s6": C(tile_m=64, tile_n=256, pingpong=True, tile_k=32, stages=6),
                 "coop k32": C(tile_k=32), "coop k64": C()},
    "logits": {"coop k32": C(tile_k=32), "coop k64": C()},
    "radial": {"coop k32": C(tile_k=32), "ewg k64": C(epi_wg=True)},
    "swiglu_fwd": {"ewg 1x2 k64": C(cluster_m=1, cluster_n=2, epi_wg=True), "coop 1x2 k32": C(cluster_m=1, cluster_n=2, tile_k=32),
                   "coop k32": C(tile_k=32)},
}


def main(rounds: int) -> None:
    print(torch.cuda.get_device_name(), f"{rounds} rounds, ms (mean of medians) / default")
    for name, (make, epi) in problems().items():
        if name not in VARIANTS:
            continue
        a, b, ops, _ = make()
        ops = {k: v for k, v in ops.items() if k in {o.name for o in epi.operands}}
        cands = {"default": None, **VARIANTS[name]}
        times = {k: [] for k in cands}
        for r in range(rounds):
            for label, cfg in cands.items():
                times[label].append(do_bench(lambda: coda.gemm(a, b, epilogue=epi, config=cfg, **ops),
                                             warmup=25, rep=100))
        base = sum(times["default"]) / rounds
        print(f"{name}: " + "; ".join(f"{k} {sum(v) / rounds:.4f} ({sum(v) / rounds / base:.3f})"
                                      for k, v in times.items()), flush=True)
        del a, b, ops


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
