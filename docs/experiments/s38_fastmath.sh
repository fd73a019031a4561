# session 38: fastmath AdamW in the epilogue warps -- GPU tests, coda.bench.optim, epi_wg, the step (H100)
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
export CODA_AUTOTUNE=0
timeout 240 python -m pytest -q -x tests/test_dsl_gpu.py -k fastmath tests/test_optim_gpu.py -p no:cacheprovider 2>&1 | tail -3
timeout 150 python -m coda.bench.optim 2>&1 | grep -v -i warn
timeout 60 python -m coda.bench.epi_wg --only adamw,adamw_plain,adamw_wide --no-ewg --variants "tile_n=256,cluster_m=2" 2>&1 | grep -v -i warn
timeout 170 python -m coda.bench.step --model llama-1b --modes stock+compile,fused --optimizer coda-adamw --head-reps 0 --profile-steps 0 --timeout 160 --out $OUT/step 2>&1 | grep -E "^\| (stock|fused)" | tail -2
