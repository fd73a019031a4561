#!/bin/bash
# needs `git apply docs/experiments/side_job.patch` (session 40: the side job is not in the library)
# session 40: why a GEMM with an empty side job is ~3 % slower (SASS of both kernels, ncu of plain / empty / full)
export CODA_AUTOTUNE=0
for c in cubins_tmp/*.cubin; do nvdisasm -c "$c" > "$OUT/$(basename "$c" .cubin).sass" 2>&1; done
ls -la $OUT
timeout 240 ncu -k regex:GemmSm90 --launch-skip 4 --launch-count 3 --section SpeedOfLight --section WarpStateStats \
  --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis \
  --metrics sm__cycles_elapsed.avg.per_second,smsp__inst_executed.sum,sm__inst_executed_pipe_tensor_op_gmma.sum,dram__bytes.sum,lts__t_bytes.sum \
  python docs/experiments/side_job_ncu.py 2 40 0 > $OUT/ncu.txt 2>&1
grep -E "GemmSm90|Duration|SM Frequency|Elapsed Cycles|Compute \(SM\)|Memory Throughput|DRAM Through|Issue Slots|Warp Cycles Per Issued|Executed Ipc|No Eligible|dram__bytes|lts__t_bytes|smsp__inst_executed.sum|sm__cycles_elapsed.avg.per|gmma" $OUT/ncu.txt | head -80
# the review mends of session 39 (CE reduction='none' fast backward, autodiff.derived) and the ce_grad kernel
# after its _block refactor
timeout 280 python -m pytest -q -x tests/test_ce_grad_gpu.py tests/test_cross_entropy_gpu.py tests/test_dsl_gpu.py 2>&1 | tail -4
