#!/bin/bash
# Where the fused da's warps stall (Nsight Compute source counters, by SASS instruction) under each config given:
# bash docs/experiments/pp_ncu.sh "tile_m=128,tile_n=192,pingpong=1,cluster_m=2,epi_n=16" ... [PROBLEM=fused_da]
set -e
for cfg in "$@"; do
  rep=$(mktemp -d)/rep
  ncu --section SourceCounters --section WarpStateStats --section SpeedOfLight -k regex:GemmSm90 --launch-skip 2 \
      --launch-count 1 -f -o $rep python docs/experiments/pp_ncu_child.py "$cfg" ${PROBLEM:-fused_da} > /dev/null
  echo "== $cfg"
  ncu -i $rep.ncu-rep --page details --csv 2>/dev/null | grep -E '"Duration"|"Compute \(SM\) Throughput"|"Memory Throughput"|"DRAM Throughput"' | awk -F'","' '{print $(NF-2), $(NF-1), $NF}'
  ncu -i $rep.ncu-rep --page source --csv --print-source sass > $rep.csv
  python -c "import sys; from coda.bench.ncu_source import summarize; print('\n'.join(summarize(open(sys.argv[1]).read(), 22)))" $rep.csv
done
