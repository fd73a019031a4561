"""``coda.distributed``: CODA under ``torch.distributed`` (issue 32).

Import it explicitly (``import coda.distributed``; it is not one of ``coda``'s lazy names). Two parts:

1. :func:`vocab_parallel_cross_entropy` -- the LM head + cross entropy with the vocabulary sharded over the ranks of
   a process group (tensor parallelism, as Megatron's vocab-parallel cross entropy), logits never stored.
2. FSDP2 helpers for a :func:`coda.fuse`\\ d model sharded with ``torch.distributed.fsdp.fully_shard``:
   :func:`stock_grads` (full gradients by stock name) and :func:`stock_state_dict` / :func:`dtensor_stock_layout`
   (state dicts with the stock keys and layout, sharded as FSDP2 shards a stock model: what
   ``torch.distributed.checkpoint`` saves and loads). ``coda.nn``'s stock-layout state-dict hooks convert whole
   tensors (they interleave / permute weight rows), which an FSDP2 shard is not; these helpers gather, convert and
   re-shard.

Vocabulary-parallel cross entropy, the phases (rank r of tp holds W_r = rows [v0, v1) of the (V, H) LM head; x (M, H)
and target (M,) are the same on every rank):

- Phase 1, local forward (one GEMM per rank, the lean forward of ``coda.ops.linear_cross_entropy``): logits
  z_r = x W_r^T are reduced in the epilogue ``ce_forward`` to lse_r = log sum_{v in shard} exp(z_v) and
  zt_r = z_t if the target lies in [v0, v1) else 0. The epilogue compares ``coda.col()`` with the target *shifted
  by v0*, so another rank's target (shifted below 0 or past v1 - v0) matches no column. A shard width not a
  multiple of 8 takes its last columns from the op's tail path (``tail_logits``).
- Phase 2, one collective: an all-gather of each rank's (lse_r, zt_r) (2 x M floats) plus its (v0, v1 - v0)
  (2 floats); every rank then forms lse = logsumexp_r lse_r and zt = sum_r zt_r in rank order: the same bits on
  every rank (an all-reduce of max, then of sum-exp and zt, as Megatron does, would take three). The gathered
  ranges also check that the shards tile [0, V) and (``check_targets``) that the targets lie in [0, V).
- Phase 3, the loss from (lse, zt) as the op finishes it (``finish_loss``): torch's ``F.cross_entropy``
  semantics, float32 (float64 for float64 inputs), the same value on every rank.
- Backward (``torch.autograd.Function``): per rank, the lean mode's chunked backward of ``coda.ops``
  (``ops/cross_entropy.py``, ``lean_backward``) on the local shard with the *global* lse: each vocabulary chunk's
  logits are recomputed by one GEMM whose epilogue ``ce_backward`` writes dz = (exp(z - lse) - onehot) g, then
  dW_r[chunk] = dz^T x and dX_r += dz W_r[chunk] (fp32 accumulation); no M x V tensor. Finally
  dX = all_reduce_sum_r(dX_r) -- the backward of the copy of x into the tensor-parallel region, folded in here;
  it is reduced in x's dtype, as Megatron does (each dX_r is rounded once to x's dtype before the sum).
  dW_r stays local: it is the gradient of this rank's shard.

The fast mode (``mode="fast"``, or "auto" when gradients are needed, the reduction is "mean" or "sum", the inputs
are 16-bit and a logits chunk of at least ``MIN_ROWS`` rows of the shard fits ``memory_budget``; the lean mode
above otherwise) forms the gradients in the forward at the cost of three GEMMs per rank, as
``coda.ops.linear_cross_entropy``'s fast mode does (``ops/cross_entropy_fast.py``), with one collective per row
chunk between its phases 1 and 2: the chunk's logits z_r = x_c W_r^T are stored (in a reused chunk buffer of the
shard's width) by the GEMM whose epilogue also reduces them to (lse_r, zt_r); an all-gather of those (as phase 2
above, 2 x rows + 2 floats) gives the chunk's global lse and zt; the in-place softmax gradient turns z_r into dz_r
with the global lse; then dX_r[chunk] = dz_r W_r and dW_r (+)= dz_r^T x_c. The backward all-reduces dX_r (in x's
dtype) and scales both by the upstream gradient.

On CPU tensors every GEMM is CODA's torch reference (float32 / float64 inputs taken too, lean mode), so this runs
under gloo; on Hopper GPUs it runs CODA's kernels under NCCL. Not supported here: label smoothing and z-loss (their
backward needs the global V in the epilogue; the op's ``ce_backward_general`` takes it as a scalar, a small
extension).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["vocab_parallel_cross_entropy", "stock_grads", "stock_state_dict", "dtensor_stock_layout"]

ENTRY = "coda.distributed.vocab_parallel_cross_entropy"
REDUCTIONS = ("mean", "sum", "none")


# ------------------------------------------------------------------------------------------------ checks
def _check(x, weight, target, ignore_index, reduction, vocab_start) -> None:
    from coda.ops.cross_entropy import check_inputs, check_tensors
    check_tensors(ENTRY, (("x", x), ("weight_shard", weight), ("target", target)))
    check_inputs(ENTRY, x, weight)
    if target.dtype != torch.int64:
        raise TypeError(f"{ENTRY}: target must be int64 (class indices), got {target.dtype}")
    if x.dim() < 1 or weight.dim() != 2:
        raise ValueError(f"{ENTRY}: x must be (..., H) and weight_shard (V/tp, H); got x {tuple(x.shape)}, "
                         f"weight_shard {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{ENTRY}: x has H={x.shape[-1]} but weight_shard has H={weight.shape[1]}")
    if weight.shape[0] < 1:
        raise ValueError(f"{ENTRY}: weight_shard must hold at least one vocabulary row")
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{ENTRY}: target must have shape x.shape[:-1] = {tuple(x.shape[:-1])}, got "
                         f"{tuple(target.shape)}")
    if target.device != x.device:
        raise ValueError(f"{ENTRY}: target must be on x's device {x.device}, got {target.device}")
    if x.dtype in (torch.bfloat16, torch.float16) and x.shape[-1] % 8:
        raise ValueError(f"{ENTRY}: x: the hidden size H={x.shape[-1]} must be a multiple of 8 (16-byte rows)")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{ENTRY}: ignore_index must be an int, got {type(ignore_index).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{ENTRY}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if vocab_start is not None and (isinstance(vocab_start, bool) or not isinstance(vocab_start, int)
                                    or vocab_start < 0):
        raise ValueError(f"{ENTRY}: vocab_start must be a non-negative int or None, got {vocab_start!r}")


def _check_layout(ranges: Tensor, target: Tensor, valid: Tensor, check_targets: bool) -> int:
    """The gathered (v0, rows) of every rank must tile [0, V) (in some order); V. Targets in [0, V) if asked."""
    spans = sorted((int(a), int(n)) for a, n in ranges.tolist())
    end = 0
    for a, n in spans:
        if a != end:
            raise ValueError(f"{ENTRY}: the ranks' vocabulary shards [v0, v0 + rows) must tile [0, V) without gaps "
                             f"or overlaps; got {[(a, a + n) for a, n in spans]}")
        end = a + n
    if check_targets:
        bad = valid & ((target < 0) | (target >= end))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"{ENTRY}: target values must be in [0, {end}) or equal ignore_index; found "
                             f"{int(target[i])} at (flattened) position {i}")
    return end


# ------------------------------------------------------------------------------------------------ phases
def _local_stats(x: Tensor, weight: Tensor, tloc: Tensor, softcap: Optional[float] = None):
    """Phase 1: (lse_r, zt_r) of this shard from one GEMM whose epilogue reduces the logits (never stored);
    ``tloc`` the target column within the shard as float (no column matches a value outside [0, rows)); with a
    ``softcap`` of the capped logits (``ce_forward_cap``)."""
    from coda.epilogues.cross_entropy import ce_forward, ce_forward_cap
    from coda.ops.cross_entropy import ALIGN, row_statistics
    V = weight.shape[0]
    wide = x.dtype in (torch.float32, torch.float64)  # the reference path: no alignment rules, no tail
    # (a shard width not a multiple of 8: its last rows through the op's tail path)
    lse, stats = row_statistics(x, weight, tloc, ce_forward if softcap is None else ce_forward_cap, softcap,
                                V if wide else V // ALIGN * ALIGN, ENTRY)
    if lse is None:
        empty = x.new_empty((0,), dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
        return empty, empty
    return lse, stats["zt"]


def _gather_stats(lse: Tensor, zt: Tensor, v0: int, rows: int, group):
    """Phase 2: one all-gather of (lse_r, zt_r, v0, rows) -> (lse, zt, ranges (tp, 2)), identical on all ranks."""
    M = lse.shape[0]
    mine = torch.cat((lse, zt, torch.tensor([v0, rows], dtype=lse.dtype, device=lse.device)))
    world = dist.get_world_size(group)
    out = mine.new_empty((world * mine.numel(),))
    _all_gather(out, mine, group=group)
    out = out.view(world, -1)
    # rank order, fixed: every rank forms the same bits
    return torch.logsumexp(out[:, :M], 0), out[:, M:2 * M].sum(0), out[:, 2 * M:]


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name first


def _backward_wide(grad, x, weight, tloc, lse, valid, reduction, chunk_size, softcap=None):
    """The same chunked recompute for float32 / float64 (CPU reference path only), which the op's lean backward
    does not take: per chunk, dz from ``ce_backward`` (``ce_backward_cap`` with a ``softcap``) on recomputed
    logits, then dX += dz W_c, dW_c = dz^T x in x's precision (no alignment rules on this path)."""
    from coda.epilogues.cross_entropy import ce_backward, ce_backward_cap
    from coda.ops.cross_entropy import chunk_columns, gemm_for
    epi, extra = ((ce_backward, {}) if softcap is None else
                  (ce_backward_cap, dict(smoothing=0.0, z_loss=0.0, inv_v=1.0, cap=softcap)))
    M, V = x.shape[0], weight.shape[0]
    g = grad.to(lse.dtype)
    if reduction == "mean":
        g = g / valid.sum().clamp_min(1)
    g = torch.where(valid, g.expand(M), 0.0).contiguous()
    vc = chunk_columns(M, x.element_size(), chunk_size)
    dx, dw = torch.zeros_like(x), torch.empty_like(weight)
    for c0 in range(0, V, vc):
        w = weight[c0:c0 + vc]
        dz = gemm_for(x.device, ENTRY)(x, w, epilogue=epi, t=tloc - c0, lse=lse, g=g, **extra)
        dx.addmm_(dz, w)
        dw[c0:c0 + vc] = dz.t() @ x
    return dx, dw


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, group, ignore_index, reduction, v0, chunk_size, check_targets, softcap):
        from coda.ops.cross_entropy import finish_loss
        valid = target != ignore_index
        rows = weight.shape[0]
        tloc = torch.where(valid, target - v0, -1).to(torch.float32)  # -1 / out of [0, rows): matches no column
        lse_r, zt_r = _local_stats(x, weight, tloc, softcap)
        lse, zt, ranges = _gather_stats(lse_r, zt_r, v0, rows, group)
        V = _check_layout(ranges, target, valid, check_targets)
        loss = finish_loss(lse, {"zt": zt}, valid, V, reduction, 0.0, 0.0)
        ctx.save_for_backward(x, weight, target, lse)
        ctx.args = (group, ignore_index, reduction, v0, chunk_size, softcap)
        return loss

    @staticmethod
    def backward(ctx, grad):
        from coda.ops.cross_entropy import lean_backward
        x, weight, target, lse = ctx.saved_tensors
        group, ignore_index, reduction, v0, chunk_size, softcap = ctx.args
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # the lean backward of coda.ops on this shard, with the global lse and the target shifted by v0; the
        # ignored rows get a sentinel no shifted valid target can equal (those lie in [-v0, V - v0))
        valid = target != ignore_index
        if x.dtype in (torch.float32, torch.float64):
            tloc = torch.where(valid, target - v0, -1).to(lse.dtype)
            dx, dw = _backward_wide(grad, x, weight, tloc, lse, valid, reduction, chunk_size, softcap)
        else:
            sentinel = -v0 - 1
            shifted = torch.where(valid, target - v0, sentinel)
            dx, dw = lean_backward(grad, x, weight, shifted, lse, sentinel, reduction, 0.0, 0.0, chunk_size, need_x,
                                   need_w, softcap=softcap)
        if need_x:
            dist.all_reduce(dx, op=dist.ReduceOp.SUM, group=group)  # dX = sum_r dz_r W_r
        return dx, dw, None, None, None, None, None, None, None, None


class _VocabParallelCEFast(torch.autograd.Function):
    """The fast mode (module docstring): the gradients formed in the forward, scaled in the backward."""

    @staticmethod
    def forward(ctx, x, weight, target, group, ignore_index, reduction, v0, rows, check_targets, softcap):
        from coda.ops.cross_entropy import finish_loss, forward_with_grads, tail_logits
        valid = target != ignore_index
        shifted = torch.where(valid, target - v0, -1)  # a target outside the shard matches no column
        ranges = []

        def combine(lse_c, zt_c):  # one all-gather per chunk (the shard layout rides along)
            lse_g, zt_g, rng = _gather_stats(lse_c, zt_c, v0, weight.shape[0], group)
            ranges.append(rng)
            return lse_g, zt_g
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        lse, stats, dx, dw, _, _ = forward_with_grads(x, weight, shifted, valid, shifted.to(torch.float32), reduction,
                                                   0.0, 0.0, rows, need_x, need_w, ENTRY, tail_logits, softcap,
                                                   combine=combine)
        V = _check_layout(ranges[0], target, valid, check_targets)
        ctx.save_for_backward(dx if need_x else None, dw if need_w else None)
        ctx.group = group
        return finish_loss(lse, stats, valid, V, reduction, 0.0, 0.0)

    @staticmethod
    def backward(ctx, grad):
        from coda.ops.cross_entropy import _scale_in_place
        dx, dw = ctx.saved_tensors
        g = grad.to(torch.float32)
        if dx is not None:
            dist.all_reduce(dx, op=dist.ReduceOp.SUM, group=ctx.group)  # dX = sum_r dz_r W_r, in x's dtype
            dx = _scale_in_place(dx, g)
        if dw is not None:
            dw = _scale_in_place(dw, g)
        return dx, dw, None, None, None, None, None, None, None, None


MODES = ("auto", "fast", "lean")


def _fast_rows(x: Tensor, weight: Tensor, reduction: str, mode: str, memory_budget, group) -> Optional[int]:
    """Rows per chunk of the fast mode, or None for the lean mode (module docstring). Every rank must choose the
    same (the chunks' collectives pair up): the arguments are the same on every rank, and the chunk buffer is
    sized for the widest shard (one all-reduce of one integer, only when the fast mode is possible)."""
    from coda.ops.cross_entropy import _fast_rows as rows_for
    if x.dtype not in (torch.bfloat16, torch.float16) or x.shape[0] == 0:
        return None

    def widest():
        w = torch.tensor([weight.shape[0]], dtype=torch.int64, device=x.device)
        dist.all_reduce(w, op=dist.ReduceOp.MAX, group=group)
        return int(w.item())
    return rows_for(x, weight, reduction, 0.0, mode, memory_budget, width=widest)


def vocab_parallel_cross_entropy(x: Tensor, weight_shard: Tensor, target: Tensor, group=None,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 vocab_start: Optional[int] = None, *, chunk_size: Optional[int] = None,
                                 check_targets: bool = True, softcap: Optional[float] = None, mode: str = "auto",
                                 memory_budget: Optional[int] = None) -> Tensor:
    """``F.cross_entropy(x @ W.T, target)`` with W's vocabulary rows sharded over the ranks of ``group``.

    Every rank passes the same x (..., H) and target (...) (int64 in [0, V) or ``ignore_index``) and its own
    ``weight_shard`` = W[v0 : v0 + rows] (rows = V / tp, or any split that tiles [0, V)); ``vocab_start`` is v0
    (default ``rank * rows``, the even split). ``group``: the tensor-parallel process group (default: the world).
    dtypes: bfloat16 / float16 (float32 / float64 too on CPU tensors, CODA's reference path). Returns the loss
    (float32; float64 for float64 inputs), the same on every rank; ``reduction`` "mean" (over non-ignored rows),
    "sum" or "none". Backward: x.grad is the full dX on every rank (all-reduced), ``weight_shard.grad`` this
    shard's rows of dW. ``chunk_size``: vocabulary columns per backward chunk (as ``coda.ops.linear_cross_entropy``).
    ``check_targets``: check after the gather that the targets lie in [0, V) (a host sync). ``softcap``: the loss
    of the soft-capped logits c tanh(z / c) (Gemma 2; as ``coda.ops.linear_cross_entropy``). One all-gather of
    2 M + 2 floats per rank in forward, one all-reduce of M x H in backward. ``mode`` "auto" / "fast" / "lean" and
    ``memory_budget`` (bytes of the fast mode's logits chunk, default ``coda.ops.cross_entropy.MEMORY_BUDGET``) as
    ``coda.ops.linear_cross_entropy``'s; every rank must pass the same. See the module docstring."""
    _check(x, weight_shard, target, ignore_index, reduction, vocab_start)
    from coda.ops.cross_entropy import check_softcap
    check_softcap(ENTRY, softcap)
    if mode not in MODES:
        raise ValueError(f"{ENTRY}: mode must be one of {MODES}, got {mode!r}")
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, int)
                                      or memory_budget <= 0):
        raise ValueError(f"{ENTRY}: memory_budget must be a positive int (bytes), got {memory_budget!r}")
    if not dist.is_initialized():
        raise RuntimeError(f"{ENTRY}: torch.distributed is not initialized (call init_process_group first)")
    rows = weight_shard.shape[0]
    v0 = dist.get_rank(group) * rows if vocab_start is None else vocab_start
    H = x.shape[-1]
    softcap = None if softcap is None else float(softcap)
    chunk_rows = _fast_rows(x.reshape(-1, H), weight_shard, reduction, mode, memory_budget, group)
    if chunk_rows is not None:
        return _VocabParallelCEFast.apply(x.reshape(-1, H), weight_shard, target.reshape(-1), group, ignore_index,
                                          reduction, v0, chunk_rows, bool(check_targets), softcap)
    loss = _VocabParallelCE.apply(x.reshape(-1, H), weight_shard, target.reshape(-1), group, ignore_index,
                                  reduction, v0, chunk_size, bool(check_targets), softcap)
    return loss.reshape(target.shape) if reduction == "none" else loss


# ------------------------------------------------------------------------------------------------ FSDP2 helpers
def _full(t):
    """A DTensor's full value (a collective: every rank must call it in the same order); other tensors as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def stock_grads(model: torch.nn.Module) -> dict:
    """:func:`coda.stock_grads` for a model whose parameters may be FSDP2 DTensors: every gradient gathered to its
    full value (on every rank), by stock name and in the stock layout. Every rank must call it."""
    from coda.fuse import stock_grads as _stock_grads
    return _stock_grads(model, full=_full)


def _resharding(convert):
    """``convert`` (a ``_to_stock`` / ``_from_stock``) made to take DTensors: gather each to its full value,
    convert, and shard every result like the first DTensor given (FSDP2: Shard(0) over its mesh)."""
    def wrapped(local):
        like = next((v for v in local.values() if hasattr(v, "full_tensor")), None)
        if like is None:
            return convert(local)
        from torch.distributed.tensor import distribute_tensor
        out = convert({k: _full(v) for k, v in local.items()})
        # src_data_rank=None: every rank holds the full value already; each keeps its own chunk, no communication
        return {k: distribute_tensor(v.detach(), like.device_mesh, like.placements, src_data_rank=None)
                for k, v in out.items()}
    return wrapped


@contextlib.contextmanager
def dtensor_stock_layout(model: torch.nn.Module):
    """While active, the stock-layout state-dict hooks of the model's fused modules (``coda.nn``) take and return
    DTensors: ``model.state_dict()`` gives the stock keys as FSDP2 would shard a stock model, and
    ``model.load_state_dict(sd)`` takes such a dict. Every rank must enter it and call the same methods (the
    conversions gather full tensors)."""
    from coda.nn import _StockLayout
    mods = [m for m in model.modules() if isinstance(m, _StockLayout)]
    for m in mods:
        m._to_stock = _resharding(type(m)._to_stock.__get__(m))
        m._from_stock = _resharding(type(m)._from_stock.__get__(m))
    try:
        yield model
    finally:
        for m in mods:
            m.__dict__.pop("_to_stock", None)
            m.__dict__.pop("_from_stock", None)


def stock_state_dict(model: torch.nn.Module, full: bool = False) -> dict:
    """The model's state dict with the stock keys and layout. ``full=False``: DTensors sharded as FSDP2 shards a
    stock model (what ``torch.distributed.checkpoint.save`` takes); ``full=True``: plain full tensors on every
    rank (loads into a stock model with ``load_state_dict``). Every rank must call it."""
    with dtensor_stock_layout(model):
        sd = model.state_dict()
    return {k: _full(v) for k, v in sd.items()} if full else sd
