"""128 x 192 ping-pong tiles (192 fp32 accumulators a consumer thread; the bound was 128 before session 37):
does a ping-pong tile with cooperative-class arithmetic intensity hide the heavy epilogues (issue 29)?

Runs ``coda.bench.epi_wg`` with consumer-warp variants (epi_wg=0) next to the shipped / default configs and cuBLAS.
Usage on the GPU:
python docs/experiments/pingpong_192.py [--only ...] [--variants ...] (bench.epi_wg's arguments; default: the variants
below on da_plain, fused_da, swiglu_fwd, adamw)."""
import sys

from coda.bench.epi_wg import main

VARIANTS = ";".join([
    "tile_m=64,tile_n=256,pingpong=1,epi_wg=0,cluster_m=2,epi_n=32",
    "tile_m=128,tile_n=192,pingpong=1,epi_wg=0,cluster_m=2,epi_n=16",
    "tile_m=128,tile_n=192,pingpong=1,epi_wg=0,cluster_m=2,epi_n=32",
])
if __name__ == "__main__":
    args = sys.argv[1:] or ["--only", "da_plain,fused_da,swiglu_fwd,adamw"]
    if "--variants" not in args:
        args += ["--no-ewg", "--variants", VARIANTS]
    sys.exit(main(args))
