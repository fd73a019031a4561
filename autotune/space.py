"""The config space of CODA's GEMM per (dtypes, epilogue), and the rules that prune it before anything is compiled.

:func:`enumerate_space` is the product of the knobs of :class:`coda.config.GemmConfig` (tile shape, cooperative /
ping-pong, cluster shape, raster order, swizzle group, pipeline stages, epilogue sub-tile, static / dynamic tile
schedule). :func:`prune` splits it
into kept configs and ``(config, reason)`` pairs; every rule states its reason:

- ``GemmConfig.problems()``: tile / schedule / cluster / register-budget validity;
- the tile shape is not one of the variants CODA builds and tests (``coda.config.all_configs``);
- shared memory: the kernel's own plan (``coda.kernels.epilogue.smem_plan``) must leave >= 2 pipeline stages; an
  explicit ``stages`` must fit. It counts the tile outputs the kernel stores (no D where the epilogue stores none,
  half-width outputs at half size), takes TileMN operands as fp32 (the largest rings) and TMA-aligned, and deepens
  their rings and the output buffers where that costs no stage;
- an explicit ``stages`` whose plan is the one ``stages=None`` derives is a duplicate;
- the epilogue needs more than 12 kernel tensors (operands + extra outputs + reduction partials).

:func:`shape_reasons` adds the rules that depend on the problem (a cluster dimension of 2 over a single tile, a
reduction partial buffer too large for int32 indexing). Nothing here imports torch or cutlass.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Iterable, Iterator, Optional

from coda.config import GemmConfig, all_configs

from .keys import DTYPE_BYTES, dtype_name

from coda.kernels.epilogue import MAX_EPI_TENSORS, out_col_bytes, smem_plan  # noqa: E402 (MAX: GemmSm90's x-slots)
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

# the first-order knobs: what the quick tuning level varies (the rest stay at GemmConfig's defaults)
QUICK_DEFAULTS = dict(swizzle=GemmConfig.swizzle, stages=None, epi_n=GemmConfig.epi_n)

VERIFIED_TILES = frozenset((c.tile_m, c.tile_n, c.pingpong) for c in all_configs())


def enumerate_space() -> Iterator[GemmConfig]:
    for tm, tn, pp, (cm, cn), r, sw, st, en, sd in itertools.product(TILE_M, TILE_N, SCHEDULES, CLUSTERS, RASTERS,
                                                                       SWIZZLES, STAGES, EPI_N, SCHEDS):
        yield GemmConfig(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, pingpong=pp, raster=r, swizzle=sw,
                         stages=st, epi_n=en, sched=sd)


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
    if n > MAX_EPI_TENSORS:
        return (f"epilogue {epi.name!r} needs {n} kernel tensors (operands + extra outputs + reductions); the "
                f"kernel takes at most {MAX_EPI_TENSORS}")
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


def prune(epi: Any = None, in_dtype: Any = "bfloat16", out_dtype: Any = "bfloat16",
          configs: Optional[Iterable[GemmConfig]] = None):
    """Split ``configs`` (default: the whole space) into ``kept`` and ``pruned`` = [(config, reason)]."""
    kept, pruned = [], []
    for cfg in (enumerate_space() if configs is None else configs):
        reason = config_reason(cfg, epi, in_dtype, out_dtype)
        if reason is None:
            kept.append(cfg)
        else:
            pruned.append((cfg, reason))
    return kept, pruned


def shape_reasons(cfg: GemmConfig, epi: Any, M: int, N: int, L: int = 1) -> Optional[str]:
    """Problem-dependent pruning (``M``, ``L`` as the kernel sees them: a broadcast weight folds L into M)."""
    epi = epi if epi is not None else _identity()
    tiles_m, tiles_n = -(-M // cfg.tile_m), -(-N // cfg.tile_n)
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


def _first_order(cfg: GemmConfig) -> tuple:
    return (cfg.tile_m, cfg.tile_n, cfg.pingpong, cfg.cluster_m, cfg.cluster_n, cfg.raster, cfg.sched)


def candidates(epi: Any, in_dtype: Any, out_dtype: Any, M: int, N: int, L: int = 1, level: str = "quick",
               around: Iterable[GemmConfig] = ()):
    """Configs worth timing for one problem: ``(kept, pruned)``.

    ``level="quick"``: the first-order knobs (tile, schedule, cluster, raster, static / dynamic tile order) at the
    default swizzle, stages and epilogue sub-tile. ``level="refine"``: every kept config (any swizzle, stages, sub-tile) that shares its
    first-order knobs with one of ``around`` (the tuner's best quick configs), except ``around`` themselves."""
    if level not in ("quick", "refine"):
        raise ValueError(f"level must be 'quick' or 'refine', got {level!r}")
    kept, pruned = prune(epi, in_dtype, out_dtype)
    around = list(around)
    firsts = {_first_order(c) for c in around}
    out = []
    for cfg in kept:
        if level == "quick" and any(getattr(cfg, k) != v for k, v in QUICK_DEFAULTS.items()):
            continue  # not pruned: outside the quick level
        if level == "refine" and (_first_order(cfg) not in firsts or cfg in around):
            continue
        reason = shape_reasons(cfg, epi, M, N, L)
        if reason is None:
            out.append(cfg)
        else:
            pruned.append((cfg, reason))
    return out, pruned


def config_to_dict(cfg: GemmConfig) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict) -> GemmConfig:
    names = {f.name for f in dataclasses.fields(GemmConfig)}
    # "sched" came later: an entry stored without it is a static-schedule config
    if not isinstance(d, dict) or set(d) - names or names - set(d) - {"sched"}:
        raise ValueError(f"not a GemmConfig: {d!r}")
    return GemmConfig(**d)
