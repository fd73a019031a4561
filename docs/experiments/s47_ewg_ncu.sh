#!/bin/bash
# Where the gate/up dW GEMM with the AdamW update in the epilogue warps loses its time (session 46: the AdamW
# epilogues cost +3.9 ms a llama-1b step over their dW GEMMs, their state traffic at DRAM speed): Nsight Compute's
# source counters and throughputs of coda.bench.epi_wg's "adamw" (16384 x 2048 x 8192, update) and "adamw_plain"
# (the same dW GEMM through the epilogue warps without the update), coda.optim's config (128 x 256, cluster 2 x 1,
# epi_wg). Read: stalls of the MMA warps on the EMPTY named barrier (the epilogue warps late) vs long scoreboard on
# the full barriers (operands late: DRAM / L2 contention), DRAM throughput, SM clock.
cd "$(dirname "$0")/../.." || exit 1
for p in adamw adamw_plain; do
  echo "#### $p"
  PROBLEM=$p bash docs/experiments/pp_ncu.sh "tile_m=128,tile_n=256,cluster_m=2,epi_wg=1"
done
