#!/bin/bash
# ncu counters of docs/experiments/a_transform.py's kernels (one launch each: dX transform, plain dX, dW transform,
# plain dW): duration, SM clock, tensor-pipe activity, instructions, the stall reasons per issued instruction.
# Usage (GPU): bash docs/experiments/a_transform_ncu.sh [a_transform.py options] > ncu.txt
S=smsp__average_warps_issue_stalled
M=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
M=$M,sm__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active
for r in long_scoreboard wait barrier math_pipe_throttle mio_throttle lg_throttle short_scoreboard no_instruction \
         dispatch_stall membar sleeping selected not_selected tex_throttle drain imc_miss branch_resolving; do
  M=$M,${S}_${r}_per_issue_active.ratio
done
ncu --profile-from-start off --metrics "$M" python docs/experiments/a_transform.py --ncu "$@" 2>&1 | \
  grep -v "Warning\|^==PROF==" | grep -E "kernel|duration|per_second|gmma|inst_executed|issue_active|stalled|error"
