"""Which config ``coda.gemm(..., config=None)`` runs (moved from ``coda.autotune``, issue 27: the core asks the
runtime; the autotuner only searches configs and registers itself here with :func:`set_tuner`).

:func:`select_config` never tunes unless asked to:

- default (``CODA_AUTOTUNE`` unset or empty): this process's memory, then the user's tuning store (on-disk result
  cache: ``$CODA_CACHE_DIR``, default ``~/.cache/coda``; JSON keyed by GPU name + SM count, cutlass-dsl and CODA
  versions, dtypes, shape bucket and the epilogue's semantic key; see :mod:`coda.runtime.keys` and
  :mod:`coda.runtime.store`), then a config shipped for this GPU model (:mod:`coda.runtime.shipped`, nearest shape
  bucket), else the heuristic ``coda.config.default_config``. A new shape costs a file read, never a tuning run;
- ``CODA_AUTOTUNE=1``: memory, the store, then on a miss the tuner (``coda.autotune.tuner.tune`` through the package
  root's ``coda._tune_on_miss``, imported when first run; :func:`set_tuner` replaces it) and store the winner --
  unless the problem is too small to be worth it (< ``MIN_TUNE_FLOP``: K = 0 epilogue-only passes among them) or the
  stream is being captured into a CUDA graph, where the default chain above is used (not remembered);
- ``CODA_AUTOTUNE=0``: the heuristic, no timing, nothing read or written.

Visibility: :func:`counts` / :func:`summary` (how many distinct shapes used tuned, shipped or heuristic configs;
printed once at exit with ``CODA_AUTOTUNE_SUMMARY=1``, or when a heuristic config was used on a GPU while tuning
was not turned off). ``coda.autotune`` re-exports all of this. Nothing here imports torch or cutlass at import.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
import warnings
from typing import Any, Callable, Optional

from coda import _tune_on_miss  # the package root's wiring: coda.autotune.tuner.tune, imported when first run

from . import rules
from .keys import tune_key
from .rules import config_problem, result_entry_problem
from .store import ResultStore

MIN_TUNE_FLOP = 2**34  # ~17 GFLOP (~25 us on an H100): below this, tuning is not worth a first-call delay

store = ResultStore(validate=result_entry_problem)  # a bad entry on disk is ignored (one warning), then dropped
_memory: dict = {}  # tune key -> GemmConfig (tuned in this process, or read from the store)
_served: dict = {}  # tune key -> (GemmConfig, source) of the default chain (shipped / heuristic; not tuned)
_tune_lock = threading.RLock()
_TUNE_VALUES = ("1", "true", "yes", "on")
_tuner: list = [_tune_on_miss]  # (a, b, epi, out_dtype, operands) -> TuneResult; the package root's by default

# usage and the recorder
_usage: dict = {}  # shape id -> source ("tuned", "shipped", "heuristic")
_heuristic_on_gpu = [False]
_recorders: list = []  # active coda.autotune.model.Recorder objects
_usage_lock = threading.Lock()


def set_tuner(fn: Optional[Callable]) -> None:
    """Register the function ``CODA_AUTOTUNE=1`` tunes a missed problem with: ``fn(a, b, epi, out_dtype,
    operands)`` returning a result with ``.best``, ``.best_ms`` and ``.entry(prob, epi)`` (``coda.autotune``'s
    TuneResult). None: no tuner (``CODA_AUTOTUNE=1`` then serves the default chain)."""
    _tuner[0] = fn


def forget() -> None:
    """Drop this process's memory of tuned and served configs (not the store)."""
    with _tune_lock:
        _memory.clear()
        _served.clear()


def mode() -> str:
    """``"off"`` (``CODA_AUTOTUNE=0``), ``"tune"`` (``CODA_AUTOTUNE=1``) or ``"default"`` (unset: store, shipped,
    heuristic; never tunes). Read at every call."""
    v = os.environ.get("CODA_AUTOTUNE", "").strip().lower()
    if v in ("0", "false", "no", "off"):
        return "off"
    return "tune" if v in _TUNE_VALUES else "default"


def enabled() -> bool:
    """False when ``CODA_AUTOTUNE=0`` (read at every call): configs are then the heuristic's, no lookups."""
    return mode() != "off"


def _kernel_view(prob) -> tuple:
    """(M, L) as the kernel sees them: a weight shared by every batch folds L into M."""
    L = prob.L or 1
    return (L * prob.M, 1) if prob.b_broadcast else (prob.M, L)


def heuristic(prob) -> Any:
    """``coda.config.default_config`` for this problem as the kernel sees it, on its device's SMs."""
    from coda._device import sm_count
    from coda.config import default_config
    M, L = _kernel_view(prob)
    cfg = default_config(M, prob.N, prob.K, batch=L, sms=sm_count(prob.device))
    if prob.wide_out and (cfg.tile_m, cfg.tile_n) == (128, 256) and not cfg.pingpong:
        # a 1 -> 2 epilogue (two stored values per element, its operands read per element): 128 x 128 tiles. The
        # SwiGLU backward in llama-1b's da GEMM (8192 x 8192 x 2048) on the H100: 0.557 ms there, 0.643 on 128 x 256
        # at epi_n 16 (72 bytes of spills at 32); cuBLAS's da + the K = 0 pass it replaces 0.673 (bench.kzero)
        cfg = dataclasses.replace(cfg, tile_n=128)
    return cfg


def _config_of(entry: Optional[dict], epi: Any, prob) -> Optional[Any]:
    """The stored config if the entry is usable: parses, and the config is still kept by today's pruning rules."""
    if not entry or config_problem(entry.get("config")) is not None:
        return None
    try:
        cfg = rules.config_from_dict(entry.get("config"))
    except (TypeError, ValueError):
        return None
    M, L = _kernel_view(prob)
    if (rules.config_reason(cfg, epi, prob.in_dtype, prob.out_dtype)
            or rules.shape_reasons(cfg, epi, M, prob.N, L, prob.K)):
        return None
    return cfg


def key_for(prob, epi: Any) -> str:
    from .keys import device_info
    M, L = _kernel_view(prob)
    return tune_key(device_info(prob.device), prob.in_dtype, prob.out_dtype, M, prob.N, prob.K, L, epi)


def _from_store(key: str, prob, epi: Any) -> Optional[Any]:
    """The store's usable config for ``key`` (remembered in this process's memory), or None."""
    cfg = _config_of(store.get(key), epi, prob)
    if cfg is not None:
        _memory[key] = cfg
    return cfg


def lookup(prob, epi: Any) -> Optional[Any]:
    """The remembered config for this problem (memory, then the store), or None. Never tunes."""
    key = key_for(prob, epi)
    return _memory.get(key) or _from_store(key, prob, epi)


def shipped(prob, epi: Any, default: Any = None) -> Optional[Any]:
    """The config shipped for this GPU model and problem (nearest shape bucket, :mod:`coda.autotune.ship`), or
    None. An entry whose config is the heuristic default of its tuning run (the tuner found nothing better) is
    used only while today's heuristic still picks that config. Never raises."""
    from . import shipped as ship
    from .keys import device_info
    try:
        M, L = _kernel_view(prob)
        found = ship.lookup(device_info(prob.device), prob.in_dtype, prob.out_dtype, prob.a_major, prob.b_major,
                            M, prob.N, prob.K, L, ship.epilogue_id(epi))
    except Exception:  # a damaged package file must not break a GEMM call
        return None
    if found is None:
        return None
    entry = found[0]
    cfg = _config_of(entry, epi, prob)
    if cfg is None:
        return None
    default = default if default is not None else heuristic(prob)
    if cfg.name == entry.get("default") and default.name != entry.get("default"):
        return None  # the heuristic changed since: the entry said only "the heuristic of then was best"
    return cfg


def _default_chain(prob, epi: Any, key: str, default: Any) -> tuple:
    """(config, source) without tuning: the store ("tuned"), a shipped config ("shipped"), the heuristic."""
    hit = _served.get(key)
    if hit is not None:
        return hit
    cfg = _from_store(key, prob, epi)
    if cfg is not None:
        return cfg, "tuned"
    cfg = shipped(prob, epi, default)
    hit = (cfg, "shipped") if cfg is not None else (default, "heuristic")
    _served[key] = hit
    return hit


def measured_config(prob, epi: Any) -> Optional[Any]:
    """The config a tuning run measured for this problem -- remembered in this process, in the store, or shipped --
    without tuning, or None (also with ``CODA_AUTOTUNE=0``, which reads no cache, and where the store cannot be
    read: a GEMM call must not fail on it). Memoised with the default chain's answers."""
    if mode() == "off":
        return None
    try:
        key = key_for(prob, epi)
        cfg = _memory.get(key)
        if cfg is None:
            cfg, source = _default_chain(prob, epi, key, heuristic(prob))
            cfg = None if source == "heuristic" else cfg
    except Exception:
        return None
    return cfg


def _capturing() -> bool:
    import torch
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


def select_config(prob, epi: Any, a: Any, b: Any, operands: dict) -> Any:
    """The config ``coda.gemm`` uses when called with ``config=None`` (see the module docstring)."""
    default = heuristic(prob)
    m = mode()
    if m == "off" or prob.empty_result:
        _note(prob, epi, default, "heuristic", a, b, operands)
        return default
    key = key_for(prob, epi)
    cfg = _memory.get(key)
    if cfg is not None:
        _note(prob, epi, cfg, "tuned", a, b, operands)
        return cfg
    if m != "tune" or _recorders or _tuner[0] is None:
        cfg, source = _default_chain(prob, epi, key, default)
        _note(prob, epi, cfg, source, a, b, operands)
        return cfg
    with _tune_lock:
        cfg = _memory.get(key) or _from_store(key, prob, epi)
        if cfg is None:
            M, L = _kernel_view(prob)
            if 2 * M * prob.N * prob.K * L < MIN_TUNE_FLOP or _capturing():
                # not remembered as tuned: a later, capturable call of a large problem still tunes
                cfg, source = _default_chain(prob, epi, key, default)
                _note(prob, epi, cfg, source, a, b, operands)
                return cfg
            try:
                result = _tuner[0](a, b, epi, prob.out_dtype, operands)
            except Exception as e:  # e.g. out of memory for the input copies: the call itself must still work
                warnings.warn(f"coda.autotune: tuning {prob.M}x{prob.N}x{prob.K} failed ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''}); using the default config "
                              f"{default.name} for this process", RuntimeWarning, stacklevel=3)
                _memory[key] = default
                _note(prob, epi, default, "heuristic", a, b, operands)
                return default
            cfg = result.best
            if result.best_ms is not None:
                store.put(key, _entry(result, prob, epi))
        _memory[key] = cfg
    _note(prob, epi, cfg, "tuned", a, b, operands)
    return cfg


def _entry(result, prob, epi) -> dict:
    try:
        return result.entry(prob, epi)
    except TypeError:  # a TuneResult stand-in without the epilogue argument
        return result.entry(prob)


def _note(prob, epi, cfg, source: str, a, b, operands) -> None:
    M, L = _kernel_view(prob)
    sid = (M, prob.N, prob.K, L, str(prob.in_dtype), str(prob.out_dtype), prob.a_major, prob.b_major,
           type(epi).__qualname__, getattr(epi, "name", ""))
    with _usage_lock:
        _usage[sid] = source
        if source == "heuristic" and getattr(prob.device, "type", None) == "cuda" and mode() != "off":
            _heuristic_on_gpu[0] = True
        recs = list(_recorders)
    for r in recs:
        r.add(prob, epi, cfg, source, a, b, operands)


def counts() -> dict:
    """How many distinct problems (shape, dtypes, layouts, epilogue) this process ran with a tuned (the store or
    tuned here), shipped or heuristic config."""
    with _usage_lock:
        vals = list(_usage.values())
    return {k: vals.count(k) for k in ("tuned", "shipped", "heuristic")}


def summary() -> str:
    """One line: what was tuned and what was guessed in this process (see :func:`counts`)."""
    c = counts()
    n = sum(c.values())
    line = (f"coda.autotune: {n} GEMM shape{'' if n == 1 else 's'}: {c['tuned']} tuned, {c['shipped']} shipped, "
            f"{c['heuristic']} heuristic (CODA_AUTOTUNE={os.environ.get('CODA_AUTOTUNE', '') or 'unset'})")
    if c["heuristic"] and mode() == "default":
        line += "; tune them once per machine: python -m coda.autotune --model PRESET (or CODA_AUTOTUNE=1)"
    guessed = heuristic_problems()
    if guessed:  # which ones (what `--source heuristic` would tune): M x N x K, layouts of A / B, epilogue
        more = len(guessed) - SUMMARY_LISTED
        line += "; heuristic: " + ", ".join(guessed[:SUMMARY_LISTED]) + (f" and {more} more" if more > 0 else "")
    return line


SUMMARY_LISTED = 4  # heuristic-served problems the summary line names


def heuristic_problems() -> list:
    """Labels of the problems this process ran with the heuristic's config, in the order first met:
    ``"MxNxK[xL] a/b epilogue"`` (the kernel's M and L; a / b: the operands' major modes)."""
    with _usage_lock:
        sids = [sid for sid, src in _usage.items() if src == "heuristic"]
    return [f"{M}x{N}x{K}{f'x{L}' if L > 1 else ''} {am}/{bm} {name or qual}"
            for M, N, K, L, _, _, am, bm, qual, name in sids]


def _at_exit() -> None:
    flag = os.environ.get("CODA_AUTOTUNE_SUMMARY", "").strip()
    if flag == "0" or not _usage:
        return
    if flag == "1" or _heuristic_on_gpu[0]:
        try:
            print(summary(), file=sys.stderr, flush=True)
        except Exception:
            pass


atexit.register(_at_exit)
