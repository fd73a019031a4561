"""``coda.gemm``: D = epilogue(a @ b.T) on CODA's Hopper kernel (F.linear semantics).

Argument checks (``coda._validate``) run first on any machine; then the Hopper check; then the config is chosen
(``config=None``: ``coda.runtime.select``, i.e. the in-memory / on-disk tuning result, a shipped config or the
heuristic ``default_config``; a tuning run on a miss only with ``CODA_AUTOTUNE=1``); then the kernel for (config,
epilogue, dtypes) is loaded from the on-disk compile cache or compiled, once per process (cached, thread-safe),
and launched on the current stream.

Repeated calls with the same shapes, strides, dtypes, epilogue and config reuse a *launch plan*
(``coda._launch``): only the data pointers and the stream change, and the compiled host function is called
directly. ``CODA_LAUNCH_PLANS=0`` turns plans off. ``CODA_L2_PREFETCH=P`` (an experiment switch) runs every GEMM
whose epilogue reads TileMN operands with ``GemmConfig.l2_prefetch=P``, 0 included, whatever its config says
(``coda.config.l2_prefetch_env``).

Split-K (``config=None``, identity epilogue, 2-D operands): a problem whose output tiles fill few SMs and whose K is
long (``coda.config.split_k``'s model, e.g. the weight gradient of a small layer, K = tokens) runs as one batched
launch over ``split`` K-slices of ``a`` and ``b`` (strided views, nothing copied) into fp32 partials, which
``torch.sum`` adds (fp32) and, for a 16-bit result, casts: a deterministic reduction pass.
"""
from __future__ import annotations

import os
import threading
from typing import Optional

import torch

from . import _device, _launch
from ._validate import check_gemm_args
from .config import GemmConfig, l2_prefetch_env, split_k
from .kernels.operand_kinds import SCALAR, TILE
from .kernels.epilogue import (Epilogue, check_call, check_epilogue, empty_reductions,
                               finish_reduction, out_flags)
from .runtime import precompile as _precompile
from .runtime.rules import split_reason
from .runtime.select import measured_config, select_config

_TORCH_TO_CUTLASS = {}
_cache: dict = {}
_lock = threading.Lock()
_max_clusters: dict = {}
_plans: dict = {}  # plan key -> _launch.Plan
_PLAN_LIMIT = 4096


def _cutlass_dtype(dt: torch.dtype):
    import cutlass
    if not _TORCH_TO_CUTLASS:
        _TORCH_TO_CUTLASS.update({torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
                                  torch.float32: cutlass.Float32})
    return _TORCH_TO_CUTLASS[dt]


def _mnl(t: torch.Tensor) -> torch.Tensor:
    """(L, R, C) torch tensor -> (R, C, L) view, the kernel's mode order (C contiguous)."""
    return t.permute(1, 2, 0)


def _canonical(t: torch.Tensor, leading: int) -> torch.Tensor:
    """``t`` with a canonical stride for size-1 dims (torch may give them any value, and a TMA descriptor needs
    every stride to be a multiple of 16 bytes); a view, the data is not copied."""
    if any(s == 1 for s in t.shape):
        strides = list(t.stride())
        span = max((st * (sz - 1) for st, sz in zip(strides, t.shape) if sz > 1), default=0) + 1
        span = -(-span // 8) * 8
        strides = [span if sz == 1 and i != leading else st for i, (st, sz) in enumerate(zip(strides, t.shape))]
        t = t.as_strided(t.shape, strides)
    return t


def tma_aligned(t: torch.Tensor) -> bool:
    """Whether TMA can read ``t``: a 16-byte aligned address and every non-unit stride a multiple of 16 bytes."""
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all((st * es) % 16 == 0 for st in t.stride() if st != 1)


def _cute(t: torch.Tensor, leading: int):
    """A cute view of ``t`` (already canonical, see :func:`_canonical`)."""
    from cutlass.cute.runtime import from_dlpack
    return from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=leading)


def _max_active_clusters(size: int, device=None) -> int:
    if size not in _max_clusters:
        from coda.runtime import compile_cache
        from coda.runtime.keys import device_info

        def compute():
            import cutlass.utils
            return cutlass.utils.HardwareInfo().get_max_active_clusters(size)
        _max_clusters[size] = compile_cache.max_active_clusters(device_info(device), size, compute)
    return _max_clusters[size]


def _new_partial(shape, device) -> torch.Tensor:
    """A reduction's partial buffer (L, tiles, length), fp32; every entry is written by the kernel."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def epilogue_tensors(epi: Epilogue, prob, operands: dict, out3: torch.Tensor, cfg: GemmConfig):
    """The epilogue's kernel arguments (operands, extra outputs, reduction partials) as torch tensors in the
    kernel's mode order, plus the torch views handed back to the caller."""
    L, M, N = out3.shape
    # each operand as its kind passes it (coda/kernels/operand_kinds.py): a Scalar a 1-element fp32 tensor, a VecM
    # (M, L), a TileMN (M, N, L) -- M x N/2 in a pairs epilogue
    args = [op.spec.host_arg(operands[op.name], L, M, epi.operand_cols(prob.N), out3.device) for op in epi.operands]
    outs = {}
    for name in epi.outputs:
        if name in epi.inplace:  # written back into its TileMN operand (Epilogue.inplace)
            o = operands[name]
            outs[name] = o
            o = o.reshape(L, M, N)  # a view: the operand is (M, N) / (L, M, N) with a contiguous last dim
        else:
            o = outs[name] = torch.empty((L, M, N), dtype=out3.dtype, device=out3.device)
        args.append((_mnl(o), 1))
    partials = {}
    for r in epi.kernel_reductions():
        # per-row: one partial per N-tile of the accumulator (prob.N columns; out3 has N/2 for "half" pairs);
        # per-column: one partial per warp of each M-tile, for each column (each column pair j in a pairs epilogue)
        tiles, length = r.spec.partials(epi, cfg, M, prob.N)
        # per-column: slots for the M-tiles the cluster shape pads the grid with too; the default epilogue skips a
        # padded tile, the epilogue warps write its (zero) sums there (a predicate spilled their AdamW + dgamma
        # epilogue); only the real tiles' slots are finished
        slots = r.spec.kernel_slots(cfg, M) if r.axis == "m" else tiles
        p = _new_partial((L, slots, length), out3.device)
        args.append((p.permute(2, 1, 0), 0))
        partials[r.name] = (p[:, :tiles], r.op)
    if cfg.sched == "dynamic":  # the tile counter, last (kernels/schedule.py)
        args.append((_tile_counter(out3.device), 0))
    if cfg.splits > 1:  # the split-K workspace and flags, last (kernels/split_k.py)
        args += [(t, 0) for t in _split_buffers(cfg, L, M, prob.N, out3.device)]
    return args, outs, partials


_split_bufs: dict = {}
_graph_split_bufs: list = []  # captured launches' buffers, alive as long as the process (a graph may be replayed)


def _split_buffers(cfg: GemmConfig, L: int, M: int, N: int, device) -> list:
    """[workspace (fp32), flags (int32, zero between launches: the kernel resets every flag it reads)] of a split-K
    launch over the (L, M, N) accumulator: one tile slot and flag per non-final split of every CTA tile
    (``split_k.slots``). One pair per device and stream, grown as needed (stream-ordered: launches queued on a
    replaced pair finish first); a launch captured into a CUDA graph gets a pair of its own, kept alive."""
    from .kernels.split_k import slots as split_slots
    rows = -(-(-(-M // cfg.tile_m)) // cfg.cluster_m)
    cols = -(-(-(-N // cfg.tile_n)) // cfg.cluster_n)
    n = split_slots(rows * cols * L, cfg.splits, cfg.cluster_m * cfg.cluster_n)
    tile = cfg.tile_m * cfg.tile_n
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        bufs = [torch.empty(n * tile, dtype=torch.float32, device=device),
                torch.zeros(n, dtype=torch.int32, device=device)]
        _graph_split_bufs.append(bufs)
        return bufs
    key = _stream_key(device)
    bufs = _split_bufs.get(key)
    if bufs is None or bufs[0].numel() < n * tile or bufs[1].numel() < n:
        n = max(n, bufs[1].numel() if bufs else 0)
        bufs = _split_bufs[key] = [_persistent_zeros(n * tile, torch.float32, device),
                                   _persistent_zeros(n, torch.int32, device)]
    return bufs


_counters: dict = {}
# counters of launches captured into CUDA graphs: pairs of a buffer allocated (zeroed) outside any capture, one pair
# per captured launch, never handed out twice (graphs may be replayed concurrently on different streams and must
# not share a counter; replays of one graph are ordered). The kernel leaves its pair at zero, so a replay needs no
# memset node: with one (the torch.zeros this replaces) the fused llama-1b step as one graph ran ~60 fill kernels,
# 0.126 ms a step (H100, session 32). Used up: torch.zeros again. Each pair starts a 16-byte slot (COUNTER_SLOT int32):
# the kernel's tensor arguments are marshalled as 16-byte aligned (``_cute``), and a launch whose first call is
# inside a capture takes that path (session 48: pairs 8 bytes apart failed there on every odd pair).
GRAPH_COUNTERS = 4096
COUNTER_SLOT = 4
_graph_pools: dict = {}  # device index -> [buffer (COUNTER_SLOT * GRAPH_COUNTERS int32), next free pair]
_graph_lock = threading.Lock()


def _stream_key(device) -> tuple:
    """(device index, current stream handle) of a CUDA device -- what launches sharing a buffer must share --;
    (str(device), 0) elsewhere (only the CPU tests build kernel arguments there)."""
    if device.type != "cuda":
        return (str(device), 0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (index, _launch.stream_handle(index))


def _tile_counter(device) -> torch.Tensor:
    """The dynamic schedule's two int32 (next tile, finished CTAs), zero between launches: the last CTA of each
    launch resets them. One pair per device and stream, so that launches sharing one run one after another.
    A launch captured into a CUDA graph gets a pair of its own (see ``GRAPH_COUNTERS``)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        index = device.index if device.index is not None else torch.cuda.current_device()
        pool = _graph_pools.get(index)
        with _graph_lock:
            i = None if pool is None or pool[1] >= GRAPH_COUNTERS else pool[1]
            if i is not None:
                pool[1] += 1
        if i is None:  # no launch before the capture, or used up
            return torch.zeros(2, dtype=torch.int32, device=device)
        return pool[0][COUNTER_SLOT * i:COUNTER_SLOT * i + 2]
    key = _stream_key(device)
    if device.type == "cuda" and key[0] not in _graph_pools:
        _graph_pools[key[0]] = [_persistent_zeros(COUNTER_SLOT * GRAPH_COUNTERS, torch.int32, device), 0]
    c = _counters.get(key)
    if c is None:
        c = _counters[key] = _persistent_zeros(2, torch.int32, device)
    return c


def gemm(a: torch.Tensor, b: torch.Tensor, *, epilogue: Optional[Epilogue] = None, out: Optional[torch.Tensor] = None,
         out_dtype: Optional[torch.dtype] = None, config: Optional[GemmConfig] = None, **operands):
    """``epilogue(a @ b.T)`` with fp32 accumulation; a (M, K) or (L, M, K), b (N, K) or (L, N, K).

    Returns the main output (or a dict with ``"out"``, extra outputs and finished reductions when the epilogue
    declares them). Not differentiable: tensors that require grad are read through detached views (use
    ``coda.ops.linear`` for autograd)."""
    if config is not None and not isinstance(config, GemmConfig):
        raise TypeError(f"config: expected a coda.GemmConfig or None, got {type(config).__name__}")
    if _grad_tracked(a, b, out, operands):  # not differentiable (coda.ops.linear is): plain views of the data
        a, b, out, operands = _detach(a, b, out, operands)
    pkey = _plan_key(a, b, epilogue, out, out_dtype, config, operands)
    if pkey is not None and _precompile.recorder() is not None:  # a dry run: no plan is used or made
        pkey = None
    if pkey is not None:
        plan = _plans.get(pkey)
        if plan is not None:
            res = _run_plan(plan, a, b, out, operands)
            if res is not None:
                return res
    epi = check_epilogue(epilogue)
    prob = check_gemm_args(a, b, out=out, out_dtype=out_dtype, **out_flags(epi))
    check_call(epi, prob, out, operands)
    if config is not None:
        config.validate()
        why = split_reason(config, prob.K)
        if why:
            raise ValueError(f"coda.gemm: config {why}")
    _device.require_hopper(prob.device, "coda.gemm")
    if config is None and epi.is_identity and not (prob.batched or prob.zero_k or prob.empty_result):
        split = split_k(prob.M, prob.N, prob.K, prob.out_dtype.itemsize, _device.sm_count(prob.device))
        remembered = measured_config(prob, epi)  # a tuned or shipped in-kernel split-K wins
        if split > 1 and not (remembered is not None and remembered.splits > 1):
            return _split_k(a, b, out, prob, split)
    cfg = (config or select_config(prob, epi, a, b, operands)).validate()
    cfg = l2_prefetch_env(cfg, any(o.spec is TILE for o in epi.operands), prob.zero_k)

    res, key, views, leads, outs, partials = _kernel_views(prob, epi, cfg, a, b, out, operands)
    if key is None:  # empty result: nothing to launch
        return _package(epi, res, outs, partials, prob)
    ts = [_cute(v, lead) for v, lead in zip(views, leads)]
    import cuda.bindings.driver as cuda
    device_index = res.device.index if res.device.index is not None else torch.cuda.current_device()
    handle = _launch.stream_handle(device_index)
    cute_args = [*ts[:3], cuda.CUstream(handle), *ts[3:]]
    fn = _compiled(key, cfg, epi, prob, cute_args)
    plan = None
    if pkey is not None and os.environ.get("CODA_LAUNCH_PLANS", "1") != "0":
        plan = _make_plan(fn, cute_args, views, handle, prob, cfg, epi, (a, b, out), device_index, operands)
    if plan is not None:
        if len(_plans) >= _PLAN_LIMIT:
            _plans.clear()
        _plans[pkey] = plan
        plan.launch([v.data_ptr() for v in views], handle)
    else:
        fn(*cute_args)
    reds = {name: finish_reduction(p, op) for name, (p, op) in partials.items()}
    return _package(epi, res, outs, reds, prob)


def clear_plans() -> None:
    """Drop every cached launch plan (the repeat-call fast path): the next call of each shape chooses its config and
    kernel again (what ``coda.autotune`` does after storing or clearing results)."""
    _plans.clear()


def split_k_views(t: torch.Tensor, split: int) -> torch.Tensor:
    """(rows, K) -> (split, rows, K / split): slice s holds columns [s K/split, (s + 1) K/split) of every row; a
    strided view of ``t`` (K-major or rows-major alike), nothing copied."""
    rows, K = t.shape
    s_rows, s_k = t.stride()
    return t.as_strided((split, rows, K // split), (s_k * (K // split), s_rows, s_k))


def _split_k(a, b, out, prob, split: int):
    """``a @ b.T`` of a validated 2-D problem as ``split`` K-slices (one batched launch, fp32 partials) summed in
    slice order by elementwise adds, the last one writing the result (cast to its dtype by the add): on the H100
    ``torch.sum(partial, 0)`` + a cast took 0.27 ms for 3 x 2816 x 2048, the adds run at copy bandwidth."""
    partial = gemm(split_k_views(a, split), split_k_views(b, split), out_dtype=torch.float32)
    if out is None:
        out = torch.empty(prob.out_shape, dtype=prob.out_dtype, device=a.device)
    for s in range(1, split - 1):  # the partials are this call's own buffer: accumulate into slice 0
        partial[0].add_(partial[s])
    return torch.add(partial[0], partial[split - 1], out=out)


def whole_tiles(epi: Epilogue, cfg: GemmConfig, M: int, N: int):
    """The kernel's ``even`` flags (``GemmSm90``: a reduction along a whole-tile axis needs no mask of padded
    elements), or None where they do not apply. Only per-row reductions over whole N-tiles drop their masks (the
    fast cross entropy's logsumexp: 920 fewer SASS instructions a thread with the target select gone too); with
    the masks gone ptxas spilled in two epilogues, which keep them: the per-column dgamma of ``adamw_fold``
    (16 bytes, 128 x 256 cooperative) and the fused SwiGLU backward's row sums (60 bytes, 1 -> 2, 64 x 256
    ping-pong)."""
    if not any(r.axis == "n" for r in epi.reductions) or epi.pair_mode is not None or epi.expand:
        return None
    return (False, N % cfg.tile_n == 0)


def _kernel_views(prob, epi: Epilogue, cfg: GemmConfig, a, b, out, operands):
    """The result tensor and the kernel's arguments for a validated call: ``(res, key, views, leads, outs,
    partials)`` with ``views`` the torch tensors behind the cute tensors (A, B, D, epilogue tensors) and ``leads``
    their contiguous dims; ``key`` (the compile-cache key) is None for an empty result (nothing to launch)."""
    L = prob.L or 1
    a3 = a if a.dim() == 3 else a.unsqueeze(0)
    b3 = b if b.dim() == 3 else b.unsqueeze(0)
    if prob.b_broadcast:  # one weight for every batch: fold the batch into M (a view; checked to exist)
        a3 = a3.view(1, L * prob.M, prob.K)
    res = out if out is not None else _new_result(prob, epi, a.device)
    out3 = res if res.dim() == 3 else res.unsqueeze(0)
    if prob.b_broadcast:
        out3 = out3.reshape(1, L * prob.M, prob.out_shape[-1])
    if prob.empty_result:  # nothing to launch: empty extra outputs, reductions over nothing
        outs = {k: operands[k] if k in epi.inplace else torch.empty(prob.out_shape, dtype=prob.out_dtype,
                                                                     device=a.device) for k in epi.outputs}
        return res, None, [], [], outs, empty_reductions(epi, prob)
    if prob.zero_k:
        # the kernel needs rows of >= 16 bytes: K = 0 becomes one all-zero K-tile of 8 columns (cached zeros)
        na, nb = a3.shape[0] * a3.shape[1] * 8, b3.shape[0] * prob.N * 8
        z = _zeros(a3.device, a3.dtype, max(na, nb))
        a3, b3 = z[:na].view(a3.shape[0], a3.shape[1], 8), z[:nb].view(b3.shape[0], prob.N, 8)

    args, outs, partials = epilogue_tensors(epi, prob, operands, out3, cfg)
    # the contiguous dim of A / B in the kernel's (rows, K, L) order: 1 = K-major, 0 = MN-major
    la = 0 if prob.a_major == "mn" and not prob.zero_k else 1
    lb = 0 if prob.b_major == "mn" and not prob.zero_k else 1
    sig = tuple((t.dtype, t.dim()) for t, _ in args)
    if la == 0 or lb == 0:  # MN-major operands compile their own kernel (K-major keys stay as they were)
        sig += (("major", la, lb),)
    views = [_canonical(_mnl(a3), la), _canonical(_mnl(b3), lb), _canonical(_mnl(out3), 1)]
    views += [_canonical(t, lead) for t, lead in args]
    tiles = [v for op, v in zip(epi.operands, views[3:]) if op.kind == "tile"]
    if tiles:  # TileMN operands: TMA-loaded when 16-byte aligned (and the smem allows), else element by element
        sig += (("tile_aligned", tuple(tma_aligned(v) for v in tiles)),)
    even = whole_tiles(epi, cfg, out3.shape[1], prob.N)
    if even is not None:
        sig += (("even", even),)
    key = (cfg, epi.key(), prob.in_dtype, prob.out_dtype, sig)
    leads = [la, lb, 1] + [lead for _, lead in args]
    return res, key, views, leads, outs, partials


_zero_bufs: dict = {}


def _zeros(device, dtype, n: int) -> torch.Tensor:
    """A flat all-zero tensor of >= n elements: a K = 0 launch reads its A and B (one zero K-tile) from views of
    it. One buffer per (device, dtype), never written; a larger one replaces it when needed (the old ones are
    kept: kernels queued on other streams may still read them)."""
    bufs = _zero_bufs.setdefault((device, dtype), [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(_persistent_zeros(max(n, 2 * bufs[-1].numel() if bufs else 0), dtype, device))
    return bufs[-1]


def _persistent_zeros(size: int, dtype, device) -> torch.Tensor:
    """``torch.zeros`` for a buffer that outlives the call. On a GPU (outside a stream capture) it is allocated and
    filled by a helper thread, which then waits for its own stream: torch.compile's CUDA-graph trees route every
    allocation of the thread that warms up a graph into the graph's private pool and refuse a tensor that outlives
    the call there. Inside a capture it is the capturing thread's allocation (no host wait is allowed there)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.zeros(size, dtype=dtype, device=device)
    box: list = []

    def alloc():
        try:
            box.append(torch.zeros(size, dtype=dtype, device=device))
            torch.cuda.current_stream(device).synchronize()
        except BaseException as e:  # re-raised in the caller (e.g. out of memory)
            box.append(e)

    t = threading.Thread(target=alloc, name="coda-zeros")
    t.start()
    t.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _compiled(key, cfg: GemmConfig, epi: Epilogue, prob, cute_args):
    """The compiled host function for ``key``: in memory, else the on-disk compile cache, else compiled. In a dry
    run (``coda.runtime.precompile.recording``): the kernel's recipe is recorded and a no-op is returned."""
    rec = _precompile.recorder()
    if rec is not None:
        from coda.runtime.keys import device_info
        params = (cfg, epi, prob.in_dtype, prob.out_dtype, key[-1],
                  _max_active_clusters(cfg.cluster_m * cfg.cluster_n, prob.device))
        return rec.add("gemm", params, cute_args, device_info(prob.device).arch, in_memory=key in _cache,
                       label=f"gemm {epi.name} {cfg.name}")
    fn = _cache.get(key)
    if fn is None:
        with _lock:
            fn = _cache.get(key)
            if fn is None:
                from coda.runtime import compile_cache
                from coda.runtime.keys import device_info
                fn, _ = compile_cache.compile_kernel(cfg, epi, prob.in_dtype, prob.out_dtype, key[-1], cute_args,
                                                     _max_active_clusters(cfg.cluster_m * cfg.cluster_n,
                                                                          prob.device),
                                                     device_info(prob.device).arch)
                _cache[key] = fn
    return fn


def _grad_tracked(a, b, out, operands) -> bool:
    return any(getattr(t, "requires_grad", False) for t in (a, b, out, *operands.values()))


def _detach(a, b, out, operands):
    """Tensors that autograd tracks cannot be handed to the kernel (DLPack refuses them); coda.gemm computes no
    gradient, so it reads their data through detached views (same memory, nothing copied)."""
    def d(t):
        return t.detach() if isinstance(t, torch.Tensor) else t
    return d(a), d(b), d(out), {k: d(v) for k, v in operands.items()}


def _plan_key(a, b, epilogue, out, out_dtype, config, operands):
    if epilogue is None:
        ek = None
    elif isinstance(epilogue, Epilogue):
        ek = (type(epilogue), epilogue.key())
    else:
        return None
    return _launch.plan_key(a, b, ek, out, out_dtype, config, operands)


def _make_plan(fn, cute_args, views, handle, prob, cfg, epi, tensors, device_index, operands):
    """A launch plan checked against the DSL's marshalling of this call (None if it does not match)."""
    try:
        plan = _launch.Plan(fn, cute_args, views, handle)
    except _launch.PlanError:
        return None
    plan.prob, plan.cfg, plan.epi, plan.device_index = prob, cfg, epi, device_index
    # an epilogue whose kernel arguments are all its operands' own memory -- tensor operands passed as views,
    # Scalars given as 1-element fp32 device tensors, extra outputs only in place (an operand's memory again, e.g.
    # coda.optim's AdamW), no reductions: a repeated call only needs those data pointers (and, for the dynamic
    # schedule, the current stream's tile counter, the last argument; split-K takes the full path: its buffers)
    plan.operand_names = None
    n_ops = len(epi.operands)
    if (plan.has_epi_args and cfg.splits == 1 and all(n in epi.inplace for n in epi.outputs)
            and not epi.kernel_reductions()
            and all((op.spec.by_view or op.spec is SCALAR) and isinstance(operands.get(op.name), torch.Tensor)
                    and v.data_ptr() == operands[op.name].data_ptr() for op, v in zip(epi.operands, views[3:]))
            and all(v.data_ptr() == operands[n].data_ptr() for n, v in zip(epi.outputs, views[3 + n_ops:]))):
        plan.operand_names = tuple(op.name for op in epi.operands) + tuple(epi.outputs)
    # tensor operands: their address must stay 16-byte aligned, as check_operands requires on the full path (the
    # cute views assume it; TileMN operands may be TMA-loaded); shapes and strides are in the plan's key
    plan.tensor_operands = tuple(op.name for op in epi.operands if op.spec.by_view)
    a, b, out = tensors
    plan.extents = (_launch.byte_extent(a), _launch.byte_extent(b), 0 if out is None else _launch.byte_extent(out))
    # every tensor operand's byte extent (its shape and strides are in the key) for the per-call overlap test
    # with out, and the operands found to be exactly out (in place: same address, same layout) and accepted by
    # check_call, which depends on nothing else a plan does not fix
    plan.operand_extents = tuple((n, _launch.byte_extent(v)) for n, v in operands.items()
                                 if isinstance(v, torch.Tensor) and v.numel())
    plan.aliases_ok = set()
    plan.zero_elems = max(views[0].numel(), views[1].numel()) if prob.zero_k else 0  # A, B: views of _zeros
    return plan


def _run_plan(plan, a, b, out, operands):
    """A repeated call through its launch plan; None when a per-call check fails (the full path then raises the
    proper error). Shapes, strides, dtypes, devices and the epilogue are the plan's (its key); what is left to check
    per call is what depends on the data pointers: 16-byte alignment and ``out`` sharing memory with ``a``/``b`` or
    with an operand (as the full path's ``check_call``)."""
    prob = plan.prob
    if prob.zero_k:  # K = 0: A and B are the cached zeros (the buffer may have been replaced by a larger one)
        pa = pb = _zeros(a.device, a.dtype, plan.zero_elems).data_ptr()
    else:
        pa, pb = a.data_ptr(), b.data_ptr()
    if (pa | pb) & 15 or any(operands[n].data_ptr() & 15 for n in plan.operand_names or plan.tensor_operands):
        return None
    if out is None:
        res = _new_result(prob, plan.epi, a.device)
        po = res.data_ptr()
    else:
        po = out.data_ptr()
        ea, eb, eo = plan.extents
        if po & 15 or _launch.overlap(po, eo, pa, ea) or _launch.overlap(po, eo, pb, eb):
            return None
        for n, e in plan.operand_extents:
            pv = operands[n].data_ptr()
            if not _launch.overlap(po, eo, pv, e) or (pv == po and e == eo and n in plan.aliases_ok):
                continue
            # out shares memory with an operand: allowed only as add-to-output or in place (a TileMN operand that is
            # exactly out); the full path's check decides (check_call), else the full path raises its error
            try:
                check_call(plan.epi, prob, out, operands)
            except (TypeError, ValueError):
                return None
            if pv == po and e == eo:
                plan.aliases_ok.add(n)
        res = out
    epi = plan.epi
    if plan.operand_names is not None:  # operands only, each passed as is: just their pointers
        ptrs = [pa, pb, po, *(operands[n].data_ptr() for n in plan.operand_names)]
        if plan.cfg.sched == "dynamic":
            counter = _tile_counter(a.device)  # held until the launch is enqueued (a capture's counter is fresh)
            ptrs.append(counter.data_ptr())
        plan.launch(ptrs, _launch.stream_handle(plan.device_index))
        return _package(epi, res, {n: operands[n] for n in epi.outputs}, {}, prob) if epi.outputs else res
    if plan.has_epi_args:
        out3 = res if res.dim() == 3 else res.unsqueeze(0)
        if prob.b_broadcast:
            out3 = out3.reshape(1, prob.L * prob.M, prob.out_shape[-1])
        args, outs, partials = epilogue_tensors(epi, prob, operands, out3, plan.cfg)
        plan.launch([pa, pb, po, *(t.data_ptr() for t, _ in args)], _launch.stream_handle(plan.device_index))
        reds = {name: finish_reduction(p, op) for name, (p, op) in partials.items()}
        return _package(epi, res, outs, reds, prob)
    plan.launch((pa, pb, po), _launch.stream_handle(plan.device_index))
    return _package(epi, res, {}, {}, prob)


def _new_result(prob, epi: Epilogue, device) -> torch.Tensor:
    """The main output D, or for an epilogue that stores none a stand-in that only carries the shape (M, N, L)
    to the kernel: one row of N elements broadcast (stride 0) over M and L; nothing is written to it."""
    if epi.stores_out:
        return torch.empty(prob.out_shape, dtype=prob.out_dtype, device=device)
    shape = prob.out_shape
    return torch.empty(shape[-1], dtype=prob.out_dtype, device=device).as_strided(
        shape, (0,) * (len(shape) - 1) + (1,))


def _package(epi: Epilogue, res, outs, reds, prob):
    if epi.stores_out and not epi.outputs and not epi.reductions:
        return res
    shape = prob.out_shape
    result = {"out": res} if epi.stores_out else {}
    result.update({k: v if k in epi.inplace else v.reshape(shape) for k, v in outs.items()})  # in place: the operand
    for k, v in reds.items():
        if prob.b_broadcast:  # the batch was folded into M: (1, L*M) -> (L, M)
            v = v.reshape(prob.L, prob.M)
        result[k] = v if prob.batched else v[0]
    return result
