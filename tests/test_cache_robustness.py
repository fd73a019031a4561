"""The compile cache and the tuning store never crash on a damaged, unwritable or unsafe cache dir (issue 26).

Each test fails before the fix it covers: damaged JSON (not UTF-8, nested too deeply, wrong field types, unbounded
hardware facts), an unwritable cache dir (a file, a directory where a file should be, read-only), checksums of
compiled objects, refused cache dirs (not ours, writable by others) and symlinked lock files. CPU only."""
import hashlib
import importlib
import json
import os
import stat
import warnings

import pytest
import torch

import coda.autotune as at
from coda._validate import check_gemm_args
from coda.autotune import compile_cache, entries, keys, space
from coda.autotune.store import CacheFileWarning, ResultStore
from coda.config import GemmConfig, default_config
from coda.kernels.epilogue import IDENTITY

store_mod = importlib.import_module("coda.autotune.store")  # (coda.autotune.store is the ResultStore)
BF16 = torch.bfloat16
FAKE_DEV = keys.DeviceInfo("Fake H100", 132, "sm_90a")
TUNED = GemmConfig(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2)


@pytest.fixture(autouse=True)
def _autotune_on(monkeypatch):
    monkeypatch.delenv("CODA_AUTOTUNE", raising=False)
    monkeypatch.delenv("CODA_COMPILE_CACHE", raising=False)
    monkeypatch.setattr(keys, "device_info", lambda device=None: FAKE_DEV)


class Recorder:
    def __init__(self):
        self._cm = warnings.catch_warnings(record=True)

    def __enter__(self):
        self.w = self._cm.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)

    @property
    def cache(self):
        return [str(x.message) for x in self.w if issubclass(x.category, CacheFileWarning)]


def _prob(M=8192, N=8192, K=8192):
    return check_gemm_args(torch.empty(M, K, dtype=BF16), torch.empty(N, K, dtype=BF16))


def _entry(**config):
    return {"config": {**space.config_to_dict(TUNED), **config}, "name": TUNED.name}


def _write(path, entries, schema=keys.SCHEMA):
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema": schema, "entries": entries}))


def _fake_tune(monkeypatch, calls):
    from coda.autotune import tuner

    def fake_tune(a, b, epi, out_dtype, operands, **kw):
        calls.append(1)
        return tuner.TuneResult(best=TUNED, best_ms=1.0, default=GemmConfig(), default_ms=1.1, rows=[], pruned=[],
                                seconds=0.1, flop=1, level="quick")
    monkeypatch.setattr(tuner, "tune", fake_tune)


# ---------------------------------------------------------------------------------------------- a damaged store
@pytest.mark.parametrize("raw", [b"\xff\xfe{\"schema\": 1}", b"[" * 100_000 + b"]" * 100_000,
                                 b'{"schema": 1, "entries": {"k": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"],
                         ids=["not-utf8", "nested", "nested-entry"])
def test_non_utf8_or_deeply_nested_file_warns_once_and_is_rebuilt(cache, raw):
    path = cache / "autotune.json"
    path.parent.mkdir(mode=0o700)
    path.write_bytes(raw)
    key = at.key_for(_prob(), IDENTITY)
    with Recorder() as r:
        assert at.lookup(_prob(), IDENTITY) is None and at.store.load() == {}
        assert at.store.put(key, _entry())
        assert at.lookup(_prob(), IDENTITY) == TUNED
    assert len(r.cache) == 1 and "corrupt" in r.cache[0], r.cache
    assert list(json.loads(path.read_text())["entries"]) == [key]


def test_an_entry_nested_below_the_json_limit_does_not_break_the_next_write(cache):
    deep = "[" * 600 + "]" * 600  # json.loads takes it; the indenting encoder used to recurse past the limit
    path = cache / "autotune.json"
    path.parent.mkdir(mode=0o700)
    path.write_text('{"schema": 1, "entries": {"deep": {"x": %s}, "ok": %s}}' % (deep, json.dumps(_entry())))
    with Recorder() as r:
        assert at.store.put("new", _entry())
    assert len(r.cache) == 1 and "nested too deeply" in r.cache[0], r.cache
    assert sorted(json.loads(path.read_text())["entries"]) == ["new", "ok"]


@pytest.mark.parametrize("bad", [dict(tile_n=None), dict(swizzle=1.5), dict(pingpong=1), dict(tile_m=True),
                                 dict(raster=["m"]), dict(stages="4"), dict(epi_n=48), dict(cluster_m=3),
                                 dict(sched=None), dict(extra=1)])
def test_entries_with_wrong_field_types_are_dropped_with_one_warning(cache, bad):
    prob = _prob()
    key = at.key_for(prob, IDENTITY)
    path = cache / "autotune.json"
    _write(path, {key: _entry(**bad), "other": _entry(), "alsobad": _entry(**bad)})
    with Recorder() as r:
        assert at.lookup(prob, IDENTITY) is None  # no TypeError, no config with swizzle 1.5
        assert at.store.get("other") == _entry() and at.store.get("alsobad") is None
        assert at.lookup(prob, IDENTITY) is None
    assert len(r.cache) == 1 and "invalid entr" in r.cache[0], r.cache
    at.store.put("fresh", _entry())  # the next write rebuilds the file without the bad entries
    assert sorted(json.loads(path.read_text())["entries"]) == ["fresh", "other"]


@pytest.mark.parametrize("field, value", [("ms", "fast"), ("ms", float("nan")), ("tried", 1.5),
                                          ("shape", [1, 2]), ("shape", [1, 2, 3, "x"]), ("name", 7)])
def test_every_stored_field_is_checked(cache, field, value):
    path = cache / "autotune.json"
    e = {**_entry(), field: value}
    _write(path, {"k": e})
    with Recorder() as r:
        assert at.store.get("k") is None
    assert len(r.cache) == 1, r.cache
    good = {**_entry(), "ms": 1.0, "default": "x", "default_ms": None, "tried": 3, "shape": [1, 2, 3, None],
            "tuning_s": 0.5, "level": "quick", "time": 1.7e9}
    assert entries.result_entry_problem("k", good) is None


@pytest.mark.parametrize("value", [True, 10**9, 1e9, 0, -3, "66", None, 132.0])
def test_hardware_facts_are_bounded(cache, value):
    path = cache / "hardware.json"
    calls = []

    def compute():
        calls.append(1)
        return 66
    key = (f"{FAKE_DEV.name}|sm{FAKE_DEV.sm_count}|{FAKE_DEV.arch}|cutlass-dsl {keys.cutlass_dsl_version()}"
           "|cluster 2")
    _write(path, {key: {"max_active_clusters": value}})
    with Recorder() as r:
        assert compile_cache.max_active_clusters(FAKE_DEV, 2, compute) == 66 and len(calls) == 1
        assert compile_cache.max_active_clusters(FAKE_DEV, 2, compute) == 66 and len(calls) == 1  # rewritten
    assert len(r.cache) == 1, r.cache
    # a count above the GPU's SM count (one cluster per SM at most) is recomputed too
    _write(path, {key: {"max_active_clusters": 133}})
    assert compile_cache.max_active_clusters(FAKE_DEV, 2, compute) == 66 and len(calls) == 2


# ------------------------------------------------------------------------------------- an unwritable cache dir
def _unwritable(kind, tmp_path, monkeypatch):
    """Point CODA_CACHE_DIR at a cache dir that cannot be written, in one of several ways."""
    d = tmp_path / "c"
    if kind == "file":
        d.write_text("not a dir")
    elif kind == "dirs-in-place-of-files":
        for name in ("autotune.json", "hardware.json"):
            (d / name).mkdir(parents=True)
        (d / "kernels").write_text("not a dir")
        d.chmod(0o700)
    elif kind == "read-only":
        d.mkdir(mode=0o700)
        if os.geteuid() == 0:  # root writes anyway: fail the writes as a read-only file system would
            def ro(*a, dir=None, **kw):
                raise OSError(30, "Read-only file system", str(dir))
            monkeypatch.setattr(store_mod.tempfile, "mkstemp", ro)
        else:
            d.chmod(0o500)
    monkeypatch.setenv("CODA_CACHE_DIR", str(d))
    return d


KINDS = ["file", "dirs-in-place-of-files", "read-only"]


@pytest.mark.parametrize("kind", KINDS)
def test_first_launch_with_an_unwritable_cache_dir(tmp_path, monkeypatch, kind):
    _unwritable(kind, tmp_path, monkeypatch)
    calls = []

    def compute():
        calls.append(1)
        return 66
    with Recorder() as r:
        assert compile_cache.max_active_clusters(FAKE_DEV, 2, compute) == 66
        assert compile_cache.max_active_clusters(FAKE_DEV, 2, compute) == 66 and len(calls) == 1  # in memory
        assert compile_cache.load("ab" * 32) is None

        class Fn:
            def dump_to_object(self, prefix):
                return b"\x7fELF object"
        monkeypatch.setattr(compile_cache, "_load_runtime_global", lambda: None)
        assert compile_cache.save("ab" * 32, Fn()) is False
    assert 1 <= len(r.cache) <= 2, r.cache  # reading a directory as a file may warn once more
    assert any("kept in memory" in m for m in r.cache), r.cache


@pytest.mark.parametrize("kind", KINDS)
def test_a_tuning_result_whose_write_failed_is_kept_in_memory(tmp_path, monkeypatch, kind):
    d = _unwritable(kind, tmp_path, monkeypatch)
    monkeypatch.setenv("CODA_AUTOTUNE", "1")  # tuning on a miss is opt-in (issue 31)
    at._memory.clear()
    calls = []
    _fake_tune(monkeypatch, calls)
    prob = _prob()
    with Recorder() as r:
        assert at.select_config(prob, IDENTITY, "a", "b", {}) == TUNED and len(calls) == 1
        at._memory.clear()  # the store still has it: no second tuning run
        assert at.lookup(prob, IDENTITY) == TUNED
        assert at.select_config(prob, IDENTITY, "a", "b", {}) == TUNED and len(calls) == 1
    assert 1 <= len(r.cache) <= 2 and any("kept in memory" in m for m in r.cache), r.cache
    if kind == "file":  # the dir becomes usable: the next write stores what was kept in memory
        d.unlink()
        assert at.store.put("later", _entry())
        assert at.key_for(prob, IDENTITY) in json.loads((d / "autotune.json").read_text())["entries"]
    at._memory.clear()


@pytest.mark.parametrize("kind", KINDS)
def test_clear_with_an_unwritable_cache_dir(tmp_path, monkeypatch, kind):
    _unwritable(kind, tmp_path, monkeypatch)
    at._memory["x"] = TUNED
    with Recorder():
        at.store.put("k", _entry())
        removed = at.clear()
    assert removed["kernels"] == 0 and not at._memory and at.store.get("k") is None


def test_tune_shape_style_put_returns_false_and_keeps_the_entry(tmp_path):
    s = ResultStore(tmp_path / "file" / "r.json")
    (tmp_path / "file").write_text("x")
    with Recorder() as r:
        assert s.put("a", {"x": 1}) is False
        assert s.put("b", {"x": 2}) is False
    assert s.load() == {"a": {"x": 1}, "b": {"x": 2}} and len(r.cache) == 1, r.cache


# ------------------------------------------------------------------------------------------ compiled objects
class FakeFn:
    def __init__(self, data):
        self.data = data

    def dump_to_object(self, prefix):
        return self.data


@pytest.fixture
def fake_runtime(monkeypatch):
    """save / load without cutlass's JIT linker: load_module records the path and returns {prefix: 'fn'}."""
    import cutlass.runtime as crt
    loaded = []

    def load_module(path, **kw):
        loaded.append(path)
        return {compile_cache.prefix_of(KEY): "fn"}
    monkeypatch.setattr(compile_cache, "_load_runtime_global", lambda: None)
    monkeypatch.setattr(crt, "load_module", load_module)
    compile_cache._modules.clear()
    yield loaded
    compile_cache._modules.clear()


KEY = hashlib.sha256(b"a kernel").hexdigest()
OBJ = b"\x7fELF" + bytes(range(256)) * 8


def test_a_stored_object_has_a_checksum_and_a_flipped_byte_is_recompiled(cache, fake_runtime):
    assert compile_cache.save(KEY, FakeFn(OBJ))
    path, sums = compile_cache.kernel_path(KEY), compile_cache.checksum_path(KEY)
    assert sums.read_text().strip() == hashlib.sha256(path.read_bytes()).hexdigest()
    assert compile_cache.load(KEY) == "fn" and fake_runtime == [str(path)]
    compile_cache._modules.clear()
    data = bytearray(OBJ)
    data[1000] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.warns(CacheFileWarning, match="unloadable.*checksum mismatch"):
        assert compile_cache.load(KEY) is None
    assert len(fake_runtime) == 1 and not path.exists() and not sums.exists()
    # an object without its checksum is not loaded either
    assert compile_cache.save(KEY, FakeFn(OBJ))
    sums.unlink()
    with pytest.warns(CacheFileWarning, match="no readable checksum"):
        assert compile_cache.load(KEY) is None
    assert len(fake_runtime) == 1


def _text_section(data: bytes):
    """(offset, size) of the code section (.text, or .ltext of the large code model) of an ELF64 object."""
    import struct
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = sections[shstrndx][4]
    for name, _, _, _, off, size in sections:
        if data[strtab + name:data.index(b"\0", strtab + name)] in (b".text", b".ltext") and size:
            return off, size
    raise AssertionError("no .text")


def test_a_real_object_with_a_flipped_byte_in_text_is_not_loaded(cache):
    import cuda.bindings.driver as cuda
    gemm_mod = importlib.import_module("coda.gemm")
    a, b, out = torch.randn(256, 64, dtype=BF16), torch.randn(128, 64, dtype=BF16), torch.empty(256, 128, dtype=BF16)
    cfg = GemmConfig(tile_m=128, tile_n=128, cluster_m=1, pingpong=True)
    prob = check_gemm_args(a, b, out=out)
    _, key, views, leads, _, _ = gemm_mod._kernel_views(prob, IDENTITY, cfg, a, b, out, {})
    ts = [gemm_mod._cute(v, lead) for v, lead in zip(views, leads)]
    args = [*ts[:3], cuda.CUstream(0x1234), *ts[3:]]
    kw = dict(max_clusters=132, arch="sm_90a", options="--gpu-arch=sm_90a")
    assert compile_cache.compile_kernel(cfg, IDENTITY, BF16, BF16, key[-1], args, **kw)[1] == "compiled"
    compile_cache._modules.clear()
    path = next((cache / "kernels").glob("*.o"))
    data = bytearray(path.read_bytes())
    off, size = _text_section(bytes(data))
    data[off + size // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.warns(CacheFileWarning, match="checksum mismatch"):
        assert compile_cache.compile_kernel(cfg, IDENTITY, BF16, BF16, key[-1], args, **kw)[1] == "compiled"
    compile_cache._modules.clear()
    assert compile_cache.compile_kernel(cfg, IDENTITY, BF16, BF16, key[-1], args, **kw)[1] == "disk"
    compile_cache._modules.clear()


# ----------------------------------------------------------------------------------------- unsafe cache dirs
def _plant(cache):
    """A valid object + checksum and a valid tuning result, as someone else could have written them."""
    (cache / "kernels").mkdir(parents=True, mode=0o700)
    compile_cache.kernel_path(KEY).write_bytes(OBJ)
    compile_cache.checksum_path(KEY).write_text(hashlib.sha256(OBJ).hexdigest())
    _write(cache / "autotune.json", {"k": _entry()})


@pytest.mark.parametrize("how", ["group-writable", "world-writable", "kernels-world-writable", "other-owner"])
def test_a_cache_dir_others_can_write_is_refused(cache, fake_runtime, monkeypatch, how):
    _plant(cache)
    if how == "group-writable":
        cache.chmod(0o770)
    elif how == "world-writable":
        cache.chmod(0o777)
    elif how == "kernels-world-writable":
        (cache / "kernels").chmod(0o777)
    else:
        monkeypatch.setattr(store_mod, "_euid", lambda: os.geteuid() + 4242)
    with Recorder() as r:
        assert compile_cache.load(KEY) is None  # nothing planted there is linked into the process
        assert compile_cache.save("cd" * 32, FakeFn(OBJ)) is False
        if how != "kernels-world-writable":
            assert at.store.get("k") is None
        assert at.store.put("mine", _entry()) is (how == "kernels-world-writable")
        assert at.store.get("mine") == _entry()  # kept in memory
        at.clear()  # leaves the refused dir alone
    assert fake_runtime == [] and not compile_cache.kernel_path("cd" * 32).exists()
    assert compile_cache.kernel_path(KEY).exists()
    assert len(r.cache) == 1 and "not using the cache dir" in r.cache[0], r.cache


def test_the_cache_dir_is_created_private(cache, fake_runtime):
    old = os.umask(0o002)
    try:
        assert compile_cache.save(KEY, FakeFn(OBJ)) and at.store.put("k", _entry())
    finally:
        os.umask(old)
    for d in (cache, cache / "kernels"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE(compile_cache.kernel_path(KEY).stat().st_mode) == 0o600
    assert compile_cache.load(KEY) == "fn"


def test_lock_files_do_not_follow_symlinks(cache, tmp_path):
    cache.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    (cache / "autotune.json.lock").symlink_to(victim)
    with Recorder() as r:
        assert at.store.put("k", _entry()) is False
        assert at.store.get("k") == _entry()  # kept in memory
    assert not victim.exists() and len(r.cache) == 1, r.cache
    victim.write_text("precious")
    with Recorder():
        at.store.put("k2", _entry())
        at.clear()
    assert victim.read_text() == "precious"


def test_autotune_off_still_touches_nothing(cache, monkeypatch):
    monkeypatch.setenv("CODA_AUTOTUNE", "0")
    assert at.select_config(_prob(), IDENTITY, None, None, {}) == default_config(8192, 8192, 8192)
    assert not cache.exists()
