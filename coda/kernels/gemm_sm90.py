"""CODA's Hopper GEMM: D = epilogue(A @ B^T), written in CuTeDSL for sm_90a.

A (M, K, L) and B (N, K, L) are K-major (the ``nn.Linear`` layout), D (M, N, L) is N-major; fp32 accumulation.

Structure (one CTA = 3 warpgroups, persistent over output tiles):

Phase 0 (host, ``__call__``): build the tiled WGMMA, the swizzled shared-memory layouts, the TMA descriptors (A/B
  loads, multicast across the cluster when it has more than one CTA along the other dimension; D and extra outputs
  stores), the persistent grid and the shared-storage struct; the number of pipeline stages is what the shared memory
  holds after the epilogue buffers.
Phase 1 (all warps): allocate shared memory, initialise the mainloop mbarrier pipeline, cluster-sync.
Phase 2 (producer warpgroup, warp 0; registers lowered to 40): for each tile of this CTA (``schedule.py``: grouped
  raster order; cluster c takes tiles c, c + P, ..., or with ``sched="dynamic"`` the next index from a global
  counter, passed on to the consumers through a shared-memory ring; with ``splits`` > 1 each tile is that many
  units of contiguous k-ranges, ``split_k.py``), for each k-tile: wait for an empty stage, TMA-load A and B into it
  (multicast to the cluster peers).
Phase 3 (consumer warpgroups; registers raised to 232):
  cooperative: both warpgroups work on the same tile (64 or 128 rows each);
  ping-pong:   warpgroup w takes every other tile; an ordering barrier serialises the two mainloops so that one
               warpgroup's epilogue runs under the other's tensor-core work.
  3a mainloop: wait for a full stage, issue WGMMAs, keep one WGMMA batch in flight, release the previous stage.
  3b epilogue: per sub-tile (tile_m x epi_n): call the epilogue hook on every accumulator element (with its global
     row/column and operand values), convert, write to shared memory with stmatrix (into a ring of 2 or 4 sub-tile
     buffers), one named barrier, TMA-store (one warp; before that barrier it waits until its older stores have
     left the buffer the next sub-tile writes); TileMN operands arrive by TMA in a ring of 2-8 sub-tiles; per-row
     (axis n) reductions accumulate in registers across the sub-tiles and are reduced across the 4 lanes sharing a
     row, then written as one partial per (row, N-tile); per-column (axis m) reductions are reduced over a warp's rows
     (in-thread, then across the 8 lanes sharing a column) and written as one partial per (column, warp of the
     M-tile). No atomics: deterministic. Split-K: a non-final unit stores its fp32 accumulator to a workspace
     slot and raises the slot's flag; the final one adds the partials in split order, then runs the epilogue.
     The tile grid is rounded up to whole clusters only: the peer of a CTA past the last M- or N-tile computes a
     tile that stores nothing (TMA clips it, partial stores are predicated on the tile index).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.tensor_utils import LayoutEnum
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from ..config import GemmConfig
from . import epilogue_wg, l2_prefetch, lse, schedule, segment, split_k, visit
from .ring_view import RingView
from .epilogue import (MAX_EPI_TENSORS, ODD_OUT, Epilogue, staged_operands,  # noqa: F401 (the x-slots)
                       smem_plan, tile_operand_cols)
from .operand_kinds import TILE
from .sub_tile import SubTile, column_pair

WG_THREADS = 128
PRODUCER_REGS, CONSUMER_REGS = 40, 232
# named barriers (0 is __syncthreads): epilogue of the cooperative pair, or of ping-pong warpgroup w (1 + w);
# ping-pong mainloop ordering: warpgroup w waits on 3 + w.
BAR_EPI, BAR_ORDER = 1, 3


class GemmSm90(visit.EpilogueVisit, epilogue_wg.EpilogueWarpgroup):
    def __init__(self, cfg: GemmConfig, epi: Epilogue, tile_aligned=None, even=(False, False)):
        """``tile_aligned``: per TileMN operand (in declaration order), whether its address and strides are 16-byte
        aligned (TMA can read it; None: all are); see ``tile_tma_plan`` for which ones are TMA-loaded. ``even``:
        (M a multiple of tile_m, N of tile_n): a reduction along an even axis needs no mask of padded elements
        (every element of a real tile is inside; a padded tile's partial is never stored or finished)."""
        self.cfg = cfg.validate()
        self.epi = epi
        self.acc_dtype = cutlass.Float32
        self.tile_mnk = (cfg.tile_m, cfg.tile_n, cfg.tile_k)
        self.epi_tile = (cfg.tile_m, cfg.epi_n)  # epilogue sub-tile: full tile height, epi_n columns
        # cooperative: the two warpgroups stack along M; ping-pong: one warpgroup spans the tile
        self.atom_layout = (1, 1, 1) if cfg.pingpong else (2, 1, 1)
        self.num_tiles_in_flight = 2 if cfg.pingpong else 1  # consumer tiles resident at once
        self.epi_threads = WG_THREADS if cfg.pingpong else 2 * WG_THREADS
        self.red_n = [r for r in epi.reductions if r.axis == "n"]
        self.red_m = [r for r in epi.reductions if r.axis == "m"]
        # VecN / VecM operands read through shared memory (3b; the epilogue warps of epi_wg read global memory)
        self.staged = [] if cfg.epi_wg else staged_operands(epi, cfg)
        self.tiles = [i for i, o in enumerate(epi.operands) if o.spec is TILE]
        self.tile_aligned = (True,) * len(self.tiles) if tile_aligned is None else tuple(tile_aligned)
        if len(self.tile_aligned) != len(self.tiles):
            raise ValueError(f"tile_aligned: {len(self.tile_aligned)} flags for {len(self.tiles)} TileMN operands")
        self.op_tile = (cfg.tile_m, tile_operand_cols(epi, cfg))
        self.pf_ops = [i for i, o in enumerate(epi.operands) if o.spec is TILE]  # what cfg.l2_prefetch prefetches
        self.even = tuple(bool(x) for x in even)
        self.ewg = cfg.epi_wg  # the epilogue in warps of the producer warpgroup (kernels/epilogue_wg.py)
        if self.ewg:
            epilogue_wg.check(epi)
        self.segments = segment.check(epi, cfg)  # coda.segment_sum: the consumer epilogue's pre-pass (segment.py)

    def __str__(self):
        """What CuTeDSL's name mangling puts into the kernel's name: the epilogue's, so that profiles tell the
        kernels apart (e.g. the optimizer's K = 0 pass, ``coda.bench.step_report.RULES``)."""
        return "coda.kernels.gemm_sm90.GemmSm90_" + "".join(c if c.isalnum() else "_" for c in self.epi.name)

    # ------------------------------------------------------------------------------------------------ phase 0: host
    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mD: cute.Tensor, max_active_clusters: cutlass.Constexpr,
                 stream, x0=None, x1=None, x2=None, x3=None, x4=None, x5=None, x6=None, x7=None, x8=None, x9=None, x10=None, x11=None, x12=None, x13=None, x14=None, x15=None, x16=None, x17=None, x18=None, x19=None):
        """x0..x19 (MAX_EPI_TENSORS): the epilogue's tensors in order: operands, extra outputs, reduction partial
        buffers (the DSL takes no *args at the top level)."""
        epi_args = [x for x in (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, x16, x17, x18,
                                x19) if x is not None]
        cfg = self.cfg
        self.ab_dtype = mA.element_type
        if cutlass.const_expr(mB.element_type != self.ab_dtype):
            raise TypeError(f"A is {self.ab_dtype} but B is {mB.element_type}")
        self.d_dtype = mD.element_type
        n_ops = len(self.epi.operands)
        n_out = len(self.epi.outputs)
        self.dynamic = cfg.sched == "dynamic"
        # the schedule's tensors, last after the epilogue's: the dynamic tile counter (schedule.py: two int32) or
        # the split-K workspace and flags (split_k.py)
        n_sched = 1 if self.dynamic else 2 if cfg.splits > 1 else 0
        sched_ts = epi_args[len(epi_args) - n_sched:] if n_sched else []
        epi_args = epi_args[:len(epi_args) - n_sched]
        op_tensors = epi_args[:n_ops]
        out_tensors = epi_args[n_ops:n_ops + n_out]
        red_tensors = epi_args[n_ops + n_out:]
        # tile outputs stored by TMA: D (unless the epilogue stores no main output) and the extra outputs;
        # mD always gives the problem shape (M, N, L)
        store_ts = ([mD] if self.epi.stores_out else []) + list(out_tensors)
        # pairs epilogues (coda.pairs): "half" stores one value per column pair, so D and the extra outputs have
        # N/2 columns and each sub-tile stores tile_m x epi_n/2; "full" stores two values per pair (width N); a
        # 1 -> 2 epilogue (epi.expand) two values per accumulator element (width 2N, sub-tiles tile_m x 2 epi_n)
        self.pair_mode = self.epi.pair_mode
        self.half, self.expand = self.pair_mode == "half", self.epi.expand
        self.store_tile = (cfg.tile_m, self.epi.out_cols(cfg.epi_n))
        self.out_tile = (cfg.tile_m, self.epi.out_cols(cfg.tile_n))
        self.store_names = (["out"] if self.epi.stores_out else []) + list(self.epi.outputs)
        out_dtypes = [t.element_type for t in store_ts]
        self.out_dtypes = out_dtypes
        if cutlass.const_expr(self.ewg and any(d.width > 16 for d in out_dtypes)):
            raise TypeError("epi_wg=True stages the accumulator in bf16: the outputs must be bf16 or fp16")

        a_layout = LayoutEnum.from_tensor(mA)
        b_layout = LayoutEnum.from_tensor(mB)
        d_layout = LayoutEnum.from_tensor(mD)
        self.d_layout = d_layout
        self.tiled_mma = self._tiled_mma(a_layout, b_layout)

        # shared memory (epilogue.smem_plan, also the autotuner's pruning): TileMN operands read by TMA (3b), per
        # operand a ring of sub-tile buffers (per consumer tile in flight), one mbarrier per buffer; the tile outputs'
        # sub-tile buffers (a half-width output takes half its element size per accumulator column); the stages
        in_b = self.ab_dtype.width // 8
        tile_b = [op_tensors[i].element_type.width // 8 for i in self.tiles]
        plan = smem_plan(self.epi, cfg, [d.width // 8 for d in out_dtypes], tile_b, self.tile_aligned, in_b)
        # epi_wg: the operands' cp.async ring (depth 0: none), per operand (chunk, lane, slot) buffers
        self.ring_depth = epilogue_wg.ring_depth(self.epi, cfg, tile_b, self.tile_aligned, in_b) if self.ewg else 0
        self.ring_ops = epilogue_wg.ring_ops(self.epi, tile_b, self.tile_aligned) if self.ring_depth else {}
        self.ring = plan.ring
        self.ld_bufs = self.ring * self.num_tiles_in_flight
        self.tma_tiles = [i for i, f in zip(self.tiles, plan.tma_flags) if f]
        ld_ops = [op_tensors[i] for i in self.tma_tiles]
        ld_smems = [sm90_utils.make_smem_layout_epi(t.element_type, LayoutEnum.from_tensor(t), self.op_tile,
                                                    self.ld_bufs) for t in ld_ops]
        lds = [cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), t, cute.slice_(sl, (None, None, 0)),
                                           self.op_tile) for t, sl in zip(ld_ops, ld_smems)]
        self.ld_tx = sum(self.op_tile[0] * self.op_tile[1] * t.element_type.width // 8 for t in ld_ops)
        # epilogue sub-tile buffers: 4 where they cost no pipeline stage, else 2 (GemmConfig.epi_buffers)
        self.epi_stages = plan.epi_buffers
        self.ab_stage = plan.stages
        a_smem = sm90_utils.make_smem_layout_a(a_layout, self.tile_mnk, self.ab_dtype, self.ab_stage)
        b_smem = sm90_utils.make_smem_layout_b(b_layout, self.tile_mnk, self.ab_dtype, self.ab_stage)
        epi_bufs = self.epi_stages * self.num_tiles_in_flight
        epi_smems = [] if self.ewg else [sm90_utils.make_smem_layout_epi(dt, d_layout, self.store_tile, epi_bufs)
                                         for dt in out_dtypes]

        # TMA: A is shared by the CTAs of a cluster row (same m): multicast over cluster_n, B over cluster_m
        self.mcast_a, self.mcast_b = cfg.cluster_n, cfg.cluster_m
        tma_a, tA = self._tma_load(mA, a_smem, (cfg.tile_m, cfg.tile_k), self.mcast_a)
        tma_b, tB = self._tma_load(mB, b_smem, (cfg.tile_n, cfg.tile_k), self.mcast_b)
        stores = [cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), t,
                                              cute.slice_(sl, (None, None, 0)), self.store_tile)
                  for t, sl in zip(store_ts, epi_smems)]
        self.tx_bytes = (cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem, (None, None, 0)))
                         + cute.size_in_bytes(self.ab_dtype, cute.slice_(b_smem, (None, None, 0))))

        # persistent grid (schedule.py): one cluster per cluster tile (split-K: per unit), at most what fits on the
        # GPU at once
        rows, cols = self._cluster_tiles(mD)
        grid = (cfg.cluster_m, cfg.cluster_n, cutlass.min(rows * cols * mD.shape[2] * cfg.splits,
                                                           max_active_clusters))

        ab_stage = self.ab_stage
        ab_dt = self.ab_dtype

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, ab_stage * 2]
            sA: cute.struct.Align[cute.struct.MemRange[ab_dt, cute.cosize(a_smem)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[ab_dt, cute.cosize(b_smem)], 1024]

        self.shared_storage = SharedStorage  # the epilogue buffers (one per tile output) follow the struct

        # (epi_wg: the epilogue warps store into the tensors themselves, element by element)
        self.kernel(tma_a, tA, tma_b, tB, mD, [s[0] for s in stores], store_ts if self.ewg else [s[1] for s in stores],
                    op_tensors, red_tensors, self.tiled_mma, a_smem, b_smem, epi_smems,
                    [x[0] for x in lds], [x[1] for x in lds], ld_smems, sched_ts).launch(
            grid=grid, block=[3 * WG_THREADS, 1, 1], cluster=(cfg.cluster_m, cfg.cluster_n, 1),
            min_blocks_per_mp=1, stream=stream)

    @staticmethod
    def _tma_load(t, smem_staged, tile, mcast):
        op = cpasync.CopyBulkTensorTileG2SOp() if mcast == 1 else cpasync.CopyBulkTensorTileG2SMulticastOp()
        return cpasync.make_tiled_tma_atom(op, t, cute.slice_(smem_staged, (None, None, 0)), tile,
                                           num_multicast=mcast)

    # ---------------------------------------------------------------------------------------------- device kernel
    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               mD: cute.Tensor, store_atoms: list, store_tensors: list, op_tensors: list, red_tensors: list,
               tiled_mma: cute.TiledMma, a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout,
               epi_smems: list, ld_atoms: list, ld_tensors: list, ld_smems: list, sched_ts: list):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            for atom in store_atoms + ld_atoms:
                cpasync.prefetch_descriptor(atom)

        # ---- phase 1: shared memory, mainloop pipeline, cluster sync
        cta_layout = cute.make_layout((cfg.cluster_m, cfg.cluster_n, 1))
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout.get_flat_coord(cta_rank)
        a_mask = cute.make_layout_image_mask(cta_layout, cluster_coord, mode=1) if self.mcast_a > 1 else 0
        b_mask = cute.make_layout_image_mask(cta_layout, cluster_coord, mode=0) if self.mcast_b > 1 else 0

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sOuts = [smem.allocate_tensor(self.out_dtypes[i], sl.outer, byte_alignment=1024,
                                      swizzle=sl.inner) for i, sl in enumerate(epi_smems)]
        # TileMN rings (multiples of 1024 bytes, right after the output buffers: no padding), staged VecN / VecM
        # operands (values per tile, consumer tile in flight; fp32), the rings' mbarriers
        sLds = [smem.allocate_tensor(op_tensors[i].element_type, sl.outer, byte_alignment=1024, swizzle=sl.inner)
                for i, sl in zip(self.tma_tiles, ld_smems)]
        sOps = [smem.allocate_tensor(cutlass.Float32, cute.make_layout((n, self.num_tiles_in_flight)),
                                     byte_alignment=16) for _, n in self.staged]
        sStage = None  # the staged accumulator tile of the epilogue warps
        if cutlass.const_expr(self.ewg):
            sl = epilogue_wg.staging_layout(self.cfg)
            sStage = smem.allocate_tensor(cutlass.BFloat16, sl.outer, byte_alignment=1024, swizzle=sl.inner)
        rings = {}  # epi_wg: {operand index: (chunk, lane, slot)} (epilogue_wg.ring_ops; 16-bit VecMs read directly)
        for i, nbytes in self.ring_ops.items():
            dt = op_tensors[i].element_type
            if cutlass.const_expr(self._vectorizable(op_tensors[i]) if self.epi.operands[i].spec is TILE
                                  else dt.width == 32):
                slots = self.ring_depth * epilogue_wg.ewg_unroll(self.epi)
                chunk = nbytes * 8 // dt.width  # elements a lane copies per row
                rings[i] = smem.allocate_tensor(dt, cute.make_ordered_layout(
                    (chunk, epilogue_wg.EPI_THREADS, slots), order=(0, 1, 2)), byte_alignment=16)
        ld_mbar = None
        if cutlass.const_expr(len(self.tma_tiles) > 0):  # fenced and synced by pipeline_init_arrive / _wait below
            ld_mbar = smem.allocate_array(cutlass.Int64, self.ld_bufs, byte_alignment=8)
            if tidx == 0:
                for j in cutlass.range_constexpr(self.ld_bufs):
                    cute.arch.mbarrier_init(ld_mbar + j, 1)
        # (with the output buffers that half-width and 1 -> 2 epilogues write element by element, as RingViews)
        tile_ld = dict(atoms=ld_atoms, tensors=ld_tensors, smem=sLds, mbar=ld_mbar,
                       views=[RingView(t, sl) for t, sl in zip(sLds, ld_smems)],
                       out_views=[RingView(t, sl) for t, sl in zip(sOuts, epi_smems)]
                       if (self.half or self.expand) and not self.ewg else [])

        consumer_wgs = 1 if cfg.pingpong else 2  # warpgroups that read each stage
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(), num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, (self.mcast_a + self.mcast_b - 1) * consumer_wgs * 4),
            tx_count=self.tx_bytes, cta_layout_vmnk=cute.make_layout((1, *cta_layout.shape)), defer_sync=True)
        # sched="dynamic": the tile-index ring from the producer warp to the consumers (schedule.py); split-K: the
        # workspace and flags (split_k.py)
        sched = None
        if cutlass.const_expr(self.dynamic):
            sched = schedule.make_ring(smem, sched_ts, cfg.cluster_m * cfg.cluster_n, 2 * WG_THREADS, cta_rank)
        elif cutlass.const_expr(cfg.splits > 1):
            sched = sched_ts
        pipeline_init_arrive(cluster_shape_mn=(cfg.cluster_m, cfg.cluster_n), is_relaxed=True)

        gA = cute.local_tile(mA, (cfg.tile_m, cfg.tile_k), (None, None, None))  # (bM, bK, m, k, l)
        gB = cute.local_tile(mB, (cfg.tile_n, cfg.tile_k), (None, None, None))  # (bN, bK, n, k, l)
        k_tiles = cute.size(gA, mode=[3])
        tAsA, tAgA = cpasync.tma_partition(tma_a, cluster_coord[1], cute.make_layout(cfg.cluster_n),
                                           cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cpasync.tma_partition(tma_b, cluster_coord[0], cute.make_layout(cfg.cluster_m),
                                           cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
        pipeline_init_wait(cluster_shape_mn=(cfg.cluster_m, cfg.cluster_n))

        if wg_idx == 0:
            # ---- phase 2: producer (epi_wg: warps 1-3 run the epilogue, EWG_REGS registers; epilogue_wg.py)
            if cutlass.const_expr(not self.ewg):
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            else:
                cute.arch.setmaxregister_increase(epilogue_wg.EWG_REGS)
                if warp_idx > 0:
                    self.ewg_run(tidx - 32, sStage, rings, mD, store_tensors, op_tensors, red_tensors)
            if warp_idx == 0:
                w = self._work(mD)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
                t = w["cluster"]
                if cutlass.const_expr(self.dynamic):
                    ring_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, schedule.RING)
                    t = schedule.producer_next(sched, ring_state)
                    ring_state.advance()
                while t < w["n_tiles"]:  # this cluster's tiles (units): c, c + P, ... or the counter's (schedule.py)
                    m, n, l = self._tile(w, t)
                    kb, ke = self._k_range(t, k_tiles)
                    for k in range(kb, ke):
                        mainloop.producer_acquire(state)
                        bar = mainloop.producer_get_barrier(state)
                        cute.copy(tma_a, tAgA[(None, m, k, l)], tAsA[(None, state.index)], tma_bar_ptr=bar,
                                  mcast_mask=a_mask)
                        cute.copy(tma_b, tBgB[(None, n, k, l)], tBsB[(None, state.index)], tma_bar_ptr=bar,
                                  mcast_mask=b_mask)
                        mainloop.producer_commit(state)
                        state.advance()
                        if cutlass.const_expr(cfg.l2_prefetch > 0 and len(self.pf_ops) > 0):
                            l2_prefetch.chunk(cfg, self.op_tile[1], [op_tensors[i] for i in self.pf_ops],
                                              m, n, l, k - (ke - cfg.l2_prefetch), tidx)
                    if cutlass.const_expr(self.dynamic):
                        t = schedule.producer_next(sched, ring_state)
                        ring_state.advance()
                    else:
                        t += w["n_clusters"]
                mainloop.producer_tail(state)
                if cutlass.const_expr(self.dynamic):
                    for _ in cutlass.range_constexpr(schedule.RING):
                        schedule.ring_drain(sched, ring_state)
                        ring_state.advance()
                    schedule.finish(sched[3])
        elif cutlass.const_expr(self.ewg):  # ---- phase 3a only: the MMA warpgroups hand each tile over
            cute.arch.setmaxregister_decrease(epilogue_wg.MMA_REGS)
            self.consumer(tidx, wg_idx - 1, mainloop, sched, k_tiles, sA, sB, sOuts, sOps, tiled_mma, mD,
                          store_atoms, store_tensors, op_tensors, red_tensors, tile_ld, sStage)
        else:
            # ---- phase 3: consumers
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self.consumer(tidx, wg_idx - 1, mainloop, sched, k_tiles, sA, sB, sOuts, sOps, tiled_mma, mD,
                          store_atoms, store_tensors, op_tensors, red_tensors, tile_ld)

    @cute.jit
    def consumer(self, tidx, cwg, mainloop, sched, k_tiles, sA, sB, sOuts, sOps, tiled_mma, mD, store_atoms,
                 store_tensors, op_tensors, red_tensors, tile_ld, sStage=None):
        cfg = self.cfg
        pp = cfg.pingpong
        # thread index inside the group that shares a tile: the warpgroup (ping-pong) or both warpgroups
        etidx = tidx % WG_THREADS if pp else tidx - WG_THREADS
        thr_mma = tiled_mma.get_slice(0 if pp else cwg * WG_THREADS)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        gD = cute.local_tile(mD, (cfg.tile_m, cfg.tile_n), (None, None, None))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gD[(None, None, 0, 0, 0)]).shape, self.acc_dtype)
        k_blocks = cute.size(tCrA, mode=[2])

        w = self._work(mD)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        tile_step = 1
        t = w["cluster"]
        if cutlass.const_expr(pp):
            tile_step = 2
            if cwg == 1:  # warpgroup 1 starts on the CTA's second tile, after warpgroup 0's k-tiles
                t += w["n_clusters"]
                read.advance(k_tiles)
                release.advance(k_tiles)
                # let warpgroup 0 start its first mainloop
                cute.arch.barrier_arrive(barrier_id=BAR_ORDER, number_of_threads=2 * WG_THREADS)
        if cutlass.const_expr(self.dynamic):  # the producer warp's tile indices (schedule.py)
            ring_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, schedule.RING)
            t = schedule.consumer_next(sched, ring_state)
            ring_state.advance()

        # ---- epilogue partitions (shared by every tile; the epilogue warps of epi_wg have their own)
        epi, scalars = None, {}
        if cutlass.const_expr(not self.ewg):
            epi = self._epi_setup(tiled_mma, etidx, cwg, sOuts, mD, tile_ld["out_views"])
            scalars = self._read_scalars(op_tensors)
        tiles_done = cutlass.Int32(0)
        sk = None  # split-K (split_k.py): the workspace, the flags, the consumers' barrier, this CTA's slot offset
        if cutlass.const_expr(cfg.splits > 1):
            sk = (*sched, pipeline.NamedBarrier(barrier_id=BAR_EPI, num_threads=self.epi_threads),
                  cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()))

        while t < w["n_tiles"]:  # this consumer's tiles (split-K: units; schedule.py, split_k.py)
            m, n, l = self._tile(w, t)
            kb, ke = self._k_range(t, k_tiles)
            pre = []
            if cutlass.const_expr(not self.ewg):
                # this tile's VecN / VecM operand values, loaded now so the global-memory latency hides under the
                # mainloop; the epilogue writes them to shared memory
                pre = self._prefetch(op_tensors, m, n, l, etidx)
                # and the TMA loads of its first `ring` TileMN sub-tiles (into buffers the previous tile is done
                # with)
                if cutlass.const_expr(cfg.splits > 1):
                    if ke == k_tiles:  # split-K: the final unit runs the epilogue
                        self._first_tile_loads(tile_ld, m, n, l, tiles_done, cwg, etidx)
                else:
                    self._first_tile_loads(tile_ld, m, n, l, tiles_done, cwg, etidx)
            # ---- 3a mainloop
            if cutlass.const_expr(pp):
                cute.arch.barrier(barrier_id=BAR_ORDER + cwg, number_of_threads=2 * WG_THREADS)
            read, release = self._mainloop(mainloop, read, release, ke - kb, k_blocks, tiled_mma, acc, tCrA, tCrB,
                                           dict(sA=sA, tidx=etidx, m=m, n=n, n_cols=w["cols"] * cfg.cluster_n,
                                                ops=op_tensors))
            if cutlass.const_expr(pp):
                # hand the tensor cores to the other warpgroup, skip its k-tiles in the pipeline state
                cute.arch.barrier_arrive(barrier_id=BAR_ORDER + 1 - cwg, number_of_threads=2 * WG_THREADS)
                read.advance(k_tiles)
                release.advance(k_tiles)

            # ---- 3b epilogue (or the hand-off to the epilogue warpgroup; split-K: a non-final unit's partial to
            # the workspace, the final unit adds the others' first)
            stage = dict(pre=pre, sOps=sOps, scalars=scalars, ld=tile_ld, etidx=etidx)
            if cutlass.const_expr(self.ewg):
                self.ewg_stage(acc, tiled_mma, etidx, sStage)
                tiles_done += 1
            elif cutlass.const_expr(cfg.splits > 1):
                if ke == k_tiles:
                    self._split_fixup(sk, acc, t, True, etidx)
                    self._epilogue(epi, acc, m, n, l, tiles_done, mD, store_atoms, store_tensors, op_tensors,
                                   red_tensors, cwg, stage)
                    tiles_done += 1
                else:
                    self._split_fixup(sk, acc, t, False, etidx)
            else:
                self._epilogue(epi, acc, m, n, l, tiles_done, mD, store_atoms, store_tensors, op_tensors,
                               red_tensors, cwg, stage)
                tiles_done += 1
            if cutlass.const_expr(self.dynamic):
                t = schedule.consumer_next(sched, ring_state)
                ring_state.advance()
            else:
                t += tile_step * w["n_clusters"]
        cute.arch.cp_async_bulk_wait_group(0, read=True)  # the last TMA stores are done with shared memory

    def _tiled_mma(self, a_layout, b_layout):
        """The WGMMA of the mainloop: both operands from shared memory, one 64-row atom per consumer warpgroup."""
        return sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, a_layout.sm90_mma_major_mode(), b_layout.sm90_mma_major_mode(),
            self.acc_dtype, self.atom_layout, tiler_mn=(64, self.cfg.tile_n))

    @cute.jit
    def _mainloop(self, mainloop, read, release, k_tiles, k_blocks, tiled_mma, acc, tCrA, tCrB, ctx):
        """One tile's k-loop: wait for each stage, its WGMMAs, release the previous stage once they are done;
        returns the advanced pipeline states (the caller's objects do not see this function's updates). ``ctx``:
        the A tiles in shared memory, the thread's index in the tile's group, the tile's row and column blocks,
        the number of column blocks and the epilogue's operands (unused here; for a mainloop that transforms A,
        docs/experiments/a_transform.py)."""
        # first k-tile peeled: its first WGMMA overwrites the accumulator, every later one accumulates
        mainloop.consumer_wait(read)
        warpgroup.fence()
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        for j in cutlass.range_constexpr(k_blocks):
            cute.gemm(tiled_mma, acc, tCrA[(None, None, j, read.index)], tCrB[(None, None, j, read.index)], acc)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        read.advance()
        for k in range(1, k_tiles):
            mainloop.consumer_wait(read)
            warpgroup.fence()
            for j in cutlass.range_constexpr(k_blocks):
                cute.gemm(tiled_mma, acc, tCrA[(None, None, j, read.index)], tCrB[(None, None, j, read.index)], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(1)  # the previous k-tile's WGMMAs are done: release its stage
            mainloop.consumer_release(release)
            release.advance()
            read.advance()
        warpgroup.wait_group(0)
        mainloop.consumer_release(release)
        release.advance()
        return read, release

    def _cluster_tiles(self, mD):
        """(cluster rows, cluster columns) of the output (a batch adds mD.shape[2] times as many cluster tiles)."""
        cfg = self.cfg
        tiles_m = (mD.shape[0] + self.out_tile[0] - 1) // self.out_tile[0]
        tiles_n = (mD.shape[1] + self.out_tile[1] - 1) // self.out_tile[1]
        return (tiles_m + cfg.cluster_m - 1) // cfg.cluster_m, (tiles_n + cfg.cluster_n - 1) // cfg.cluster_n

    @cute.jit
    def _work(self, mD):
        """This CTA's place in the persistent schedule (schedule.py): cluster tiles, this cluster's index, the
        number of clusters, the CTA's rank in its cluster."""
        cfg = self.cfg
        bidx, bidy, bidz = cute.arch.block_idx()
        _, _, n_clusters = cute.arch.grid_dim()
        rows, cols = self._cluster_tiles(mD)
        # n_tiles: linear units (split-K: splits per cluster tile; split_k.py)
        return dict(rows=rows, cols=cols, n_tiles=rows * cols * mD.shape[2] * cfg.splits, cluster=bidz,
                    n_clusters=n_clusters, rank_m=bidx % cfg.cluster_m, rank_n=bidy % cfg.cluster_n)

    @cute.jit
    def _tile(self, w, t):
        """CTA tile (m, n, l) of linear cluster tile t (split-K: of linear unit t)."""
        cfg = self.cfg
        if cutlass.const_expr(cfg.splits > 1):
            t = t // cfg.splits
        mc, nc, l = schedule.tile_coord(t, w["rows"], w["cols"], cfg.swizzle, cfg.raster == "m")
        return (cute.arch.make_warp_uniform(mc * cfg.cluster_m + w["rank_m"]),
                cute.arch.make_warp_uniform(nc * cfg.cluster_n + w["rank_n"]), cute.arch.make_warp_uniform(l))

    @cute.jit
    def _k_range(self, t, k_tiles):
        """The k-tiles [kb, ke) of linear unit t: all of them, or its split's (split_k.py)."""
        kb, ke = 0, k_tiles
        if cutlass.const_expr(self.cfg.splits > 1):
            _, _, kb, ke = split_k.unit(t, self.cfg.splits, k_tiles)
        return kb, ke

    @cute.jit
    def _split_fixup(self, sk, acc, t, final: cutlass.Constexpr, etidx):
        """Split-K after a unit's mainloop (split_k.py): a non-final split stores its partial, the final one adds
        the tile's other partials in split order."""
        cfg = self.cfg
        ws, flags, bar, rank = sk
        size = cfg.cluster_m * cfg.cluster_n
        tile, s, _, _ = split_k.unit(t, cfg.splits, 1)
        slot0 = tile * (cfg.splits - 1) * size + rank  # split_k.slot(tile, 0, rank, ...); split s: + s * size
        if cutlass.const_expr(final):
            split_k.add_partials(acc, ws, flags, slot0, cfg.splits - 1, size, etidx, self.epi_threads, bar)
        else:
            split_k.store_partial(acc, ws, flags, slot0 + s * size, etidx, self.epi_threads, bar)

    @cute.jit
    def _first_tile_loads(self, tile_ld, m, n, l, tiles_done, cwg, etidx):
        """The TMA loads of a tile's first ``ring`` TileMN sub-tiles, issued before its mainloop (into buffers the
        previous tile is done with)."""
        for e in cutlass.range_constexpr(min(self.ring, self.cfg.tile_n // self.cfg.epi_n)):
            self._load_tiles(tile_ld, e, m, n, l, tiles_done, cwg, etidx)

    # ------------------------------------------------------------------------------------------------- epilogue
    @cute.jit
    def _epi_setup(self, tiled_mma, etidx, cwg, sOuts, mD, out_views):
        """Register->shared-memory copy partitions of the epilogue sub-tile, one per tile output. With no tile
        output (an epilogue of reductions only) the D-typed partition still gives the register/coordinate map.
        Half-width and 1 -> 2 outputs are written element by element through :class:`RingView` addresses."""
        d_layout = self.d_layout
        atom_c = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(d_layout.is_m_major_c(), 4), self.d_dtype)
        tiled_copy_c = cute.make_tiled_copy_C_atom(atom_c, tiled_mma)
        parts = []
        for s in sOuts:
            if cutlass.const_expr(not (self.half or self.expand)):  # those are stored element by element instead
                r2s = sm90_utils.get_smem_store_op(d_layout, elem_ty_d=s.element_type,
                                                   elem_ty_acc=self.acc_dtype)
                tiled = cute.make_tiled_copy_S(r2s, tiled_copy_c)
                parts.append((tiled, tiled.get_slice(etidx).partition_D(s)))
        if cutlass.const_expr(len(parts) > 0):
            tiled0 = parts[0][0]
            thr0 = tiled0.get_slice(etidx)
            rshape = cute.shape(thr0.partition_S(sOuts[0]))[:3]
        else:
            r2s = sm90_utils.get_smem_store_op(d_layout, elem_ty_d=self.d_dtype, elem_ty_acc=self.acc_dtype)
            tiled0 = cute.make_tiled_copy_S(r2s, tiled_copy_c)
            thr0 = tiled0.get_slice(etidx)
            rshape = cute.shape(thr0.partition_S(cute.make_identity_tensor(self.epi_tile)))[:3]
        # this thread's (row, column) in the sub-tile for each register (the half-width stores address smem by it)
        cloc = thr0.partition_S(cute.make_identity_tensor(self.epi_tile))
        return dict(parts=parts, tiled=tiled0, thr=thr0, souts=sOuts, tiled_mma=tiled_mma, rshape=rshape,
                    cloc=cloc, views=out_views)

    def _ld_buf(self, tiles_done, e, cwg):
        """(ring buffer, mbarrier phase) of TileMN sub-tile e of this consumer's tiles_done-th tile: the sub-tiles
        u = tiles_done * n_epi + e take the consumer's ``ring`` buffers in turn."""
        u = tiles_done * (self.cfg.tile_n // self.cfg.epi_n) + e
        return (self.ring * cwg if self.cfg.pingpong else 0) + u % self.ring, (u // self.ring) % 2

    @cute.jit
    def _load_tiles(self, ld, e, m, n, l, tiles_done, cwg, etidx):
        """TMA-load sub-tile e of tile (m, n, l) of every TMA TileMN operand into its ring buffer: the first
        epilogue warp issues the copies (the TMA copy elects one lane itself: the whole warp must execute it), one
        elected lane arms the buffer's mbarrier with the byte count (out-of-bounds rows / columns are zero-filled
        and counted); the epilogue waits on the mbarrier."""
        if cutlass.const_expr(len(self.tma_tiles) > 0):
            b, _ = self._ld_buf(tiles_done, e, cwg)
            if cute.arch.make_warp_uniform(etidx // 32) == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(ld["mbar"] + b, self.ld_tx)
                for k in cutlass.range_constexpr(len(self.tma_tiles)):
                    width = self.op_tile[1] * (self.cfg.tile_n // self.cfg.epi_n)
                    gT = cute.local_tile(ld["tensors"][k], (self.cfg.tile_m, width), (m, n, l))
                    sP, gP = cpasync.tma_partition(ld["atoms"][k], 0, cute.make_layout(1),
                                                   cute.group_modes(ld["smem"][k], 0, 2),
                                                   cute.zipped_divide(gT, self.op_tile))
                    cute.copy(ld["atoms"][k], gP[(None, (0, e))], sP[(None, b)], tma_bar_ptr=ld["mbar"] + b)

    def _prefetch(self, op_tensors, m, n, l, etidx):
        """[[(value, index in the tile's buffer, store predicate or None)] per staged operand]: each epilogue
        thread loads every epi_threads-th value of the tile (clamped indices: padded rows / columns are computed,
        never stored)."""
        pre = []
        for i, length in self.staged:
            t, kind = op_tensors[i], self.epi.operands[i].spec
            vals = []
            for j in range((length + self.epi_threads - 1) // self.epi_threads):
                c = etidx + j * self.epi_threads
                pred = None if (j + 1) * self.epi_threads <= length else c < length
                vals.append((kind.prefetch(t, m, n, l, length, c).to(cutlass.Float32), c, pred))
            pre.append(vals)
        return pre

    @cute.jit
    def _epilogue(self, epi, acc, m, n, l, tiles_done, mD, store_atoms, store_tensors, op_tensors,
                  red_tensors, cwg, stage):
        cfg = self.cfg
        pp = cfg.pingpong
        M, N = mD.shape[0], (mD.shape[1] * 2 if self.half else mD.shape[1] // 2 if self.expand else mD.shape[1])
        rD = cute.make_rmem_tensor(epi["rshape"], self.acc_dtype)
        n_v = cute.size(rD)
        n_epi = cfg.tile_n // cfg.epi_n
        needs_coords = not self.epi.is_identity
        cEpi = cute.flat_divide(cute.local_tile(cute.make_identity_tensor((M, N, mD.shape[2])),
                                                (cfg.tile_m, cfg.tile_n), (m, n, l)), self.epi_tile)
        # thread 0's static sub-tile coordinates tell which registers share a row / a column (same for all threads)
        c_sub = epi["tiled"].get_slice(0).partition_S(cute.make_identity_tensor(self.epi_tile))
        c_sub = self._static_coords(c_sub, n_v)  # read once: each read of a coordinate tensor is traced IR
        rows_of, cols_of = self._groups(c_sub, n_v)
        if cutlass.const_expr(needs_coords):
            self._check_affine(epi, c_sub, n_v)
        acc_of = self._acc_map(epi["tiled_mma"], c_sub, n_v, n_epi)
        bar = pipeline.NamedBarrier(barrier_id=BAR_EPI + (cwg if pp else 0), num_threads=self.epi_threads)
        buf_base = cwg * self.epi_stages if pp else 0
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        store_warp = warp == (4 + 4 * cwg if pp else 4)
        names = self.store_names
        # staged operands -> this consumer tile's shared-memory buffer (the previous tile's epilogue finished
        # reading it before its last barrier)
        slot = cwg if pp else 0
        for k in cutlass.range_constexpr(len(self.staged)):
            for v, c, pred in stage["pre"][k]:
                if cutlass.const_expr(pred is None):
                    stage["sOps"][k][(c, slot)] = v
                else:
                    self._store_if(stage["sOps"][k], (c, slot), v, pred)
        if cutlass.const_expr(len(self.staged) > 0):
            bar.arrive_and_wait()
        staged = {self.epi.operands[i].name: (stage["sOps"][k], slot) for k, (i, _) in enumerate(self.staged)}
        lbase = epi["cloc"][0]  # this thread's register 0 in the sub-tile: (row, column) local to the tile
        row_acc = [[None] * len(rows_of) for _ in self.red_n]
        cSub0 = None
        seg = None
        if cutlass.const_expr(self.segments):  # every segment sum of the tile, before its sub-tiles are visited
            seg = segment.prepass(self, acc, acc_of, c_sub, n_v, n_epi, lambda e: SubTile(
                self, epi["thr"].partition_S(cEpi[(None, None, 0, e)]), c_sub, op_tensors, M, N,
                (lbase, e * cfg.epi_n, staged, stage["scalars"], {})))

        for e in cutlass.range_constexpr(n_epi):
            for v in cutlass.range_constexpr(n_v):
                rD[v] = acc[acc_of[e][v]]
            if cutlass.const_expr(needs_coords):
                cSub = epi["thr"].partition_S(cEpi[(None, None, 0, e)])
                if cutlass.const_expr(e == 0):
                    cSub0 = cSub
                tiles = {}
                if cutlass.const_expr(len(self.tma_tiles) > 0):  # this sub-tile's TileMN values have landed
                    b, phase = self._ld_buf(tiles_done, e, cwg)
                    cute.arch.mbarrier_wait(stage["ld"]["mbar"] + b, phase)
                    tiles = {self.epi.operands[i].name: stage["ld"]["views"][k].buffer(b)
                             for k, i in enumerate(self.tma_tiles)}
                lazy = SubTile(self, cSub, c_sub, op_tensors, M, N,
                                  (lbase, e * cfg.epi_n, staged, stage["scalars"], tiles))
                if cutlass.const_expr(seg is not None):
                    lazy.segments = lambda v, e=e: seg[(e, v)]
                results = self._visit_pairs(rD, lazy, c_sub, n_v) if self.pair_mode else self._visit_all(rD, lazy, n_v)
            else:
                results = {"out": [rD[v] for v in range(n_v)]}
            # per-row (axis n) reductions: one row's registers combined in-thread, carried across sub-tiles
            for ri, r in enumerate(self.red_n):
                for g, regs in enumerate(rows_of):
                    xs = [results[r.name][v] for v in regs]
                    if cutlass.const_expr(r.op == "logsumexp"):
                        row_acc[ri][g] = lse.update(row_acc[ri][g], xs)
                    else:
                        val = xs[0]
                        for x in xs[1:]:
                            val = self._combine(r.op, val, x)
                        row_acc[ri][g] = val if e == 0 else self._combine(r.op, row_acc[ri][g], val)
            # per-column (axis m) reductions: over the tile's rows, through shared memory
            if cutlass.const_expr(len(self.red_m) > 0):
                self._reduce_m(results, cols_of, c_sub, cSub, red_tensors, m, l, M, N)
            # tile outputs: convert, stmatrix into this sub-tile's buffer, then one warp TMA-stores them
            buf = buf_base + (tiles_done * n_epi + e) % self.epi_stages
            for i in cutlass.range_constexpr(len(epi["parts"])):
                tiled_i, tRS_s = epi["parts"][i]
                rOut = cute.make_rmem_tensor(epi["rshape"], self.out_dtypes[i])
                vals = results[names[i]]
                for v in cutlass.range_constexpr(n_v):
                    rOut[v] = self.out_dtypes[i](vals[v])
                cute.copy(tiled_i, rOut, tRS_s[(None, None, None, buf)])
            if cutlass.const_expr(self.half):  # one value per pair, at (row, column / 2) of the half-width buffer
                for i in cutlass.range_constexpr(len(names)):
                    vals = results[names[i]]
                    sBuf = epi["views"][i].buffer(buf)
                    for p in cutlass.range_constexpr(n_v // 2):
                        r, c = epi["cloc"][2 * p]
                        sBuf.at(r, c // 2)[0] = self.out_dtypes[i](vals[p])
            if cutlass.const_expr(self.expand):  # two values per element, at (row, 2 column + 0 / 1)
                sBuf = epi["views"][0].buffer(buf)
                for v in cutlass.range_constexpr(n_v):
                    w = column_pair(c_sub, v)  # trace time; v == w + 1 was written with w
                    if cutlass.const_expr(w == v):  # columns c, c + 1: 4 values, one write
                        r, c = epi["cloc"][v]
                        f = cute.make_rmem_tensor((4,), self.out_dtypes[0])
                        for i, (u, key) in enumerate(((v, "out"), (v, ODD_OUT), (v + 1, "out"), (v + 1, ODD_OUT))):
                            f[i] = self.out_dtypes[0](results[key][u])
                        cute.autovec_copy(f, sBuf.at(r, 2 * c, 4))
                    elif cutlass.const_expr(w is None):
                        r, c = epi["cloc"][v]
                        for h, key in ((0, "out"), (1, ODD_OUT)):
                            sBuf.at(r, 2 * c + h)[0] = self.out_dtypes[0](results[key][v])
            # one barrier per sub-tile: before it, the store warp waits until at most epi_stages - 2 of its stores
            # still read shared memory, i.e. the store of sub-tile e - epi_stages + 1 is done with the buffer that
            # sub-tile e + 1 writes after the barrier (sub-tile e's buffer was freed the same way one barrier ago).
            # After it, every thread is also done with sub-tile e's TileMN buffers and staged operands.
            if cutlass.const_expr(len(names) > 0):
                cute.arch.fence_proxy("async.shared", space="cta")
                if store_warp:
                    cute.arch.cp_async_bulk_wait_group(self.epi_stages - 2, read=True)
                bar.arrive_and_wait()
                if store_warp:
                    for i in cutlass.range_constexpr(len(names)):
                        gTile = cute.local_tile(store_tensors[i], self.out_tile, (m, n, l))
                        sT, gT = cpasync.tma_partition(store_atoms[i], 0, cute.make_layout(1),
                                                       cute.group_modes(epi["souts"][i], 0, 2),
                                                       cute.zipped_divide(gTile, self.store_tile))
                        cute.copy(store_atoms[i], sT[(None, buf)], gT[(None, (0, e))])
                    cute.arch.cp_async_bulk_commit_group()
            # no tile output (reductions only): no per-sub-tile barrier except before a TileMN buffer is reused
            elif cutlass.const_expr(len(self.tma_tiles) > 0 and e + self.ring < n_epi):
                bar.arrive_and_wait()
            if cutlass.const_expr(e + self.ring < n_epi):  # every thread is done with sub-tile e's TileMN buffer
                self._load_tiles(stage["ld"], e + self.ring, m, n, l, tiles_done, cwg, stage["etidx"])
        if cutlass.const_expr(len(names) == 0):
            # one barrier per tile instead: the staged operands' and TileMN buffers are free for the next tile
            bar.arrive_and_wait()

        # finish the per-row partials: the 4 lanes of a quad hold the same rows
        lane = cute.arch.lane_idx()
        for ri, r in enumerate(self.red_n):
            for g, regs in enumerate(rows_of):
                val = row_acc[ri][g]
                if cutlass.const_expr(r.op == "logsumexp"):
                    val = lse.finish(val)
                else:
                    for off in (1, 2):
                        val = self._combine(r.op, val, cute.arch.shuffle_sync_bfly(val, offset=off))
                row = cSub0[regs[0]][0]
                # n < N-tiles: the scheduler pads the tile grid (swizzle groups, cluster shape); a padded tile's
                # elements are all masked, but its partial has no slot in the (M, N-tiles, L) buffer
                self._store_if(red_tensors[ri], (row, n, l), val,
                               (lane % 4 == 0) & (row < M) & (n * cfg.tile_n < N))

    @cute.jit
    def _reduce_m(self, results, cols_of, c_static, cSub, red_tensors, m, l, M, N):
        """Per-column partials of this sub-tile: in-thread over a column's registers, then across the 8 lanes that
        share the column; lanes 0-3 of each warp write one partial per (column, warp slot of the M-tile). In a
        pairs epilogue a reduction has one value per pair, held by the even column's registers (the odd
        column's hold the neutral element and are skipped): the partial of pair j = column // 2."""
        lane = cute.arch.lane_idx()
        warps = self.cfg.warps_per_tile
        warp_slot = m * warps + cute.arch.warp_idx() % warps  # warps 4..11 (coop) or 4..7 / 8..11 (ping-pong)
        for ri, r in enumerate(self.red_m):
            for g, regs in enumerate(cols_of):
                if cutlass.const_expr(self.pair_mode is not None and c_static[regs[0]][1] % 2 == 1):
                    continue
                val = results[r.name][regs[0]]
                for v in regs[1:]:
                    val = self._combine(r.op, val, results[r.name][v])
                for off in (4, 8, 16):  # lanes with the same lane % 4 hold the same columns
                    val = self._combine(r.op, val, cute.arch.shuffle_sync_bfly(val, offset=off))
                col, n_cols = cSub[regs[0]][1], N
                if cutlass.const_expr(self.pair_mode is not None):
                    col, n_cols = col // 2, N // 2
                # padded M-tiles (cluster shape, swizzle) have no slot in the partial buffer
                self._store_if(red_tensors[len(self.red_n) + ri], (col, warp_slot, l), val,
                               (lane < 4) & (col < n_cols) & (m * self.cfg.tile_m < M))
