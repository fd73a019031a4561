"""GEMM kernel configurations: the knobs of the one Hopper GEMM, their validity rules, and a default heuristic.

A :class:`GemmConfig` selects, at compile time:

- the CTA tile ``tile_m x tile_n`` and its k-extent per pipeline stage, ``tile_k`` (64 elements: one 128-byte
  swizzled row of 16-bit inputs; 32: half the stage, so that twice as many stages fit beside a large epilogue buffer);
- the consumer schedule: *cooperative* (two consumer warpgroups split one tile along M) or *ping-pong* (each consumer
  warpgroup owns a whole tile; their mainloops are serialised by an ordering barrier so one warpgroup's epilogue
  overlaps the other's tensor-core work);
- the cluster shape ``cluster_m x cluster_n`` (1x1, 2x1, 1x2): A is TMA-multicast along the cluster's N extent, B
  along its M extent;
- the persistent tile scheduler's rasterisation (``raster="m"`` walks down M inside a group of ``swizzle`` N-tiles)
  and how tiles are handed out (``sched``): ``"static"``, cluster c takes tiles c, c + P, c + 2P, ...; or
  ``"dynamic"``, each cluster takes the next tile of the order from a global counter when it needs one, so the
  tiles in flight stay consecutive in the order (cooperative schedule; ``kernels/schedule.py``);
- the number of pipeline stages (``stages=None`` derives it from the shared memory left after the epilogue).

No object in this module imports cutlass: configs are plain data and cheap to enumerate.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Iterator, Optional

TILE_K = 64
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)  # GemmConfig.splits (in-kernel split-K)
SMEM_CAPACITY = 227 * 1024  # bytes of dynamic shared memory per CTA on sm_90
# Register budget of a consumer thread after setmaxnreg (232): the fp32 accumulator must leave room for addressing
# and the epilogue. 192 values a thread: a 128 x 192 ping-pong warpgroup (the widest tile whose plain GEMM and light
# epilogues compile without spills; heavy epilogues spill there -- python -m coda.check, and the tuner times them).
MAX_ACC_PER_THREAD = 192


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    tile_m: int = 128
    tile_n: int = 256
    cluster_m: int = 2
    cluster_n: int = 1
    pingpong: bool = False
    raster: str = "m"
    swizzle: int = 8
    stages: Optional[int] = None
    epi_n: int = 32
    sched: str = "static"
    # epilogue warps (3 of the producer warpgroup) run the epilogue on the accumulator the two MMA warpgroups stage
    # in shared memory, rounded to bf16, while they start the next tile (kernels/epilogue_wg.py; coda.optim's dW
    # GEMMs); cooperative 128-row tiles, static schedule, bf16 / fp16 outputs
    epi_wg: bool = False
    # L2 prefetch of the epilogue's TileMN operands: the producer warp spreads prefetches of the tile's operand rows
    # (prefetch.global.L2, one 128-byte line a lane and instruction) over the last ``l2_prefetch`` k-tiles of the
    # tile's mainloop, so that the epilogue's loads hit L2 (kernels/gemm_sm90.py, ``_l2_prefetch``); 0: none
    l2_prefetch: int = 0
    # k-extent of a pipeline stage: 64 (default) or 32 (stages of half the bytes: 6 instead of 3 beside the epilogue
    # warps' 64 KB staged tile at 128 x 256)
    tile_k: int = TILE_K
    # in-kernel split-K (kernels/split_k.py): each output tile's k-tiles cut into ``splits`` ranges run as separate
    # units of the persistent schedule, the partials added in split order by the last one before its epilogue (for
    # few output tiles with a long K); cooperative, static schedule, shared epilogue
    splits: int = 1

    # -- derived ---------------------------------------------------------------------------------------------------
    @property
    def wg_tile_m(self) -> int:
        """Rows of the CTA tile held by one consumer warpgroup."""
        return self.tile_m if self.pingpong else self.tile_m // 2

    @property
    def warps_per_tile(self) -> int:
        """Consumer warps covering one M-tile: the number of axis-m reduction partials per (column, M-tile)."""
        return 4 if self.pingpong else 8

    @property
    def name(self) -> str:
        sched = "pp" if self.pingpong else "coop"
        st = f"_s{self.stages}" if self.stages else ""
        dyn = "_dyn" if self.sched == "dynamic" else ""
        return (f"{self.tile_m}x{self.tile_n}_{sched}_c{self.cluster_m}x{self.cluster_n}"
                f"_r{self.raster}{self.swizzle}{st}{dyn}" + ("_ewg" if self.epi_wg else "")
                + (f"_pf{self.l2_prefetch}" if self.l2_prefetch else "")
                + (f"_k{self.tile_k}" if self.tile_k != TILE_K else "")
                + (f"_sk{self.splits}" if self.splits != 1 else ""))

    def problems(self) -> list[str]:
        """Reasons this config cannot be built (empty list: valid)."""
        out = []
        if self.pingpong:
            if self.tile_m not in (64, 128):
                out.append(f"ping-pong tile_m must be 64 or 128 (one warpgroup per tile), got {self.tile_m}")
        elif self.tile_m not in (128, 256):
            out.append(f"cooperative tile_m must be 128 or 256 (two warpgroups of 64 or 128 rows), got {self.tile_m}")
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            out.append(f"tile_n must be a multiple of 16 in [16, 256], got {self.tile_n}")
        if self.wg_tile_m * self.tile_n // 128 > MAX_ACC_PER_THREAD:
            out.append(f"a warpgroup would hold {self.wg_tile_m}x{self.tile_n} fp32 accumulators "
                       f"({self.wg_tile_m * self.tile_n // 128} registers/thread > {MAX_ACC_PER_THREAD})")
        if (self.cluster_m, self.cluster_n) not in ((1, 1), (2, 1), (1, 2)):
            out.append(f"cluster shape must be 1x1, 2x1 or 1x2, got {self.cluster_m}x{self.cluster_n}")
        if self.raster not in ("m", "n"):
            out.append(f"raster must be 'm' or 'n', got {self.raster!r}")
        if self.swizzle < 1:
            out.append(f"swizzle must be >= 1, got {self.swizzle}")
        if self.epi_n not in (16, 32, 64) or self.tile_n % self.epi_n:
            out.append(f"epi_n must be 16, 32 or 64 and divide tile_n={self.tile_n}, got {self.epi_n}")
        if self.stages is not None and self.stages < 2:
            out.append(f"stages must be >= 2, got {self.stages}")
        if self.sched not in ("static", "dynamic"):
            out.append(f"sched must be 'static' or 'dynamic', got {self.sched!r}")
        elif self.sched == "dynamic" and self.pingpong:
            out.append("sched='dynamic' is built for the cooperative schedule only")
        if self.l2_prefetch < 0 or self.l2_prefetch & (self.l2_prefetch - 1) or self.l2_prefetch > self.tile_m:
            out.append(f"l2_prefetch must be 0 or a power of two <= tile_m={self.tile_m}, got {self.l2_prefetch}")
        if self.tile_k not in (32, 64):
            out.append(f"tile_k must be 32 or 64, got {self.tile_k}")
        if self.epi_wg and (self.pingpong or self.tile_m != 128 or self.sched != "static"):
            out.append("epi_wg=True is built for cooperative 128-row tiles with sched='static'")
        if self.splits not in SPLITS:
            out.append(f"splits must be one of {SPLITS}, got {self.splits}")
        elif self.splits > 1 and (self.pingpong or self.sched != "static" or self.epi_wg or self.l2_prefetch):
            out.append("splits > 1 is built for the cooperative schedule with sched='static', the shared epilogue "
                       "(epi_wg=False) and l2_prefetch=0")
        return out

    def validate(self) -> "GemmConfig":
        p = self.problems()
        if p:
            raise ValueError(f"invalid GemmConfig {self}: " + "; ".join(p))
        return self

    # -- shared memory budget --------------------------------------------------------------------------------------
    def epi_smem_bytes(self, out_bytes: list[int], epi_stages: int = 2) -> int:
        """Shared memory of the epilogue: ``epi_stages`` sub-tile buffers per tile output, per consumer tile."""
        per_tile = sum(self.tile_m * self.epi_n * b for b in out_bytes) * epi_stages
        return per_tile * (2 if self.pingpong else 1)

    def ab_stage_bytes(self, in_bytes: int = 2) -> int:
        return (self.tile_m + self.tile_n) * self.tile_k * in_bytes

    def derive_stages(self, out_bytes: list[int], extra_smem: int = 0, in_bytes: int = 2, epi_stages: int = 2) -> int:
        """Pipeline stages that fit in the shared memory left after the epilogue (``epi_stages`` sub-tile buffers
        per tile output) and barriers/scratch."""
        left = SMEM_CAPACITY - 2048 - extra_smem - self.epi_smem_bytes(out_bytes, epi_stages)
        n = left // self.ab_stage_bytes(in_bytes)
        if self.stages is not None:
            if self.stages > n:
                raise ValueError(f"GemmConfig {self.name}: {self.stages} stages need "
                                 f"{self.stages * self.ab_stage_bytes(in_bytes)} B of shared memory, {left} B left")
            return self.stages
        if n < 2:
            raise ValueError(f"GemmConfig {self.name}: shared memory too small for 2 pipeline stages")
        return min(n, 8)

    def fit_stages(self, out_bytes: list[int], extra_smem: int = 0, in_bytes: int = 2, epi_stages: int = 2) -> int:
        """:meth:`derive_stages`, or 0 where the shared memory does not hold them (to compare layouts)."""
        try:
            return self.derive_stages(out_bytes, extra_smem, in_bytes, epi_stages)
        except ValueError:
            return 0

    def epi_buffers(self, out_bytes: list[int], extra_smem: int = 0, in_bytes: int = 2) -> int:
        """Epilogue sub-tile buffers per tile output and consumer tile: 4 where two more leave the pipeline stage
        count as it is with 2 (then sub-tile e's store waits for sub-tile e - 3's to be read, not e - 1's), else
        2."""
        base = self.derive_stages(out_bytes, extra_smem, in_bytes)
        return 4 if self.fit_stages(out_bytes, extra_smem, in_bytes, epi_stages=4) == base else 2


def l2_prefetch_env(cfg: GemmConfig, tile_operands: bool, zero_k: bool) -> GemmConfig:
    """``cfg`` with ``l2_prefetch`` from the environment: ``CODA_L2_PREFETCH=P`` (an experiment switch, unset by
    default) gives every GEMM with TileMN epilogue operands and a mainloop (K > 0) ``l2_prefetch=P`` in place of its
    config's own value (``0``: none, e.g. to time a shipped entry that sets it without); anything else as given.
    A value that is no valid ``l2_prefetch`` raises ValueError."""
    text = os.environ.get("CODA_L2_PREFETCH", "").strip()
    if not text or not tile_operands or zero_k:
        return cfg
    try:
        p = int(text)
    except ValueError:
        p = -1
    new = dataclasses.replace(cfg, l2_prefetch=max(p, 0))
    if p < 0 or new.problems():
        raise ValueError(f"CODA_L2_PREFETCH={text!r}: expected 0 or a power of two <= {cfg.tile_m} "
                         f"(config {cfg.name})")
    return cfg if new == cfg else new


def epi_wg_config() -> GemmConfig:
    """128 x 256 cooperative tiles, cluster 2 x 1, static schedule, the epilogue in the epilogue warps
    (``epi_wg``): the library's config for a GEMM whose epilogue streams M x N operands under a long mainloop (an
    update in place: ``coda.optim``'s dW GEMMs)."""
    return GemmConfig(tile_m=128, tile_n=256, cluster_m=2, epi_wg=True)


def all_configs() -> Iterator[GemmConfig]:
    """Every tile/schedule/cluster variant CODA builds (`python -m coda.check` compiles each)."""
    tiles = {False: [(128, 128), (128, 256), (256, 128)], True: [(128, 128), (64, 256), (64, 128), (128, 192)]}
    for pingpong, shapes in tiles.items():
        for (tm, tn), (cm, cn) in itertools.product(shapes, [(1, 1), (2, 1), (1, 2)]):
            cfg = GemmConfig(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, pingpong=pingpong)
            if not cfg.problems():
                yield cfg
    # the dynamic tile schedule (kernels/schedule.py: a global tile counter), built for the cooperative schedule
    for tm, tn, cm, cn in ((128, 256, 1, 1), (128, 256, 2, 1), (256, 128, 1, 2)):
        yield GemmConfig(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, sched="dynamic")
    # in-kernel split-K (kernels/split_k.py): two of them, so that the sweep and the GPU variant tests (K >= 4
    # k-tiles there) cover it
    yield GemmConfig(tile_m=128, tile_n=256, cluster_m=2, cluster_n=1, splits=2)
    yield GemmConfig(tile_m=128, tile_n=128, cluster_m=1, cluster_n=1, splits=4)


H100_SMS = 132  # SMs of an H100 SXM: the default wave size of the heuristic

# The heuristic's candidates, each with its throughput per SM relative to 128x256 cooperative in full waves (the
# H100's do_bench medians at K >= 1024, docs/NOTES.md session 17: 128x128 ping-pong 0.86-0.94, 64x128 0.55-0.65).
HEURISTIC = (
    # the dynamic tile schedule keeps the tiles in flight consecutive in the raster order (kernels/schedule.py):
    # on the H100, 0.98-1.00x cuBLAS's time where the static order took 1.00-1.02x (docs/NOTES.md, session 13)
    (GemmConfig(tile_m=128, tile_n=256, cluster_m=2, cluster_n=1, sched="dynamic"), 1.0),
    (GemmConfig(tile_m=128, tile_n=128, cluster_m=2, cluster_n=1, pingpong=True), 0.89),
    (GemmConfig(tile_m=64, tile_n=128, cluster_m=1, cluster_n=1, pingpong=True), 0.6),
)
HEURISTIC_MARGIN = 0.9  # a smaller tile must promise 10 % less time than the one before it to be chosen


def wave_cost(cfg: GemmConfig, efficiency: float, M: int, N: int, batch: int = 1, sms: int = H100_SMS) -> float:
    """Modelled time of a problem in units of one 128x256 tile: whole waves of tiles over ``sms`` SMs, each wave
    as long as one tile of ``cfg`` (its area over its relative throughput)."""
    tiles = -(-M // cfg.tile_m) * -(-N // cfg.tile_n) * max(batch, 1)
    return -(-tiles // sms) * cfg.tile_m * cfg.tile_n / (128 * 256) / efficiency


def _heuristic(M: int, N: int, batch: int = 1, sms: int = H100_SMS) -> tuple:
    """(config, modelled time in 128x256 tile-times) of :func:`default_config`'s choice."""
    best, best_cost = None, None
    for cfg, efficiency in HEURISTIC:
        if cfg.cluster_m > 1 and -(-M // cfg.tile_m) < cfg.cluster_m:  # a 2-CTA cluster along M needs 2 M-tiles
            continue
        cost = wave_cost(cfg, efficiency, M, N, batch, sms)
        if best is None or cost < HEURISTIC_MARGIN * best_cost:
            best, best_cost = cfg, cost
    return best, best_cost


def default_config(M: int, N: int, K: int, batch: int = 1, sms: int = H100_SMS) -> GemmConfig:
    """Heuristic choice without timing (used when autotuning is off): the largest tile unless a smaller one fills
    the ``sms`` SMs in fewer or emptier waves so that its modelled time (:func:`wave_cost`) is at least 10 % lower.
    A problem of few tiles (small M or N, e.g. decoding, or a weight gradient with a large K) gets the smaller
    tiles; a 2x1 cluster needs two M-tiles. ``batch``: the L of a batched problem, in the kernel's view."""
    best = _heuristic(M, N, batch, sms)[0]
    # K = 0 (an epilogue-only pass over memory): one all-zero k-tile, so 2 stages; the shared memory left deepens
    # the TileMN operands' TMA rings and the output buffers (kernels/epilogue.py: tile_ring, GemmConfig.epi_buffers)
    return dataclasses.replace(best, stages=2) if K == 0 else best


# --- split-K: a problem of few tiles and a long K as S problems of K/S, summed (coda.gemm, identity epilogue) ------
# H100 constants of the model (docs/NOTES.md, session 17): one 64-deep k-step of a 128x256 tile (8192^3 sustained:
# 1.58 ms over 16 waves of 128 k-steps), the copy bandwidth, and the gap a dependent kernel adds.
K_STEP_US = 0.7
HBM_BYTES_PER_US = 3.0e6
KERNEL_US = 3.0
# bytes of fp32 partials a split may allocate: 128 MiB lets the LM head's dX chunks (2816 x 2048 x 128256, split 3 or
# 4) split; on the H100 that took them from 1.35-1.54x cuBLAS's time to 0.93-1.02x (coda.bench.split_k, session 19)
SPLIT_K_WORKSPACE = 128 << 20
SPLIT_K_FACTORS = (2, 3, 4, 6, 8, 16, 32)  # 3 and 6: K = 128256 (a Llama-3 vocabulary) is 64 x 2004 = 64 x 12 x 167
SPLIT_K_MIN_K = 512  # K per slice
# below this modelled time the split's extra host work (a batched launch, a sum and a cast instead of one launch;
# ~40 us) is not hidden: measured on the H100, 200x136x16384 took 10.7x cuBLAS split, 2.9x unsplit
SPLIT_K_MIN_US = 200.0


def gemm_us(M: int, N: int, K: int, batch: int = 1, sms: int = H100_SMS) -> float:
    """Modelled time (us) of the heuristic's kernel for a (batch x) M x N x K problem."""
    return _heuristic(M, N, batch, sms)[1] * -(-K // TILE_K) * K_STEP_US


def split_k_us(M: int, N: int, K: int, split: int, out_bytes: int, sms: int = H100_SMS) -> float:
    """Modelled time (us) of the split: ``split`` batched problems of K/split into fp32 partials, their sum over the
    split (read split x M x N x 4 bytes, write M x N x 4) and, for a 16-bit result, the cast (another kernel)."""
    cast = out_bytes != 4
    moved = M * N * 4 * (split + 1) + (M * N * (4 + out_bytes) if cast else 0)
    return gemm_us(M, N, K // split, split, sms) + moved / HBM_BYTES_PER_US + KERNEL_US * (2 if cast else 1)


def split_k(M: int, N: int, K: int, out_bytes: int = 2, sms: int = H100_SMS) -> int:
    """The K-split :func:`coda.gemm` uses for a 2-D problem with the identity epilogue and no config: 1 (none)
    unless the unsplit kernel's modelled time is >= :data:`SPLIT_K_MIN_US` and a split into whole 64-deep k-steps
    of >= 512 each, with partials within :data:`SPLIT_K_WORKSPACE`, promises >= 10 % less time (:func:`split_k_us`
    vs :func:`gemm_us`): problems whose tiles fill few SMs and whose K is long, e.g. a weight gradient (K =
    tokens) of a small layer.""" 
    base = gemm_us(M, N, K, 1, sms)
    if base < SPLIT_K_MIN_US:
        return 1
    best, best_us = 1, base
    for s in SPLIT_K_FACTORS:
        if K % (s * TILE_K) or K // s < SPLIT_K_MIN_K or s * M * N * 4 > SPLIT_K_WORKSPACE:
            continue
        t = split_k_us(M, N, K, s, out_bytes, sms)
        if t < best_us:
            best, best_us = s, t
    return best if best_us < HEURISTIC_MARGIN * base else 1
