"""Reliability of coda.gemm on the H100 (issue 7): bitwise determinism, streams, threads (cold compile cache),
failed calls leaving out= untouched, and non-finite / large-magnitude numerics.

``CODA_TEST_TIER=small`` (what ``tests/sanitize.sh`` sets) shrinks shapes, configs and repetitions so that the file
runs under compute-sanitizer in a few minutes. The tests named after bugs pin library bugs found while writing it (fixed since).
"""
import math
import os
import threading
import time

import pytest
import torch

import coda
from coda.config import GemmConfig

pytestmark = pytest.mark.gpu

SMALL = os.environ.get("CODA_TEST_TIER", "").strip().lower() == "small"
CONFIGS = [GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=1),
           GemmConfig(tile_m=128, tile_n=256, cluster_m=2),
           GemmConfig(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2)]
if SMALL:
    CONFIGS = CONFIGS[:1]
SHAPE = (200, 136, 128) if SMALL else (1000, 776, 520)  # ragged in M and N, several tiles
REPS = 2 if SMALL else 5
DEV = "cuda"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@coda.epilogue
def rel_stats(acc, bias: coda.VecN):
    y = acc + bias
    return {"out": y, "ss": coda.reduce_n(y * y), "mx": coda.reduce_n(y, "max"), "cs": coda.reduce_m(y)}


@coda.epilogue
def rel_lse(acc):
    return {"out": acc, "lse": coda.reduce_n(acc, "logsumexp")}


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _as_dict(r):
    return r if isinstance(r, dict) else {"out": r}


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise(r1, r2, what=""):
    r1, r2 = _as_dict(r1), _as_dict(r2)
    assert sorted(r1) == sorted(r2)
    for k in r1:
        assert torch.equal(_bits(r1[k]), _bits(r2[k])), f"{what}: {k!r} differs bitwise between runs"


def _inputs(M, N, K, L=None, dtype=BF16, seed=0, majors=("k", "k")):
    g = torch.Generator(device=DEV).manual_seed(seed)
    lead = (L,) if L else ()

    def op(rows, major):
        if major == "k":
            return torch.randn(*lead, rows, K, device=DEV, dtype=dtype, generator=g)
        return torch.randn(*lead, K, rows, device=DEV, dtype=dtype, generator=g).transpose(-1, -2)

    return op(M, majors[0]), op(N, majors[1])


def _check_stats(got, a, b, bias):
    """rel_stats against float64 (2x-of-torch rule for the main output, tolerances for the reductions)."""
    acc = torch.matmul(a.double(), b.double().transpose(-1, -2))
    y = acc + bias.double()
    theirs = (torch.matmul(a, b.transpose(-1, -2)).float() + bias).to(got["out"].dtype)
    assert rel_err(got["out"], y) <= 2 * rel_err(theirs, y) + 1e-6
    torch.testing.assert_close(got["ss"].double(), (y * y).sum(-1), rtol=1e-3, atol=1e-2)
    torch.testing.assert_close(got["mx"].double(), y.amax(-1), rtol=1e-3, atol=1e-2)
    torch.testing.assert_close(got["cs"].double(), y.sum(-2), rtol=1e-3, atol=1e-1)


# ------------------------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("majors", [("k", "k"), ("mn", "k")] if not SMALL else [("k", "k")], ids="".join)
@pytest.mark.parametrize("epi", [None, rel_stats], ids=["plain", "row_col_reductions"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_bitwise_deterministic(cfg, epi, majors, monkeypatch):
    """Run to run, launch plan or not, default or side stream: the same bits (no atomics anywhere)."""
    M, N, K = SHAPE
    a, b = _inputs(M, N, K, majors=majors)
    ops = {"bias": torch.randn(N, device=DEV)} if epi is not None else {}
    first = coda.gemm(a, b, epilogue=epi, config=cfg, **ops)  # compiles, makes a launch plan
    runs = [coda.gemm(a, b, epilogue=epi, config=cfg, **ops) for _ in range(REPS)]  # launch-plan path
    monkeypatch.setenv("CODA_LAUNCH_PLANS", "0")
    runs.append(coda.gemm(a, b, epilogue=epi, config=cfg, **ops))  # full path
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        runs.append(coda.gemm(a, b, epilogue=epi, config=cfg, **ops))
    torch.cuda.synchronize()
    for i, r in enumerate(runs):
        assert_bitwise(first, r, f"run {i + 1}")
    if epi is not None:
        _check_stats(first, a, b, ops["bias"])


def test_bitwise_deterministic_batched_out():
    """Batched, broadcast weight, fp32 out= reused: identical bits each time."""
    M, N, K = SHAPE
    a = torch.randn(3, M // 2, K, device=DEV, dtype=BF16)
    b = torch.randn(N, K, device=DEV, dtype=BF16)
    out = torch.empty(3, M // 2, N, device=DEV, dtype=FP32)
    coda.gemm(a, b, out=out)
    first = out.clone()
    for _ in range(REPS):
        out.fill_(float("nan"))
        coda.gemm(a, b, out=out)
        assert torch.equal(_bits(out), _bits(first))


# ------------------------------------------------------------------------------------------- streams


def test_launches_on_the_current_stream():
    """The kernel runs on the caller's current stream: queued behind a slow op on that stream, it reads the inputs
    that op's stream wrote (on any other stream it would read the old values)."""
    M, N, K = SHAPE
    a, b = _inputs(M, N, K, seed=1)
    a_new = torch.randn_like(a)
    coda.gemm(a, b)  # compile outside the timed part
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000 if not SMALL else 2_000_000)
        a.copy_(a_new)
        r = coda.gemm(a, b)
    torch.cuda.synchronize()
    ref = a_new.double() @ b.double().T
    assert rel_err(r, ref) <= 2 * rel_err(a_new @ b.T, ref) + 1e-6


@coda.epilogue
def rel_scaled(acc, s: coda.Scalar, r: coda.VecM, res: coda.TileMN):
    return acc * s * r + res


def test_no_host_sync():
    """Launches queue work without a host-device sync (torch's sync debug mode raises on one): a run-time scalar
    given as a Python number becomes a device fill, not a pageable host-to-device copy (which synchronises the
    stream); also for the K = 0 launches, and for a whole fused MLP and RMSNorm-linear forward + backward."""
    import coda.ops
    M, N, K = SHAPE
    a, b = torch.randn(M, K, device=DEV, dtype=BF16), torch.randn(N, K, device=DEV, dtype=BF16)
    ops = dict(s=0.5, r=torch.rand(M, device=DEV), res=torch.randn(M, N, device=DEV, dtype=BF16))
    x = torch.randn(M, K, device=DEV, dtype=BF16, requires_grad=True)
    gamma = torch.rand(K, device=DEV, requires_grad=True)
    wgu = (torch.randn(2 * N, K, device=DEV, dtype=BF16) * K ** -0.5).requires_grad_()
    wd = (torch.randn(K, N, device=DEV, dtype=BF16) * N ** -0.5).requires_grad_()

    def calls():
        outs = [coda.gemm(a, b, epilogue=rel_scaled, **ops), coda.gemm(a[:, :0], b[:, :0], epilogue=rel_scaled, **ops)]
        leaves = (x, gamma, wgu, wd)
        loss = coda.ops.mlp(x, gamma, wgu, wd).float().sum() + coda.ops.rmsnorm_linear(x, gamma, wd.t().contiguous()
                                                                                       ).float().sum()
        return outs + list(torch.autograd.grad(loss, leaves))

    want = calls()  # compiles (and builds the launch plans) outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = calls()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(want[0].float(), (a.float() @ b.float().T) * 0.5 * ops["r"][:, None]
                               + ops["res"].float(), rtol=2e-2, atol=2e-2)


def test_two_streams_different_shapes():
    """Two streams launch different shapes (one with reductions) back to back; every result is right and equal to
    the single-stream result bit for bit."""
    M, N, K = SHAPE
    a1, b1 = _inputs(M, N, K, seed=2)
    a2, b2 = _inputs(M // 2 + 8, N + 128, K + 64, seed=3)
    bias2 = torch.randn(b2.shape[0], device=DEV)
    want1 = coda.gemm(a1, b1)
    want2 = coda.gemm(a2, b2, epilogue=rel_stats, bias=bias2)
    torch.cuda.synchronize()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    got = []
    for _ in range(REPS * 2):
        with torch.cuda.stream(s1):
            r1 = coda.gemm(a1, b1)
        with torch.cuda.stream(s2):
            r2 = coda.gemm(a2, b2, epilogue=rel_stats, bias=bias2)
        got.append((r1, r2))
    torch.cuda.synchronize()
    for r1, r2 in got:
        assert_bitwise(want1, r1, "stream 1")
        assert_bitwise(want2, r2, "stream 2")
    ref1 = a1.double() @ b1.double().T
    assert rel_err(want1, ref1) <= 2 * rel_err(a1 @ b1.T, ref1) + 1e-6
    _check_stats(want2, a2, b2, bias2)


# ------------------------------------------------------------------------------------------- threads


def _fresh_epilogues():
    """Two epilogues no cache has seen: a constant unique to this call is part of their semantic key."""
    c = 1.0 + (time.time_ns() % 100_003) * 1e-7

    @coda.epilogue
    def thread_bias_relu(acc, bias: coda.VecN):
        return coda.relu(acc * c + bias)

    @coda.epilogue
    def thread_rowscale_ss(acc, rs: coda.VecM):
        y = acc * rs * c
        return {"out": y, "ss": coda.reduce_n(y * y)}

    return c, thread_bias_relu, thread_rowscale_ss


def _run_threads(jobs, timeout=540):
    """Run each job in its own thread, started together; returns their results (re-raises a thread's error)."""
    barrier = threading.Barrier(len(jobs))
    results, errors = [None] * len(jobs), []

    def worker(i, job):
        try:
            barrier.wait()
            results[i] = job()
            torch.cuda.synchronize()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("reps", [1, REPS], ids=["once", "repeated"])
def test_two_threads_cold_compile_cache(reps, monkeypatch, tmp_path):
    """Two threads call coda.gemm at the same moment with epilogues and shapes never compiled before (empty on-disk
    cache, new in-memory keys), then repeatedly; every result is right."""
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    c, epi1, epi2 = _fresh_epilogues()
    M, N, K = SHAPE
    a1, b1 = _inputs(M, N, K, seed=4)
    a2, b2 = _inputs(M + 56, N // 2 + 4, K * 2, seed=5)
    bias = torch.randn(N, device=DEV)
    rs = torch.rand(a2.shape[0], device=DEV) + 0.5
    torch.cuda.synchronize()
    job1 = lambda: [coda.gemm(a1, b1, epilogue=epi1, bias=bias) for _ in range(reps)]  # noqa: E731
    job2 = lambda: [coda.gemm(a2, b2, epilogue=epi2, config=CONFIGS[-1], rs=rs) for _ in range(reps)]  # noqa: E731
    res1, res2 = _run_threads([job1, job2])
    acc1 = a1.double() @ b1.double().T
    want1 = torch.relu(acc1 * c + bias.double())
    acc2 = a2.double() @ b2.double().T
    y2 = acc2 * rs.double().unsqueeze(-1) * c
    for r in res1:
        assert rel_err(r, want1) < 1e-2
        assert_bitwise(res1[0], r, "thread 1")
    for r in res2:
        assert rel_err(r["out"], y2) < 1e-2
        torch.testing.assert_close(r["ss"].double(), (y2 * y2).sum(-1), rtol=1e-3, atol=1e-2)
        assert_bitwise(res2[0], r, "thread 2")


def test_two_threads_share_one_launch_plan():
    """Both threads hit the same launch plan (same shapes, epilogue, config) with different data and streams."""
    M, N, K = SHAPE
    data = [_inputs(M, N, K, seed=10 + i) + (torch.randn(N, device=DEV),) for i in range(2)]
    wants = [coda.gemm(a, b, epilogue=rel_stats, bias=bias) for a, b, bias in data]
    torch.cuda.synchronize()

    def job(i):
        a, b, bias = data[i]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            return [coda.gemm(a, b, epilogue=rel_stats, bias=bias) for _ in range(REPS * 4)]

    results = _run_threads([lambda: job(0), lambda: job(1)])
    for i, rs in enumerate(results):
        for r in rs:
            assert_bitwise(wants[i], r, f"thread {i}")
    _check_stats(wants[0], *data[0])


def test_k0_launch_plans(monkeypatch):
    """K = 0 launches (the epilogue alone) go through launch plans like any call: repeated calls with new data,
    and after a larger K = 0 call replaced the cached zero operand buffer, give the full path's bits."""
    import importlib
    from coda.epilogues.rmsnorm import scale_sumsq  # a K = 0 epilogue: a TileMN, a VecN, an output, a reduction
    gemm_mod = importlib.import_module("coda.gemm")
    M, N = SHAPE[:2]

    def call(m, seed):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        h = torch.randn(m, N, device=DEV, generator=gen).to(BF16)
        g = torch.randn(N, device=DEV, generator=gen)
        x = torch.full((m, 8), float("nan"), device=DEV, dtype=BF16)
        b = torch.empty(N, 0, device=DEV, dtype=BF16)
        return coda.gemm(x[:, :0], b, epilogue=scale_sumsq, out_dtype=BF16, h=h, gamma=g), h, g

    first, h, g = call(M, 0)
    assert gemm_mod._zero_bufs, "the K = 0 call did not use the cached zero operands"
    calls = []
    real = gemm_mod._run_plan
    monkeypatch.setattr(gemm_mod, "_run_plan", lambda *a: calls.append(1) or real(*a))
    later = [call(M, s) for s in (0, 1)]
    call(4 * M, 2)  # a larger K = 0 launch: the zero buffer is replaced by a larger one
    again = call(M, 1)
    assert len(calls) >= 3
    monkeypatch.setenv("CODA_LAUNCH_PLANS", "0")
    full = [call(M, s) for s in (0, 1)]
    torch.cuda.synchronize()
    assert_bitwise(first, later[0][0], "plan, same data")
    assert_bitwise(full[0][0], first, "full path")
    assert_bitwise(full[1][0], later[1][0], "plan, new data")
    assert_bitwise(full[1][0], again[0], "plan after the zero buffer grew")
    torch.testing.assert_close(first["out"].float(), (h.float() * g).to(BF16).float())
    torch.testing.assert_close(first["ss"], h.double().square().sum(-1).float(), rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------------------------------- failed calls


def _sentinel(shape, dtype=BF16):
    return torch.full(shape, -123.0, device=DEV, dtype=dtype)


@pytest.mark.parametrize("case", ["bias_shape", "bias_dtype", "missing", "bias_device"])
def test_failed_call_leaves_everything_untouched(case):
    M, N, K = SHAPE
    a, b = _inputs(M, N, K, seed=6)
    bias = torch.randn(N, device=DEV)
    coda.gemm(a, b, epilogue=rel_stats, bias=bias, out=_sentinel((M, N)))  # a launch plan exists for this call
    ops = {"bias_shape": {"bias": torch.randn(N + 8, device=DEV)},
           "bias_dtype": {"bias": bias.double()},
           "missing": {},
           "bias_device": {"bias": bias.cpu()}}[case]
    out = _sentinel((M, N))
    tensors = [a, b, out, *ops.values()]
    before = [t.clone() for t in tensors]
    with pytest.raises((TypeError, ValueError), match="bias"):
        coda.gemm(a, b, epilogue=rel_stats, out=out, **ops)
    torch.cuda.synchronize()
    for t, t0 in zip(tensors, before):
        assert torch.equal(_bits(t), _bits(t0)), "a failed call wrote into a tensor"


def test_failed_hot_path_call_leaves_out_untouched():
    """Calls whose shapes/strides match an existing launch plan but whose pointers are bad (misaligned, out
    overlapping a) fall back to the checks and fail without writing."""
    M, N, K = SHAPE
    buf = torch.randn(M * K + M * N + 64, device=DEV, dtype=BF16)
    a = buf[:M * K].view(M, K)
    b = _inputs(M, N, K, seed=7)[1]
    out = torch.empty(M * N + 64, device=DEV, dtype=BF16)[:M * N].view(M, N)
    coda.gemm(a, b, out=out)  # the plan: (M, K) a, (N, K) b, (M, N) out, all contiguous
    torch.cuda.synchronize()

    bad_out = buf[64:64 + M * N].view(M, N)  # overlaps a, same strides as out
    before = buf.clone()
    with pytest.raises(ValueError, match="^out: must not share memory with a"):
        coda.gemm(a, b, out=bad_out)
    mis_a = buf[3:3 + M * K].view(M, K)  # 6 bytes off
    out0 = out.clone()
    with pytest.raises(ValueError, match="^a: the data pointer must be 16-byte aligned"):
        coda.gemm(mis_a, b, out=out)
    torch.cuda.synchronize()
    assert torch.equal(_bits(buf), _bits(before)) and torch.equal(_bits(out), _bits(out0))


@pytest.mark.parametrize("which", ["a", "bias"])
def test_requires_grad_inputs_work_or_are_named(which):
    M, N, K = SHAPE
    a, b = _inputs(M, N, K, seed=8)
    bias = torch.randn(N, device=DEV)
    if which == "a":
        a.requires_grad_(True)
    else:
        bias.requires_grad_(True)
    try:
        got = coda.gemm(a, b, epilogue=rel_stats, bias=bias)
    except (TypeError, ValueError) as e:
        assert which in str(e)
        return
    _check_stats({k: v.detach() for k, v in got.items()}, a.detach(), b, bias.detach())


@pytest.mark.parametrize("M,N", [(0, 136), (200, 0)], ids=["M0", "N0"])
def test_empty_result_keeps_reductions(M, N):
    a, b = _inputs(M, N, 64, seed=9)
    bias = torch.randn(N, device=DEV)
    got = _as_dict(coda.gemm(a, b, epilogue=rel_stats, bias=bias))
    assert sorted(got) == ["cs", "mx", "out", "ss"]


# ------------------------------------------------------------------------------------------- numerics at edges


def _poisoned(M, N, K, seed, where):
    """Inputs with +inf, -inf and NaN in rows of a (``where="a"``) or a NaN row of b (``where="b"``)."""
    a, b = _inputs(M, N, K, seed=seed)
    if where == "a":
        a[0, 3], a[1, 5], a[2, 7] = math.inf, -math.inf, math.nan
        a[4, 0] = math.inf
        b[:, 0] = b[:, 0].abs() + 0.5  # row 4 of the product is +inf in every column (no -inf to cancel)
    else:
        b[5, 2] = math.nan
    return a, b


def _assert_nonfinite_like(got, ref):
    """NaN exactly where the float64 product has NaN (never hidden, never invented); the same infinities."""
    got = got.double()
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), "NaN pattern differs from the float64 product"
    inf = torch.isinf(ref)
    assert torch.equal(got[inf], ref[inf]), "infinities differ from the float64 product"
    fin = torch.isfinite(ref)
    assert torch.isfinite(got[fin]).all()
    torch.testing.assert_close(got[fin], ref[fin], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("out_dtype", [BF16, FP32])
@pytest.mark.parametrize("where", ["a", "b"])
def test_inf_nan_propagate_plain(where, out_dtype):
    M, N, K = SHAPE
    a, b = _poisoned(M, N, K, 11, where)
    got = coda.gemm(a, b, out_dtype=out_dtype)
    ref = a.double() @ b.double().T
    assert torch.isnan(ref).any() and (where == "b" or torch.isinf(ref).any())
    _assert_nonfinite_like(got, ref)


@pytest.mark.parametrize("where", ["a", "b"])
def test_inf_nan_logsumexp_never_hidden(where):
    """The main output follows the float64 product; a row's logsumexp is NaN wherever the reference's is NaN, and
    never finite where the reference's is infinite (a row with +inf has logsumexp +inf, see the next test)."""
    M, N, K = SHAPE
    a, b = _poisoned(M, N, K, 12, where)
    got = coda.gemm(a, b, epilogue=rel_lse, out_dtype=FP32)
    ref = rel_lse.reference(a.double() @ b.double().T)
    _assert_nonfinite_like(got["out"], ref["out"])
    lse, ref_lse = got["lse"].double(), ref["lse"]
    assert torch.isnan(lse[torch.isnan(ref_lse)]).all(), "a NaN row's logsumexp was hidden"
    assert not torch.isfinite(lse[~torch.isfinite(ref_lse)]).any()
    fin = torch.isfinite(ref_lse)
    assert torch.isfinite(lse[fin]).all()
    torch.testing.assert_close(lse[fin], ref_lse[fin], rtol=1e-4, atol=1e-3)


def test_logsumexp_of_row_with_pos_inf_is_inf():
    M, N, K = SHAPE
    a, b = _poisoned(M, N, K, 13, "a")
    got = coda.gemm(a, b, epilogue=rel_lse, out_dtype=FP32)
    ref = rel_lse.reference(a.double() @ b.double().T)
    assert ref["lse"][4].item() == math.inf
    assert got["lse"][4].item() == math.inf


def test_large_magnitudes_fp32_out():
    """|inputs| ~ 1e4 (|acc| ~ 1e10): fp32 output and the logsumexp keep full fp32 accuracy."""
    M, N, K = SHAPE
    a, b = _inputs(M, N, K, seed=14)
    a, b = (a.float() * 1e4).to(BF16), (b.float() * 1e4).to(BF16)
    ref = a.double() @ b.double().T
    got = coda.gemm(a, b, out_dtype=FP32)
    theirs = a.float() @ b.float().T  # cuBLAS SGEMM (TF32 off by default)
    assert rel_err(got, ref) <= 2 * rel_err(theirs, ref) + 1e-6
    r = coda.gemm(a, b, epilogue=rel_lse, out_dtype=FP32)
    assert torch.equal(_bits(r["out"]), _bits(got))
    torch.testing.assert_close(r["lse"].double(), torch.logsumexp(ref, -1), rtol=1e-5, atol=0.0)


def test_fp16_output_overflow_is_inf():
    """Documented behaviour: fp16 output overflows to +-inf (IEEE round to nearest, no saturation); the fp32
    reductions see the accumulator, not the rounded output, and stay finite."""
    M, N, K = SHAPE
    a, b = _inputs(M, N, K, dtype=FP16, seed=15)
    a, b = a * 60, b * 60  # |acc| ~ 3600 * sqrt(K) ~ 4e4 .. 8e4: many entries on both sides of 65504
    ref = a.double() @ b.double().T
    big, small = ref.abs() > 65520 * 1.001, ref.abs() < 65504 * 0.999
    assert big.any() and small.any()
    for r in (coda.gemm(a, b), coda.gemm(a, b, epilogue=rel_lse)["out"]):
        assert r.dtype == FP16 and not torch.isnan(r).any()
        assert torch.equal(r[big].double(), torch.sign(ref[big]) * math.inf)
        assert torch.isfinite(r[small]).all()
        torch.testing.assert_close(r[small].double(), ref[small], rtol=2e-3, atol=1e-1)
    lse = coda.gemm(a, b, epilogue=rel_lse)["lse"]
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(lse.double(), torch.logsumexp(ref, -1), rtol=1e-5, atol=0.0)


# ----------------------------------------------------------------------------------- issue 26: wrong results
@coda.epilogue
def add_tile26(acc, r: coda.TileMN):
    return acc + r


def test_plan_repeat_call_checks_out_against_operands():
    """The repeat-call fast path refuses an out that overlaps a TileMN operand, as the first call does (a
    read/write race otherwise); add-to-output (the operand is exactly out) stays allowed."""
    M, N, K = 256, 256, 128
    a, b = _inputs(M, N, K, seed=26)
    buf = torch.zeros(2 * M * N, device=DEV, dtype=BF16)
    out = buf[:M * N].view(M, N)
    r_ok = torch.randn(M, N, device=DEV, dtype=BF16)
    for _ in range(2):  # the second call runs through the launch plan
        coda.gemm(a, b, epilogue=add_tile26, out=out, r=r_ok)
    r_bad = buf[N:N + M * N].view(M, N)  # same shape and strides, one row into out
    with pytest.raises(ValueError, match="share memory with operand"):
        coda.gemm(a, b, epilogue=add_tile26, out=out, r=r_bad)
    acc = a.double() @ b.double().T
    res = torch.randn(M, N, device=DEV, dtype=BF16)
    for _ in range(2):
        start = res.clone()
        coda.gemm(a, b, epilogue=add_tile26, out=res, r=res)  # add-to-output, then through the plan
        torch.testing.assert_close(res.double(), acc + start.double(), rtol=2e-2, atol=2e-1)


@coda.epilogue
def with_max26(acc):
    return {"out": acc, "mx": coda.reduce_n(acc, "max")}


@pytest.mark.parametrize("save_preact", [False, True])
def test_max_gradient_splits_exact_ties(save_preact):
    """Equal weight rows tie in every row: torch's amax splits the gradient (0.5 each); 1000 and 1000.03125 do
    not tie (equal only in bf16, the dtype of the saved pre-activation)."""
    M, N, K = 64, 128, 64
    x = torch.zeros(M, K, device=DEV, dtype=BF16)
    x[:, 0] = 1000.0
    x[:, 1] = 0.03125
    x[1::2, 1] = 0.0  # odd rows: columns 0, 1 and 2 tie; even rows: column 1 wins alone
    w = torch.zeros(N, K, device=DEV, dtype=BF16)
    w[:3, 0] = 1.0
    w[1, 1] = 1.0
    x.requires_grad_()
    w.requires_grad_()
    coda.ops.linear(x, w, epilogue=with_max26, save_preact=save_preact)["mx"].sum().backward()
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    (x64 @ w64.T).amax(-1).sum().backward()
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=8e-3, atol=0.0)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=8e-3, atol=0.0)


IEEE26 = [
    (lambda acc: coda.where(acc == acc, acc, 0.0), lambda x: torch.where(x == x, x, 0.0)),
    (lambda acc: acc - acc + 1, lambda x: x - x + 1),
    (lambda acc: acc / acc, lambda x: x / x),
    (lambda acc: acc * 0, lambda x: x * 0),
    (lambda acc: coda.where(~(acc > 0), 1.0, 2.0), lambda x: torch.where(~(x > 0), 1.0, 2.0)),
    (lambda acc: coda.sqrt(acc) * coda.sqrt(acc), lambda x: x.sqrt() * x.sqrt()),
    (lambda acc: coda.exp(coda.log(acc)), lambda x: x.log().exp()),
]


@pytest.mark.parametrize("i", range(len(IEEE26)))
def test_kernel_keeps_ieee_semantics(i):
    """NaN, +-inf, zero and negative accumulators: the kernel computes what was written, as torch does."""
    f, ref = IEEE26[i]
    epi = coda.epilogue(f, name=f"ieee26_{i}")
    M, N, K = 128, 128, 64
    a = torch.rand(M, K, device=DEV) + 0.1
    a[0, 0], a[1, 0], a[2, 0], a[3] = math.nan, math.inf, -math.inf, 0.0
    a[4:64] = -a[4:64]  # negative accumulators
    b = torch.rand(N, K, device=DEV) + 0.1
    a, b = a.to(BF16), b.to(BF16)
    got = coda.gemm(a, b, epilogue=epi, out_dtype=FP32)
    want = ref(a.float() @ b.float().T)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    torch.testing.assert_close(got.nan_to_num(0.0), want.nan_to_num(0.0), rtol=1e-3, atol=1e-3)
