"""The rules of CODA's config space that the runtime applies to every config it is handed (moved from
``coda.autotune.space`` and ``coda.autotune.entries``, issue 27): the knob values a config may take, why a config
cannot (or need not) be built for an epilogue and dtypes (:func:`config_reason`), the problem-dependent rules
(:func:`shape_reasons`), the kernel's shared-memory plan for a config (:func:`kernel_smem_plan`), configs to and
from their stored form, and the validation of stored tuning results (:func:`config_problem`,
:func:`result_entry_problem`). ``coda.runtime.select`` uses them to accept a stored or shipped config;
``coda.autotune.space`` enumerates and prunes the search space with them. Nothing here imports torch or cutlass.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from coda.config import SPLITS, GemmConfig, all_configs
from coda.kernels.epilogue import MAX_EPI_TENSORS, out_col_bytes, smem_plan  # MAX: GemmSm90's x-slots

from .keys import DTYPE_BYTES, _is_int, _is_num, dtype_name

INT32_MAX = 2**31 - 1

TILE_M = (64, 128, 256)
TILE_N = (64, 128, 192, 256)
SCHEDULES = (False, True)  # pingpong
CLUSTERS = ((1, 1), (2, 1), (1, 2), (2, 2))
RASTERS = ("m", "n")
SWIZZLES = (1, 4, 8, 16)
STAGES = (None, 3, 4, 5, 6)
EPI_N = (32, 64)
SCHEDS = ("static", "dynamic")  # tile schedule (GemmConfig.sched; dynamic: cooperative only)

VERIFIED_TILES = frozenset((c.tile_m, c.tile_n, c.pingpong) for c in all_configs())


def epilogue_tensor_count(epi: Any) -> int:
    return len(epi.operands) + len(epi.outputs) + len(epi.kernel_reductions())


def _identity():
    from coda.kernels.epilogue import IDENTITY
    return IDENTITY


def config_reason(cfg: GemmConfig, epi: Any = None, in_dtype: Any = "bfloat16",
                  out_dtype: Any = "bfloat16") -> Optional[str]:
    """Why ``cfg`` cannot (or need not) be built for this epilogue and these dtypes; None if it is kept."""
    epi = epi if epi is not None else _identity()
    n = epilogue_tensor_count(epi)
    sched = (cfg.sched == "dynamic") + 2 * (cfg.splits > 1)  # the schedule's tensors after the epilogue's
    if n + sched > MAX_EPI_TENSORS:
        return (f"epilogue {epi.name!r} needs {n} kernel tensors (operands + extra outputs + reductions)"
                + (f" and the schedule {sched}" if sched else "") + f"; the kernel takes at most {MAX_EPI_TENSORS}")
    problems = cfg.problems()
    if problems:
        return "invalid: " + "; ".join(problems)
    if (cfg.tile_m, cfg.tile_n, cfg.pingpong) not in VERIFIED_TILES:
        sched = "ping-pong" if cfg.pingpong else "cooperative"
        return (f"tile {cfg.tile_m}x{cfg.tile_n} {sched} is not one of the variants CODA builds and tests "
                "(coda.config.all_configs)")
    try:
        plan = kernel_smem_plan(cfg, epi, in_dtype, out_dtype)
    except ValueError as e:
        cols = out_col_bytes(epi, smem_plan_outputs(epi, out_dtype))
        return f"shared memory: {e} (epilogue buffers {cfg.epi_smem_bytes(cols)} B)"
    if cfg.stages is not None:
        derived = kernel_smem_plan(dataclasses.replace(cfg, stages=None), epi, in_dtype, out_dtype)
        if plan == derived:
            return f"duplicate: stages={plan.stages} is what stages=None derives"
    return None


def smem_plan_outputs(epi: Any, out_dtype: Any) -> list:
    """Element sizes of the tile outputs the kernel stores: D (unless the epilogue stores no main output), then
    the extra outputs, all of ``out_dtype``."""
    return [DTYPE_BYTES[dtype_name(out_dtype)]] * (int(bool(epi.stores_out)) + len(epi.outputs))


def kernel_smem_plan(cfg: GemmConfig, epi: Any = None, in_dtype: Any = "bfloat16", out_dtype: Any = "bfloat16"):
    """The kernel's shared-memory plan (``coda.kernels.epilogue.smem_plan``) for these dtypes, with every TileMN
    operand fp32 (the largest rings) and TMA-aligned; ValueError where the stages do not fit."""
    epi = epi if epi is not None else _identity()
    n_tiles = sum(o.kind == "tile" for o in epi.operands)
    return smem_plan(epi, cfg, smem_plan_outputs(epi, out_dtype), [4] * n_tiles, [True] * n_tiles,
                     DTYPE_BYTES[dtype_name(in_dtype)])


def split_reason(cfg: GemmConfig, K: int) -> Optional[str]:
    """Why ``cfg``'s split-K cannot run a K-deep problem: every split needs a k-tile (None: it can)."""
    k_tiles = -(-K // cfg.tile_k)
    if cfg.splits > 1 and k_tiles < cfg.splits:
        return f"splits={cfg.splits} needs at least {cfg.splits} k-tiles of {cfg.tile_k}; K={K} has {k_tiles}"
    return None


def shape_reasons(cfg: GemmConfig, epi: Any, M: int, N: int, L: int = 1, K: Optional[int] = None) -> Optional[str]:
    """Problem-dependent pruning (``M``, ``L`` as the kernel sees them: a broadcast weight folds L into M; ``K``
    where known)."""
    epi = epi if epi is not None else _identity()
    tiles_m, tiles_n = -(-M // cfg.tile_m), -(-N // cfg.tile_n)
    if cfg.splits > 1:
        why = split_reason(cfg, K) if K is not None else None
        if why:
            return why
        padded = -(-tiles_m // cfg.cluster_m) * cfg.cluster_m * -(-tiles_n // cfg.cluster_n) * cfg.cluster_n  # CTAs
        if L * padded * (cfg.splits - 1) * cfg.tile_m * cfg.tile_n > INT32_MAX:
            return f"splits={cfg.splits}: the split-K workspace of this problem exceeds int32 indexing"
    if cfg.cluster_m == 2 and tiles_m == 1:
        return f"cluster 2x1 but M={M} is one {cfg.tile_m}-row tile: the peer CTA would only compute padding"
    if cfg.cluster_n == 2 and tiles_n == 1:
        return f"cluster 1x2 but N={N} is one {cfg.tile_n}-column tile: the peer CTA would only compute padding"
    for r in epi.kernel_reductions():
        tiles, length = (tiles_n, M) if r.axis == "n" else (tiles_m * cfg.warps_per_tile, N)
        if L * tiles * length > INT32_MAX:
            return (f"reduction {r.name!r}: partial buffer of {L}x{tiles}x{length} fp32 exceeds int32 indexing "
                    f"(tile_{'n' if r.axis == 'n' else 'm'}={cfg.tile_n if r.axis == 'n' else cfg.tile_m})")
    return None


# fields that came later, with the value an entry stored without them means ("sched": a static schedule; "epi_wg":
# the shared epilogue, left out of stored entries while False so that they read as before)
LATER_FIELDS = {"sched": "static", "epi_wg": False, "l2_prefetch": 0, "tile_k": 64, "splits": 1}


def config_to_dict(cfg: GemmConfig) -> dict:
    d = dataclasses.asdict(cfg)
    for k in ("epi_wg", "l2_prefetch", "tile_k", "splits"):  # left out at their defaults: entries read as before
        if d[k] == LATER_FIELDS[k]:
            del d[k]
    return d


def config_from_dict(d: dict) -> GemmConfig:
    names = {f.name for f in dataclasses.fields(GemmConfig)}
    if not isinstance(d, dict) or set(d) - names or names - set(d) - set(LATER_FIELDS):
        raise ValueError(f"not a GemmConfig: {d!r}")
    return GemmConfig(**d)


def config_problem(d: Any) -> Optional[str]:
    """Why the stored config ``d`` (``config_to_dict`` of a GemmConfig) is unusable: unknown or missing
    fields, a wrong type (``{"tile_n": None}``, ``swizzle: 1.5``, ``pingpong: 1``) or a value outside the tuning
    space. None if every field is one the space could have produced."""
    if not isinstance(d, dict):
        return f"config is {type(d).__name__}, not an object"
    choices = {"tile_m": TILE_M, "tile_n": TILE_N, "cluster_m": (1, 2), "cluster_n": (1, 2),
               "pingpong": (False, True), "raster": RASTERS, "swizzle": range(1, 65),
               "stages": (None, *range(2, 17)), "epi_n": (16, 32, 64), "sched": SCHEDS, "epi_wg": (False, True),
               "l2_prefetch": (0, 1, 2, 4, 8, 16, 32, 64, 128), "tile_k": (32, 64), "splits": SPLITS}
    types_ = {"pingpong": (bool,), "raster": (str,), "sched": (str,), "stages": (int, type(None)), "epi_wg": (bool,)}
    extra = sorted(set(d) - set(choices))
    if extra:
        return f"config has unknown field {extra[0][:40]!r}"
    for name, allowed in choices.items():
        if name not in d:
            if name in LATER_FIELDS:  # stored before the field existed (or epi_wg left out while False)
                continue
            return f"config lacks {name!r}"
        v = d[name]
        if type(v) not in types_.get(name, (int,)) or v not in allowed:
            shown = f"{allowed.start}..{allowed.stop - 1}" if isinstance(allowed, range) else list(allowed)
            return f"config field {name!r} = {v!r:.40} is not one of {shown}"
    return None


_RESULT_FIELDS = {"name": (str,), "default": (str,), "level": (str,), "ms": ("num", type(None)),
                  "default_ms": ("num", type(None)), "tuning_s": ("num",), "time": ("num",), "tried": (int,)}


def result_entry_problem(key: str, entry: dict) -> Optional[str]:
    """Why a stored tuning result is unusable (the validator of ``coda.autotune.store``); None if usable."""
    why = config_problem(entry.get("config"))
    if why is not None:
        return why
    for name, kinds in _RESULT_FIELDS.items():
        if name in entry:
            v = entry[name]
            ok = any((_is_num(v) and v >= 0) if k == "num" else type(v) is k for k in kinds)
            if not ok:
                return f"field {name!r} = {v!r:.40} has the wrong type or range"
    shape = entry.get("shape", [0, 0, 0, None])
    if not (isinstance(shape, list) and len(shape) == 4
            and all((_is_int(x) and 0 <= x < 1 << 40) or (i == 3 and x is None) for i, x in enumerate(shape))):
        return f"field 'shape' = {shape!r:.60} is not [M, N, K, L]"
    return None
