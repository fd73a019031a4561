# session 38: where the epilogue warps' AdamW excess goes: the dW GEMM through the hand-off with no update
# (adamw_plain), the update (adamw), both at gate/up's shape; the down projection's (adamw_wide); H100
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
export CODA_AUTOTUNE=0
timeout 400 python -m coda.bench.epi_wg --only adamw,adamw_plain,adamw_wide --variants "stages=2;tile_n=192,cluster_m=2" 2>&1 | grep -v -i warn
