"""coda.autotune: config space pruning, cache keys, the on-disk result store, config selection and CODA_AUTOTUNE,
the CLI (CPU, CI); tuning on the H100 is in the tests marked ``gpu``. The compile cache and coda.gemm's launch
plans: tests/test_kernel_cache.py."""
import importlib
import json
import multiprocessing
import os
import pathlib
import subprocess
import sys
import time
import warnings

import pytest
import torch

import coda
import coda.autotune as at
from coda.autotune import keys, space
from coda.autotune.__main__ import main as cli_main
from coda.autotune.store import CacheFileWarning, ResultStore, cache_dir
from coda._validate import check_gemm_args
from coda.config import GemmConfig, all_configs, default_config
from coda.kernels.epilogue import IDENTITY, Epilogue
from hook_epilogues import Everything

gemm_mod = importlib.import_module("coda.gemm")
BF16 = torch.bfloat16


pytestmark = pytest.mark.usefixtures("autotune_unset")  # conftest.py: the library's default


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
                "coda/runtime/compile_cache.py", "coda/_eval.py", "coda/dsl.py", "coda/dsl_nodes.py"):
        src = pathlib.Path(__file__).resolve().parents[1] / rel
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, root / rel)
    h = keys.kernel_source_hash(str(root))
    (root / "coda/reference.py").write_text("# unrelated edit\n")
    assert keys.kernel_source_hash.__wrapped__(str(root)) == h
    (root / "coda/kernels/gemm_sm90.py").write_text((root / "coda/kernels/gemm_sm90.py").read_text() + "\n# x\n")
    h2 = keys.kernel_source_hash.__wrapped__(str(root))
    assert h2 != h
    # the lowering of an epilogue's math (coda/_eval.py, coda/dsl.py and its sympy nodes) is kernel source too
    for rel in ("coda/_eval.py", "coda/dsl.py", "coda/dsl_nodes.py"):
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


@pytest.mark.gpu
def test_gpu_model_recording_prefill_forward_against_training_step():
    """``--prefill`` records the inference forward: no backward, optimizer or loss epilogue, and its gate/up GEMM
    saves no pre-activation; the training step records those."""
    from coda.autotune import model
    backward = ("bwd", "dgrad", "radial", "adamw", "accumulate", "ce_", "fold_grads", "preact")
    train = model.record_model_step("tiny", 2, 64, optimizer="coda-adamw")
    prefill = model.record_model_step("tiny", 2, 64, optimizer="coda-adamw", prefill=True)
    names = [r.epi.name for r in prefill]
    assert names and not [n for n in names if any(s in n for s in backward)], names
    assert [r.epi.name for r in train if any(s in r.epi.name for s in backward)]
    assert any(r.prob.M == 2 * 64 for r in prefill)  # the prompts' tokens
