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
reduction partial buffer too large for int32 indexing). :func:`neighbours` and :func:`combine` give the ``near``
tuning level: the heuristic's choice one knob away, then the improving knobs together. Nothing here imports torch
or cutlass.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Iterable, Iterator, Optional

from coda.config import SPLITS, GemmConfig
# the rules every config obeys live in the runtime (coda.runtime.rules, issue 27); re-exported here
from coda.runtime.rules import (CLUSTERS, EPI_N, INT32_MAX, RASTERS, SCHEDS, SCHEDULES, STAGES, SWIZZLES,  # noqa: F401
                                TILE_M, TILE_N, VERIFIED_TILES, config_from_dict, config_reason, config_to_dict,
                                epilogue_tensor_count, kernel_smem_plan, shape_reasons, smem_plan_outputs)
# the first-order knobs: what the quick tuning level varies (the rest stay at GemmConfig's defaults)
QUICK_DEFAULTS = dict(swizzle=GemmConfig.swizzle, stages=None, epi_n=GemmConfig.epi_n)


def enumerate_space() -> Iterator[GemmConfig]:
    for tm, tn, pp, (cm, cn), r, sw, st, en, sd in itertools.product(TILE_M, TILE_N, SCHEDULES, CLUSTERS, RASTERS,
                                                                       SWIZZLES, STAGES, EPI_N, SCHEDS):
        yield GemmConfig(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, pingpong=pp, raster=r, swizzle=sw,
                         stages=st, epi_n=en, sched=sd)


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


def _first_order(cfg: GemmConfig) -> tuple:
    return (cfg.tile_m, cfg.tile_n, cfg.pingpong, cfg.cluster_m, cfg.cluster_n, cfg.raster, cfg.sched)


def candidates(epi: Any, in_dtype: Any, out_dtype: Any, M: int, N: int, L: int = 1, level: str = "quick",
               around: Iterable[GemmConfig] = ()):
    """Configs worth timing for one problem: ``(kept, pruned)``.

    ``level="quick"``: the first-order knobs (tile, schedule, cluster, raster, static / dynamic tile order) at the
    default swizzle, stages and epilogue sub-tile. ``level="refine"``: every kept config (any swizzle, stages,
    sub-tile) that shares its first-order knobs with one of ``around`` (the tuner's best quick configs), except
    ``around`` themselves. ``level="near"``: ``around`` (the heuristic's config) and their :func:`neighbours`."""
    if level not in ("quick", "refine", "near"):
        raise ValueError(f"level must be 'quick', 'refine' or 'near', got {level!r}")
    around = list(around)
    if level == "near":
        return near_candidates(epi, in_dtype, out_dtype, M, N, L, [c for a in around for c in (a, *neighbours(a))])
    kept, pruned = prune(epi, in_dtype, out_dtype)
    firsts = {_first_order(c) for c in around}
    if level == "quick":
        kept = [c for c in kept if all(getattr(c, k) == v for k, v in QUICK_DEFAULTS.items())]
    else:
        kept = [c for c in kept if _first_order(c) in firsts and c not in around]
    return _shape_filter(kept, pruned, epi, M, N, L)


# in-kernel split-K (GemmConfig.splits) for problems of at most two waves of tiles: these base tiles, each split at
# most into four waves of units, every split at least SPLIT_MIN_K_TILES deep
SPLIT_BASES = (GemmConfig(tile_m=128, tile_n=256, cluster_m=1), GemmConfig(tile_m=128, tile_n=128, cluster_m=1))
SPLIT_MIN_K_TILES = 8


def split_candidates(epi: Any, in_dtype: Any, out_dtype: Any, M: int, N: int, K: int, L: int = 1,
                     sms: int = 132, level: str = "quick") -> list:
    """Split-K configs worth timing for a problem of at most two waves of tiles (none otherwise): for each of
    :data:`SPLIT_BASES`, the splits s with tiles x s <= 4 x sms and K / s >= SPLIT_MIN_K_TILES k-tiles that the
    rules keep; ``level="near"``: the first base's splits 2, 4 and 8 only (each candidate is one more compile)."""
    out = []
    for base in SPLIT_BASES[:1] if level == "near" else SPLIT_BASES:
        tiles = L * -(-M // base.tile_m) * -(-N // base.tile_n)
        if tiles > 2 * sms:
            continue
        for s in (2, 4, 8) if level == "near" else SPLITS[1:]:
            cfg = dataclasses.replace(base, splits=s)
            if (tiles * s <= 4 * sms and -(-K // cfg.tile_k) >= SPLIT_MIN_K_TILES * s
                    and config_reason(cfg, epi, in_dtype, out_dtype) is None
                    and shape_reasons(cfg, epi, M, N, L, K) is None):
                out.append(cfg)
    return out


def _shape_filter(kept: list, pruned: list, epi: Any, M: int, N: int, L: int):
    """``(kept, pruned)`` with the configs :func:`shape_reasons` rules out for this problem moved to ``pruned``."""
    out = []
    for cfg in kept:
        reason = shape_reasons(cfg, epi, M, N, L)
        if reason is None:
            out.append(cfg)
        else:
            pruned.append((cfg, reason))
    return out, pruned


# -- the "near" level: one knob away from the heuristic's choice ----------------------------------------------------
# a fused step's problems mostly want the heuristic's tile with another tile order, epilogue sub-tile or cluster
# (H100, llama-1b, session 21: the RMSNorm + SwiGLU forward 0.880 -> 0.841 ms static, the norm backward's dX
# 0.786 -> 0.731 at epi_n 16, the SwiGLU backward's da 0.577 -> 0.546 on 64 x 256 ping-pong): ~10 configs a problem
# where the quick level times ~50
NEAR_EPI_N = (16, 32, 64)
NEAR_CLUSTERS = ((1, 1), (2, 1), (1, 2))
NEAR_TILES = ((128, 256, False), (128, 128, False), (128, 128, True), (64, 256, True),  # (tile_m, tile_n, pingpong)
              (128, 192, True))  # session 37: the fast CE's logits GEMM 6.09-6.30 ms vs 6.76-6.88 at 128 x 256
KNOBS = (("sched",), ("epi_n",), ("cluster_m", "cluster_n"), ("tile_m", "tile_n", "pingpong", "sched"))


def neighbours(d: GemmConfig) -> list:
    """Configs one knob of :data:`KNOBS` away from ``d``: the other tile order (static / dynamic), each other
    epilogue sub-tile width, each other cluster shape, each other tile shape and schedule of :data:`NEAR_TILES`
    (ping-pong with the static order, the only one it has). Unvalidated: the caller prunes them."""
    out = [dataclasses.replace(d, sched="static" if d.sched == "dynamic" else "dynamic")]
    out += [dataclasses.replace(d, epi_n=e) for e in NEAR_EPI_N if e != d.epi_n]
    out += [dataclasses.replace(d, cluster_m=cm, cluster_n=cn) for cm, cn in NEAR_CLUSTERS
            if (cm, cn) != (d.cluster_m, d.cluster_n)]
    out += [dataclasses.replace(d, tile_m=tm, tile_n=tn, pingpong=pp, sched="static" if pp else d.sched)
            for tm, tn, pp in NEAR_TILES if (tm, tn, pp) != (d.tile_m, d.tile_n, d.pingpong)]
    return [c for c in dict.fromkeys(out) if c != d]


def combine(d: GemmConfig, better: Iterable[GemmConfig]) -> Optional[GemmConfig]:
    """``d`` with the knobs in which each config of ``better`` (best first) differs from it, an earlier config
    winning a knob group; None if that is ``d`` or one of ``better`` itself (nothing new to time)."""
    better = list(better)
    fields: dict = {}
    for c in better:
        for group in KNOBS:
            if any(getattr(c, f) != getattr(d, f) for f in group) and not any(f in fields for f in group):
                fields.update({f: getattr(c, f) for f in group})
    out = dataclasses.replace(d, **fields)
    return None if out == d or out in better else out


def near_candidates(epi: Any, in_dtype: Any, out_dtype: Any, M: int, N: int, L: int, configs: Iterable[GemmConfig]):
    """``(kept, pruned)`` of exactly ``configs`` (duplicates dropped) under every rule: :func:`prune`'s, then the
    problem's shape."""
    kept, pruned = prune(epi, in_dtype, out_dtype, list(dict.fromkeys(configs)))
    return _shape_filter(kept, pruned, epi, M, N, L)
