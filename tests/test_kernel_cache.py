"""The on-disk compile cache (a compiled kernel round-trips through disk; a new process loads it) and coda.gemm's
launch plans (the repeated call's pointer-only path and its checks) (CPU, CI; loading and the plan path on the
H100 in the tests marked ``gpu``). Moved out of tests/test_autotune.py."""
import ctypes
import gc
import json
import importlib
import os
import subprocess
import sys
import textwrap
import time
import weakref

import pytest
import torch

import coda
import coda.autotune as at
from coda import _launch
from coda._validate import check_gemm_args
from coda.autotune import compile_cache, keys
from coda.autotune.store import CacheFileWarning
from coda.config import GemmConfig
from coda.kernels.epilogue import IDENTITY
from hook_epilogues import Everything

gemm_mod = importlib.import_module("coda.gemm")
BF16 = torch.bfloat16
FAKE_DEV = keys.DeviceInfo("Fake H100", 132, "sm_90a")


pytestmark = pytest.mark.usefixtures("autotune_unset")  # conftest.py: the library's default


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    """One compile-cache dir for the tests that compile (each kernel is compiled once per test session)."""
    d = tmp_path_factory.mktemp("kernels")
    old = os.environ.get("CODA_CACHE_DIR")
    os.environ["CODA_CACHE_DIR"] = str(d)
    yield d
    if old is None:
        os.environ.pop("CODA_CACHE_DIR", None)
    else:
        os.environ["CODA_CACHE_DIR"] = old



# ---------------------------------------------------------------------------------------------- compile cache
def _cute_call(a, b, out, epi=IDENTITY, cfg=GemmConfig(), operands=None):
    import cuda.bindings.driver as cuda
    prob = check_gemm_args(a, b, out=out)
    _, key, views, leads, _, _ = gemm_mod._kernel_views(prob, epi, cfg, a, b, out, dict(operands or {}))
    ts = [gemm_mod._cute(v, lead) for v, lead in zip(views, leads)]
    return key, [*ts[:3], cuda.CUstream(0x1234), *ts[3:]], views


def test_compiled_kernel_round_trips_through_disk(kernel_cache):
    a, b, out = torch.randn(256, 64, dtype=BF16), torch.randn(128, 64, dtype=BF16), torch.empty(256, 128, dtype=BF16)
    cfg = GemmConfig(tile_m=128, tile_n=128, cluster_m=1, pingpong=True)
    key, args, views = _cute_call(a, b, out, cfg=cfg)
    compile_kw = dict(max_clusters=132, arch="sm_90a", options="--gpu-arch=sm_90a")
    fn, how = compile_cache.compile_kernel(cfg, IDENTITY, BF16, BF16, key[-1], args, **compile_kw)
    files = list((kernel_cache / "kernels").glob("*.o"))
    assert how in ("compiled", "disk") and len(files) >= 1
    t = time.perf_counter()
    fn2, how2 = compile_cache.compile_kernel(cfg, IDENTITY, BF16, BF16, key[-1], args, **compile_kw)
    assert how2 == "disk" and time.perf_counter() - t < 2.0
    for f in (fn, fn2):  # both take the same arguments, marshalled the same way
        _launch.Plan(f, args, views, 0x1234)
    # a damaged object is ignored with a warning, recompiled and rewritten
    path = compile_cache.kernel_path(keys.kernel_key("sm_90a", 132, cfg, IDENTITY, BF16, BF16, key[-1]))
    path.write_bytes(b"\x7fELF garbage")
    compile_cache._modules.clear()
    with pytest.warns(CacheFileWarning, match="unloadable"):
        fn3, how3 = compile_cache.compile_kernel(cfg, IDENTITY, BF16, BF16, key[-1], args, **compile_kw)
    assert how3 == "compiled" and path.stat().st_size > 1000


def test_max_active_clusters_is_remembered_per_gpu(cache):
    calls = []

    def compute():
        calls.append(1)
        return 66
    assert compile_cache.max_active_clusters(FAKE_DEV, 2, compute) == 66
    assert compile_cache.max_active_clusters(FAKE_DEV, 2, compute) == 66 and len(calls) == 1  # from disk
    other = keys.DeviceInfo("Fake H100 MIG", 16, "sm_90a")
    assert compile_cache.max_active_clusters(other, 2, compute) == 66 and len(calls) == 2
    assert compile_cache.max_active_clusters(FAKE_DEV, 1, compute) == 66 and len(calls) == 3
    at.clear()
    assert compile_cache.max_active_clusters(FAKE_DEV, 2, compute) == 66 and len(calls) == 4


# ----------------------------------------------------------------------------------------------- launch plans
def _epi_tensors(M, N, L=None):
    lead = (L,) if L else ()
    return {"bias": torch.randn(N), "rs": torch.rand(*lead, M), "res": torch.randn(*lead, M, N, dtype=BF16),
            "s": 0.5}


@coda.epilogue
def _operands_only(acc, bias: coda.VecN, rs: coda.VecM, res: coda.TileMN):
    return acc * rs + bias + res


@pytest.mark.parametrize("epi_name", ["identity", "many", "operands"])
def test_gemm_repeated_call_takes_the_plan_and_writes_the_right_pointers(kernel_cache, monkeypatch, epi_name):
    from coda.bench.launch import NullRun, cpu_plan
    epi = {"identity": None, "many": Everything(), "operands": _operands_only}[epi_name]
    L, M, N, K = 2, 200, 136, 64
    a, b, out = torch.randn(L, M, K, dtype=BF16), torch.randn(L, N, K, dtype=BF16), torch.empty(L, M, N, dtype=BF16)

    def _ops():
        t = {} if epi is None else _epi_tensors(M, N, L)
        return {k: v for k, v in t.items() if k in {o.name for o in epi.operands}} if epi is not None else t
    ops = _ops()
    pkey, plan, _, _, _ = cpu_plan(a, b, out, epi, GemmConfig(), ops)
    # operands only (no scalar, extra output, reduction): the repeated call just swaps the operands' pointers
    assert plan.operand_names == (("bias", "rs", "res") if epi_name == "operands" else None)
    plan.run = NullRun()
    monkeypatch.setitem(gemm_mod._plans, pkey, plan)
    monkeypatch.setattr(_launch, "stream_handle", lambda index: 0xABC)
    a2, b2, out2 = torch.randn_like(a), torch.randn_like(b), torch.empty_like(out)
    ops2 = _ops()
    res = coda.gemm(a2, b2, epilogue=epi, out=out2, config=GemmConfig(), **ops2)
    assert plan.run.calls == 1
    if epi_name != "many":
        assert res is out2
    else:
        assert res["out"] is out2 and set(res) == {"out", "pre", "ss", "cs", "mx"}
    # what the plan handed to the host function == the DSL's own marshalling of this call (fresh cute tensors)
    ctypes = _launch.ctypes
    ours = [ctypes.string_at(p.value, ctypes.sizeof(d)) for p, d in
            zip([x for i, x in enumerate(plan.exe_args) if i != 3], plan.descs)]
    assert ctypes.c_void_p.from_address(plan.exe_args[3].value).value == 0xABC
    _, args2, _ = _cute_call(a2, b2, out2, epi or IDENTITY, GemmConfig(), ops2)
    exe2, _ = plan.fn.generate_execution_args(*args2)
    theirs = [ctypes.string_at(p, len(o)) for p, o in zip([x for i, x in enumerate(exe2) if i != 3], ours)]
    assert [o[8:] for o in ours] == [t[8:] for t in theirs]  # shapes and strides, every tensor
    # data pointers: A, B, D and the operands that are views of the caller's tensors (bias, rs, res); the scalar,
    # extra output and partial buffers are allocated per call
    n_same = 3 if epi is None else 6
    assert [o[:8] for o in ours[:n_same]] == [t[:8] for t in theirs[:n_same]]
    assert int.from_bytes(ours[2][:8], "little") == out2.data_ptr()
    if epi is not None:
        assert int.from_bytes(ours[4][:8], "little") == ops2["rs"].data_ptr()
        assert int.from_bytes(ours[5][:8], "little") == ops2["res"].data_ptr()


@pytest.mark.parametrize("epi_name", ["identity", "operands"])
def test_dynamic_schedule_repeated_call_takes_the_plan_with_the_tile_counter(kernel_cache, monkeypatch, epi_name):
    """The dynamic schedule's only per-call argument beyond the operands is the current stream's tile counter: a
    repeated call swaps pointers and appends the counter's, as the DSL marshals the full path's arguments."""
    from coda.bench.launch import NullRun, cpu_plan
    epi = None if epi_name == "identity" else _operands_only
    cfg = GemmConfig(sched="dynamic")
    L, M, N, K = 2, 200, 136, 64
    a, b, out = torch.randn(L, M, K, dtype=BF16), torch.randn(L, N, K, dtype=BF16), torch.empty(L, M, N, dtype=BF16)
    ops = {} if epi is None else {k: v for k, v in _epi_tensors(M, N, L).items() if k in ("bias", "rs", "res")}
    pkey, plan, _, _, _ = cpu_plan(a, b, out, epi, cfg, ops)
    assert plan.operand_names == (() if epi is None else ("bias", "rs", "res"))
    plan.run = NullRun()
    monkeypatch.setitem(gemm_mod._plans, pkey, plan)
    monkeypatch.setattr(_launch, "stream_handle", lambda index: 0xABC)
    a2, b2, out2 = torch.randn_like(a), torch.randn_like(b), torch.empty_like(out)
    ops2 = {k: torch.randn_like(v) for k, v in ops.items()}
    assert coda.gemm(a2, b2, epilogue=epi, out=out2, config=cfg, **ops2) is out2 and plan.run.calls == 1
    ctypes = _launch.ctypes
    ours = [ctypes.string_at(p.value, ctypes.sizeof(d)) for p, d in
            zip([x for i, x in enumerate(plan.exe_args) if i != 3], plan.descs)]
    _, args2, _ = _cute_call(a2, b2, out2, epi or IDENTITY, cfg, ops2)
    exe2, _ = plan.fn.generate_execution_args(*args2)
    theirs = [ctypes.string_at(p, len(o)) for p, o in zip([x for i, x in enumerate(exe2) if i != 3], ours)]
    assert ours == theirs  # every pointer, shape and stride, the counter last
    assert int.from_bytes(ours[-1][:8], "little") == gemm_mod._tile_counter(a.device).data_ptr()


def test_plan_misses_fall_back_to_the_checked_path(kernel_cache, monkeypatch):
    from coda.bench.launch import NullRun, cpu_plan
    M, N, K = 256, 128, 64
    a, b, out = torch.randn(M, K, dtype=BF16), torch.randn(N, K, dtype=BF16), torch.empty(M, N, dtype=BF16)
    pkey, plan, _, _, _ = cpu_plan(a, b, out, None, GemmConfig())
    plan.run = NullRun()
    monkeypatch.setitem(gemm_mod._plans, pkey, plan)
    monkeypatch.setattr(_launch, "stream_handle", lambda index: 0)
    buf = torch.empty(M * K + 4, dtype=BF16)
    a_mis = buf[4:].view(M, K)  # same shape and strides, data pointer 8 bytes off
    assert _launch.plan_key(a_mis, b, None, out, None, GemmConfig(), {}) == pkey
    with pytest.raises(ValueError, match="16-byte aligned"):
        coda.gemm(a_mis, b, out=out, config=GemmConfig())
    big = torch.empty(M * N + M * K, dtype=BF16)
    a_ov, out_ov = big[:M * K].view(M, K), big[M * K - N * 8:M * K - N * 8 + M * N].view(M, N)
    with pytest.raises(ValueError, match="must not share memory"):
        coda.gemm(a_ov, b, out=out_ov, config=GemmConfig())
    assert plan.run.calls == 0
    with pytest.raises(RuntimeError, match="Hopper"):  # other shapes: no plan, the full path (no GPU here)
        coda.gemm(torch.randn(M + 8, K, dtype=BF16), b, config=GemmConfig())


def test_in_place_update_takes_the_pointer_only_plan(kernel_cache, monkeypatch):
    """coda.optim's AdamW epilogue (p, m, v in place, eight Scalar operands as 1-element fp32 tensors): a repeated
    call only writes pointers -- every one of them what the DSL's own marshalling of that call holds -- and returns
    the in-place outputs as the operands themselves."""
    from coda.bench.launch import NullRun, cpu_plan
    from coda.epilogues.adamw import HYPER, adamw
    N, K, T = 256, 128, 64
    a, b = torch.randn(T, N, dtype=BF16).t(), torch.randn(T, K, dtype=BF16).t()

    def ops():
        hyper = torch.rand(8, 4)
        p, m, v = (torch.randn(N, K, dtype=BF16) for _ in range(3))
        return p, dict(p=p, m=m, v=v, **{n: hyper[i, :1] for i, n in enumerate(HYPER)})
    p, o = ops()
    pkey, plan, _, _, _ = cpu_plan(a, b, p, adamw, GemmConfig(), o)
    assert plan.operand_names == ("p", "m", "v", *HYPER, "m", "v")
    plan.run = NullRun()
    monkeypatch.setitem(gemm_mod._plans, pkey, plan)
    monkeypatch.setattr(_launch, "stream_handle", lambda index: 0x1234)
    p2, o2 = ops()
    res = coda.gemm(a, b, epilogue=adamw, out=p2, config=GemmConfig(), **o2)
    assert plan.run.calls == 1 and res["out"] is p2 and res["m"] is o2["m"] and res["v"] is o2["v"]
    ctypes = _launch.ctypes
    ours = [ctypes.string_at(x.value, ctypes.sizeof(d)) for x, d in
            zip([x for i, x in enumerate(plan.exe_args) if i != 3], plan.descs)]
    _, args2, _ = _cute_call(a, b, p2, adamw, GemmConfig(), o2)
    exe2, _ = plan.fn.generate_execution_args(*args2)
    theirs = [ctypes.string_at(x, len(y)) for x, y in zip([x for i, x in enumerate(exe2) if i != 3], ours)]
    assert [y[:8] for y in ours] == [t[:8] for t in theirs]  # every data pointer
    assert [y[8:] for y in ours] == [t[8:] for t in theirs]  # shapes and strides


@coda.epilogue
def _add_tile(acc, r: coda.TileMN):
    return acc + r


def test_plan_checks_an_in_place_operand_once_and_every_partial_overlap(kernel_cache, monkeypatch):
    """The repeat-call path: an operand that is exactly out (add-to-output / in place) is accepted by check_call
    once per plan and then only compared by address; one that overlaps out otherwise is refused at every call."""
    from coda.bench.launch import NullRun, cpu_plan
    M, N, K = 256, 128, 64
    a, b = torch.randn(M, K, dtype=BF16), torch.randn(N, K, dtype=BF16)
    out, r = torch.empty(M, N, dtype=BF16), torch.empty(M, N, dtype=BF16)
    pkey, plan, _, _, _ = cpu_plan(a, b, out, _add_tile, GemmConfig(), {"r": r})
    plan.run = NullRun()
    monkeypatch.setitem(gemm_mod._plans, pkey, plan)
    monkeypatch.setattr(_launch, "stream_handle", lambda index: 0)
    checks = []
    real = gemm_mod.check_call
    monkeypatch.setattr(gemm_mod, "check_call", lambda *x: checks.append(1) or real(*x))
    for _ in range(3):
        res = torch.empty(M, N, dtype=BF16)
        coda.gemm(a, b, epilogue=_add_tile, out=res, r=res, config=GemmConfig())  # in place
    assert plan.run.calls == 3 and len(checks) == 1 and plan.aliases_ok == {"r"}
    big = torch.empty(2 * M * N, dtype=BF16)
    out2, r_bad = big[:M * N].view(M, N), big[N:N + M * N].view(M, N)  # one row apart
    for _ in range(2):
        with pytest.raises(ValueError, match="share memory with operand"):
            coda.gemm(a, b, epilogue=_add_tile, out=out2, r=r_bad, config=GemmConfig())
    assert plan.run.calls == 3


def test_plan_keeps_no_tensor_alive_and_rejects_mismatched_descriptors(kernel_cache):
    from coda.bench.launch import cpu_plan

    def build():
        a, b, out = torch.randn(256, 64, dtype=BF16), torch.randn(128, 64, dtype=BF16), torch.empty(256, 128, dtype=BF16)
        refs = [weakref.ref(t) for t in (a, b, out)]
        _, plan, args, views, _ = cpu_plan(a, b, out, None, GemmConfig())
        wide = torch.empty(256, 256, dtype=BF16)[:, :128]  # D with another row stride than the cute tensor's
        other = gemm_mod._canonical(gemm_mod._mnl(wide.unsqueeze(0)), 1)
        with pytest.raises(_launch.PlanError, match="descriptor of argument 2"):
            _launch.Plan(plan.fn, args, [views[0], views[1], other], 0x5EED)
        return plan, refs

    plan, refs = build()
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(plan.descs) == 3


def test_plan_ignores_the_descriptor_padding(kernel_cache):
    """The DSL allocates its descriptors itself: the 4 bytes of padding after an odd number of int32 shapes hold
    whatever that memory held. A plan compares the fields the compiled function reads, so garbage there must not
    reject it (a byte comparison did, at random: the CPU micro-benchmark failed once with "the plan did not match");
    a field that differs still does."""
    from coda.bench.launch import cpu_plan
    a, b, out = torch.randn(256, 64, dtype=BF16), torch.randn(128, 64, dtype=BF16), torch.empty(256, 128, dtype=BF16)
    _, plan, args, views, _ = cpu_plan(a, b, out, None, GemmConfig())
    cls = type(plan.descs[0])
    pad = range(cls.shapes.offset + cls.shapes.size, cls.strides.offset)
    assert len(pad) == 4  # (M, K, L) int32 shapes, then int64 strides

    class Dirty:  # the compiled function, its descriptors copied into buffers whose padding is 0xFF
        def __init__(self, fn, field=None):
            self.fn, self.field, self.bufs = fn, field, []
            self.run_compiled_program = fn.run_compiled_program

        def generate_execution_args(self, *cute_args):
            exe, keep = self.fn.generate_execution_args(*cute_args)
            out = []
            for j, p in enumerate(exe):
                if j == _launch.Plan.STREAM_INDEX:
                    out.append(p)
                    continue
                raw = bytearray(ctypes.string_at(p, ctypes.sizeof(cls)))
                for i in pad:
                    raw[i] = 0xFF
                buf = ctypes.create_string_buffer(bytes(raw), len(raw))
                if self.field is not None and j == 0:
                    cls.from_buffer(buf).strides[0] += self.field
                self.bufs.append(buf)
                out.append(ctypes.addressof(buf))
            return out, (keep, self.bufs)

    dirty = _launch.Plan(Dirty(plan.fn), args, views, 0x5EED)
    assert [_launch.fields(d) for d in dirty.descs] == [_launch.fields(d) for d in plan.descs]
    with pytest.raises(_launch.PlanError, match="descriptor of argument 0"):
        _launch.Plan(Dirty(plan.fn, field=8), args, views, 0x5EED)


# -------------------------------------------------------------------------------------------------------- GPU
def _gpu_script(tmp, body):
    code = textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CODA_CACHE_DIR": str(tmp)})


@coda.epilogue
def _bias_gelu(acc, bias: coda.VecN):
    return coda.gelu(acc + bias)


@pytest.mark.gpu
@pytest.mark.parametrize("epi_name", ["identity", "bias_gelu", "operands"])
def test_gpu_plan_path_matches_the_full_path_and_is_cheap(cache, monkeypatch, epi_name):
    a, b = torch.randn(512, 256, device="cuda", dtype=BF16), torch.randn(384, 256, device="cuda", dtype=BF16)
    epi = {"identity": None, "bias_gelu": _bias_gelu, "operands": _operands_only}[epi_name]

    def fresh():
        t = {"bias": torch.randn(384, device="cuda"), "rs": torch.rand(512, device="cuda"),
             "res": torch.randn(512, 384, device="cuda", dtype=BF16)}
        return {k: v for k, v in t.items() if epi is not None and k in {o.name for o in epi.operands}}
    ops = fresh()
    cfg = GemmConfig(tile_m=128, tile_n=128, cluster_m=1, pingpong=True)
    monkeypatch.setenv("CODA_LAUNCH_PLANS", "0")
    ref = coda.gemm(a, b, epilogue=epi, config=cfg, **ops)
    monkeypatch.setenv("CODA_LAUNCH_PLANS", "1")
    first = coda.gemm(a, b, epilogue=epi, config=cfg, **ops)
    again = coda.gemm(a.clone(), b.clone(), epilogue=epi, config=cfg, **{k: v.clone() for k, v in ops.items()})
    assert torch.equal(first, ref) and torch.equal(again, ref)
    ops2 = fresh()  # other operand values through the plan: the pointers are swapped, not the first call's kept
    monkeypatch.setenv("CODA_LAUNCH_PLANS", "0")
    ref2 = coda.gemm(a, b, epilogue=epi, config=cfg, **ops2)
    monkeypatch.setenv("CODA_LAUNCH_PLANS", "1")
    assert torch.equal(coda.gemm(a, b, epilogue=epi, config=cfg, **ops2), ref2)
    out = torch.empty_like(ref)
    for _ in range(200):
        coda.gemm(a, b, epilogue=epi, out=out, config=cfg, **ops)
    torch.cuda.synchronize()
    mm_out = torch.empty(512, 384, device="cuda", dtype=BF16)
    times, mm_times = [], []
    for _ in range(2000):  # interleaved with torch.mm's own warm call: the host's speed and load cancel out
        t = time.perf_counter()
        coda.gemm(a, b, epilogue=epi, out=out, config=cfg, **ops)
        t1 = time.perf_counter()
        torch.mm(a, b.t(), out=mm_out)
        times.append(t1 - t)
        mm_times.append(time.perf_counter() - t1)
    torch.cuda.synchronize()
    med, mm_med = (sorted(x)[len(x) // 2] * 1e6 for x in (times, mm_times))
    print(f"warm coda.gemm call (Python to launch), epilogue {epi_name}: median {med:.1f} us (torch.mm {mm_med:.1f})")
    assert torch.equal(out, ref)
    # 20 us on a quiet host; on a slower or loaded one (the H100 host measured 17-33 us while other test processes
    # compiled kernels) at most 4 torch.mm calls' worth
    bound = max(20.0, 4.0 * mm_med)
    assert med <= bound, f"warm-call overhead {med:.1f} us > {bound:.1f} us (torch.mm: {mm_med:.1f} us)"


@pytest.mark.gpu
def test_gpu_new_process_loads_the_kernel_from_disk(tmp_path):
    body = """
        import json, time, torch, coda
        from coda.config import GemmConfig
        a = torch.randn(1000, 456, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(904, 456, device="cuda", dtype=torch.bfloat16)
        import cutlass, cuda.bindings.driver  # imports are not what is measured
        torch.cuda.synchronize()
        t = time.perf_counter()
        y = coda.gemm(a, b, config=GemmConfig(raster="n"))
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        err = ((y.double() - a.double() @ b.double().T).norm() / (a.double() @ b.double().T).norm()).item()
        print(json.dumps({"first_call_s": dt, "err": err}))
    """
    runs = [_gpu_script(tmp_path, body) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    cold, warm = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    print(f"first call: cold compile {cold['first_call_s']:.3f} s, from the disk cache {warm['first_call_s']:.3f} s")
    assert cold["err"] < 1e-2 and warm["err"] < 1e-2
    assert warm["first_call_s"] < cold["first_call_s"] and warm["first_call_s"] < 0.5
    assert len(list((tmp_path / "kernels").glob("*.o"))) == 1
