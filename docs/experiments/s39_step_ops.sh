# session 39: which torch ops launch the fused step's small non-GEMM kernels (H100, llama-1b with 2 layers,
# coda.optim.AdamW, one step after warm-up): by input shapes, then by Python stack
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
timeout 150 python -m coda.bench.step_ops --layers 2 --optimizer coda-adamw --top 120 > $OUT/step_ops_shapes.txt 2>&1
timeout 150 python -m coda.bench.step_ops --layers 2 --optimizer coda-adamw --top 200 --stack 8 > $OUT/step_ops_stack.txt 2>&1
wc -l $OUT/*.txt
