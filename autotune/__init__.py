"""Autotuning of GemmConfig for CODA's GEMM (installed as ``coda.autotune``).

``coda.gemm(..., config=None)`` asks :func:`select_config`:

1. ``CODA_AUTOTUNE=0``: ``coda.config.default_config`` (the heuristic), no timing, nothing read or written;
2. the in-memory result of this process, then the on-disk result cache (``$CODA_CACHE_DIR``, default
   ``~/.cache/coda``; JSON keyed by GPU name + SM count, cutlass-dsl and CODA versions, dtypes, shape bucket and
   the epilogue's semantic key; see :mod:`coda.autotune.keys` and :mod:`coda.autotune.store`);
3. on a miss, tune (:mod:`coda.autotune.tuner`: every config of the pruned space that is worth timing,
   L2-cold inputs, ``triton.testing.do_bench`` medians, results checked against the torch reference) and store the
   winner (kept in memory, with one warning, if the cache dir cannot be written) -- unless the problem is too
   small to be worth it (< ``MIN_TUNE_FLOP``) or the stream is being captured into a CUDA graph, where the
   heuristic is used (remembered in memory only).

Also: :func:`clear` (results, compiled kernels, in-memory state), :func:`tune_shape` (what the CLI
``python -m coda.autotune --gemm M,N,K`` runs), and the compile cache (:mod:`coda.autotune.compile_cache`).
Importing this package imports neither torch nor cutlass.
"""
from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Any, Optional

from .keys import config_problem, result_entry_problem, tune_key
from .store import ResultStore, cache_dir, path_exists

__all__ = ["enabled", "select_config", "lookup", "tune_shape", "clear", "cache_dir", "store", "MIN_TUNE_FLOP"]

MIN_TUNE_FLOP = 2**34  # ~17 GFLOP (~25 us on an H100): below this, tuning is not worth a first-call delay

store = ResultStore(validate=result_entry_problem)  # a bad entry on disk is ignored (one warning), then dropped
_memory: dict = {}  # tune key -> GemmConfig
_tune_lock = threading.RLock()


def enabled() -> bool:
    """False when ``CODA_AUTOTUNE=0`` (read at every call)."""
    return os.environ.get("CODA_AUTOTUNE", "1").strip() != "0"


def _kernel_view(prob) -> tuple:
    """(M, L) as the kernel sees them: a weight shared by every batch folds L into M."""
    L = prob.L or 1
    return (L * prob.M, 1) if prob.b_broadcast else (prob.M, L)


def heuristic(prob) -> Any:
    """``coda.config.default_config`` for this problem as the kernel sees it, on its device's SMs."""
    from coda._device import sm_count
    from coda.config import default_config
    M, L = _kernel_view(prob)
    return default_config(M, prob.N, prob.K, batch=L, sms=sm_count(prob.device))


def _config_of(entry: Optional[dict], epi: Any, prob) -> Optional[Any]:
    """The stored config if the entry is usable: parses, and the config is still kept by today's pruning rules."""
    from . import space
    if not entry or config_problem(entry.get("config")) is not None:
        return None
    try:
        cfg = space.config_from_dict(entry.get("config"))
    except (TypeError, ValueError):
        return None
    M, L = _kernel_view(prob)
    if space.config_reason(cfg, epi, prob.in_dtype, prob.out_dtype) or space.shape_reasons(cfg, epi, M, prob.N, L):
        return None
    return cfg


def key_for(prob, epi: Any) -> str:
    from .keys import device_info
    M, L = _kernel_view(prob)
    return tune_key(device_info(prob.device), prob.in_dtype, prob.out_dtype, M, prob.N, prob.K, L, epi)


def lookup(prob, epi: Any) -> Optional[Any]:
    """The remembered config for this problem (memory, then disk), or None. Never tunes."""
    key = key_for(prob, epi)
    cfg = _memory.get(key)
    if cfg is None:
        cfg = _config_of(store.get(key), epi, prob)
        if cfg is not None:
            _memory[key] = cfg
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
    if not enabled() or prob.empty_result or prob.zero_k:
        return default
    key = key_for(prob, epi)
    cfg = _memory.get(key)
    if cfg is not None:
        return cfg
    with _tune_lock:
        cfg = _memory.get(key)
        if cfg is None:
            cfg = _config_of(store.get(key), epi, prob)
        if cfg is None:
            M, L = _kernel_view(prob)
            if 2 * M * prob.N * prob.K * L < MIN_TUNE_FLOP or _capturing():
                return default  # not remembered: a later, capturable call of a large problem still tunes
            from . import tuner
            try:
                result = tuner.tune(a, b, epi, prob.out_dtype, operands)
            except Exception as e:  # e.g. out of memory for the input copies: the call itself must still work
                warnings.warn(f"coda.autotune: tuning {prob.M}x{prob.N}x{prob.K} failed ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''}); using the default config "
                              f"{default.name} for this process", RuntimeWarning, stacklevel=3)
                _memory[key] = default
                return default
            cfg = result.best
            if result.best_ms is not None:
                store.put(key, result.entry(prob))
        _memory[key] = cfg
    return cfg


def tune_shape(M: int, N: int, K: int, L: Optional[int] = None, dtype: Any = "bfloat16", out_dtype: Any = None,
               epi: Any = None, operands: Optional[dict] = None, level: str = "quick", save: bool = True):
    """Tune one problem on random inputs (what the CLI runs) and store the result; returns the TuneResult."""
    import torch

    from coda._device import require_hopper
    from coda._validate import check_gemm_args
    from coda.kernels.epilogue import check_epilogue

    from . import tuner
    from .keys import dtype_name
    require_hopper(None, "coda.autotune")
    dt = getattr(torch, dtype_name(dtype))
    lead = (L,) if L else ()
    a = torch.randn(*lead, M, K, device="cuda", dtype=dt)
    b = torch.randn(*lead, N, K, device="cuda", dtype=dt)
    epi = check_epilogue(epi)
    od = getattr(torch, dtype_name(out_dtype)) if out_dtype is not None else dt
    operands = dict(operands) if operands is not None else tuner.random_operands(epi, L, M, N, od)
    result = tuner.tune(a, b, epi, od, operands, level=level)
    if save and result.best_ms is not None:
        prob = check_gemm_args(a, b, out_dtype=od)
        key = key_for(prob, epi)
        store.put(key, result.entry(prob))
        with _tune_lock:
            _memory[key] = result.best
        _drop_plans()
    return result


def _drop_plans() -> None:
    gemm_mod = sys.modules.get("coda.gemm")
    if gemm_mod is not None and hasattr(gemm_mod, "_plans"):
        gemm_mod._plans.clear()


def clear(results: bool = True, kernels: bool = True) -> dict:
    """Empty the caches of the current cache dir (tuning results, compiled kernels) and this process's memory of
    them (remembered configs, launch plans). Returns what was removed. A cache dir that cannot be written (or is
    refused, see :mod:`coda.autotune.store`) warns once; the memory is cleared anyway."""
    removed = {"results": False, "kernels": 0}
    if results:
        path = store.path
        removed["results"] = path_exists(path)
        removed["results"] &= store.clear()  # never raises: an unwritable cache dir warns once
    if kernels:
        from . import compile_cache
        removed["kernels"] = compile_cache.clear()
    with _tune_lock:
        _memory.clear()
    _drop_plans()
    return removed
