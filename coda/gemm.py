"""``coda.gemm``: D = epilogue(a @ b.T) on CODA's Hopper kernel (F.linear semantics).

Argument checks (``coda._validate``) run first on any machine; then the Hopper check; then the kernel for
(config, epilogue, dtypes) is compiled once per process (cached, thread-safe) and launched on the current stream.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

from . import _device
from ._validate import check_gemm_args
from .config import GemmConfig, default_config
from .kernels.epilogue import Epilogue, check_epilogue, finish_reduction

_TORCH_TO_CUTLASS = {}
_cache: dict = {}
_lock = threading.Lock()
_max_clusters: dict = {}


def _cutlass_dtype(dt: torch.dtype):
    import cutlass
    if not _TORCH_TO_CUTLASS:
        _TORCH_TO_CUTLASS.update({torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
                                  torch.float32: cutlass.Float32})
    return _TORCH_TO_CUTLASS[dt]


def _mnl(t: torch.Tensor) -> torch.Tensor:
    """(L, R, C) torch tensor -> (R, C, L) view, the kernel's mode order (C contiguous)."""
    return t.permute(1, 2, 0)


def _cute(t: torch.Tensor, leading: int):
    """A cute view of ``t``. Size-1 dims get a canonical stride (torch may give them any value, and a TMA
    descriptor needs every stride to be a multiple of 16 bytes); the data is not copied."""
    from cutlass.cute.runtime import from_dlpack
    if any(s == 1 for s in t.shape):
        strides = list(t.stride())
        span = max((st * (sz - 1) for st, sz in zip(strides, t.shape) if sz > 1), default=0) + 1
        span = -(-span // 8) * 8
        strides = [span if sz == 1 and i != leading else st for i, (st, sz) in enumerate(zip(strides, t.shape))]
        t = t.as_strided(t.shape, strides)
    return from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=leading)


def _max_active_clusters(size: int) -> int:
    if size not in _max_clusters:
        import cutlass.utils
        _max_clusters[size] = cutlass.utils.HardwareInfo().get_max_active_clusters(size)
    return _max_clusters[size]


def _new_partial(shape, device) -> torch.Tensor:
    """A reduction's partial buffer (L, tiles, length), fp32; every entry is written by the kernel."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def epilogue_tensors(epi: Epilogue, prob, operands: dict, out3: torch.Tensor, cfg: GemmConfig):
    """The epilogue's kernel arguments (operands, extra outputs, reduction partials) as torch tensors in the
    kernel's mode order, plus the torch views handed back to the caller."""
    L, M, N = out3.shape
    names = {o.name for o in epi.operands}
    missing, extra = names - operands.keys(), operands.keys() - names
    if missing or extra:
        raise TypeError(f"epilogue {epi.name!r}: missing operands {sorted(missing)}, unexpected {sorted(extra)}")
    args = []
    for op in epi.operands:
        t = operands[op.name]
        if op.kind == "scalar":
            t = torch.as_tensor(t, dtype=torch.float32, device=out3.device).reshape(1)
            args.append((t, 0))
        elif op.kind == "vec_n":
            args.append((t, 0))
        elif op.kind == "vec_m":
            args.append((t.reshape(L, M).permute(1, 0), 0))
        else:
            args.append((_mnl(t.reshape(L, M, N)), 1))
    outs = {}
    for name in epi.outputs:
        o = torch.empty((L, M, N), dtype=out3.dtype, device=out3.device)
        outs[name] = o
        args.append((_mnl(o), 1))
    partials = {}
    tiles_n = -(-N // cfg.tile_n)
    tiles_m = -(-M // cfg.tile_m)
    for r in epi.kernel_reductions():
        # per-row: one partial per N-tile; per-column: one partial per warp of each M-tile
        tiles, length = (tiles_n, M) if r.axis == "n" else (tiles_m * cfg.warps_per_tile, N)
        p = _new_partial((L, tiles, length), out3.device)
        args.append((p.permute(2, 1, 0), 0))
        partials[r.name] = (p, r.op)
    return args, outs, partials


def gemm(a: torch.Tensor, b: torch.Tensor, *, epilogue: Optional[Epilogue] = None, out: Optional[torch.Tensor] = None,
         out_dtype: Optional[torch.dtype] = None, config: Optional[GemmConfig] = None, **operands):
    """``epilogue(a @ b.T)`` with fp32 accumulation; a (M, K) or (L, M, K), b (N, K) or (L, N, K).

    Returns the main output (or a dict with ``"out"``, extra outputs and finished reductions when the epilogue
    declares them)."""
    epi = check_epilogue(epilogue)
    prob = check_gemm_args(a, b, out=out, out_dtype=out_dtype)
    _device.require_hopper(prob.device, "coda.gemm")
    cfg = (config or default_config(prob.M, prob.N, prob.K)).validate()

    L = prob.L or 1
    a3 = a if a.dim() == 3 else a.unsqueeze(0)
    b3 = b if b.dim() == 3 else b.unsqueeze(0)
    if prob.b_broadcast:  # one weight for every batch: fold the batch into M (a view; checked to exist)
        a3 = a3.reshape(1, L * prob.M, prob.K)
    res = out if out is not None else torch.empty(prob.out_shape, dtype=prob.out_dtype, device=a.device)
    out3 = res if res.dim() == 3 else res.unsqueeze(0)
    if prob.b_broadcast:
        out3 = out3.reshape(1, L * prob.M, prob.N)
    if prob.empty_result:
        return _package(epi, res, {}, {}, prob)
    if prob.zero_k:
        # the kernel needs rows of >= 16 bytes: K = 0 becomes one all-zero K-tile of 8 columns
        a3 = torch.zeros((a3.shape[0], a3.shape[1], 8), dtype=a3.dtype, device=a3.device)
        b3 = torch.zeros((b3.shape[0], prob.N, 8), dtype=b3.dtype, device=b3.device)

    if prob.b_broadcast and any(r.axis == "m" for r in epi.reductions):
        raise ValueError("an epilogue with a per-column (axis m) reduction needs b batched like a, got b "
                         f"{tuple(b.shape)} shared by every batch of a {tuple(a.shape)}")
    args, outs, partials = epilogue_tensors(epi, prob, operands, out3, cfg)
    if len(args) > 12:
        raise ValueError(f"epilogue {epi.name!r} needs {len(args)} tensors (operands + extra outputs + reductions); "
                         "the kernel takes at most 12")
    key = (cfg, epi.key(), prob.in_dtype, prob.out_dtype, tuple((t.dtype, t.dim()) for t, _ in args))
    mA, mB, mD = _cute(_mnl(a3), 1), _cute(_mnl(b3), 1), _cute(_mnl(out3), 1)
    xs = [_cute(t, lead) for t, lead in args]
    import cuda.bindings.driver as cuda
    stream = cuda.CUstream(torch.cuda.current_stream(a.device).cuda_stream)
    fn = _cache.get(key)
    if fn is None:
        with _lock:
            fn = _cache.get(key)
            if fn is None:
                import cutlass.cute as cute
                from .kernels.gemm_sm90 import GemmSm90
                fn = cute.compile(GemmSm90(cfg, epi), mA, mB, mD,
                                  _max_active_clusters(cfg.cluster_m * cfg.cluster_n), stream, *xs)
                _cache[key] = fn
    fn(mA, mB, mD, stream, *xs)
    reds = {name: finish_reduction(p, op) for name, (p, op) in partials.items()}
    return _package(epi, res, outs, reds, prob)


def _package(epi: Epilogue, res, outs, reds, prob):
    if not epi.outputs and not epi.reductions:
        return res
    shape = prob.out_shape
    result = {"out": res}
    result.update({k: v.reshape(shape) for k, v in outs.items()})
    for k, v in reds.items():
        if prob.b_broadcast:  # the batch was folded into M: (1, L*M) -> (L, M)
            v = v.reshape(prob.L, prob.M)
        result[k] = v if prob.batched else v[0]
    return result
