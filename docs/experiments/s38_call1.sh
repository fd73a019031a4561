source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv
export CODA_AUTOTUNE=0
timeout 200 python docs/experiments/sustained_gemm.py --secs 2.5 --problems fused_da swiglu_fwd radial adamw adamw_wide logits 2>&1 | grep -v Warning | tail -30
for r in 1 2; do P=""; [ $r = 1 ] && P=--power
timeout 150 python -m coda.bench.step --model llama-1b --modes stock+compile,fused --optimizer coda-adamw --head-reps 0 --profile-steps 0 --timeout 140 $P --out $OUT/step_${r} 2>&1 | grep -iE "mode|tok|W |MHz|J |step ms|\| (stock|fused)" | tail -8
done
