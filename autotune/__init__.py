"""Autotuning of GemmConfig for CODA's GEMM (installed as ``coda.autotune``).

``coda.gemm(..., config=None)`` (and every op) asks ``coda.runtime.select.select_config`` (re-exported here),
which never tunes unless asked to:

- default (``CODA_AUTOTUNE`` unset or empty): this process's memory, then the user's tuning store (on-disk result
  cache: ``$CODA_CACHE_DIR``, default ``~/.cache/coda``; JSON keyed by GPU name + SM count, cutlass-dsl and CODA
  versions, dtypes, shape bucket and the epilogue's semantic key; see :mod:`coda.autotune.keys` and
  :mod:`coda.autotune.store`), then a config shipped for this GPU model (:mod:`coda.autotune.ship`, nearest shape
  bucket), else the heuristic ``coda.config.default_config``. A new shape costs a file read, never a tuning run;
- ``CODA_AUTOTUNE=1``: memory, the store, then on a miss tune (:mod:`coda.autotune.tuner`, registered with the
  runtime by ``import coda``: every config of the
  pruned space that is worth timing, L2-cold inputs, ``triton.testing.do_bench`` medians, results checked against
  the torch reference) and store the winner (kept in memory, with one warning, if the cache dir cannot be
  written) -- unless the problem is too small to be worth it (< ``MIN_TUNE_FLOP``) or the stream is being captured
  into a CUDA graph, where the default chain above is used (not remembered);
- ``CODA_AUTOTUNE=0``: ``coda.config.default_config`` (the heuristic), no timing, nothing read or written.

Explicit tuning: :func:`tune` (the caller's tensors), :func:`tune_shape` (random inputs; CLI ``--gemm``), and
``python -m coda.autotune --model PRESET`` (every GEMM of a fused training step: :mod:`coda.autotune.model`).
Visibility: :func:`summary` (how many distinct shapes used tuned, shipped or heuristic configs; printed once at
exit with ``CODA_AUTOTUNE_SUMMARY=1``, or when a heuristic config was used on a GPU while tuning was not turned
off), ``python -m coda.autotune --show``. Also :func:`clear` (results, compiled kernels, in-memory state) and the
compile cache (:mod:`coda.autotune.compile_cache`). Importing this package imports neither torch nor cutlass.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

# the runtime layer below (issue 27): kernel identity (keys), the on-disk stores, the compile cache and the config
# selection live in coda.runtime; coda.autotune.keys / .store / .compile_cache are aliases of those modules (three
# shim files), and the selection is re-exported here
from . import compile_cache, keys, store as _store_module  # noqa: F401 (the aliases load now: the package's
# ``store`` attribute below is the results store, and a later ``import coda.autotune.store`` must not replace it)
from coda.runtime.select import (MIN_TUNE_FLOP, _config_of, _entry, _heuristic_on_gpu, _kernel_view,  # noqa: F401
                                 _memory, _recorders, _served, _tune_lock, _usage, _usage_lock, counts, enabled,
                                 forget, heuristic, heuristic_problems, key_for, lookup, mode, select_config,
                                 shipped, store, summary)
from coda.runtime.store import cache_dir, path_exists

__all__ = ["enabled", "mode", "select_config", "lookup", "tune", "tune_shape", "clear", "cache_dir", "store",
           "summary", "counts", "heuristic_problems", "MIN_TUNE_FLOP"]


def tune(a: Any, b: Any, *, epilogue: Any = None, out_dtype: Any = None, level: str = "quick", save: bool = True,
         progress: bool = True, **operands):
    """Tune ``epilogue(a @ b.T)`` on the caller's tensors now (every candidate config timed; minutes for a large
    problem), store the winner in the tuning store (``save``) and remember it for this process; returns the
    :class:`coda.autotune.tuner.TuneResult`. Later ``coda.gemm(..., config=None)`` calls of this problem use it."""
    from coda._validate import check_gemm_args
    from coda.kernels.epilogue import check_epilogue, out_flags

    from . import tuner
    epi = check_epilogue(epilogue)
    prob = check_gemm_args(a, b, out_dtype=out_dtype, **out_flags(epi))
    result = tuner.tune(a, b, epi, prob.out_dtype, operands, level=level, progress=progress)
    if save and result.best_ms is not None:
        _remember(prob, epi, result)
    return result


def _remember(prob, epi, result) -> None:
    key = key_for(prob, epi)
    store.put(key, _entry(result, prob, epi))
    with _tune_lock:
        _memory[key] = result.best
        _served.pop(key, None)
    _drop_plans()


def tune_shape(M: int, N: int, K: int, L: Optional[int] = None, dtype: Any = "bfloat16", out_dtype: Any = None,
               epi: Any = None, operands: Optional[dict] = None, level: str = "quick", save: bool = True):
    """Tune one problem on random inputs (what the CLI runs) and store the result; returns the TuneResult."""
    import torch

    from coda._device import require_hopper
    from coda._validate import check_gemm_args
    from coda.kernels.epilogue import check_epilogue, out_flags

    from . import tuner
    from .keys import dtype_name
    require_hopper(None, "coda.autotune")
    dt = getattr(torch, dtype_name(dtype))
    lead = (L,) if L else ()
    std = tuner.input_std(K)
    a = torch.empty(*lead, M, K, device="cuda", dtype=dt).normal_(0.0, std)
    b = torch.empty(*lead, N, K, device="cuda", dtype=dt).normal_(0.0, std)
    epi = check_epilogue(epi)
    od = getattr(torch, dtype_name(out_dtype)) if out_dtype is not None else dt
    operands = dict(operands) if operands is not None else tuner.random_operands(epi, L, M, N, od)
    result = tuner.tune(a, b, epi, od, operands, level=level)
    if save and result.best_ms is not None:
        _remember(check_gemm_args(a, b, out_dtype=od, **out_flags(epi)), epi, result)
    return result


def _drop_plans() -> None:
    gemm_mod = sys.modules.get("coda.gemm")  # not imported yet: no plans to drop (and no torch import here)
    if gemm_mod is not None:
        gemm_mod.clear_plans()


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
    forget()
    _drop_plans()
    return removed
