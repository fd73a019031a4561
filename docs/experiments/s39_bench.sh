# session 39: the op-level speed-of-light report at the current commit (H100; CODA_AUTOTUNE unset: shipped configs
# where an entry fits, else the heuristic -- what a user gets), in two appended runs, then the fused + compile step
# mode for the README's step table.
source .device/cutlass-dsl-4.8.1/setup.sh; python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
O=$OUT/bench
timeout 280 python -m coda.bench --ops gemm,gemm_scale_bias,gemm_scale_bias_sumsq,rmsnorm_linear.fwd,linear_swiglu.fwd,linear_geglu.fwd,linear_cross_entropy.fwd,mlp.fwd --out $O 2>&1 | grep -vi warn | tail -3
timeout 250 python -m coda.bench --ops rmsnorm_linear.fwd+bwd,linear_swiglu.fwd+bwd,linear_geglu.fwd+bwd,linear_cross_entropy.fwd+bwd,mlp.fwd+bwd --append --out $O 2>&1 | grep -vi warn | tail -3
grep -A30 "^## Summary" $O/report.md | head -28
