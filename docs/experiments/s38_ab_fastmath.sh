# session 38: step A/B, the AdamW epilogues with / without fastmath (same machine, fused only, alternating), the
# optimizer's GPU tests, then the full step report (H100)
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
export CODA_AUTOTUNE=0
timeout 120 python -m pytest -q -x tests/test_optim_gpu.py -p no:cacheprovider 2>&1 | tail -2
Q="--model llama-1b --modes fused --optimizer coda-adamw --head-reps 0 --profile-steps 0 --timeout 100"
for r in 1 2; do
  for fm in on off; do
    if [ $fm = off ]; then sed -i 's/^@coda.epilogue(fastmath=True)$/@coda.epilogue/' epilogues/adamw.py
    else sed -i 's/^@coda.epilogue$/@coda.epilogue(fastmath=True)/' epilogues/adamw.py; fi
    echo "round $r fastmath $fm: $(timeout 110 python -m coda.bench.step $Q --out /tmp/ab_${r}_${fm} 2>&1 | grep -E '^\| fused' | cut -d'|' -f5)"
  done
done
sed -i 's/^@coda.epilogue$/@coda.epilogue(fastmath=True)/' epilogues/adamw.py
grep -c "fastmath=True" epilogues/adamw.py
CODA_COMMIT=$CODA_COMMIT timeout 280 python -m coda.bench.step --model llama-1b --modes stock+compile,fused,fused+graph --optimizer coda-adamw --timeout 130 --out $OUT/step 2>&1 | grep -E "^\| (stock|fused)" | tail -3
