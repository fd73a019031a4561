"""coda.precompile on the CPU (issue 31): the dry run records recipes and launches nothing, recipes pickle (traced
epilogues included), a spawned worker stores the kernel under the key the runtime computes -- byte for byte the
object the parent would compile --, stored kernels are skipped, CODA_COMPILE_WORKERS=0, bad cache dirs and bad
arguments. ``coda.gemm`` runs here with its Hopper check, device facts and stream patched out (the kernels are
compiled for sm_90a, never launched). One worker spawn and a few ~1 s compiles in all."""
import hashlib
import importlib
import os
import pickle
import warnings

import pytest
import torch

import coda
import coda.optim
from coda import _device
from coda.runtime import compile_cache, keys
from coda.runtime import precompile as pc
from coda.runtime.store import CacheFileWarning
from test_fuse_families import fp32_ops  # noqa: F401 (fixture: coda.ops on float32 CPU tensors)

gemm_mod = importlib.import_module("coda.gemm")
ce_grad = importlib.import_module("coda.kernels.ce_grad")
BF = torch.bfloat16
FAKE_DEV = keys.DeviceInfo("Fake H100", 132, "sm_90a")


@coda.epilogue
def bias_silu_row(acc, bias: coda.VecN, r: coda.VecM, s: coda.Scalar):
    return coda.silu(acc * s + bias) + r


@pytest.fixture
def cpu_gemm(monkeypatch, cache):
    """coda.gemm on CPU tensors up to the compile point (Hopper check, device facts and stream patched)."""
    monkeypatch.delenv("CODA_COMPILE_WORKERS", raising=False)
    monkeypatch.delenv("CODA_COMPILE_CACHE", raising=False)
    monkeypatch.setattr(_device, "require_hopper", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(gemm_mod._launch, "stream_handle", lambda index: 0)
    monkeypatch.setattr(keys, "device_info", lambda device=None: FAKE_DEV)
    monkeypatch.setattr(gemm_mod, "_max_active_clusters", lambda size, device=None: 132 // size)
    for d in (gemm_mod._cache, gemm_mod._plans, compile_cache._modules):
        d.clear()
    yield cache
    for d in (gemm_mod._cache, gemm_mod._plans, compile_cache._modules):
        d.clear()


def _problem():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 64, generator=g).to(BF), torch.randn(128, 64, generator=g).to(BF)
    ops = dict(bias=torch.randn(128, generator=g), r=torch.randn(256, generator=g), s=torch.tensor([0.5]))
    return a, b, ops


def _runtime_key_and_args(a, b, ops, epi=bias_silu_row):
    """What coda.gemm computes for the call: (kernel key, cfg, epilogue, problem, arg_sig, cute args)."""
    import cuda.bindings.driver as cuda
    from coda._validate import check_gemm_args
    from coda.kernels.epilogue import check_epilogue, out_flags
    from coda.runtime.select import select_config
    epi = check_epilogue(epi)
    prob = check_gemm_args(a, b, **out_flags(epi))
    cfg = select_config(prob, epi, a, b, ops)
    _, key, views, leads, _, _ = gemm_mod._kernel_views(prob, epi, cfg, a, b, None, ops)
    ts = [gemm_mod._cute(v, lead) for v, lead in zip(views, leads)]
    mc = 132 // (cfg.cluster_m * cfg.cluster_n)
    k = keys.kernel_key("sm_90a", mc, cfg, epi, prob.in_dtype, prob.out_dtype, key[-1])
    return k, (cfg, epi, prob.in_dtype, prob.out_dtype, key[-1], mc), [*ts[:3], cuda.CUstream(0), *ts[3:]]


# --------------------------------------------------------------------------------------------------- pickling
def _epilogues():
    for m in ("adamw", "cross_entropy", "gated", "layernorm", "rmsnorm", "rope"):
        importlib.import_module(f"coda.epilogues.{m}")
    importlib.import_module("coda.ops")
    from coda.dsl import _BY_OP_NAME
    return list(_BY_OP_NAME.values())


def test_recipes_pickle_and_epilogues_keep_their_structure_and_key():
    scale = 3.0

    @coda.epilogue
    def local(acc, t: coda.TileMN):  # a closure: plain pickle refuses its function
        return coda.where(acc > 0, acc * scale, t) / (1 + coda.exp(-acc))

    from coda import autodiff
    derived = [autodiff.with_preact(bias_silu_row), autodiff.backward_epilogue(bias_silu_row, ("out",), ("bias",))]
    assert all(e.fn is None for e in derived)  # (derived programs have no Python function)
    epis = _epilogues() + [local] + derived
    assert len(epis) > 20
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pickle.dumps(local)
    spec = pc.ArgSpec("tensor", "BFloat16", (None, None, None), (None, 1, None), "gmem", 16, False, "Tensor<x>")
    for epi in epis:
        r = pc.Recipe("gemm", (None, epi, BF, BF, ((torch.float32, 1),), 132), (spec, pc.ArgSpec("stream", value=0)),
                      "sm_90a", "k" * 64, "label", pc.structure_fingerprint(epi))
        back = pc.loads(pc.dumps(r))
        e2 = back.params[1]
        assert type(e2) is type(epi) and e2 is not epi
        assert pc.structure_fingerprint(e2) == r.fingerprint, epi.name
        assert keys.epilogue_key(e2) == keys.epilogue_key(epi), epi.name
        assert back.args == r.args and back.params[2:] == r.params[2:]
    # unevaluated sympy survives: plain unpickling would evaluate 2 * (x + y) into 2 x + 2 y (other code)
    import sympy as sp
    x, y = sp.symbols("x y")
    e = sp.Mul(2, sp.Add(x, y), evaluate=False)
    assert sp.srepr(pc.loads(pickle.dumps(e))) == sp.srepr(e) != sp.srepr(pickle.loads(pickle.dumps(e)))


def test_fingerprint_never_prints_a_whole_expression(monkeypatch):
    """The structural fingerprint walks each expression's DAG; it never hands a compound expression to sympy's
    srepr, whose sorting of Add / Mul arguments evaluates products and asks sympy's assumptions -- which raised
    InconsistentAssumptions on an unevaluated -1*0.0 in a derived epilogue after other tests had queried it (a
    fresh-clone CI run, session 42) -- and whose output grows exponentially with reused subexpressions."""
    import sympy as sp
    srepr = sp.srepr

    def atoms_only(e, *a, **k):
        assert not getattr(e, "args", ()), "srepr of a compound expression"
        return srepr(e, *a, **k)
    monkeypatch.setattr(sp, "srepr", atoms_only)
    epis = _epilogues()
    prints = {pc.structure_fingerprint(e) for e in epis}
    assert len(prints) == len(epis)  # (distinct epilogues, distinct prints)
    x, y = sp.symbols("x y")
    two = [sp.Mul(2, sp.Add(x, y), evaluate=False), sp.Add(sp.Mul(2, x), sp.Mul(2, y), evaluate=False)]
    outs = [[], []]
    for e, out in zip(two, outs):
        pc._structure(e, out)
    assert outs[0] != outs[1]  # the structure, not the value


def test_arg_specs_rebuild_the_runtime_mlir_types(cpu_gemm):
    from cutlass._mlir import ir
    a, b, ops = _problem()
    _, _, args = _runtime_key_and_args(a, b, ops)
    specs = [pc.spec_of(t) for t in args]
    assert [s.kind for s in specs] == ["tensor"] * 3 + ["stream"] + ["tensor"] * 3
    with ir.Context(), ir.Location.unknown():
        for t, s in zip(args, specs):
            if s.kind == "tensor":
                assert str(pc.build_arg(s).mlir_type) == str(t.mlir_type)
                assert str(pc.build_arg(s)) == str(t)  # the DSL names the host function after it


# ---------------------------------------------------------------------------------------------------- dry run
def test_dry_run_records_and_launches_nothing(cpu_gemm):
    a, b, ops = _problem()
    with pc.recording() as rec:
        out = coda.gemm(a, b, epilogue=bias_silu_row, **ops)
        coda.gemm(a, b, epilogue=bias_silu_row, **ops)
        with pytest.raises(RuntimeError, match="do not nest"):
            with pc.recording():
                pass
    assert out.shape == (256, 128) and out.dtype == BF
    assert rec.calls == 2 and len(rec.recipes) == 1 and rec.pending() == rec.recipes
    key, _, _ = _runtime_key_and_args(a, b, ops)
    assert rec.recipes[0].key == key and rec.recipes[0].kind == "gemm"
    assert not gemm_mod._cache and not gemm_mod._plans and pc.recorder() is None
    assert not (cpu_gemm / "kernels").exists()


def test_precompile_compiles_in_a_worker_under_the_runtime_key(cpu_gemm, tmp_path, monkeypatch):
    a, b, ops = _problem()
    lin = torch.nn.Linear(8, 8)
    w = torch.nn.Parameter(torch.zeros(16, 8, dtype=BF))
    opt = coda.optim.AdamW([w], lr=1e-3)
    x = torch.randn(4, 8)
    held = torch.nn.Linear(8, 8)
    held(x).sum().backward()  # a gradient held before the dry run (accumulation): it must come back unchanged
    held_grad = held.weight.grad.clone()

    def step(x):
        coda.gemm(a, b, epilogue=bias_silu_row, **ops)
        (lin(x).sum() + held(x).sum()).backward()  # a real torch backward: its .grad must not survive
        with coda.optim.eager_backward():
            assert coda.optim.in_backward_operands(w) is not None  # the dW kernel's bookkeeping is committed
        return torch.rand(3)  # draws from the RNG

    before = torch.rand(3)
    torch.manual_seed(1)
    s = coda.precompile(step, x, workers=1)
    after = torch.rand(3)
    torch.manual_seed(1)
    assert torch.equal(after, torch.rand(3)) and not torch.equal(before, after)  # RNG as it was
    assert (s.found, s.cached, s.compiled, s.workers, s.in_parent, s.failed) == (1, 0, 1, 1, 0, 0), str(s)
    assert lin.weight.grad is None and lin.bias.grad is None and w.grad is None
    assert torch.equal(held.weight.grad, held_grad)
    assert not opt._done and not opt._steps and not opt._hyper and not opt.state
    assert not gemm_mod._cache and not gemm_mod._plans
    # the key the runtime computes for this call names the worker's object, which loads
    key, params, args = _runtime_key_and_args(a, b, ops)
    assert compile_cache.stored(key)
    worker_obj = compile_cache.kernel_path(key).read_bytes()
    assert compile_cache.load(key) is not None
    # byte for byte what this process compiles for the same call (runtime cute tensors, not fakes)
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path / "in-process"))
    fn, how = compile_cache.compile_kernel(*params[:5], args, params[5], "sm_90a", options="--gpu-arch=sm_90a")
    assert how == "compiled" and compile_cache.kernel_path(key).read_bytes() == worker_obj
    # stored already: skipped (no worker started)
    monkeypatch.setenv("CODA_CACHE_DIR", str(cpu_gemm))
    s = coda.precompile(step, x, workers=1)
    assert (s.found, s.cached, s.compiled, s.workers) == (1, 1, 0, 0), str(s)


def test_unpicklable_recipe_and_ce_grad_compile_in_this_process(cpu_gemm, tmp_path, monkeypatch):
    """A recipe that does not pickle (a hand-written epilogue holding a lambda) is compiled here; ce_grad's kernel
    goes through the same recipe path into the disk cache, as bytes this process would compile."""
    from cutlass.cute.runtime import from_dlpack

    from coda.epilogues.scale_bias import ScaleBias

    class Holding(ScaleBias):
        pass

    epi = Holding()
    epi.hook = lambda: None  # (not part of the kernel)
    a, b, _ = _problem()
    ops = dict(scale=torch.randn(256), bias=torch.randn(128))
    z, lse = torch.randn(64, 1000).to(BF), torch.randn(64)
    tgt, scale = torch.randint(0, 1000, (64,)), torch.ones(64)
    import cuda.bindings.driver as cuda
    import cutlass
    mz = from_dlpack(ce_grad._kernel_view(z), assumed_align=16).mark_layout_dynamic(leading_dim=1)
    vecs = [from_dlpack(ce_grad._vec(t)).mark_layout_dynamic(leading_dim=0) for t in (lse, tgt, scale)]
    ce_args = [mz, *vecs, cutlass.Float32(0.0), cuda.CUstream(0)]  # ce_grad._cute_args on CPU tensors, stream 0
    with pc.recording() as rec:
        coda.gemm(a, b, epilogue=epi, **ops)
        fn = ce_grad._compiled_for((BF, 0.0, 0.0, None), ce_args, torch.device("cpu"))
        fn(*ce_args)  # the no-op
    assert [r.kind for r in rec.recipes] == ["gemm", "ce_grad"]
    with pytest.raises(Exception):
        pc.dumps(rec.recipes[0])
    s = pc.compile_recipes(rec.recipes, workers=1)
    assert (s.found, s.compiled, s.in_parent, s.failed) == (2, 2, 1, 0), str(s)
    ce_key = rec.recipes[1].key
    assert compile_cache.stored(ce_key) and compile_cache.stored(rec.recipes[0].key)
    # the runtime's compile point now loads it from disk
    assert pc.load_or_compile("ce_grad", (BF, 0.0, 0.0, None), ce_args, "sm_90a")[1] == "disk"
    stored_obj = compile_cache.kernel_path(ce_key).read_bytes()
    own = ce_grad.compile_kernel(BF, 0.0, 0.0, None, fake=False, args=ce_args, options="--gpu-arch=sm_90a")
    compile_cache._load_runtime_global()
    assert own.dump_to_object(compile_cache.prefix_of(ce_key)) == stored_obj


# ---------------------------------------------------------------------------------- switches, bad dirs, errors
def test_zero_workers_records_only(cpu_gemm, monkeypatch):
    a, b, ops = _problem()
    monkeypatch.setenv("CODA_COMPILE_WORKERS", "0")
    s = coda.precompile(lambda: coda.gemm(a, b, epilogue=bias_silu_row, **ops))
    assert (s.found, s.cached, s.compiled, s.workers) == (1, 0, 0, 0), str(s)
    assert not (cpu_gemm / "kernels").exists()
    monkeypatch.delenv("CODA_COMPILE_WORKERS")
    s = coda.precompile(lambda: coda.gemm(a, b, epilogue=bias_silu_row, **ops), workers=0)
    assert (s.found, s.compiled, s.workers) == (1, 0, 0)
    assert pc.worker_count(5, None) == min(5, 8, max((os.cpu_count() or 2) - 1, 1))
    monkeypatch.setenv("CODA_COMPILE_WORKERS", "3")
    assert pc.worker_count(5) == 3 and pc.worker_count(2) == 2 and pc.worker_count(5, 1) == 1


@pytest.mark.parametrize("how", ["file", "world-writable", "cache-off"])
def test_a_bad_cache_dir_or_cache_off_warns_and_compiles_nothing(cpu_gemm, tmp_path, monkeypatch, how):
    a, b, ops = _problem()
    if how == "file":
        bad = tmp_path / "a-file"
        bad.write_text("x")
        monkeypatch.setenv("CODA_CACHE_DIR", str(bad))
    elif how == "world-writable":
        bad = tmp_path / "open"
        bad.mkdir(mode=0o777)
        os.chmod(bad, 0o777)
        monkeypatch.setenv("CODA_CACHE_DIR", str(bad))
    else:
        monkeypatch.setenv("CODA_COMPILE_CACHE", "0")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = coda.precompile(lambda: coda.gemm(a, b, epilogue=bias_silu_row, **ops), workers=1)
    assert (s.found, s.compiled, s.workers, s.failed) == (1, 0, 0, 0), str(s)
    assert any(issubclass(x.category, CacheFileWarning) for x in w), [str(x.message) for x in w]


def test_bad_arguments_raise_clear_errors(monkeypatch):
    with pytest.raises(TypeError, match="fn must be callable"):
        coda.precompile(42)
    for bad in (True, 1.5, "2"):
        with pytest.raises(TypeError, match="workers must be an int"):
            coda.precompile(lambda: None, workers=bad)
    with pytest.raises(ValueError, match="workers must be >= 0"):
        coda.precompile(lambda: None, workers=-1)
    with pytest.raises(TypeError, match="dispatcher must be True or False"):
        coda.precompile(lambda: None, dispatcher=1)
    with pytest.raises(TypeError, match="expected Recipe"):
        pc.compile_recipes([object()])
    for env in ("x", "-1"):
        monkeypatch.setenv("CODA_COMPILE_WORKERS", env)
        with pytest.raises(ValueError, match="CODA_COMPILE_WORKERS"):
            pc.worker_count(3)
    with pytest.raises(TypeError, match="cannot describe"):
        pc.spec_of(object())


def test_a_recipe_from_another_source_is_refused(cpu_gemm):
    a, b, ops = _problem()
    with pc.recording() as rec:
        coda.gemm(a, b, epilogue=bias_silu_row, **ops)
    r = rec.recipes[0]
    r.key = hashlib.sha256(b"another checkout").hexdigest()
    with pytest.raises(pc.RecipeError, match="another CODA source"):
        pc.compile_recipe(r)
    r.fingerprint = "0" * 64
    with pytest.raises(pc.RecipeError, match="epilogue differs"):
        pc.compile_recipe(r)


class _ExitOnLoad:
    """Unpickling it ends the process at once (a worker killed mid-compile)."""

    def __reduce__(self):
        return os._exit, (3,)


def test_a_broken_worker_pool_does_not_hang():
    payloads = [(0, pickle.dumps(_ExitOnLoad())), (1, pickle.dumps(_ExitOnLoad()))]
    with pytest.warns(RuntimeWarning, match="compile worker failed"):
        res = pc._run_workers(payloads, 1, "sm_90a")
    assert sorted(r[0] for r in res) == [0, 1] and all(r[1] is None for r in res)


def test_dispatcher_dry_run_takes_the_compiled_steps_path(fp32_ops):
    """dispatcher=True: during the dry run the ops go through torch's dispatcher (as in a torch.compile'd graph),
    where coda.optim's in-backward updates run through the ops' update twins (ops._builder): the same weights as in
    eager are updated in backward (no .grad), only the norm weights get gradients; after it the eager entry is back
    and the gradients and the optimizer's bookkeeping are undone."""
    import coda.ops._common as common
    from test_optim import _models
    model, _ = _models()
    opt = coda.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16))
    seen = {}

    def step(dispatcher):
        model(ids, labels=ids).loss.backward()
        seen[dispatcher] = {n for n, p in model.named_parameters() if p.grad is not None}
    for dispatcher in (False, True):
        coda.precompile(step, dispatcher, dispatcher=dispatcher)
        assert all(p.grad is None for p in model.parameters()) and not opt._done
    assert pc.recorder() is None and common.EAGER_FUNCTIONS is True
    assert seen[True] == seen[False] and seen[True] and all("norm" in n for n in seen[True]), seen


def test_background_precompile_is_waited_for_by_the_step(cpu_gemm, monkeypatch):
    """background=True returns once the worker is started; the compile point meeting that kernel meanwhile waits
    for the worker and loads its object (it does not build the kernel beside it); afterwards nothing is in flight."""
    a, b, ops = _problem()
    bg = coda.precompile(lambda: coda.gemm(a, b, epilogue=bias_silu_row, **ops), workers=1, background=True)
    assert isinstance(bg, pc.Background)
    key, params, args = _runtime_key_and_args(a, b, ops)
    assert key in pc._inflight and not bg.done()  # the worker starts a Python and imports cutlass: seconds
    built = []
    monkeypatch.setattr(compile_cache, "save", lambda *x: built.append(x))  # a second build would store
    fn, how = compile_cache.compile_kernel(*params[:5], args, params[5], "sm_90a", options="--gpu-arch=sm_90a")
    assert how == "disk" and fn is not None and not built
    s = bg.wait()
    assert (s.found, s.compiled, s.failed, s.workers) == (1, 1, 0, 1), str(s)
    assert bg.done() and not pc._inflight and "1 compiled" in str(bg)


def test_background_worker_failure_leaves_the_kernel_to_the_step(cpu_gemm):
    a, b, ops = _problem()
    with pc.recording() as rec:
        coda.gemm(a, b, epilogue=bias_silu_row, **ops)
    r = rec.recipes[0]
    r.fingerprint = "0" * 64  # the worker refuses it (RecipeError)
    bg = pc.compile_recipes([r], workers=1, background=True)
    s = bg.wait(timeout=300)
    assert bg.done() and (s.compiled, s.failed) == (0, 1) and "epilogue differs" in s.errors[0]
    assert not pc._inflight and not compile_cache.stored(r.key)
    assert pc.compile_recipes([], background=True).wait().found == 0  # nothing to do: done at once
