"""coda.autotune: config space pruning, cache keys, the on-disk result and compile caches, CODA_AUTOTUNE=0, the CLI,
and coda.gemm's launch plans (CPU, CI); the timing / loading on the H100 is in the tests marked ``gpu``."""
import ctypes
import gc
import importlib
import json
import multiprocessing
import os
import pathlib
import subprocess
import sys
import textwrap
import time
import warnings
import weakref

import pytest
import torch

import coda
import coda.autotune as at
from coda import _launch
from coda._validate import check_gemm_args
from coda.autotune import compile_cache, keys, space
from coda.autotune.__main__ import main as cli_main
from coda.autotune.store import CacheFileWarning, ResultStore, cache_dir
from coda.config import GemmConfig, all_configs, default_config
from coda.kernels.epilogue import IDENTITY, Epilogue
from hook_epilogues import Everything

gemm_mod = importlib.import_module("coda.gemm")
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _autotune_on(monkeypatch):
    """conftest.py turns tuning off for the GPU suites; this file tests the unset default (store lookups, no
    tuning) and turns tuning on (CODA_AUTOTUNE=1) where it tests it."""
    monkeypatch.delenv("CODA_AUTOTUNE", raising=False)


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


def outputs_epilogue(n_out):
    return type("Outs", (Epilogue,), {"name": f"outs{n_out}", "outputs": tuple(f"o{i}" for i in range(n_out))})()


# --------------------------------------------------------------------------------------------------- pruning
def test_every_pruned_config_has_a_reason_and_kept_ones_are_valid():
    kept, pruned = space.prune()
    assert len(kept) + len(pruned) == len(list(space.enumerate_space()))
    assert kept and pruned
    assert all(isinstance(r, str) and len(r) > 10 for _, r in pruned)
    for cfg in kept:
        assert not cfg.problems()
        assert cfg.derive_stages([2]) >= 2
        assert (cfg.tile_m, cfg.tile_n, cfg.pingpong) in space.VERIFIED_TILES
    firsts = {(c.tile_m, c.tile_n, c.pingpong, c.cluster_m, c.cluster_n) for c in kept}
    assert {(c.tile_m, c.tile_n, c.pingpong, c.cluster_m, c.cluster_n) for c in all_configs()} <= firsts
    for M in (64, 8192):
        assert default_config(M, 8192, 8192) in kept


def test_epilogue_buffers_never_cost_a_pipeline_stage():
    cfg = GemmConfig()  # 128x256: 48 KB per pipeline stage
    # one bf16 output: 4 sub-tile buffers (32 KB) leave the stages of 2
    assert cfg.derive_stages([2], epi_stages=4) == cfg.derive_stages([2]) == 4
    assert cfg.epi_buffers([2]) == 4
    # fp32 out, or three half-width bf16 outputs (swiglu and its pre-activation: 1 byte per accumulator column):
    # 4 buffers would drop a stage, so 2
    for out_bytes in ([4], [1, 1, 1]):
        assert cfg.derive_stages(out_bytes, epi_stages=4) < cfg.derive_stages(out_bytes)
        assert cfg.epi_buffers(out_bytes) == 2
    # an explicit stage count: 4 buffers only when the stages still fit with them
    assert GemmConfig(stages=4).epi_buffers([2]) == 4
    assert GemmConfig(stages=4).epi_buffers([4]) == 2 and GemmConfig(stages=3).epi_buffers([4]) == 4


def test_pruning_rules_state_their_reason():
    cfg = GemmConfig(tile_m=256, tile_n=256)  # 256 fp32 accumulators per thread
    assert "registers/thread" in space.config_reason(cfg)
    assert "not one of the variants" in space.config_reason(GemmConfig(tile_m=128, tile_n=192, cluster_m=1))
    # 4 extra fp32 outputs: the epilogue buffers leave room for 1 stage of 128x256
    r = space.config_reason(GemmConfig(), outputs_epilogue(4), "bfloat16", "float32")
    assert r.startswith("shared memory") and "2 pipeline stages" in r
    assert space.config_reason(GemmConfig(), outputs_epilogue(4), "bfloat16", "bfloat16") is None
    n = GemmConfig().derive_stages([2])
    assert "duplicate" in space.config_reason(GemmConfig(stages=n))
    assert space.config_reason(GemmConfig(stages=n - 1)) is None
    assert "shared memory" in space.config_reason(GemmConfig(stages=n + 1))
    # the kernel takes at most MAX_EPI_TENSORS (20) epilogue tensors: every config of such an epilogue is pruned
    from coda.kernels.epilogue import MAX_EPI_TENSORS
    kept, pruned = space.prune(outputs_epilogue(MAX_EPI_TENSORS + 1), configs=list(all_configs()))
    assert not kept and all(f"at most {MAX_EPI_TENSORS}" in r for _, r in pruned)
    assert "at most" not in (space.config_reason(GemmConfig(), outputs_epilogue(12)) or "")  # 12 are allowed


def test_shape_rules():
    assert "peer CTA" in space.shape_reasons(GemmConfig(cluster_m=2, cluster_n=1), IDENTITY, M=100, N=4096)
    assert "peer CTA" in space.shape_reasons(GemmConfig(cluster_m=1, cluster_n=2), IDENTITY, M=4096, N=200)
    assert space.shape_reasons(GemmConfig(cluster_m=2, cluster_n=1), IDENTITY, M=4096, N=4096) is None
    big = space.shape_reasons(GemmConfig(cluster_m=1, tile_n=128), Everything(), M=2**20, N=2**20)
    assert "int32" in big and "'ss'" in big
    quick, pruned = space.candidates(IDENTITY, "bfloat16", "bfloat16", M=64, N=8192)
    assert quick and all(c.cluster_m == 1 for c in quick)
    assert any("peer CTA" in r for _, r in pruned)
    top = quick[:2]
    refine, _ = space.candidates(IDENTITY, "bfloat16", "bfloat16", 8192, 8192, level="refine", around=top)
    assert refine and not set(refine) & set(top)
    assert {space._first_order(c) for c in refine} <= {space._first_order(c) for c in top}


def _sample(kept):
    """Kept configs that differ from the tested defaults in every knob the space adds."""
    picks = [lambda c: c.raster == "n" and c.swizzle == 1 and not c.pingpong,
             lambda c: c.stages is not None and c.pingpong and c.tile_m == 64,
             lambda c: c.epi_n == 64 and c.tile_m == 256 and c.cluster_n == 2,
             lambda c: c.swizzle == 16 and c.stages == 3 and c.tile_n == 128 and not c.pingpong]
    return [next(c for c in kept if p(c)) for p in picks]


@pytest.mark.parametrize("i", range(4))
def test_sample_of_kept_configs_compiles_for_sm90a(i):
    from coda.check import compile_variant
    kept, _ = space.prune()
    cfg = _sample(kept)[i]
    row = compile_variant(cfg)
    assert row["ok"], (cfg.name, row["error"])
    assert row["wgmma"] > 0 and row["spill_bytes"] == 0


def test_a_config_pruned_for_shared_memory_does_not_build():
    from coda.check import compile_variant
    cfg = GemmConfig(stages=GemmConfig().derive_stages([2]) + 1)
    assert space.config_reason(cfg).startswith("shared memory")
    row = compile_variant(cfg)
    assert not row["ok"] and "shared memory" in row["error"], row


# ------------------------------------------------------------------------------------------------------ keys
EPI_SRC = '''
from coda.kernels.epilogue import Epilogue, Operand

class ScaleBias(Epilogue):
    name = "scale_bias"
    operands = (Operand("scale", "vec_m"), Operand("bias", "vec_n"))
    alpha = ALPHA

    def visit(self, acc, env):
        VAR = acc * env["scale"] * MUL
        return {"out": VAR + env["bias"] * self.alpha}
'''


def _load_epi(tmp_path, tag, var="y", mul="2.0", alpha="0.5"):
    d = tmp_path / tag
    d.mkdir()
    (d / "epi_mod_x.py").write_text(EPI_SRC.replace("VAR", var).replace("MUL", mul).replace("ALPHA", alpha))
    sys.path.insert(0, str(d))
    try:
        sys.modules.pop("epi_mod_x", None)
        mod = importlib.import_module("epi_mod_x")
    finally:
        sys.path.remove(str(d))
        sys.modules.pop("epi_mod_x", None)
    return mod.ScaleBias()


def test_epilogue_key_sensitive_to_math_not_to_variable_names(tmp_path):
    base = keys.epilogue_key(_load_epi(tmp_path, "a"))
    assert keys.epilogue_key(_load_epi(tmp_path, "b")) == base  # same source, another module object
    assert keys.epilogue_key(_load_epi(tmp_path, "c", var="renamed")) == base
    assert keys.epilogue_key(_load_epi(tmp_path, "d", mul="3.0")) != base
    assert keys.epilogue_key(_load_epi(tmp_path, "e", alpha="0.25")) != base
    e = _load_epi(tmp_path, "f")
    e.name = "other"  # key() includes the name
    assert keys.epilogue_key(e) != base
    e = _load_epi(tmp_path, "g")
    e.alpha = 0.75  # instance constants count
    assert keys.epilogue_key(e) != base


def test_epilogue_key_ignores_the_op_name_counter():
    """A DSL epilogue's ``op_name`` counts the programs built earlier in the process: the same program built after
    another one has the same kernel and tuning keys."""
    import coda

    def make():
        @coda.epilogue
        def scaled_tanh(acc, s: coda.Scalar):
            return coda.tanh(acc * s)
        return scaled_tanh

    first = make()

    @coda.epilogue
    def unrelated(acc, bias: coda.VecN):
        return acc * bias + 1.5

    import coda.dsl as dsl
    dsl._OP_NAMES.pop(first._key)  # as if this process had built ``unrelated`` first
    second = make()
    assert first.op_name != second.op_name
    assert keys.epilogue_key(first) == keys.epilogue_key(second)


def test_epilogue_key_is_stable_across_processes(tmp_path):
    (tmp_path / "epi_mod_y.py").write_text(EPI_SRC.replace("VAR", "y").replace("MUL", "2.0").replace("ALPHA", "1"))
    code = ("import sys; sys.path.insert(0, %r); import epi_mod_y; from coda.autotune import keys; "
            "print(keys.epilogue_key(epi_mod_y.ScaleBias()))" % str(tmp_path))
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONHASHSEED": seed}) for seed in ("1", "2")]
    assert all(o.returncode == 0 for o in outs), [o.stderr for o in outs]
    assert outs[0].stdout == outs[1].stdout and "scale_bias" in outs[0].stdout


def test_tune_key_buckets_and_sensitivity():
    dev = keys.DeviceInfo("NVIDIA H100 80GB HBM3", 132, "sm_90a")
    k = keys.tune_key(dev, BF16, BF16, 5000, 28672, 4096, 1, IDENTITY)
    assert k == keys.tune_key(dev, "bf16", "bfloat16", 8192, 28672, 4096, 1, IDENTITY)  # M bucket 8192
    assert keys.pow2_bucket(8192) == 8192 and keys.pow2_bucket(8193) == 16384 and keys.pow2_bucket(1) == 1
    others = [keys.tune_key(dev, BF16, BF16, 9000, 28672, 4096, 1, IDENTITY),
              keys.tune_key(dev, BF16, BF16, 8192, 28680, 4096, 1, IDENTITY),
              keys.tune_key(dev, BF16, BF16, 8192, 28672, 4104, 1, IDENTITY),
              keys.tune_key(dev, BF16, torch.float32, 8192, 28672, 4096, 1, IDENTITY),
              keys.tune_key(dev, torch.float16, torch.float16, 8192, 28672, 4096, 1, IDENTITY),
              keys.tune_key(dev, BF16, BF16, 8192, 28672, 4096, 2, IDENTITY),
              keys.tune_key(dev, BF16, BF16, 8192, 28672, 4096, 1, Everything()),
              keys.tune_key(keys.DeviceInfo("NVIDIA H100 PCIe", 114, "sm_90a"), BF16, BF16, 8192, 28672, 4096, 1,
                            IDENTITY)]
    assert len({k, *others}) == len(others) + 1
    for part in ("NVIDIA H100 80GB HBM3", "sm132", "cutlass-dsl 4.8", f"coda {coda.__version__}", "M8192xN28672xK4096"):
        assert part in k


def test_kernel_key_and_source_hash(tmp_path):
    import shutil
    root = tmp_path / "tree"
    for rel in ("coda/kernels/gemm_sm90.py", "coda/kernels/epilogue.py", "coda/config.py", "coda/reference.py",
                "coda/runtime/compile_cache.py", "coda/_eval.py", "coda/dsl.py"):
        src = pathlib.Path(__file__).resolve().parents[1] / rel
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, root / rel)
    h = keys.kernel_source_hash(str(root))
    (root / "coda/reference.py").write_text("# unrelated edit\n")
    assert keys.kernel_source_hash.__wrapped__(str(root)) == h
    (root / "coda/kernels/gemm_sm90.py").write_text((root / "coda/kernels/gemm_sm90.py").read_text() + "\n# x\n")
    h2 = keys.kernel_source_hash.__wrapped__(str(root))
    assert h2 != h
    # the lowering of an epilogue's math (coda/_eval.py, coda/dsl.py) is kernel source too
    for rel in ("coda/_eval.py", "coda/dsl.py"):
        (root / rel).write_text((root / rel).read_text() + "\n# x\n")
        assert keys.kernel_source_hash.__wrapped__(str(root)) != h2
        h2 = keys.kernel_source_hash.__wrapped__(str(root))
    k = keys.kernel_key("sm_90a", 66, GemmConfig(), IDENTITY, BF16, BF16, (), source_hash="s")
    assert k == keys.kernel_key("sm_90a", 66, GemmConfig(), IDENTITY, "bf16", "bf16", (), source_hash="s")
    assert len({k, keys.kernel_key("sm_90a", 33, GemmConfig(), IDENTITY, BF16, BF16, (), source_hash="s"),
                keys.kernel_key("sm_90a", 66, GemmConfig(raster="n"), IDENTITY, BF16, BF16, (), source_hash="s"),
                keys.kernel_key("sm_90a", 66, GemmConfig(), Everything(), BF16, BF16, (), source_hash="s"),
                keys.kernel_key("sm_90a", 66, GemmConfig(), IDENTITY, BF16, BF16, (), source_hash="t")}) == 5


# ---------------------------------------------------------------------------------------------- result store
def test_cache_dir_override(cache, monkeypatch):
    assert cache_dir() == cache
    at.store.put("k", {"config": space.config_to_dict(GemmConfig())})
    assert (cache / "autotune.json").is_file()
    assert json.loads((cache / "autotune.json").read_text())["entries"]["k"]["config"]["tile_n"] == 256
    monkeypatch.delenv("CODA_CACHE_DIR")
    assert cache_dir() == pathlib.Path.home() / ".cache" / "coda"


def _writer(path, tag, n, go):
    from coda.autotune.store import ResultStore
    go.wait()
    s = ResultStore(path)
    for i in range(n):
        s.put(f"{tag}-{i}", {"i": i, "pad": "x" * 2000})


def _reader(path, go, seconds, result):
    from coda.autotune.store import _parse
    go.wait()
    t, bad = time.time(), 0
    while time.time() - t < seconds:
        bad += _parse(path)[1] is not None
    result.value = bad


def test_two_processes_writing_at_once_lose_nothing(tmp_path):
    path = tmp_path / "autotune.json"
    ctx = multiprocessing.get_context("spawn")
    go, bad = ctx.Event(), ctx.Value("i", -1)
    procs = [ctx.Process(target=_writer, args=(path, tag, 40, go)) for tag in ("p0", "p1")]
    procs.append(ctx.Process(target=_reader, args=(path, go, 3.0, bad)))
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    entries = ResultStore(path).load()
    assert sorted(entries) == sorted(f"p{j}-{i}" for j in range(2) for i in range(40))
    assert bad.value == 0  # a reader never saw a partial file
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


@pytest.mark.parametrize("content", ["{not json", json.dumps({"schema": 0, "entries": {}}), json.dumps([1, 2])])
def test_corrupt_or_stale_file_warns_once_and_is_rewritten(tmp_path, content):
    path = tmp_path / "autotune.json"
    path.write_text(content)
    s = ResultStore(path)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert s.get("a") is None
        assert s.load() == {}
        s.put("a", {"x": 1})
        assert s.get("a") == {"x": 1}
    assert len([x for x in w if issubclass(x.category, CacheFileWarning)]) == 1, [str(x.message) for x in w]
    assert json.loads(path.read_text())["entries"] == {"a": {"x": 1}}


# ------------------------------------------------------------------------------------------ config selection
def _prob(M=8192, N=8192, K=8192):
    return check_gemm_args(torch.empty(M, K, dtype=BF16), torch.empty(N, K, dtype=BF16))


FAKE_DEV = keys.DeviceInfo("Fake H100", 132, "sm_90a")


def test_autotune_off_uses_the_heuristic_without_touching_caches(cache, monkeypatch):
    monkeypatch.setenv("CODA_AUTOTUNE", "0")

    def boom(*a, **k):
        raise AssertionError("must not be called with CODA_AUTOTUNE=0")
    monkeypatch.setattr(keys, "device_info", boom)
    monkeypatch.setattr(at.store, "get", boom)
    for M, N, K in ((8192, 8192, 8192), (64, 4096, 4096)):
        assert at.select_config(_prob(M, N, K), IDENTITY, None, None, {}) == default_config(M, N, K)
    # the heuristic counts the tiles of every batch (16 x 32 of 128x256: 4 waves), a shared weight folding L into M
    batched = check_gemm_args(torch.empty(16, 1024, 1024, dtype=BF16), torch.empty(16, 1024, 1024, dtype=BF16))
    shared = check_gemm_args(torch.empty(16, 1024, 1024, dtype=BF16), torch.empty(1024, 1024, dtype=BF16))
    assert default_config(1024, 1024, 1024).tile_n == 128
    for prob in (batched, shared):
        assert at.select_config(prob, IDENTITY, None, None, {}) == default_config(1024, 1024, 1024, batch=16)
        assert default_config(1024, 1024, 1024, batch=16).tile_n == 256
    assert not cache.exists()


def test_select_config_memory_disk_and_tuning_on_miss(cache, monkeypatch):
    from coda.autotune import tuner
    monkeypatch.setenv("CODA_AUTOTUNE", "1")  # tuning on a miss is opt-in (issue 31); the default never tunes
    monkeypatch.setattr(keys, "device_info", lambda device=None: FAKE_DEV)
    calls = []
    tuned = GemmConfig(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2)

    def fake_tune(a, b, epi, out_dtype, operands, **kw):  # stands in for the GPU timing loop
        calls.append((a, b))
        return tuner.TuneResult(best=tuned, best_ms=1.0, default=GemmConfig(), default_ms=1.1, rows=[], pruned=[],
                                seconds=0.1, flop=1, level="quick")
    monkeypatch.setattr(tuner, "tune", fake_tune)
    prob = _prob()
    assert at.select_config(prob, IDENTITY, "a", "b", {}) == tuned and len(calls) == 1
    assert at.select_config(prob, IDENTITY, "a", "b", {}) == tuned and len(calls) == 1  # memory
    at._memory.clear()
    assert at.select_config(_prob(M=5000), IDENTITY, "a", "b", {}) == tuned and len(calls) == 1  # disk, same bucket
    entry = at.store.get(at.key_for(prob, IDENTITY))
    assert entry["name"] == tuned.name and entry["default"] == GemmConfig().name
    small = _prob(256, 256, 256)  # below MIN_TUNE_FLOP: heuristic, no tuning, nothing stored
    assert at.select_config(small, IDENTITY, "a", "b", {}) == default_config(256, 256, 256) and len(calls) == 1
    # a stored config that today's rules prune is ignored (re-tuned)
    at._memory.clear()
    at.store.put(at.key_for(prob, IDENTITY), {"config": space.config_to_dict(GemmConfig(tile_n=192))})
    assert at.lookup(prob, IDENTITY) is None
    assert at.select_config(prob, IDENTITY, "a", "b", {}) == tuned and len(calls) == 2
    removed = at.clear()
    assert removed["results"] and not (cache / "autotune.json").exists() and not at._memory

    def failing_tune(*a, **k):
        raise torch.cuda.OutOfMemoryError("no room for the input copies")
    monkeypatch.setattr(tuner, "tune", failing_tune)
    with pytest.warns(RuntimeWarning, match="tuning 8192x8192x8192 failed"):
        assert at.select_config(prob, IDENTITY, "a", "b", {}) == default_config(8192, 8192, 8192)
    assert at.store.get(at.key_for(prob, IDENTITY)) is None  # nothing stored for a failed tuning


def test_runoff_retimes_finalists_and_keeps_the_default_within_the_noise_margin():
    from coda.autotune import tuner
    from coda.config import GemmConfig
    cfgs = [GemmConfig(tile_m=128, tile_n=256, pingpong=False, cluster_m=cm, cluster_n=cn)
            for cm, cn in ((2, 1), (1, 1), (1, 2))] + [GemmConfig(tile_m=128, tile_n=128, pingpong=True)]
    default = cfgs[0]

    def rows(first):
        return [tuner.Row(c, ms=t) for c, t in zip(cfgs, first)] + [tuner.Row(cfgs[0], ms=None, status="bad")]

    # one lucky first timing (cfgs[1]: 0.90) does not win: its re-timings are 1.10, the median decides
    true = {cfgs[0]: 1.00, cfgs[1]: 1.10, cfgs[2]: 1.20, cfgs[3]: 1.30}
    calls = []
    timer = lambda c: calls.append(c) or true[c]  # noqa: E731
    best = tuner.runoff(rows([1.0, 0.90, 1.2, 1.3]), default, timer, top=2, rounds=3)
    assert best.config == default and best.ms == 1.0
    assert sorted(calls, key=cfgs.index) == [cfgs[0]] * 3 + [cfgs[1]] * 3  # top 2 only, 3 rounds each
    # a challenger 0.5 % faster than the default: inside the margin, the default stays
    true[cfgs[2]] = 0.995
    assert tuner.runoff(rows([1.0, 1.1, 0.995, 1.3]), default, lambda c: true[c], margin=0.01).config == default
    # 5 % faster: it wins; the default is a finalist even when it is not among the fastest
    true[cfgs[2]] = 0.95
    r = rows([1.0, 1.1, 0.95, 1.3])
    best = tuner.runoff(r, default, lambda c: true[c], top=1, margin=0.01)
    assert best.config == cfgs[2] and r[0].ms == 1.0
    assert tuner.runoff([tuner.Row(default, ms=None, status="failed")], default, timer) is None


def test_tuner_helpers():
    import io

    from coda.autotune import tuner
    mb = 1 << 20
    assert tuner.n_buffers(10 * mb, 50 * mb, 80_000 * mb) == 8  # small inputs: 8 sets span 4x the L2
    assert tuner.n_buffers(60 * mb, 50 * mb, 80_000 * mb) == 4
    assert tuner.n_buffers(400 * mb, 50 * mb, 80_000 * mb) == 1  # already L2-cold by size
    assert tuner.n_buffers(60 * mb, 50 * mb, 100 * mb) == 1  # no room for copies
    x = torch.randn(64, 64)
    assert tuner.check_result(x.bfloat16(), x) is None
    assert "rel err" in tuner.check_result(x + 0.5, x)
    y = x.clone()
    y[3, 3] = float("nan")
    assert "inf" in tuner.check_result(y, x)
    assert "missing" in tuner.check_result({"out": x}, {"out": x, "rs": x[:, 0]})
    assert tuner.check_result({"out": x, "rs": x[:, 0]}, {"out": x, "rs": x[:, 0]}) is None
    copies = tuner.rotating_copies(x[:, :32], 3)
    assert len(copies) == 3 and all(torch.equal(c, x[:, :32]) and c.stride() == (64, 1) for c in copies)
    assert len({c.data_ptr() for c in copies}) == 3
    stream = io.StringIO()
    bar = tuner.Progress(3, "coda.autotune test", after_s=3600, stream=stream)
    bar.update("a")
    assert stream.getvalue() == ""  # quiet while tuning is short
    bar.after_s = 0
    bar.update("b 1.000 ms")
    bar.grow(2)  # a later round of candidates (levels full / near)
    assert bar.total == 5 and (bar.bar is None or bar.bar.total == 5)
    bar.close()
    assert "coda.autotune test" in stream.getvalue()


# --------------------------------------------------------------------------------------------------------- CLI
def test_cli_without_gpu_exits_nonzero_with_a_message(cache, capsys):
    from coda._device import hopper_available
    if hopper_available():
        pytest.skip("a Hopper GPU is present")
    assert cli_main(["--gemm", "8192,28672,4096"]) == 2
    assert "needs a Hopper (sm_90) GPU" in capsys.readouterr().err
    assert cli_main(["--gemm", "8192,28672"]) == 2
    assert cli_main(["--space", "--clear"]) == 0
    out = capsys.readouterr().out
    assert "kept" in out and "pruned" in out and "cleared" in out


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


@pytest.mark.gpu
def test_gpu_tuning_picks_a_checked_config_and_remembers_it(cache):
    result = at.tune_shape(4096, 4096, 4096)
    print(result.table())
    assert result.best_ms is not None and result.default_ms is not None
    bad = [(r.config.name, r.status) for r in result.rows if not r.status.startswith("ok")]
    assert not bad, bad  # every candidate of the space ran and matched the torch reference
    a, b = torch.randn(4096, 4096, device="cuda", dtype=BF16), torch.randn(4096, 4096, device="cuda", dtype=BF16)
    prob = check_gemm_args(a, b)
    assert at.lookup(prob, IDENTITY) == result.best
    y = coda.gemm(a, b)  # config=None: the stored result, no tuning
    ref = a.double() @ b.double().T
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2
