# session 38: programmatic dependent launch of the GEMM (kernels/gemm_sm90.py PDL) -- the CUDA-graph tests, then the
# step A/B in fused+graph mode on one machine: PDL on / off / on (H100)
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
export CODA_AUTOTUNE=0
timeout 100 python -m pytest -q -x tests/test_graphs_gpu.py -p no:cacheprovider 2>&1 | tail -2
Q="--model llama-1b --modes fused+graph --optimizer coda-adamw --head-reps 0 --profile-steps 0 --timeout 110"
for pdl in True False True; do
  sed -i "s/^PDL = .*/PDL = $pdl/" coda/kernels/gemm_sm90.py
  echo "PDL $pdl: $(timeout 120 python -m coda.bench.step $Q --out /tmp/pdl_$pdl 2>&1 | grep -E '^\| fused' | cut -d'|' -f5,10,11)"
done
