"""CPU (CI): the speed-of-light report ``python -m coda.bench``.

FLOP and byte counts of every registered op against hand counts; SoL arithmetic; the measurement loop on CPU tensors
(cuBLAS stand-in and eager timed, CODA failing cleanly, coda.ops gating); rendering report.md and both PNGs from a
saved JSON; the CLI without a GPU.
"""
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from coda import bench as B
from coda.bench import report as R

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRANSFORMER_OPS = ("rmsnorm_linear", "linear_swiglu", "linear_geglu", "linear_cross_entropy", "mlp")


# -- hand counts ------------------------------------------------------------------------------------------------------
# FLOPs: 2*M*N*K per matmul, x3 with backward (forward, data gradient, weight gradient).
# Bytes (e = bytes per element of the compute dtype): every input read once, every output written once; forward +
# backward adds the output gradient (read) and the input gradients (written).
def _hand(key, s, e):
    M = s["M"]
    if key == "gemm.fwd":
        return 2 * M * s["N"] * s["K"], e * (M * s["K"] + s["N"] * s["K"] + M * s["N"])
    if key == "gemm_scale_bias.fwd":  # + fp32 scale (M) and bias (N)
        return 2 * M * s["N"] * s["K"], e * (M * s["K"] + s["N"] * s["K"] + M * s["N"]) + 4 * (M + s["N"])
    if key == "gemm_scale_bias_sumsq.fwd":  # + fp32 row sums of squares (M)
        return 2 * M * s["N"] * s["K"], e * (M * s["K"] + s["N"] * s["K"] + M * s["N"]) + 4 * (M + s["N"]) + 4 * M
    H = s["H"]
    if key.startswith("rmsnorm_linear"):
        N = s["N"]
        params = M * H + H + N * H                      # x, norm weight, weight
        if key.endswith(".fwd"):
            return 2 * M * N * H, e * (params + M * N)
        return 3 * 2 * M * N * H, e * (2 * params + 2 * M * N)  # + dy read, y written; dx, dgamma, dW written
    if key.startswith(("linear_swiglu", "linear_geglu")):
        I = s["I"]
        params = M * H + 2 * I * H
        if key.endswith(".fwd"):
            return 2 * M * 2 * I * H, e * (params + M * I)
        return 3 * 2 * M * 2 * I * H, e * (2 * params + 2 * M * I)
    if key.startswith("linear_cross_entropy"):
        V = s["V"]
        # x, weight (e), int64 targets, fp32 scalar loss; backward: fp32 scalar loss gradient, dx and dW
        if key.endswith(".fwd"):
            return 2 * M * V * H, e * (M * H + V * H) + 8 * M + 4
        return 3 * 2 * M * V * H, e * 2 * (M * H + V * H) + 8 * M + 4 + 4
    if key.startswith("mlp"):
        I = s["I"]
        flops = 2 * M * 2 * I * H + 2 * M * H * I     # gate/up, down
        params = M * H + H + 2 * I * H + H * I          # x, norm weight, gate/up, down
        if key.endswith(".fwd"):
            return flops, e * (params + M * H)
        return 3 * flops, e * (2 * params + 2 * M * H)
    raise KeyError(key)


SMALL = dict(M=24, N=40, K=56, H=32, I=48, V=72)


def _small(spec):
    return {p: SMALL[p] for p in spec.params}


def test_registry_has_the_issue_ops():
    keys = {s.key for s in B.REGISTRY}
    assert {"gemm.fwd", "gemm_scale_bias.fwd", "gemm_scale_bias_sumsq.fwd"} <= keys
    for op in TRANSFORMER_OPS:
        assert {f"{op}.fwd", f"{op}.fwd+bwd"} <= keys
        assert all(s.requires == op for s in B.REGISTRY if s.op == op)
    # issue 28: the cross entropy's lean mode beside the default one
    lean = next(s for s in B.REGISTRY if s.key == "linear_cross_entropy_lean.fwd+bwd")
    assert lean.requires == "linear_cross_entropy" and "lean" in lean.description
    gemm = next(s for s in B.REGISTRY if s.key == "gemm.fwd")
    assert gemm.shapes == ((8192, 8192, 8192), (8192, 4096, 4096), (8192, 28672, 4096), (8192, 4096, 14336),
                           (8192, 128256, 4096))
    llama = dict(M=8192, H=4096, I=14336, V=128256)
    for s in B.REGISTRY:
        if s.op in TRANSFORMER_OPS:
            assert all(v == llama[k] for k, v in s.shape_dicts()[0].items() if k in llama), s.key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("key", [s.key for s in B.REGISTRY])
def test_flops_and_bytes_match_hand_counts(key, dtype):
    spec = next(s for s in B.REGISTRY if s.key == key)
    for shape in spec.shape_dicts() + [_small(spec)]:
        flops, nbytes = _hand(key, shape, 2)
        assert spec.flops(shape) == flops, (key, shape)
        assert spec.nbytes(shape, dtype) == nbytes, (key, shape)


def test_llama_counts_spelled_out():
    """Two counts written out in numbers, independent of the formulas above."""
    ce = next(s for s in B.REGISTRY if s.key == "linear_cross_entropy.fwd")
    s = ce.shape_dicts()[0]
    assert ce.flops(s) == 8_607_114_461_184                       # 2 * 8192 * 128256 * 4096
    assert ce.nbytes(s, torch.bfloat16) == 1_117_847_556          # 2*(8192*4096 + 128256*4096) + 8*8192 + 4
    mlp = next(s for s in B.REGISTRY if s.key == "mlp.fwd+bwd")
    assert mlp.flops(mlp.shape_dicts()[0]) == 18 * 8192 * 4096 * 14336


def test_register_rejects_bad_specs():
    spec = B.REGISTRY[0]
    with pytest.raises(ValueError, match="already registered"):
        B.register(spec)
    import dataclasses
    for bad, msg in [(dict(op="x", mode="bwd"), "mode"), (dict(op="x", impls=("coda", "triton")), "unknown impl"),
                     (dict(op="x", mode="fwd+bwd", grad_inputs=()), "grad_inputs"),
                     (dict(op="x", shapes=((1, 2),)), "one value per parameter")]:
        with pytest.raises(ValueError, match=msg):
            B.register(dataclasses.replace(spec, **bad))
    assert all(s.op != "x" for s in B.REGISTRY)


# -- SoL arithmetic ---------------------------------------------------------------------------------------------------
def test_sol_arithmetic():
    # 2 TFLOP at 1000 TFLOP/s = 2 ms; 1 GB at 1000 GB/s = 1 ms -> SoL 2 ms, compute-bound
    assert R.sol_ms(2e12, 1e9, 1000, 1000) == pytest.approx(2.0)
    assert R.bound(2e12, 1e9, 1000, 1000) == "compute"
    # 1 GFLOP, 3 GB at 3000 GB/s = 1 ms > 0.001 ms -> memory-bound
    assert R.sol_ms(1e9, 3e9, 1000, 3000) == pytest.approx(1.0)
    assert R.bound(1e9, 3e9, 1000, 3000) == "memory"
    assert R.pct_sol(4.0, 2.0) == pytest.approx(50.0)
    assert R.tflops(2e12, 4.0) == pytest.approx(500.0)
    assert R.gbps(3e9, 1.5) == pytest.approx(2000.0)
    t = R.summarize_timings([(0.9, 1.0, 1.1), (1.0, 1.2, 1.3), (1.05, 1.1, 1.2)])
    assert t["ms"] == pytest.approx(1.1) and t["min_ms"] == 1.0 and t["max_ms"] == 1.2
    assert t["iqr_ms"] == pytest.approx(0.2) and t["spread_pct"] == pytest.approx(100 * 0.2 / 1.1)
    assert R.quantiles([4, 1, 3, 2], (0.0, 0.5, 1.0)) == (1, 2.5, 4)


def _case(impls, cublas_complete=False, flops=2e12, nbytes=1e9):
    return dict(op="op", mode="fwd", key="op.fwd", shape={"M": 1}, flops=flops, bytes=nbytes, gemms=[[1, 1, 1]],
                cublas_complete=cublas_complete, impls=impls)


def test_finalize_and_winner():
    ceil = dict(gemm=dict(peak_tflops=1000.0), bandwidth=dict(gbps=1000.0))
    impls = {"cublas": {"ms": 1.0}, "coda": {"ms": 2.5, "rel_err": 0.002}, "eager": {"ms": 4.0},
             "compile": {"ms": 2.0, "rel_err": 0.3}}
    rep = R.finalize(dict(ceilings=ceil, results=[_case(impls)]))
    c = rep["results"][0]
    assert c["sol_ms"] == pytest.approx(2.0) and c["bound"] == "compute"
    assert c["impls"]["coda"]["pct_sol"] == pytest.approx(80.0)
    assert c["impls"]["coda"]["vs_cublas"] == pytest.approx(2.5)
    assert c["impls"]["eager"]["tflops"] == pytest.approx(500.0)
    # cuBLAS does only the GEMM of this op and torch.compile disagrees with the reference: CODA wins
    assert c["winner"] == "coda"
    assert R.winner(_case(dict(impls, coda={"error": "boom"}))) == "eager"
    assert R.winner(_case(impls, cublas_complete=True)) == "cublas"
    assert R.winner(_case({"coda": {"ms": 1.0, "mismatch": True}})) is None


def test_paired_ratio_cancels_drift_between_repeats():
    # the card slows down by 2x in the third repeat for both: the quotient of medians moves, the paired one does not
    cublas, coda_reps = [1.0, 1.0, 2.0, 2.0, 2.0], [0.9, 0.9, 1.8, 1.8, 1.8]
    assert R.paired_ratio(coda_reps, cublas) == pytest.approx(0.9)
    assert R.median(coda_reps) / R.median(cublas) == pytest.approx(0.9)
    drift = [1.0, 1.0, 1.0, 2.0, 2.0]  # cuBLAS measured while slow, CODA while fast: 0.9 / 1.0 vs 1.8 / 2.0
    assert R.paired_ratio([0.9, 0.9, 1.8, 1.8, 1.8], drift) == pytest.approx(0.9)
    assert R.median([0.9, 0.9, 1.8, 1.8, 1.8]) / R.median(drift) == pytest.approx(1.8)
    assert R.paired_ratio([1.0, 2.0], [1.0]) is None and R.paired_ratio(None, [1.0]) is None
    ceil = dict(gemm=dict(peak_tflops=1000.0), bandwidth=dict(gbps=1000.0))
    impls = {"cublas": R.summarize_timings([(0, m, 0) for m in drift]),
             "coda": R.summarize_timings([(0, m, 0) for m in [0.9, 0.9, 1.8, 1.8, 1.8]]), "eager": {"ms": 3.0}}
    c = R.finalize(dict(ceilings=ceil, results=[_case(impls)]))["results"][0]
    assert c["impls"]["coda"]["vs_cublas"] == pytest.approx(1.8)
    assert c["impls"]["coda"]["vs_cublas_paired"] == pytest.approx(0.9)
    assert c["impls"]["eager"]["vs_cublas_paired"] is None  # no repeat medians recorded


# -- measurement loop on CPU tensors ---------------------------------------------------------------------------------
def _cpu_timer(fn, warmup_ms, rep_ms):
    fn()
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return R.quantiles(ts, (0.25, 0.5, 0.75))


def _cpu_run(**kw):
    kw.setdefault("impls", ("coda", "cublas", "eager"))
    return B.Runner(device="cpu", repeats=2, timer=_cpu_timer, log=lambda *a: None, **kw)


@pytest.mark.parametrize("key", [s.key for s in B.REGISTRY])
def test_measure_case_on_cpu(key):
    spec = next(s for s in B.REGISTRY if s.key == key)
    case = B.measure_case(spec, _small(spec), _cpu_run(dtype=torch.float32))
    assert case["flops"] == spec.flops(_small(spec)) and case["n_sets"] == 1
    assert "error" in case["impls"]["coda"]  # no Hopper GPU here / coda.ops lacks the op: reported, not raised
    for k in ("cublas", "eager") if "eager" in spec.impls else ("cublas",):
        r = case["impls"][k]
        assert "error" not in r, r
        assert r["ms"] > 0 and len(r["repeats_ms"]) == 2 and r["min_ms"] <= r["ms"] <= r["max_ms"]
    json.dumps(case, allow_nan=False)


def test_backward_wrapper_returns_output_and_gradients():
    spec = next(s for s in B.REGISTRY if s.key == "rmsnorm_linear.fwd+bwd")
    shape = _small(spec)
    inp = B.build_inputs(spec, shape, torch.float64, "cpu")
    out, dx, dg, dw = B.impl_function(spec, "eager")(inp)
    assert out.shape == (shape["M"], shape["N"]) and inp["dout"].shape == out.shape
    assert dx.shape == inp["x"].shape and dg.shape == inp["norm_weight"].shape and dw.shape == inp["weight"].shape
    # the data gradient of <dout, rmsnorm(x) @ W.T>, checked against a central difference along a random direction
    # (the Llama RMSNorm normalises in fp32, hence the step and the tolerance)
    v = torch.randn_like(inp["x"])
    f = lambda x: (spec.eager(dict(inp, x=x)) * inp["dout"]).sum()  # noqa: E731
    with torch.no_grad():
        fd = (f(inp["x"] + 1e-2 * v) - f(inp["x"] - 1e-2 * v)) / 2e-2
    assert (dx * v).sum().item() == pytest.approx(fd.item(), rel=2e-3)


def test_l2_cold_rotates_fresh_inputs():
    run = _cpu_run(l2_cold=True)
    assert run.n_sets(10 * 2**30) == 2 and run.n_sets(1) == B.MAX_SETS
    assert _cpu_run().n_sets(1) == 1
    spec = next(s for s in B.REGISTRY if s.key == "gemm_scale_bias.fwd")
    case = B.measure_case(spec, _small(spec), dataclasses_replace(run, impls=("eager",)))
    assert case["n_sets"] == B.MAX_SETS and case["impls"]["eager"]["ms"] > 0
    rot = B.Rotation(["a", "b", "c"])
    assert [rot() for _ in range(4)] == ["a", "b", "c", "a"]


def dataclasses_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)


def test_transformer_ops_are_gated_on_coda_ops(monkeypatch):
    import coda.ops
    for op in TRANSFORMER_OPS:
        if getattr(coda.ops, op, None) is None:
            spec = next(s for s in B.REGISTRY if s.key == f"{op}.fwd")
            assert B.unavailable(spec) == f"`coda.ops` has no `{op}` (not implemented yet)"
    spec = next(s for s in B.REGISTRY if s.key == "rmsnorm_linear.fwd")
    calls = []

    def rmsnorm_linear(x, norm_weight, weight, eps):  # a correct torch version stands in for the CODA op
        calls.append(x.shape)
        return torch.nn.functional.linear(B._rmsnorm(x, norm_weight, eps), weight)

    monkeypatch.setattr(coda.ops, "rmsnorm_linear", rmsnorm_linear, raising=False)
    assert B.unavailable(spec) is None
    case = B.measure_case(spec, _small(spec), _cpu_run(dtype=torch.float32))
    assert calls and case["impls"]["coda"]["rel_err"] == pytest.approx(0.0, abs=1e-6)
    assert R.winner(case) in ("coda", "eager")

    # a wrong result is flagged and can never be the winner
    monkeypatch.setattr(coda.ops, "rmsnorm_linear", lambda x, g, w, eps: 2 * rmsnorm_linear(x, g, w, eps))
    case = B.measure_case(spec, _small(spec), _cpu_run(dtype=torch.float32))
    assert R.mismatched(case["impls"]["coda"]) and R.winner(case) == "eager"


def test_ceilings_on_cpu():
    ceil = B.measure_ceilings(_cpu_run(), gemm_shape=(64, 64, 64), copy_bytes=1 << 20)
    g = ceil["gemm"]
    assert "error" in g["impls"]["coda"] and g["peak_source"] == "cublas"
    assert g["peak_tflops"] == pytest.approx(2 * 64**3 / g["impls"]["cublas"]["ms"] / 1e9)
    assert ceil["bandwidth"]["bytes"] == 2 << 20
    assert ceil["bandwidth"]["gbps"] == pytest.approx(R.gbps(2 << 20, ceil["bandwidth"]["ms"]))


# -- CLI -------------------------------------------------------------------------------------------------------------
def test_select_and_parse_shapes():
    specs = B.select_specs("gemm,mlp.fwd")
    assert [s.key for s in specs] == ["gemm.fwd", "mlp.fwd"]
    assert [s.key for s in B.select_specs("mlp")] == ["mlp.fwd", "mlp.fwd+bwd"]
    with pytest.raises(ValueError, match="unknown op"):
        B.select_specs("nope")
    shapes = B.parse_shapes("M=4096", specs)
    assert shapes["gemm.fwd"] == [dict(M=4096, N=8192, K=8192)]
    assert shapes["mlp.fwd"] == [dict(M=4096, H=4096, I=14336)]
    shapes = B.parse_shapes("N=1024,K=512", specs)  # mlp has neither: keeps its default shapes
    assert shapes["gemm.fwd"] == [dict(M=8192, N=1024, K=512)] and len(shapes["mlp.fwd"]) == 1
    gemm = B.select_specs("gemm")
    assert B.parse_shapes("64x32x16;64x32x16", gemm)["gemm.fwd"] == [dict(M=64, N=32, K=16)]
    assert len(B.parse_shapes(None, gemm)["gemm.fwd"]) == 5
    for bad in ("64x32", "Q=3", "M=-1", "M=x"):
        with pytest.raises(ValueError):
            B.parse_shapes(bad, gemm)
    with pytest.raises(ValueError, match="positional"):
        B.parse_shapes("8x8x8", specs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_cli_without_gpu_exits_nonzero_with_a_message(tmp_path):
    out = tmp_path / "res"
    proc = subprocess.run([sys.executable, "-m", "coda.bench", "--ops", "gemm", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc
    assert "cannot measure here: no CUDA GPU is visible to torch" in proc.stderr
    assert "--from" in proc.stderr
    assert not out.exists()


# -- rendering from a saved report -----------------------------------------------------------------------------------
PEAK, BW = 745.0, 2950.0
EFF = {"coda": 0.93, "cublas": 0.92, "eager": 0.6, "compile": 0.7}


def synthetic_report():
    """A plausible H100 report: counts from the registry, times from fixed efficiencies, one failure, one mismatch."""
    results = []
    for spec in B.REGISTRY:
        for shape in spec.shape_dicts():
            f, b = spec.flops(shape), spec.nbytes(shape, torch.bfloat16)
            sol = R.sol_ms(f, b, PEAK, BW)
            impls = {}
            for k in spec.impls:
                ms = sol / EFF[k] * (0.9 if k == "cublas" and not spec.cublas_complete else 1.0)
                q = [(ms * 0.99, ms * (1 + 0.004 * i), ms * 1.01) for i in (-2, -1, 0, 1, 2)]
                impls[k] = dict(R.summarize_timings(q), peak_mem_bytes=int(b), extra_mem_bytes=int(0.05 * b))
                if spec.compare and k in ("coda", "compile"):
                    impls[k]["rel_err"] = 2e-3
            results.append(dict(op=spec.op, mode=spec.mode, key=spec.key, shape=shape, flops=f, bytes=b,
                                gemms=[list(g) for g in spec.gemm_list(shape)], cublas_complete=spec.cublas_complete,
                                description=spec.description, impls=impls, n_sets=1))
    results[1]["impls"]["coda"]["rel_err"] = 0.4                    # gemm 8192x4096x4096: wrong result
    results[-1]["impls"]["compile"] = {"error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 3 GiB"}
    g_ms = 2 * 8192**3 / (PEAK * 1e9)
    return dict(schema=1, meta=dict(device="NVIDIA H100 80GB HBM3", capability="sm_90", driver="570.124.06",
                                    cuda="12.8", torch="2.13.0", triton="3.6.0", cutlass_dsl="4.8.1", coda="0.1.0",
                                    commit="0123456789abcdef", dirty=False, dtype="bfloat16", date="2026-11-21 00:00 UTC",
                                    timing=dict(timer="do_bench", repeats=5, warmup_ms=25, rep_ms=100, l2_cold=False,
                                                compile_mode="default")),
                skipped=[{"op": "linear_geglu.fwd", "reason": "`coda.ops` has no `linear_geglu` (not implemented yet)"}],
                ceilings=dict(gemm=dict(shape=[8192] * 3, flops=2 * 8192**3, peak_tflops=PEAK, peak_source="coda",
                                        impls={"cublas": R.summarize_timings([(0, g_ms * 1.01, 0)] * 3),
                                               "coda": R.summarize_timings([(0, g_ms, 0)] * 3)}),
                              bandwidth=dict(R.summarize_timings([(0, 2 * 2**31 / (BW * 1e6), 0)] * 3),
                                             bytes=2 * 2**31, gbps=BW)),
                results=results)


def test_render_from_saved_json(tmp_path):
    src = tmp_path / "saved.json"
    src.write_text(json.dumps(synthetic_report()))
    out = tmp_path / "out"
    rc = B.main(["--from", str(src), "--out", str(out)])
    assert rc == (0 if R.matplotlib_available() else 1)
    md = (out / "report.md").read_text()
    assert "NVIDIA H100 80GB HBM3" in md and "commit 0123456789" in md
    assert f"**{PEAK:.0f} TFLOP/s**" in md and f"**{BW:.0f} GB/s**" in md
    assert "| CODA / cuBLAS GEMM | paired |" in md and "Paired: the median over repeats" in md
    for spec in B.REGISTRY:
        assert f"## {spec.op} ({spec.mode})" in md
    lines = md.splitlines()
    rows = [line for line in lines if line.startswith("| M=8192 N=8192 K=8192 | ")]
    # gemm 8192^3: CODA (0.93) beats cuBLAS (0.92) and is bold; gemm_scale_bias*: CODA bold (cuBLAS is GEMM-only)
    assert rows and all("**CODA**" in r for r in rows)
    sec = lines.index("## gemm (fwd)")
    row = next(x for x in lines[sec:] if x.startswith("| M=8192 N=4096 K=4096 |"))
    assert "MISMATCH" in row and "**" not in row                      # the wrong CODA result is not the winner
    assert "**cuBLAS GEMM**" in lines[lines.index(row) + 1]
    assert "failed: OutOfMemoryError" in md and "has no `linear_geglu`" in md
    coda_ms = R.sol_ms(2 * 8192**3, 3 * 2 * 8192**2, PEAK, BW) / EFF["coda"]
    assert f"| **{coda_ms:.3f}** | **1.6 %** | **{R.tflops(2 * 8192**3, coda_ms):.0f}** |" in md
    saved = json.loads((out / "report.json").read_text())
    c = saved["results"][0]
    assert c["impls"]["coda"]["tflops"] == pytest.approx(c["flops"] / c["impls"]["coda"]["ms"] / 1e9)
    assert c["impls"]["coda"]["pct_sol"] == pytest.approx(100 * EFF["coda"])
    if not R.matplotlib_available():
        pytest.skip("matplotlib is not installed: PNGs not checked")
    for name in ("sol.png", "roofline.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", name
        assert 5_000 < len(data) < 200_000, (name, len(data))


def test_rerender_in_place_keeps_the_json(tmp_path):
    out = tmp_path / "res"
    out.mkdir()
    (out / "report.json").write_text(json.dumps(synthetic_report()))
    before = (out / "report.json").read_text()
    B.main(["--from", str(out / "report.json"), "--out", str(out)])
    assert (out / "report.json").read_text() == before and (out / "report.md").exists()


def test_commit_override(monkeypatch):
    """CODA_COMMIT names the measured commit where the checkout's .git is stale (the device machine's copy)."""
    from coda import bench
    monkeypatch.setenv("CODA_COMMIT", "abc1234")
    assert bench._git() == ("abc1234", False)


def test_bench_epilogue_measures_what_it_names():
    """The epilogues timed by ``python -m coda.bench.epilogue`` compute what their names say (reference path),
    and the table renders the ratios to our plain GEMM."""
    import torch.nn.functional as F

    import coda
    from coda.bench import epilogue as be
    torch.manual_seed(0)
    M, N, K = 6, 8, 16
    a, b = torch.randn(M, K, dtype=torch.bfloat16), torch.randn(N, K, dtype=torch.bfloat16)
    acc = a.float() @ b.float().T
    want = {"bias_gelu": lambda o: F.gelu(acc + o["bias"], approximate="tanh"),
            "sumsq": lambda o: {"out": acc, "ss": (acc * acc).sum(-1)},
            "scale_bias": lambda o: acc * o["scale"][:, None] + o["bias"],
            "residual": lambda o: acc + o["res"].float(),
            "swiglu": lambda o: F.silu(acc[:, 0::2]) * acc[:, 1::2]}
    assert set(want) == set(be.EPILOGUES)
    for name, epi in be.EPILOGUES.items():
        ops = be.operands(name, M, N, device="cpu")
        got = coda.reference.gemm(a, b, epilogue=epi, out_dtype=torch.float32, **ops)
        ref = want[name](ops)
        for k, v in (ref.items() if isinstance(ref, dict) else [("out", ref)]):
            g = got[k] if isinstance(got, dict) else got
            torch.testing.assert_close(g.float().reshape(v.shape), v, rtol=1e-5, atol=1e-5)
    rows = [{"shape": "1x2x3", "ms": {"cublas": 2.0, "identity": 1.0}, "vs_ours": {"cublas": 2.0, "identity": 1.0},
             "vs_cublas": {"cublas": 1.0, "identity": 0.5}}]
    t = be.table(rows)
    assert "| / our plain GEMM | 2.000 | 1.000 |" in t and "| / cuBLAS | 1.000 | 0.500 |" in t


def test_step_gaps_analyse_finds_idle_time_and_the_syncing_op():
    from coda.bench.step_gaps import analyse
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "b", "ts": 20, "dur": 10},  # 10 us idle before b
        {"ph": "X", "cat": "kernel", "name": "c", "ts": 25, "dur": 10},  # overlaps b: no gap
        {"ph": "X", "cat": "kernel", "name": "b", "ts": 45, "dur": 5},   # 10 us idle before b again
        {"ph": "X", "cat": "cpu_op", "name": "aten::_local_scalar_dense", "ts": 100, "dur": 5},
        {"ph": "X", "cat": "cpu_op", "name": "aten::item", "ts": 90, "dur": 50},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 101, "dur": 30},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 120, "dur": 3}]}
    got = analyse(trace)
    assert got["kernels"] == 4 and abs(got["span_ms"] - 0.05) < 1e-12
    assert abs(got["busy_ms"] - 0.03) < 1e-12 and abs(got["idle_ms"] - 0.02) < 1e-12
    assert got["gaps"] == [{"next_kernel": "b", "count": 2, "ms": 0.02}]
    # the idle time by the kernel that ended before it (c ends at 35, after b's 30) and by its length
    assert got["gaps_after"] == [{"previous_kernel": "a", "count": 1, "ms": 0.01},
                                 {"previous_kernel": "c", "count": 1, "ms": 0.01}]
    assert got["idle_by_length"] == [{"length": "<16 us", "count": 2, "ms": 0.02}]
    assert got["syncs"] == [{"call": "cudaStreamSynchronize", "op": "aten::_local_scalar_dense", "count": 1,
                             "ms": 0.03}]


def test_one_step_trains_the_fused_tiny_preset_on_the_cpu():
    """bench.step_ops.one_step (the setup of step_ops / step_gaps): a step runs and updates the weights."""
    import torch

    from coda.bench.step_ops import one_step
    step = one_step("tiny", 1, 1, 16, device="cpu")
    owner = step.__closure__  # the model is reachable through the optimizer in the closure
    opt = next(c.cell_contents for c in owner if isinstance(c.cell_contents, torch.optim.Optimizer))
    before = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    step()
    after = [p.detach() for g in opt.param_groups for p in g["params"]]
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


def test_event_times_and_sustained_ms(monkeypatch):
    """coda.bench.gemm's event loops (the experiments' sustained timing; CPU, CUDA events faked by wall time): a
    count, a time box, pauses before each call, and the median of a time box after a warm-up."""
    from coda.bench import gemm as G

    class Event:
        def __init__(self, enable_timing=True):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []
    assert len(G.event_times(lambda: calls.append(1), count=5)) == 5 and len(calls) == 5
    t0 = time.perf_counter()
    ts = G.event_times(lambda: time.sleep(0.002), count=3, pause=0.02)
    assert len(ts) == 3 and all(1.5 < t < 20 for t in ts) and time.perf_counter() - t0 >= 0.06
    assert len(G.event_times(lambda: time.sleep(0.001), secs=0.05)) >= 5
    assert 2.5 < G.sustained_ms(lambda: time.sleep(0.003), secs=0.1, warm=0.02) < 30
