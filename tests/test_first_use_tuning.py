"""First use without a stall (issue 31), on the CPU: the default path never tunes (store > shipped > heuristic),
the shipped per-GPU files (schema, provenance, nearest-bucket rule, made by the converter from real tuning runs,
every entry compiles for sm_90a), the model-step recorder and the CLI (--model with fakes, --show, --ship-from),
and the per-process summary."""
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import coda.autotune as at
from coda._validate import check_gemm_args
from coda.autotune import keys, model, ship, space, tuner
from coda.autotune.__main__ import main as cli_main
from coda.config import GemmConfig, default_config
from coda.kernels.epilogue import IDENTITY

ROOT = pathlib.Path(__file__).resolve().parents[1]
BF16 = torch.bfloat16
H100 = keys.DeviceInfo("NVIDIA H100 80GB HBM3", 132, "sm_90a")
SHIPPED = ROOT / "autotune" / "shipped" / "h100_sxm.json"
TUNED = GemmConfig(tile_m=128, tile_n=128, cluster_m=2, cluster_n=1, pingpong=True)
LM_HEAD = (8192, 128256, 4096)  # a shape of the shipped H100 file (docs/tune_h100/tuned_gemm.json)


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    """The default mode (CODA_AUTOTUNE unset), an empty tuning store, an H100 as the device, clean memory."""
    monkeypatch.delenv("CODA_AUTOTUNE", raising=False)
    monkeypatch.delenv("CODA_AUTOTUNE_SUMMARY", raising=False)
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(keys, "device_info", lambda device=None: H100)
    for d in (at._memory, at._served, at._usage):
        d.clear()
    yield
    for d in (at._memory, at._served, at._usage):
        d.clear()


def _prob(M, N, K, dtype=BF16):
    return check_gemm_args(torch.empty(M, K, dtype=dtype), torch.empty(N, K, dtype=dtype))


def _no_tuning(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the default path must never tune")
    monkeypatch.setattr(tuner, "tune", boom)


def _fake_tune(monkeypatch, calls, best=TUNED):
    def fake(a, b, epi, out_dtype, operands, **kw):
        calls.append((tuple(a.shape), tuple(b.shape), epi.name, dict(kw)))
        return tuner.TuneResult(best=best, best_ms=1.0, default=GemmConfig(), default_ms=1.1, rows=[], pruned=[],
                                seconds=0.1, flop=1, level=kw.get("level", "quick"))
    monkeypatch.setattr(tuner, "tune", fake)
    return fake


def _shipped_cfg():
    doc = json.loads(SHIPPED.read_text())
    e = next(e for e in doc["entries"].values()
             if (e["problem"]["M"], e["problem"]["N"], e["problem"]["K"]) == LM_HEAD
             and e["epilogue"]["ref"] == "identity")
    return space.config_from_dict(e["config"]), e


# ------------------------------------------------------------------------------------------------ modes
def test_default_mode_never_tunes_and_uses_shipped_or_heuristic(monkeypatch):
    _no_tuning(monkeypatch)
    assert at.mode() == "default"
    cfg, e = _shipped_cfg()
    assert cfg != at.heuristic(_prob(*LM_HEAD))  # the shipped entry is not what the heuristic says
    t0 = time.perf_counter()
    assert at.select_config(_prob(*LM_HEAD), IDENTITY, "a", "b", {}) == cfg
    assert at.select_config(_prob(4096, 128256, 4096), IDENTITY, "a", "b", {}) == cfg  # nearest bucket (M 8192)
    other = _prob(8192, 3072, 2048)  # no shipped entry: the heuristic, instantly
    assert at.select_config(other, IDENTITY, "a", "b", {}) == default_config(8192, 3072, 2048)
    assert time.perf_counter() - t0 < 5
    assert at.store.load() == {}  # nothing tuned, nothing written


def test_autotune_1_tunes_on_a_miss_and_0_touches_nothing(monkeypatch):
    calls = []
    _fake_tune(monkeypatch, calls)
    monkeypatch.setenv("CODA_AUTOTUNE", "1")
    prob = _prob(*LM_HEAD)
    assert at.mode() == "tune"
    assert at.select_config(prob, IDENTITY, torch.empty(1), torch.empty(1), {}) == TUNED and len(calls) == 1
    entry = at.store.get(at.key_for(prob, IDENTITY))
    assert entry["problem"]["N"] == 128256 and entry["epilogue"]["ref"] == "identity"  # shippable later
    monkeypatch.setenv("CODA_AUTOTUNE", "0")

    def boom(*a, **k):
        raise AssertionError("CODA_AUTOTUNE=0: no store or shipped lookups")
    monkeypatch.setattr(keys, "device_info", boom)
    monkeypatch.setattr(at.store, "get", boom)
    import coda.runtime.shipped
    monkeypatch.setattr(coda.runtime.shipped, "lookup", boom)  # where coda.runtime.select looks entries up
    assert at.select_config(prob, IDENTITY, None, None, {}) == default_config(*LM_HEAD)


def test_precedence_store_then_shipped_then_heuristic(monkeypatch):
    _no_tuning(monkeypatch)
    prob = _prob(*LM_HEAD)
    shipped, _ = _shipped_cfg()
    at.store.put(at.key_for(prob, IDENTITY), {"config": space.config_to_dict(TUNED), "name": TUNED.name})
    assert at.select_config(prob, IDENTITY, None, None, {}) == TUNED  # the user's store first
    at.clear(kernels=False)
    assert at.select_config(prob, IDENTITY, None, None, {}) == shipped  # then the shipped file
    at.clear(kernels=False)
    monkeypatch.setattr(keys, "device_info", lambda device=None: keys.DeviceInfo("NVIDIA H200", 132, "sm_90a"))
    assert at.select_config(prob, IDENTITY, None, None, {}) == at.heuristic(prob)  # no file for this GPU
    assert at.counts() == {"tuned": 0, "shipped": 0, "heuristic": 1}


def test_an_entry_equal_to_its_old_default_yields_to_todays_heuristic(monkeypatch):
    """Rows where the tuner found nothing better than the heuristic of then: today's (changed) heuristic decides."""
    _no_tuning(monkeypatch)
    doc = json.loads(SHIPPED.read_text())
    same = [e for e in doc["entries"].values() if e["name"] == e["default"] and " row " in e["source"]]
    assert same, "the H100 file has rows (session 4's tables) where the old default won"
    p = same[0]["problem"]
    prob = _prob(p["M"], p["N"], p["K"])
    assert at.heuristic(prob).name != same[0]["default"]  # the heuristic has changed since (dynamic schedule)
    assert at.shipped(prob, ship.resolve_ref(same[0]["epilogue"]["ref"])) is None


# ------------------------------------------------------------------------------------------------ nearest bucket
def _write_file(tmp_path, ms=(2048, 8192, 16384), N=4096, K=4096, name="NVIDIA H100 80GB HBM3", dsl=None):
    entries = {}
    for i, M in enumerate(ms):
        cfg = GemmConfig(tile_m=128, tile_n=128 + 0 * i, raster="n" if i % 2 else "m", swizzle=1 << i)
        k, e = ship.make_entry(cfg, M, N, K, 1, "bfloat16", "bfloat16", "k", "k", "identity",
                               ship.epilogue_id(IDENTITY), "identity", "test", ms=1.0, default="x")
        entries[k] = e
    src = [{"file": "test", "date": "2026-11-26"}]
    doc = ship.build_doc((name, 132, "sm_90a", dsl or keys.cutlass_dsl_version()), entries, src, [])
    d = tmp_path / "shipped"
    d.mkdir(parents=True, exist_ok=True)
    (d / ship.file_name(name)).write_text(json.dumps(doc))
    return d


def test_nearest_bucket_rule(tmp_path):
    d = _write_file(tmp_path)
    eid = ship.epilogue_id(IDENTITY)

    def pick(M, N=4096, K=4096, epi=eid, dt="bfloat16", layout=("k", "k"), L=1, dev=H100):
        hit = ship.lookup(dev, dt, "bfloat16", *layout, M, N, K, L, epi, directory=d)
        return hit and hit[0]["problem"]["M"]
    assert pick(8192) == 8192 and pick(2048) == 2048 and pick(16384) == 16384
    assert pick(6000) == 8192 and pick(3000) == 2048  # nearest in log2: 12.55 -> 13, 11.55 -> 11
    assert pick(4096) == 8192  # a tie (2048 and 8192 are both 1 octave away) goes to the larger M
    assert pick(12000) == 16384 and pick(600) == 2048  # 600: within 4x of 2048
    assert pick(500) is None and pick(70000) is None  # more than 4x from every entry: the heuristic
    assert pick(8192, N=4097) is None and pick(8192, K=2048) is None  # N and K must be equal
    assert pick(8192, epi="0" * 16) is None  # another epilogue
    assert pick(8192, dt="float16") is None and pick(8192, layout=("mn", "k")) is None
    assert pick(8192, L=4) is None
    assert pick(8192, dev=keys.DeviceInfo("NVIDIA H100 80GB HBM3", 114, "sm_90a")) is None  # another SM count


def test_cutlass_dsl_version_rule(tmp_path):
    v = keys.cutlass_dsl_version()
    major, minor = v.split(".")[:2]
    for dsl, found in ((v, True), (f"{major}.{minor}.99", True), (f"{major}.{int(minor) + 1}.0", False)):
        d = _write_file(tmp_path / dsl, dsl=dsl)
        assert bool(ship.files_for(H100, directory=d)) is found, dsl


# ------------------------------------------------------------------------------------------------ the shipped file
def test_shipped_h100_file_schema_and_provenance():
    doc = json.loads(SHIPPED.read_text())
    assert ship.doc_problems(doc) == []
    assert doc["gpu"] == {"name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "arch": "sm_90a"}
    assert doc["cutlass_dsl"] == "4.8.1"
    prov = doc["provenance"]
    assert "H100" in prov["gpu"] and prov["converted"] and "converter" in prov
    files = {s["file"] for s in prov["sources"]}
    store = "docs/tune_h100/llama1b_near_store.json"  # session 21: the llama-1b step's problems, near level
    store25 = "docs/tune_h100/llama1b_near_store_s25.json"  # session 25: the step's new or changed problems
    store28 = "docs/tune_h100/llama1b_l2_prefetch_s28.json"  # session 28: l2_prefetch on the MLP dX, measured
    store30 = "docs/tune_h100/llama1b_epi_wg_s30.json"  # session 30: two problems in the epilogue warps, measured
    store31 = "docs/tune_h100/llama1b_sumsq_s31.json"  # session 31: the down projection emitting the sum of squares
    store32 = "docs/tune_h100/llama1b_s32.json"  # session 32: the O projection's norm link, the QKV dX unfolded
    store34 = "docs/tune_h100/llama1b_s34.json"  # session 34: the O projection and QKV forwards, quick level
    store37 = "docs/tune_h100/llama1b_lmhead_dx_s37.json"  # session 37: the one-chunk LM head dX (coda.optim)
    store39 = "docs/tune_h100/llama8b4l_near_s39.json"  # session 39: the llama-8b-4l step's problems, near level
    store46 = "docs/tune_h100/qwen3_8b_2l_near_s46.json"  # session 46: the qwen3-8b-2l step's problems, near level
    store46b = "docs/tune_h100/llama70b_tp8_2l_near_s46.json"  # session 46: a 70B TP8 rank's step, partly tuned
    store46c = "docs/tune_h100/qwen25_7b_2l_near_s46.json"  # session 46: the qwen2.5-7b-2l step, partly tuned
    store51 = "docs/tune_h100/llama1b_heuristic_near_s51.json"  # session 51: the llama-1b step's heuristic-served
    store52 = "docs/tune_h100/llama1b_s51.json"  # session 52: store51 + the CE's exp forward (s51_call2.sh)
    stores = (store, store25, store28, store30, store31, store32, store34, store37, store39, store46, store46b,
              store46c, store51, store52)
    dates = {store: "2026-11-26", store25: "2026-11-26", store28: "2026-11-27", store30: "2026-11-27",
             store31: "2026-11-27", store32: "2026-11-27", store34: "2026-11-27", store37: "2026-11-28",
             store39: "2026-11-28", store46: "2026-12-07", store46b: "2026-12-07", store46c: "2026-12-07",
             store51: "2026-12-07", store52: "2026-12-08"}
    assert files == {"docs/tune_h100/tuned_gemm.json", "docs/tune_h100/tuned_fused.json", *stores}
    rows = {}
    for s in prov["sources"]:
        raw = (ROOT / s["file"]).read_bytes()
        import hashlib
        assert hashlib.sha256(raw).hexdigest()[:16] == s["sha256"]
        assert s["date"] == dates.get(s["file"], "2026-11-21")
        rows[s["file"]] = json.loads(raw)
    assert doc["entries"]
    for e in doc["entries"].values():  # every entry is a row of a real tuning run or a tuning store's entry
        src = next((f for f in stores if e["source"].startswith(f + " ")), None)
        if src is not None:
            kept = [v for v in rows[src]["entries"].values() if v["problem"] == e["problem"]
                    and v["epilogue"]["id"] == e["epilogue"]["id"]]
            level = {store28: {"l2_prefetch"}, store30: {"epi_wg", "near"}, store34: {"quick"}}.get(src, {"near"})
            assert len(kept) == 1 and kept[0]["name"] == e["name"] and kept[0]["level"] in level, e
            continue
        f, i = e["source"].rsplit(" row ", 1)
        row = rows[f][int(i)]
        assert row["shape"] == [e["problem"]["M"], e["problem"]["N"], e["problem"]["K"]]
        assert e["name"] in (row["tuned"], row["default"]) and e["default"] == row["default"]
        assert ship.resolve_ref(e["epilogue"]["ref"]).name == row["epilogue"]
    # session 30's five: four replace near-level entries, one is the CE logits epilogue's new id; session 31's one
    # is a new epilogue id, session 32's two as well; session 34's two replace a session 21 and a session 32 entry;
    # session 37's one is a new problem; session 39's nine are new problems (the llama-8b-4l step's; its logits
    # entry, 128 x 192 ping-pong, is dropped: it spills), and two of session 21's are dropped as stale (their
    # epilogue ids match no epilogue of this version); session 46's eight are the qwen3-8b-2l step's problems with
    # a main loop, four of a 70B TP8 rank's step and five of qwen2.5-7b-2l's (both tuned in part: the call's time
    # limit); session 51 ships K = 0 passes (keyed by K = 0 exactly): session 46's 7 + 3 + 5 and session 51's seven
    # (six K = 0 passes of the llama-1b step and the LM head's dX); session 52's store holds those seven again (it
    # was seeded with them: its entries win) and the CE's exp-stored forward
    assert sum(e["source"].startswith(stores) for e in doc["entries"].values()) == \
        13 + 4 + 1 + 1 + 2 + 1 + 9 + 8 + 4 + 5 + 7 + 3 + 5 + 0 + 8
    assert sum("xK0xL" in k for k in doc["entries"]) == 21
    assert 'shipped/*.json' in (ROOT / "pyproject.toml").read_text()


def test_shipped_h200_file_is_the_converted_tuning_store(tmp_path):
    """The H200 file: the converter's output for its sources, the near-level tuning stores of the llama-1b step's
    problems (session 30) and of the llama-8b-4l step's (session 42: 12 of its 15 problems, the run hit its time
    limit) on an H200, their K = 0 passes included (shippable since session 51)."""
    path = SHIPPED.with_name("h200.json")
    doc = json.loads(path.read_text())
    assert ship.doc_problems(doc) == []
    assert doc["gpu"] == {"name": "NVIDIA H200", "sm_count": 132, "arch": "sm_90a"} and doc["cutlass_dsl"] == "4.8.1"
    srcs = doc["provenance"]["sources"]
    assert [s["file"] for s in srcs] == ["docs/tune_h200/llama1b_near_store_s30.json",
                                         "docs/tune_h200/llama8b4l_near_s42.json"]
    import hashlib
    for src in srcs:
        assert hashlib.sha256((ROOT / src["file"]).read_bytes()).hexdigest()[:16] == src["sha256"]
    assert doc["provenance"]["skipped"] == []
    assert len(doc["entries"]) == 18 + 7 + 12 and all(e["level"] == "near" for e in doc["entries"].values())
    assert sum("xK0xL" in k for k in doc["entries"]) == 12
    assert sum(e["problem"]["K"] == 128256 or e["problem"]["N"] == 128256 and e["problem"]["K"] == 4096
               for e in doc["entries"].values()) == 2  # the 8B LM head's logits and dX GEMMs
    rc = cli_main([*sum((["--ship-from", str(ROOT / s["file"])] for s in srcs), []), "--ship-dir", str(tmp_path),
                   "--note", "x"])
    assert rc == 0 and json.loads((tmp_path / "h200.json").read_text())["entries"] == doc["entries"]


def test_the_converter_makes_the_shipped_file(tmp_path):
    """The shipped file is the converter's output for its sources and its recorded drops (not edited by hand)."""
    doc = json.loads(SHIPPED.read_text())
    srcs = [str(ROOT / s["file"]) for s in doc["provenance"]["sources"]]
    drops = [x for x in doc["provenance"]["skipped"] if x.get("dropped")]
    assert drops and all(x["why"] for x in drops)  # session 39: a spilling logits config, measured, not shipped
    rc = cli_main([*sum((["--ship-from", s] for s in srcs), []), "--gpu", doc["gpu"]["name"], "--sm-count", "132",
                   "--cutlass-dsl", doc["cutlass_dsl"], "--ship-dir", str(tmp_path), "--note", "x",
                   *sum((["--drop", f"{x['key']}={x['why']}"] for x in drops), [])])
    assert rc == 0
    new = json.loads((tmp_path / "h100_sxm.json").read_text())
    assert new["entries"] == doc["entries"]
    assert new["provenance"]["sources"] == doc["provenance"]["sources"]
    assert [x for x in new["provenance"]["skipped"] if x.get("dropped")] == drops
    assert not set(new["entries"]) & {x["key"] for x in drops}
    # a merge into the file keeps its drops: converting one source again does not bring a dropped entry back
    # (its K = 0 passes' entries also come from later sources' runs of the same problems: the merged source wins)
    rc = cli_main(["--ship-from", str(ROOT / "docs/tune_h100/llama8b4l_near_s39.json"), "--ship-dir", str(tmp_path)])
    again = json.loads((tmp_path / "h100_sxm.json").read_text())
    assert rc == 0 and set(again["entries"]) == set(doc["entries"])
    assert all(v == doc["entries"][k] for k, v in again["entries"].items() if "xK0xL" not in k)
    assert cli_main(["--ship-from", srcs[-1], "--ship-dir", str(tmp_path), "--drop", "no-reason"]) == 2
    assert cli_main(["--ship-from", srcs[0], "--ship-dir", str(tmp_path)]) == 2  # rows need --gpu ...


def test_a_tuning_store_converts_into_a_shipped_file(tmp_path, monkeypatch):
    calls = []
    _fake_tune(monkeypatch, calls)
    monkeypatch.setenv("CODA_AUTOTUNE", "1")
    prob = _prob(8192, 2048, 2048)
    at.select_config(prob, IDENTITY, torch.empty(1), torch.empty(1), {})
    at.store.put("junk|key", {"config": space.config_to_dict(TUNED)})  # no problem / epilogue recorded: skipped
    written = ship.ship_from([str(at.store.path)], out_dir=tmp_path)
    assert [p.name for p in written] == ["h100_sxm.json"]
    doc = json.loads(written[0].read_text())
    assert len(doc["entries"]) == 1 and doc["provenance"]["skipped"]
    hit = ship.lookup(H100, BF16, BF16, "k", "k", 8192, 2048, 2048, 1, ship.epilogue_id(IDENTITY), directory=tmp_path)
    assert hit and space.config_from_dict(hit[0]["config"]) == TUNED


def test_config_names_round_trip():
    kept, _ = space.prune()
    for cfg in kept:
        if cfg.epi_n == GemmConfig.epi_n:
            assert ship.config_from_name(cfg.name) == cfg
    with pytest.raises(ValueError):
        ship.config_from_name("128x256_bogus")


def _library_epilogues_by_id() -> dict:
    """{epilogue id: epilogue} of what the library's ops build: the module-level epilogues of coda.ops and
    coda.epilogues, and the generated ones the fused ops make (the sum-of-squares residual adds, the fast CE's
    logits epilogues and its exp-stored forward, the SwiGLU forward with its pre-activation and its backward on da)."""
    import importlib
    import pkgutil

    import coda.ops
    from coda.autodiff import with_preact
    from coda.dsl import DslEpilogue
    from coda.epilogues.cross_entropy import ce_forward_exp, ce_forward_logits
    mlp = importlib.import_module("coda.ops.mlp")
    found = [v for _, v in ship._library_epilogues() if isinstance(v, DslEpilogue)]  # coda.epilogues' own
    for m in pkgutil.iter_modules(coda.ops.__path__):
        found += [v for v in vars(importlib.import_module(f"coda.ops.{m.name}")).values() if isinstance(v, DslEpilogue)]
    for dt in (torch.bfloat16, torch.float16):
        for flag in (False, True):
            found += [mlp.residual_add_sumsq(dt, flag), *(ce_forward_logits(dt, flag, cap) for cap in (False, True))]
    found += [ce_forward_exp(dt) for dt in (torch.bfloat16, torch.float16)]
    found += [with_preact(mlp.rms_swiglu), *(mlp.dacc_on_da((("out",), r, False)) for r in ((), ("r",)))]
    return {ship.epilogue_id(e): e for e in found}


@pytest.mark.slow
def test_every_shipped_entry_compiles_clean_for_sm90a(monkeypatch):
    """Every shipped entry's epilogue is one the library builds (a stale id is an entry no call can look up), and
    its config compiles for sm_90a with that epilogue without spills (session 39: a tuned logits config that spilled
    was shipped because ref-less epilogues were compiled as the identity here)."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    from coda.check import compile_variant
    library = _library_epilogues_by_id()
    failed, done = [], {}
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    for path in sorted(ship.SHIPPED_DIR.glob("*.json")):
        doc = json.loads(path.read_text())
        assert ship.doc_problems(doc) == [], path
        for k, e in doc["entries"].items():
            p, ref = e["problem"], e["epilogue"]["ref"]
            epi = ship.resolve_ref(ref) if ref else library.get(e["epilogue"]["id"])
            if epi is None:
                failed.append((path.name, k, "stale: no epilogue of the library has this id"))
                continue
            what = (e["name"], str(e["config"]), ship.epilogue_id(epi), p["in_dtype"], p["out_dtype"], p["a_major"],
                    p["b_major"])
            if what not in done:
                done[what] = compile_variant(space.config_from_dict(e["config"]), epi, short[p["in_dtype"]],
                                             short[p["out_dtype"]], arch=doc["gpu"]["arch"],
                                             majors=(p["a_major"], p["b_major"]))
            row = done[what]
            if not row["ok"] or row.get("spill_bytes"):
                failed.append((path.name, k, row["error"] or f"{row['spill_bytes']} bytes of spills"))
    assert not failed, failed


# ------------------------------------------------------------------------------------------------ the recorder
def test_recorder_collects_each_problem_once_and_nothing_is_tuned(monkeypatch):
    from coda.epilogues.rmsnorm import rmsnorm_scale
    _no_tuning(monkeypatch)
    monkeypatch.setenv("CODA_AUTOTUNE", "1")  # even when tuning is on, a recording step does not tune
    a, b = torch.empty(8192, 4096, dtype=BF16), torch.empty(128256, 4096, dtype=BF16)
    r = torch.empty(8192)
    with model.Recorder() as rec:
        for _ in range(3):
            at.select_config(check_gemm_args(a, b), IDENTITY, a, b, {})
        at.select_config(check_gemm_args(a, b[:2048]), rmsnorm_scale, a, b[:2048], {"r": r})
        wt = torch.empty(4096, 2048, dtype=BF16).t()  # an MN-major weight
        at.select_config(check_gemm_args(a, wt), IDENTITY, a, wt, {})
    probs = rec.problems
    assert [(p.prob.M, p.prob.N, p.epi.name, p.calls) for p in probs] == [
        (8192, 128256, "identity", 3), (8192, 2048, "rmsnorm_scale", 1), (8192, 2048, "identity", 1)]
    assert probs[0].source == "shipped" and probs[1].source == "heuristic"
    assert probs[1].operands == {"r": ("tensor", (8192,), (1,), torch.float32)}
    assert probs[2].prob.b_major == "mn" and probs[2].b == ((2048, 4096), (1, 2048), BF16)
    assert not at._recorders  # removed on exit


def test_tune_recorded_tunes_each_problem_behind_one_bar_and_stores_it(monkeypatch, capsys):
    from coda.epilogues.rmsnorm import rmsnorm_scale
    a, b, wt = torch.empty(8192, 4096, dtype=BF16), torch.empty(2048, 4096, dtype=BF16), \
        torch.empty(4096, 2048, dtype=BF16).t()
    with model.Recorder() as rec:
        at.select_config(check_gemm_args(a, b), rmsnorm_scale, a, b, {"r": torch.empty(8192)})
        at.select_config(check_gemm_args(a, wt), IDENTITY, a, wt, {})
    calls = []
    _fake_tune(monkeypatch, calls)
    import io
    stream = io.StringIO()
    rows = model.tune_recorded(rec.problems, stream=stream, desc="coda.autotune test")
    assert [c[:3] for c in calls] == [((8192, 4096), (2048, 4096), "rmsnorm_scale"),
                                      ((8192, 4096), (2048, 4096), "identity")]
    assert all(res is not None for _, res, _ in rows)
    for r in rec.problems:
        e = at.store.get(at.key_for(r.prob, r.epi))
        assert e["name"] == TUNED.name and e["problem"]["b_major"] == r.prob.b_major
    assert "coda.autotune test" in stream.getvalue() and "2/2" in stream.getvalue()
    again = model.tune_recorded(rec.problems, stream=stream)  # the store has them now
    assert len(calls) == 2 and all(s == "in the store already" for _, _, s in again)
    at._memory.clear()
    at._served.clear()
    assert at.select_config(rec.problems[1].prob, IDENTITY, None, None, {}) == TUNED  # the default path uses it


def test_a_problem_no_config_could_time_says_why():
    """tune_recorded's status names the first failure (session 51: the exp-stored CE forward's 'no config could
    be timed' came without a reason)."""
    a, w = torch.empty(64, 4096, dtype=BF16), torch.empty(2048, 4096, dtype=BF16)
    rec = model.Recorder()
    rec.add(check_gemm_args(a, w), IDENTITY, GemmConfig(), "heuristic", a, w, {})
    rows = [tuner.Row(GemmConfig(), status="ok"), tuner.Row(TUNED, status="mismatch: 12 elements (first: inf)")]

    def fake(*_, **__):
        return tuner.TuneResult(best=GemmConfig(), best_ms=None, default=GemmConfig(), default_ms=None, rows=rows,
                                pruned=[], seconds=0.1, flop=1, level="near")
    import io
    out = model.tune_recorded(rec.problems, stream=io.StringIO(), tune_fn=fake)
    assert out[0][2] == "no config could be timed (mismatch: 12 elements (first: inf))"
    assert at.store.load() == {}


def test_inputs_for_keeps_the_recorded_layouts():
    wt = torch.empty(4096, 2048, dtype=BF16).t()
    a = torch.empty(64, 4096, dtype=BF16)
    rec = model.Recorder()
    rec.add(check_gemm_args(a, wt), IDENTITY, GemmConfig(), "heuristic", a, wt, {})
    x, w, ops = model.inputs_for(rec.problems[0])
    assert w.stride() == wt.stride() and x.shape == a.shape and ops == {}
    assert check_gemm_args(x, w).b_major == "mn"


# ------------------------------------------------------------------------------------------------ the CLI
def test_cli_model_argument_handling(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        cli_main(["--model", "llama-99b"])
    assert "unknown preset" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["--model", "llama-1b", "--batch", "0"])
    import coda._device
    monkeypatch.setattr(coda._device, "hopper_available", lambda: False)
    assert cli_main(["--model", "llama-1b"]) == 2
    assert "needs a Hopper" in capsys.readouterr().err


def test_cli_model_records_a_step_then_tunes_every_problem(monkeypatch, capsys):
    import coda._device
    from coda.epilogues.rmsnorm import rmsnorm_scale
    monkeypatch.setattr(coda._device, "hopper_available", lambda: True)
    seen = {}

    def fake_step(preset, batch, seq, dtype="bfloat16", optimizer="adamw", compile=False,
                  prefill=False):  # the fused step's stand-in
        seen.update(preset=preset, batch=batch, seq=seq, dtype=dtype, optimizer=optimizer, compile=compile,
                    prefill=prefill)
        a, b = torch.empty(batch * seq, 2048, dtype=BF16), torch.empty(8192, 2048, dtype=BF16)
        with model.Recorder() as rec:
            at.select_config(check_gemm_args(a, b), IDENTITY, a, b, {})
            at.select_config(check_gemm_args(a, b), rmsnorm_scale, a, b, {"r": torch.empty(batch * seq)})
        return rec.problems
    monkeypatch.setattr(model, "record_model_step", fake_step)
    calls = []
    _fake_tune(monkeypatch, calls)
    assert cli_main(["--model", "llama-1b", "--batch", "2", "--seq", "4096", "--level", "full"]) == 0
    assert seen == {"preset": "llama-1b", "batch": 2, "seq": 4096, "dtype": "bfloat16", "optimizer": "coda-adamw",
                    "compile": False, "prefill": False}
    assert len(calls) == 2 and all(c[3]["level"] == "full" for c in calls)
    out = capsys.readouterr()
    assert "8192x8192x2048 identity" in out.out and "results stored in" in out.out
    assert "2 GEMM problems" in out.err
    assert len(at.store.load()) == 2
    # --source: the second recording finds both problems in the store ("tuned"), none left to the heuristic
    assert cli_main(["--model", "llama-1b", "--source", "heuristic"]) == 0 and len(calls) == 2
    assert "0 GEMM problems" in capsys.readouterr().err
    assert cli_main(["--model", "llama-1b", "--source", "tuned,shipped", "--retune"]) == 0 and len(calls) == 4
    # --compile: the step of torch.compile(model) is recorded (the fused+compile mode's problems)
    assert cli_main(["--model", "llama-1b", "--compile", "--source", "heuristic"]) == 0 and seen["compile"] is True
    assert "(torch.compile)" in capsys.readouterr().err
    # --prefill: the inference forward is recorded instead of the training step
    assert cli_main(["--model", "llama-1b", "--prefill", "--batch", "4", "--source", "heuristic"]) == 0
    assert seen["prefill"] is True and seen["batch"] == 4 and "prefill forward" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--source takes"):
        cli_main(["--model", "llama-1b", "--source", "guessed"])


def test_cli_show_lists_store_and_shipped_entries(monkeypatch, capsys):
    at.store.put(at.key_for(_prob(8192, 2048, 2048), IDENTITY),
                 {"config": space.config_to_dict(TUNED), "name": TUNED.name, "ms": 0.5, "default": "d"})
    assert cli_main(["--show", "--gpu", "NVIDIA H100 80GB HBM3"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(ln.startswith("store") and TUNED.name in ln and "8192x2048x2048" in ln for ln in lines), out
    n_shipped = len(json.loads(SHIPPED.read_text())["entries"])
    assert sum(ln.startswith("shipped:h100_sxm.json") for ln in lines) == n_shipped
    assert "8192x128256x4096" in out
    assert cli_main(["--show", "--gpu", "NVIDIA H200"]) == 0
    lines = capsys.readouterr().out.splitlines()
    n_h200 = len(json.loads(SHIPPED.with_name("h200.json").read_text())["entries"])
    assert sum(ln.startswith("shipped:h200.json") for ln in lines) == n_h200
    assert cli_main(["--show", "--gpu", "NVIDIA H100 PCIe"]) == 0  # no file for this GPU
    assert "(no entries)" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ the summary
def test_summary_counts_distinct_shapes_by_source(monkeypatch):
    _no_tuning(monkeypatch)
    prob = _prob(8192, 2048, 2048)
    at.store.put(at.key_for(prob, IDENTITY), {"config": space.config_to_dict(TUNED), "name": TUNED.name})
    for _ in range(2):
        at.select_config(prob, IDENTITY, None, None, {})  # tuned (the store)
        at.select_config(_prob(*LM_HEAD), IDENTITY, None, None, {})  # shipped
        at.select_config(_prob(4096, 4096, 512), IDENTITY, None, None, {})  # heuristic
        at.select_config(_prob(4096, 1024, 512), IDENTITY, None, None, {})  # heuristic
    assert at.counts() == {"tuned": 1, "shipped": 1, "heuristic": 2}
    line = at.summary()
    assert line.startswith("coda.autotune: 4 GEMM shapes: 1 tuned, 1 shipped, 2 heuristic")
    assert "python -m coda.autotune --model" in line and "\n" not in line
    # which problems the heuristic served (session 52's compiled step said "2 heuristic" and no more)
    assert line.endswith("; heuristic: 4096x4096x512 k/k identity, 4096x1024x512 k/k identity")
    assert at.heuristic_problems() == ["4096x4096x512 k/k identity", "4096x1024x512 k/k identity"]


def test_k0_passes_use_the_store_and_shipped_configs_and_never_tune(monkeypatch, tmp_path):
    """An epilogue-only pass (K = 0, e.g. the norms' row scaling) takes a tuned or shipped config like any GEMM
    (session 51: they were always the heuristic's, and counted as such); K = 0 keys a shipped entry exactly."""
    from coda.epilogues.rmsnorm import rmsnorm_scale
    _no_tuning(monkeypatch)
    prob = _prob(8192, 2048, 0)
    assert prob.zero_k
    at.store.put(at.key_for(prob, rmsnorm_scale), {"config": space.config_to_dict(TUNED), "name": TUNED.name})
    monkeypatch.setenv("CODA_AUTOTUNE", "1")  # too small to tune: the default chain, the store first
    assert at.select_config(prob, rmsnorm_scale, None, None, {}) == TUNED
    assert at.counts() == {"tuned": 1, "shipped": 0, "heuristic": 0}
    other = _prob(4096, 1024, 0)  # nothing stored or shipped: the heuristic, and the tuner is never called
    assert at.select_config(other, rmsnorm_scale, None, None, {}) == at.heuristic(other)
    assert at.counts() == {"tuned": 1, "shipped": 0, "heuristic": 1}
    d = _write_file(tmp_path, ms=(8192,), N=2048, K=0)
    (k, e), = json.loads((d / ship.file_name(H100.name)).read_text())["entries"].items()
    assert ship.entry_problem(k, e) is None
    assert ship.entry_problem(k, {**e, "problem": {**e["problem"], "K": -1}}) is not None
    assert ship.entry_problem(k, {**e, "problem": {**e["problem"], "N": 0}}) is not None
    eid = ship.epilogue_id(IDENTITY)
    assert ship.lookup(H100, BF16, BF16, "k", "k", 8192, 2048, 0, 1, eid, directory=d)[0]["config"] == e["config"]
    assert ship.lookup(H100, BF16, BF16, "k", "k", 8192, 2048, 64, 1, eid, directory=d) is None


def test_inputs_for_gives_an_accumulator_of_unit_scale():
    """The model tuner's random a, b have std K^-1/4: acc ~ N(0, 1), so that exp-type epilogues (the CE's
    exp-stored forward) do not overflow for every config (session 51's 'no config could be timed')."""
    a, w = torch.empty(256, 4096, dtype=BF16), torch.empty(512, 4096, dtype=BF16)
    rec = model.Recorder()
    rec.add(check_gemm_args(a, w), IDENTITY, GemmConfig(), "heuristic", a, w, {})
    x, y = (t.float() for t in model.inputs_for(rec.problems[0])[:2])
    acc = x @ y.t()
    assert 0.8 < float(acc.std()) < 1.25 and 0.08 < float(x.std()) < 0.16


def _fresh(code, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("CODA_AUTOTUNE")}
    e.update(PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e, capture_output=True, text=True,
                          timeout=300, cwd=ROOT / "tests")


SUMMARY_SCRIPT = """
    import torch
    import coda.autotune as at
    from coda._validate import check_gemm_args
    from coda.kernels.epilogue import IDENTITY
    at.keys.device_info = lambda device=None: at.keys.DeviceInfo("Fake", 132, "sm_90a")
    p = check_gemm_args(torch.empty(64, 64, dtype=torch.bfloat16), torch.empty(64, 64, dtype=torch.bfloat16))
    at.select_config(p, IDENTITY, None, None, {})
    print("done")
"""


def test_summary_is_printed_once_at_exit_only_when_asked_or_guessed_on_a_gpu(tmp_path):
    loud = _fresh(SUMMARY_SCRIPT, CODA_AUTOTUNE_SUMMARY="1", CODA_CACHE_DIR=str(tmp_path))
    assert loud.returncode == 0, loud.stderr
    assert loud.stderr.count("coda.autotune: 1 GEMM shape: 0 tuned, 0 shipped, 1 heuristic") == 1, loud.stderr
    quiet = _fresh(SUMMARY_SCRIPT, CODA_CACHE_DIR=str(tmp_path))  # heuristic on the CPU: nothing printed
    assert quiet.returncode == 0 and "coda.autotune" not in quiet.stderr, quiet.stderr


def test_readme_documents_the_three_states():
    text = " ".join((ROOT / "README.md").read_text().split())
    for s in ("CODA_AUTOTUNE=1", "CODA_AUTOTUNE=0", "python -m coda.autotune --model llama-1b --batch 2 --seq 4096",
              "--show", "CODA_AUTOTUNE_SUMMARY", "nearest"):
        assert s in text, s


def test_the_mlp_dx_entry_serves_its_epilogue_warps():
    """The shipped H100 entry of llama-1b's MLP dX (rms_radial_residual, 8192 x 2048 x 16384, W^T MN-major) runs in
    the epilogue warps (session 30's measurement, docs/tune_h100/llama1b_epi_wg_s30.json: 0.729 ms against 0.807
    for session 28's l2_prefetch 32 config); the default path serves it as stored."""
    import coda.ops.mlp  # noqa: F401 (the epilogue's module)
    import sys
    epi = sys.modules["coda.ops.mlp"].rms_radial_residual
    prob = check_gemm_args(torch.empty(8192, 16384, dtype=BF16), torch.empty(16384, 2048, dtype=BF16).t())
    cfg = at.select_config(prob, epi, None, None, {})
    assert cfg.epi_wg and cfg.sched == "static" and cfg.name == "128x256_coop_c2x1_rm8_ewg", (cfg, at.counts())
    assert at.counts() == {"tuned": 0, "shipped": 1, "heuristic": 0}
