"""``coda.ops.linear_cross_entropy``: the LM head and cross entropy in GEMM epilogues; logits are never stored.

``loss = cross_entropy(x @ weight.T, target)`` with torch's ``F.cross_entropy`` semantics (``ignore_index``,
``reduction``, ``label_smoothing``) plus an optional z-loss ``z_loss * lse**2`` per (non-ignored) row, where
lse = logsumexp of the row's logits (PaLM's auxiliary loss; averaged like the rest under ``reduction="mean"``),
and optional logit soft-capping (Gemma 2): with ``softcap`` c every logit z is replaced by c tanh(z / c), in the
epilogues of both modes (``ce_forward_cap`` / ``ce_backward_cap``; the fast mode stores the capped logits).
The algebra is in ``coda/epilogues/cross_entropy.py``.

Forward: one GEMM x W^T whose epilogue stores no logits, only per-row reductions: lse (logsumexp) and the target
logit z_t (and sum_v z_v when ``label_smoothing > 0``); the loss is finished from these M-vectors.

Backward: the vocabulary is processed in chunks [v0, v1) of ``chunk_size`` columns (default: a chunk of the
logits gradient is at most ``CHUNK_BYTES`` = 64 MiB). Per chunk, one GEMM x W[v0:v1]^T recomputes the logits and
its epilogue writes dz = d loss / d z (M x (v1 - v0), in x's dtype) into one reused buffer; then
dW[v0:v1] = dz^T x is written straight into dW's rows, and dX += dz W[v0:v1] accumulates in fp32 through the
``accumulate`` epilogue (``acc + prev``, ``out=prev``). No M x V tensor is ever allocated. Where the scratch lives:

- When both gradients are needed and 2M <= V / 4 (``IN_PLACE_MAX_RECOMPUTE``; an LM head: V ~ 1e5, M a few
  thousand tokens), the scratch lives in the gradients' own storage. The fp32 dX accumulator (M x H x 4 bytes)
  occupies dW's last 2M rows, whose dW is formed after dX is finished (phase 2, below). The dz chunk uses dx's
  storage while dX is being accumulated (when the chunk is at most H columns wide; else it is allocated).
- Phase 2 recomputes dz for those last ~2M vocabulary columns (~2M / V of one GEMM more: ~13 % of one of the four
  GEMMs at M = 8192, V = 128256) through one buffer of at most ``SCRATCH_BYTES`` = 16 MiB (or the allocated chunk
  buffer, when there is one) and writes their dW rows.
- Extra memory besides the gradients is then that buffer, a few M-vectors, and the forward's per-tile partials
  (M x ceil(V / tile_n) x 4 bytes each, freed before the backward). H100, M = 8192, H = 4096, V = 128256: 0.017 GB
  over forward and backward (0.201 GB with everything allocated) for ~4 % more time (docs/NOTES.md, session 15).
- Otherwise (dX or dW alone, or 2M > V / 4, where phase 2 would recompute too much) the fp32 accumulator, if dX is
  needed, is allocated, and so is a chunk buffer that does not fit in dx (dW alone, or a chunk wider than H).

Shapes the kernel cannot align: H (the contraction of x W^T) must be a multiple of 8 (16-byte rows; else
ValueError). A vocabulary V that is not a multiple of 8 runs on the kernel for its first V - V % 8 columns; the
last V % 8 columns (the "tail") come from one GEMM against an 8-row zero-padded copy of those weight rows (fp32
logits, M x 8) and the same epilogue programs evaluated with torch ops (``Epilogue.reference``). dW = dz^T x for a
token count M that is not a multiple of 8 runs on ``torch.matmul`` (the ``backward_gemm`` rule).

Semantics to note: the loss is float32 (torch returns x's dtype); ``reduction="mean"`` divides by the number of
non-ignored rows, so with every row ignored the loss is NaN, as in torch, and the gradients are zero (as in torch);
targets are checked to lie in [0, V) or equal ``ignore_index`` before any GEMM (``check_targets``): ``True``
(default) reads the check's result on the host -- one device sync, then a ValueError naming the first bad target;
``"async"`` asserts it on the device instead (``torch._assert_async``: no sync; a bad target fails the CUDA context
with a device-side assert at the next synchronizing call, as ``F.cross_entropy`` does on CUDA; on CPU tensors it is
the ``True`` check, which costs no device sync there); ``False`` skips it (an out-of-range target is then simply a
class no logit matches: its z_t is 0, the loss is wrong, no memory outside the tensors is touched). The sync matters
in a training step, not in an op alone: it stops the host from queueing ahead of the GPU (llama_train small, fused
+ torch.compile on an H200: 18.8-19.0 ms per step with it, 18.45 ms without; docs/NOTES.md, session 10), which is
why the ``coda.nn`` LM-head module uses ``"async"``. (The fast mode's exp-stored phases read one range flag per
logits chunk on the host whatever ``check_targets`` says: they replace a 4.2 GB pass, a net gain in the step;
``CODA_CE_EXP=0`` turns them off.) The dz chunks
are in x's dtype, like torch's logits gradient (fp16 underflows tiny probabilities exactly as torch's fp16 does).

Registered as ``torch.ops.coda.linear_cross_entropy`` (a ``torch.library.custom_op`` with a fake implementation
and autograd, so ``torch.compile(fullgraph=True)`` traces through it); its backward is the custom op
``torch.ops.coda.linear_cross_entropy_backward``.
"""
from __future__ import annotations

import math
import os
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from coda.epilogues.adamw import adamw_scaled, adamw_times
from coda.epilogues.cross_entropy import (accumulate, ce_backward, ce_backward_cap, ce_backward_general, ce_forward,
                                          ce_forward_cap, ce_forward_smooth, scale_by)
from coda.optim import eager_backward, updates_in_backward

from ._builder import backward_op, forward_op
from ._common import (IN_DTYPES, backward_gemm, call, check_inputs, check_tensors, custom_op, eager_call,
                      epilogue_pass, gemm_for, kernel_aligned, update_args, update_in_backward)
from .cross_entropy_fast import defer_taken, exp_taken, forward_with_grads, pass_ready, plan_rows, scale_rows

__all__ = ["linear_cross_entropy", "CHUNK_BYTES", "MEMORY_BUDGET"]
# also used by coda.distributed (vocabulary-parallel CE): tail_logits, chunk_columns, finish_loss, lean_backward,
# ALIGN, and ops/_common's gemm_for, check_inputs, check_tensors (imported here for it)

CHUNK_BYTES = 64 << 20  # default bound on one backward chunk of the logits gradient (M x chunk, x's dtype)
ENTRY = "coda.ops.linear_cross_entropy"
REDUCTIONS = ("mean", "sum", "none")
ALIGN = 8  # 16-byte rows of 16-bit elements


# ------------------------------------------------------------------------------------------------ argument checks
def _check(x, weight, target, ignore_index, reduction, label_smoothing, z_loss, chunk_size, softcap=None) -> None:
    """Everything that can be checked without reading tensor data (the target range is checked in the op)."""
    for name, t in (("x", x), ("weight", weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"linear_cross_entropy: {name} must be a torch tensor, got {type(t).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"linear_cross_entropy: x must be bfloat16 or float16, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise TypeError(f"linear_cross_entropy: weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if target.dtype != torch.int64:
        raise TypeError(f"linear_cross_entropy: target must be int64 (class indices), got {target.dtype}")
    if x.dim() < 1 or weight.dim() != 2:
        raise ValueError(f"linear_cross_entropy: x must be (..., H) and weight (V, H); got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    H, V = x.shape[-1], weight.shape[0]
    if weight.shape[1] != H:
        raise ValueError(f"linear_cross_entropy: x has H={H} but weight has H={weight.shape[1]} (weight is (V, H))")
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"linear_cross_entropy: target must have shape x.shape[:-1] = {tuple(x.shape[:-1])}, "
                         f"got {tuple(target.shape)}")
    if weight.device != x.device or target.device != x.device:
        raise ValueError(f"linear_cross_entropy: x, weight and target must be on one device; got {x.device}, "
                         f"{weight.device}, {target.device}")
    if H % ALIGN:
        raise ValueError(f"linear_cross_entropy: x: the hidden size H={H} must be a multiple of {ALIGN} "
                         "(16-byte rows for the GEMM)")
    if not 1 <= V < 2 ** 24:
        raise ValueError(f"linear_cross_entropy: weight: the vocabulary size V={V} must be in [1, 2**24) (targets "
                         "are compared as float32 in the epilogue)")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"linear_cross_entropy: ignore_index must be an int, got {type(ignore_index).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    for name, v, hi in (("label_smoothing", label_smoothing, 1.0), ("z_loss", z_loss, math.inf)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"linear_cross_entropy: {name} must be a number, got {type(v).__name__}")
        if not (0.0 <= v <= hi) or math.isnan(v) or math.isinf(v):
            raise ValueError(f"linear_cross_entropy: {name} must be in [0, {hi}], got {v}")
    check_softcap("linear_cross_entropy", softcap)
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
            raise TypeError(f"linear_cross_entropy: chunk_size must be an int or None, got "
                            f"{type(chunk_size).__name__}")
        if chunk_size <= 0 or chunk_size % ALIGN:
            raise ValueError(f"linear_cross_entropy: chunk_size must be a positive multiple of {ALIGN} "
                             f"(vocabulary columns per backward chunk), got {chunk_size}")


def check_softcap(entry: str, softcap) -> None:
    """``softcap``: None or a positive finite number (``TypeError`` / ``ValueError`` naming ``entry``)."""
    if softcap is None:
        return
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"{entry}: softcap must be a number or None, got {type(softcap).__name__}")
    if not 0.0 < softcap < math.inf:
        raise ValueError(f"{entry}: softcap must be positive and finite, got {softcap}")


_CHECKS = {True: "sync", "async": "async", False: "off"}  # check_targets -> the custom op's ``check``


def check_targets_option(entry: str, check_targets) -> str:
    """``check_targets`` (True, "async" or False; else a TypeError naming ``entry``) as the custom op's ``check``."""
    if not (isinstance(check_targets, bool) or check_targets == "async"):
        raise TypeError(f"{entry}: check_targets must be True, False or \"async\", got {check_targets!r}")
    return _CHECKS[check_targets]


def _check_target_range(target: Tensor, V: int, ignore_index: int, check: str) -> None:
    if check == "off":
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= V))
    if check == "async" and target.device.type != "cpu":  # a device-side assert: the host does not wait
        torch._assert_async(~bad.any(), f"linear_cross_entropy: target values must be in [0, {V}) or equal "
                                        f"ignore_index={ignore_index}")
        return
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"linear_cross_entropy: target values must be in [0, {V}) or equal ignore_index="
                         f"{ignore_index}; found {int(target[i])} at (flattened) position {i}")


# ------------------------------------------------------------------------------------------------ shared pieces
def _target_columns(target: Tensor, ignore_index: int) -> Tuple[Tensor, Tensor]:
    """(valid rows, target column as float32 with -1 on ignored rows: it matches no column)."""
    valid = target != ignore_index
    return valid, torch.where(valid, target, -1).to(torch.float32)


def tail_logits(x: Tensor, weight: Tensor, v0: int) -> Tensor:
    """fp32 logits of the last V - v0 (< 8) vocabulary columns: one GEMM against those weight rows padded with
    zero rows to 8 (the kernel's 16-byte alignment), M x 8 fp32 out; the padded columns are dropped."""
    pad = weight.new_zeros((ALIGN, weight.shape[1]))
    pad[:weight.shape[0] - v0] = weight[v0:]
    return gemm_for(x.device, ENTRY)(x, pad, out_dtype=torch.float32)[:, :weight.shape[0] - v0]


def chunk_columns(M: int, esize: int, chunk_size: Optional[int], budget: Optional[int] = None) -> int:
    """Columns per chunk: ``chunk_size``, else as many as fit in ``budget`` bytes (default ``CHUNK_BYTES``)."""
    if chunk_size is not None:
        return chunk_size
    vc = (CHUNK_BYTES if budget is None else budget) // max(1, M * esize)
    return vc // 256 * 256 if vc >= 256 else max(ALIGN, vc // ALIGN * ALIGN)  # whole tiles when they fit


# ------------------------------------------------------------------------------------------------ forward
def _forward(x, weight, target, ignore_index, reduction, label_smoothing, z_loss, softcap=None, check="sync"):
    M, V = x.shape[0], weight.shape[0]
    _check_target_range(target, V, ignore_index, check)
    valid, tcol = _target_columns(target, ignore_index)
    smooth = label_smoothing > 0
    epi = ce_forward_cap if softcap is not None else ce_forward_smooth if smooth else ce_forward
    lse, stats = row_statistics(x, weight, tcol, epi, softcap, V // ALIGN * ALIGN, ENTRY)
    if lse is None:  # no rows
        lse = x.new_empty((0,), dtype=torch.float32)
        stats = {"zt": lse, "zsum": lse}
    return finish_loss(lse, stats, valid, V, reduction, label_smoothing, z_loss), lse.contiguous()


def row_statistics(x, weight, tcol, epi, softcap, v8, entry):
    """(lse, the other per-row statistics) of x weight^T reduced by the forward epilogue ``epi`` (``ce_forward``,
    ``_smooth`` or ``_cap`` with ``softcap``): the first ``v8`` columns in one GEMM whose epilogue stores no
    logits, the rest (V % 8 columns) by the tail path; (None, None) without rows or columns."""
    M, V = x.shape[0], weight.shape[0]
    cap = {} if softcap is None else {"cap": softcap}
    parts = []
    if M and v8:  # the logits are reduced in the epilogue and never stored
        parts.append(gemm_for(x.device, entry)(x, weight[:v8], epilogue=epi, t=tcol, **cap))
    if M and v8 < V:
        parts.append(epi.reference(tail_logits(x, weight, v8), t=tcol - v8, **cap))
    if not parts:
        return None, None
    lse = parts[0]["lse"] if len(parts) == 1 else torch.logaddexp(parts[0]["lse"], parts[1]["lse"])
    return lse, {k: sum(p[k] for p in parts) for k in parts[0] if k != "lse"}


def finish_loss(lse, stats, valid, V, reduction, label_smoothing, z_loss):
    """The loss from the per-row statistics (lse, z_t, sum_v z_v)."""
    row = lse - (1 - label_smoothing) * stats["zt"]
    if label_smoothing > 0:
        row = row - (label_smoothing / V) * stats["zsum"]
    if z_loss > 0:
        row = row + z_loss * lse * lse
    row = torch.where(valid, row, 0.0)
    if reduction == "none":
        return row
    if reduction == "sum":
        return row.sum()
    return row.sum() / valid.sum()  # mean over the non-ignored rows: NaN when there are none, as in torch


# ------------------------------------------------------------------------------------------------ backward
SCRATCH_BYTES = 16 << 20  # bound on the one dz buffer of phase 2 (see the module docstring)
IN_PLACE_MAX_RECOMPUTE = 0.25  # scratch in the gradients only while phase 2 recomputes <= this share of V


def lean_backward(grad, x, weight, target, lse, ignore_index, reduction, label_smoothing, z_loss, chunk_size,
                  need_x, need_w, softcap=None):
    """(dx, dweight) of the lean mode for the upstream ``grad`` and the forward's ``lse`` (module docstring: chunks
    of recomputed logits turned into dz by the epilogue, never an M x V tensor); None where not needed. With a
    ``softcap`` the epilogue recomputes the capped logits and multiplies by their derivative."""
    M, H = x.shape
    V = weight.shape[0]
    if M == 0:
        return (torch.zeros_like(x) if need_x else None), (torch.zeros((V, H), dtype=weight.dtype,
                                                                       device=weight.device) if need_w else None)
    # every element of both is written below (the chunks and the tail cover all V columns)
    dx = x.new_empty((M, H)) if need_x else None  # contiguous whatever x's layout: it doubles as the dz buffer
    dw = torch.empty((V, H), dtype=weight.dtype, device=weight.device) if need_w else None
    valid, tcol = _target_columns(target, ignore_index)
    g = grad.to(torch.float32)
    if reduction == "mean":  # no valid rows: every g is 0 below (the loss is NaN, the gradients zero)
        g = g / valid.sum().clamp_min(1)
    g = torch.where(valid, g.expand(M), 0.0).contiguous()
    general = label_smoothing > 0 or z_loss > 0 or softcap is not None
    epi = ce_backward_cap if softcap is not None else ce_backward_general if general else ce_backward
    ops = dict(lse=lse, g=g, **(dict(smoothing=label_smoothing, z_loss=z_loss, inv_v=1.0 / V) if general else {}))
    if softcap is not None:
        ops["cap"] = softcap
    gemm = gemm_for(x.device, ENTRY)
    v8 = V // ALIGN * ALIGN
    vc = min(chunk_columns(M, x.element_size(), chunk_size), max(v8, ALIGN))

    def dz_chunk(v0, out):  # recomputed logits of columns [v0, v0 + width) -> dz (out), never the logits
        gemm(x, weight[v0:v0 + out.shape[1]], epilogue=epi, out=out, t=tcol - v0, **ops)
        return out

    def dw_rows(v0, dz):  # dW rows [v0, v0 + width) = dz^T x, in place (torch.matmul where M breaks alignment)
        if dw_on_kernel:
            gemm(dz.t(), x.t(), out=dw[v0:v0 + dz.shape[1]])
        else:
            torch.matmul(dz.t(), x, out=dw[v0:v0 + dz.shape[1]])

    # The fp32 dX accumulator lives in dW's last 2M rows (M x H x 4 bytes) when both gradients are needed and the
    # vocabulary is large enough; those rows' dW is formed after dX is finished (phase 2). Else it is allocated.
    in_place = need_x and need_w and 2 * M <= IN_PLACE_MAX_RECOMPUTE * V and V >= 2 * M + ALIGN
    split = (V - 2 * M) // ALIGN * ALIGN if in_place else v8  # dW rows >= split are written in phase 2
    if in_place:
        acc = dw[V - 2 * M:].view(-1).view(torch.float32).view(M, H)  # 2-byte dW: 2M rows hold M x H fp32
    else:
        acc = torch.empty((M, H), dtype=torch.float32, device=x.device) if need_x else None
    # the dz chunk buffer (flat, M x vc elements): dx's own storage until dX is finished, when a chunk fits there
    in_dx = need_x and vc <= H
    buf = dx.view(-1) if in_dx else x.new_empty((M * vc,))

    def chunk_in(flat, w):  # an M x w dz chunk at the start of a flat buffer
        return flat[:M * w].view(M, w)

    # one alignment decision for every dz^T x: each chunk (and each column slice of one) is an M x w view at the
    # start of a fresh or 16-byte aligned buffer with w a multiple of 8, so only M and x decide
    dw_on_kernel = need_w and v8 > 0 and kernel_aligned(chunk_in(buf, min(vc, v8)).t(), x.t())

    # phase 1: every chunk's dz; dX (+)= dz W_c (W_c.t() and dz read by TMA as they are); dW rows below `split`.
    # The chunks are the same whichever gradients are needed, so dX is too (bitwise).
    for v0 in range(0, v8, vc):
        v1 = min(v0 + vc, v8)
        dz = dz_chunk(v0, chunk_in(buf, v1 - v0))
        if need_w and v0 < split:
            dw_rows(v0, dz[:, :min(v1, split) - v0])
        if need_x:
            w_t = weight[v0:v1].t()
            if v0 == 0:
                gemm(dz, w_t, out=acc)
            else:
                gemm(dz, w_t, epilogue=accumulate, out=acc, prev=acc)
    dz_tail = None
    if v8 < V:  # the last V % 8 columns: torch ops on M x (V - v8) fp32 logits
        dz_tail = epi.reference(tail_logits(x, weight, v8), t=tcol - v8, **ops)["out"]
        if need_x:
            w_t = weight[v8:].float()
            acc.addmm_(dz_tail, w_t) if v8 else torch.mm(dz_tail, w_t, out=acc)
    if need_x:
        dx.copy_(acc)  # after the last chunk's GEMMs (stream order): dx's storage is free again
    # phase 2: dW rows [split, v8) from dz recomputed once more, through one buffer of <= SCRATCH_BYTES (the
    # allocated chunk buffer, when there is one, is free again and serves instead)
    if split < v8:
        w2 = min(vc if not in_dx else chunk_columns(M, x.element_size(), chunk_size, SCRATCH_BYTES), v8 - split)
        spare = buf if not in_dx else x.new_empty((M * w2,))
        for v0 in range(split, v8, w2):
            dw_rows(v0, dz_chunk(v0, chunk_in(spare, min(w2, v8 - v0))))
    if need_w and dz_tail is not None:
        dw[v8:] = torch.matmul(dz_tail.t().to(x.dtype), x)
    return dx, dw


def _op_backward_fake(grad, x, weight, target, lse, ignore_index, reduction, label_smoothing, z_loss, softcap,
                      chunk_size, need_x, need_w):
    dw = weight.new_empty(weight.shape) if need_w else weight.new_empty((0,))
    return (x.new_empty(x.shape) if need_x else x.new_empty((0,))), dw


@backward_op("linear_cross_entropy_backward", fake=_op_backward_fake)
def _op_backward(grad: Tensor, x: Tensor, weight: Tensor, target: Tensor, lse: Tensor, ignore_index: int,
                 reduction: str, label_smoothing: float, z_loss: float, softcap: Optional[float],
                 chunk_size: Optional[int], need_x: bool, need_w: bool) -> Tuple[Tensor, Tensor]:
    """(dx, dweight); an input gradient that is not needed comes back as an empty tensor."""
    dx, dw = lean_backward(grad, x, weight, target, lse, ignore_index, reduction, label_smoothing, z_loss,
                           chunk_size, need_x, need_w, softcap=softcap)
    return (dx if dx is not None else x.new_empty((0,))), (dw if dw is not None else weight.new_empty((0,)))


def _op_fake(x, weight, target, ignore_index, reduction, label_smoothing, z_loss, softcap, chunk_size, check="sync"):
    M = x.shape[0]
    loss = x.new_empty((M,) if reduction == "none" else (), dtype=torch.float32)
    return loss, x.new_empty((M,), dtype=torch.float32)


# saved: x, weight, target, lse; the backward op's arguments after them: ignore_index .. chunk_size (check is the
# forward's only), then need_x, need_w
@forward_op("linear_cross_entropy", fake=_op_fake, backward="linear_cross_entropy_backward", grads=2,
            saved=lambda i, out: (*i[:3], out[1]), extra=lambda i: i[3:9])
def _op(x: Tensor, weight: Tensor, target: Tensor, ignore_index: int, reduction: str, label_smoothing: float,
        z_loss: float, softcap: Optional[float], chunk_size: Optional[int],
        check: str = "sync") -> Tuple[Tensor, Tensor]:
    """(loss, lse) for x (M, H), weight (V, H), target (M,); lse (M,) fp32 is saved for the backward.
    ``check``: "sync", "async" or "off" (``linear_cross_entropy``'s check_targets True, "async", False)."""
    return _forward(x, weight, target, ignore_index, reduction, label_smoothing, z_loss, softcap, check)


# ------------------------------------------------------------------------------------------------ fast mode
def _op_fast_fake(x, weight, target, ignore_index, reduction, label_smoothing, z_loss, softcap, rows, check, need_x,
                  need_w, defer, exp, slots=None, token=None):
    # (a compiled graph defers dW's GEMM only where coda.optim updates the weight in its backward: slots)
    taken = defer and defer_taken(x, weight.shape[0], rows, need_w, reduction)
    return (x.new_empty((x.shape[0],) if reduction == "none" else (), dtype=torch.float32),
            x.new_empty(x.shape) if need_x else x.new_empty((0,)),
            weight.new_empty(weight.shape) if need_w and not taken else weight.new_empty((0,)),
            x.new_empty((x.shape[0], weight.shape[0])) if taken else x.new_empty((0,)),
            x.new_empty((x.shape[0] + 1,) if taken and exp else (0,), dtype=torch.float32))


def _scale_in_place(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """t *= g (g a 0-dim fp32 tensor): on a Hopper GPU as CODA's K = 0 pass (epilogue ``scale_by``, ``out=t``; fp32
    math, vectorised), since torch's ``t.mul_(g)`` (also ``_foreach_mul_``, which falls back to it for a scalar
    tensor of another dtype) runs TensorIterator's casting loop there; elsewhere ``t.mul_(g)``. A column g
    (``reduction="none"``: one value per row of t, shape (rows, 1)) scales the rows."""
    if g.dim():
        return t.mul_(g)
    if pass_ready(t):
        return epilogue_pass(gemm_for(t.device, "coda.ops.linear_cross_entropy"), t, t.shape[0], t.shape[1],
                             epilogue=scale_by, out=t, t=t, s=g)
    return t.mul_(g)


def _update_in_backward(weight: torch.Tensor, dw: torch.Tensor, g: torch.Tensor, dz: torch.Tensor,
                        x: torch.Tensor) -> bool:
    """``coda.optim``'s AdamW step of ``weight`` on the gradient dw * g, as one K = 0 pass (``adamw_scaled``)
    instead of the scaling pass plus the optimizer's, or, with a deferred dW (dz non-empty), in the epilogue of its
    GEMM dz^T x on g dz^T x (``adamw_times``); False where it does not apply (the caller forms and scales dw)."""
    with eager_backward():  # (this backward is the op's own autograd function, not a backward op)
        if dz.numel():
            return update_in_backward(weight, dz.t(), x.t(), ENTRY, adamw_times, s=g) is not None
        if not (dw.device.type == "cpu" or (dw.dim() == 2 and dw.dtype in IN_DTYPES and dw.is_contiguous()
                                             and dw.shape[1] % 8 == 0)):
            return False
        V, H = dw.shape
        return update_in_backward(weight, dw.new_empty(V, 0), dw.new_empty(H, 0), ENTRY, adamw_scaled, t=dw,
                                  s=g) is not None


def _deferred_dw(dz: Tensor, x: Tensor) -> Tensor:
    """The deferred dW = dz^T x, where no in-backward update took it."""
    return backward_gemm(dz.t(), x.t(), ENTRY)


@custom_op("linear_cross_entropy_update", mutates_args=("token",))
def _update_op(weight: Tensor, dw: Tensor, g: Tensor, dz: Tensor, x: Tensor, slots: list[int],
               token: Tensor) -> Tensor:
    """A compiled graph's in-backward update of the LM head (``ops._builder``'s update twins do the same for the
    other ops): coda.optim's AdamW step of ``weight`` on dw * g as one K = 0 pass or, with a deferred dW (dz, x
    non-empty), in the epilogue of dW's GEMM dz^T x, the optimizer found by the weight's slot; where none takes it,
    dw * g goes to the Parameter's ``.grad``. Declares only ``token`` mutated (what keeps the op in the graph);
    returns an empty tensor."""
    from coda import optim
    with optim.slot_updates([weight], slots):
        done = _update_in_backward(weight, dw, g, dz, x)
    if not done:
        if dz.numel():
            dw = _deferred_dw(dz, x)
        optim.accumulate_grad(slots[0], (dw * g).to(dw.dtype))
    return dw.new_empty(0)


@_update_op.register_fake
def _update_fake(weight, dw, g, dz, x, slots, token):
    return dw.new_empty(0)


def _backward_fast(ctx, grad_loss, *_):
    """The gradients formed by the forward, times the upstream gradient: in place in eager mode (the saved tensors
    are this call's own and are released after this node; no second V x H buffer), out of place under
    torch.compile (its graphs are functional). A deferred dW (dz non-empty) is formed here, its GEMM carrying
    coda.optim's update (under torch.compile: ``linear_cross_entropy_update``), else dW = dz^T x before the scale."""
    dx, dw, dz, xs, weight, x = ctx.saved_tensors
    x = dz.new_empty(0) if x is None else x  # (saved only with a deferred dW)
    g = grad_loss.to(torch.float32)
    need_x, need_w = ctx.coda_extra
    eager = getattr(ctx, "coda_eager", False)
    gx = gw = g
    if g.dim():  # reduction="none": dX's rows scaled by g; dW = dz^T diag(g) x on the kept dz, x's rows scaled
        gx, gw = g.unsqueeze(1), None  # first, so dW needs no scale after (no rows: dz empty, dW zero)
    if need_w and dz.numel():  # a deferred dW: x's rows times the forward's factors xs (exp-stored; none where
        rows = xs[:-1].unsqueeze(1) if xs.numel() else None  # those phases could not run) and g ("none")
        if gw is None:
            rows = gx if rows is None else rows * gx
        if rows is not None:
            x = scale_rows(x, rows.squeeze(1), kernel=eager)
        if xs.numel():
            gw = xs[-1] if gw is None else gw * xs[-1]  # (the mean's 1 / n; 1 for "sum" and "none")
    if eager and need_w and _update_in_backward(weight, dw, g.new_ones(()) if gw is None else gw, dz, x):
        need_w, dw = False, None  # coda.optim updated the weight: no gradient
    elif not eager and need_w and ctx.coda_slots and gw is not None:  # torch.compile's update
        call("linear_cross_entropy_update", weight, dw, gw, dz, x, ctx.coda_slots, ctx.coda_token, ctx=ctx)
        need_w, dw = False, None
    elif need_w and dz.numel():
        dw = _deferred_dw(dz, x)  # not updated in its GEMM
    # a second eager backward through this graph (retain_graph=True) fails autograd's version check of the saved
    # tensors (tests/test_cross_entropy.py): an error, never g1 * g2 * grad; mode="lean" allows it
    scale = _scale_in_place if eager else (lambda t, s: (t * s).to(t.dtype))
    grads = [None if not need else t if s is None else scale(t, s)
             for t, s, need in zip((dx, dw), (gx, gw), (need_x, need_w))]
    return (*grads, *[None] * (len(ctx.needs_input_grad) - 2))


# saved: the forward's dx, dw, dz (non-differentiable outputs), the weight (coda.optim), x where dW was deferred;
# extra: need_x, need_w
@forward_op("linear_cross_entropy_fast", fake=_op_fast_fake, backward=_backward_fast,
            saved=lambda i, out: (*out[1:], i[1], i[0] if out[3].numel() else None), extra=lambda i: i[10:12],
            slots=14)
def _op_fast(x: Tensor, weight: Tensor, target: Tensor, ignore_index: int, reduction: str, label_smoothing: float,
             z_loss: float, softcap: Optional[float], rows: int, check: str, need_x: bool,
             need_w: bool, defer: bool, exp: bool, slots: Optional[list[int]] = None,
             token: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, dx, dw, dz, xs) with dx, dw the gradients for an upstream gradient of 1 (empty where not needed);
    ``defer`` (eager calls only): dW's GEMM is left to the backward where ``forward_with_grads`` can (one chunk),
    dz is the logits' gradient it reads (dw then empty; dz empty where not deferred) and xs the factors of x's rows
    and of the product for that GEMM (``forward_with_grads``; empty where not deferred, or where ``exp`` -- the
    exp-stored phases may run: ``exp_taken`` when the entry was called -- is False: then x's rows need none); see
    ``ops/cross_entropy_fast.py``. ``slots``, ``token``: ``coda.optim.compile_slots`` of the weight under
    torch.compile (the backward updates it in place: ``linear_cross_entropy_update``), else None."""
    V = weight.shape[0]
    _check_target_range(target, V, ignore_index, check)
    valid, tcol = _target_columns(target, ignore_index)
    lse, stats, dx, dw, dz, xs = forward_with_grads(x, weight, target, valid, tcol, reduction, label_smoothing,
                                                    z_loss, rows, need_x, need_w, ENTRY, tail_logits, softcap,
                                                    defer=defer, exp=exp)
    loss = finish_loss(lse, stats, valid, V, reduction, label_smoothing, z_loss)
    if dz is not None and xs is None and exp:  # the shape the fake promised: x's rows as they are
        xs = torch.ones((x.shape[0] + 1,), dtype=torch.float32, device=x.device)
    return (loss, (dx if need_x else x.new_empty((0,))), (dw if dw is not None else weight.new_empty((0,))),
            (dz if dz is not None else x.new_empty((0,))),
            (xs if dz is not None and xs is not None else x.new_empty((0,), dtype=torch.float32)))


MEMORY_BUDGET = int(os.environ.get("CODA_CE_MEMORY_BUDGET", 10 ** 9))  # bytes of the fast mode's logits chunk
# bytes of the whole logits gradient the fast mode may keep for the backward when coda.optim updates the weight
# there (dW's GEMM deferred, see ops/cross_entropy_fast.py); 0: never. An explicit memory_budget bounds it instead.
DEFER_BUDGET = int(os.environ.get("CODA_CE_DEFER_BUDGET", 4 * 10 ** 9))
MODES = ("auto", "fast", "lean")


def _fast_rows(x, weight, reduction, label_smoothing, mode, memory_budget, width=None, defer=False) -> Optional[int]:
    """Rows per chunk of the fast mode, or None for the lean mode (see ``linear_cross_entropy``). ``width()``: the
    chunk buffer's column count when it is not ``weight``'s rows (``coda.distributed``: the widest shard).
    ``defer`` (coda.optim updates the weight in the backward): all rows in one chunk when that fits
    ``DEFER_BUDGET`` (the default budget only)."""
    mode = os.environ.get("CODA_CE_MODE", mode) if mode == "auto" else mode  # the global override
    if mode == "lean" or (reduction == "none" and width is not None):
        return None
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return None
    V = weight.shape[0] if width is None else width()
    if label_smoothing > 0 and V % ALIGN:  # the in-place pass would divide eps by the chunk's V8
        return None
    budget = MEMORY_BUDGET if memory_budget is None else memory_budget
    M = x.numel() // max(1, x.shape[-1])
    none_w = reduction == "none" and weight.requires_grad  # dW = dz^T diag(g) x needs g: the whole dz kept
    if defer and (memory_budget is None or none_w):
        whole = plan_rows(M, V, x.element_size(), DEFER_BUDGET if memory_budget is None else memory_budget)
        if whole is not None and whole >= M and not (none_w and V % ALIGN):  # every row in one chunk
            return whole
    if none_w:  # dz cannot be kept (under torch.compile, too large, a V % 8 tail): the lean mode
        return None
    return plan_rows(M, V, x.element_size(), budget, force=mode == "fast")


# ------------------------------------------------------------------------------------------------ public entry
def linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0, *,
                         chunk_size: Optional[int] = None, check_targets: Union[bool, str] = True,
                         mode: str = "auto", memory_budget: Optional[int] = None,
                         softcap: Optional[float] = None) -> Tensor:
    """``F.cross_entropy(x @ weight.T, target, ...)`` (+ ``z_loss * logsumexp**2`` per row) without storing logits.

    x (..., H) bfloat16/float16, weight (V, H) of x's dtype, target (...) int64 in [0, V) or ``ignore_index``.
    ``reduction``: "mean" (over non-ignored rows), "sum" or "none" (shape of ``target``). ``label_smoothing`` in
    [0, 1] (torch semantics); ``z_loss`` >= 0. ``chunk_size``: vocabulary columns per backward chunk (a multiple of
    8; default: chunks of at most ``CHUNK_BYTES``). ``check_targets``: True (a device sync,
    ValueError on a bad target), "async" (a device-side assert, no sync) or False (no check). ``softcap``: logit
    soft-capping (Gemma 2): the loss of ``softcap * tanh(z / softcap)`` instead of z, forward and backward, in both
    modes (None: off). Returns a float32 loss. See the module docstring.

    ``mode``: "fast" forms the gradients during the forward at the cost of three GEMMs through a logits chunk
    buffer of at most ``memory_budget`` bytes (default ``MEMORY_BUDGET`` = 1 GB, env ``CODA_CE_MEMORY_BUDGET``;
    ``ops/cross_entropy_fast.py``); "lean" stores no logits at all (four GEMMs: the backward recomputes them);
    "auto" (default) is "fast" when gradients are needed and at least ``MIN_ROWS`` rows of logits fit the budget
    (``reduction="none"`` with a weight gradient: in eager calls, when the whole M x V logits gradient fits
    ``DEFER_BUDGET`` or ``memory_budget``, kept for the backward, which needs the upstream vector to form dW), else
    "lean". When ``coda.optim.AdamW`` updates ``weight`` in the
    backward (eager, or a compiled graph's backward: ``linear_cross_entropy_update``), the fast mode keeps the whole M x V logits gradient until the backward if it fits
    ``DEFER_BUDGET`` (4 GB, env ``CODA_CE_DEFER_BUDGET``; 0: never; an explicit ``memory_budget`` bounds it instead)
    and runs dW's GEMM there with the update in its epilogue: memory for time (H100, session 34: the LM head's dW and
    update 7.47 -> 5.69 ms a llama-1b step, its peak 19.4 -> 20.2 GB)."""
    _check(x, weight, target, ignore_index, reduction, label_smoothing, z_loss, chunk_size, softcap)
    softcap = None if softcap is None else float(softcap)
    check = check_targets_option("linear_cross_entropy", check_targets)
    if mode not in MODES:
        raise ValueError(f"linear_cross_entropy: mode must be one of {MODES}, got {mode!r}")
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, int)
                                      or memory_budget <= 0):
        raise ValueError(f"linear_cross_entropy: memory_budget must be a positive int (bytes), got {memory_budget!r}")
    H = x.shape[-1]
    # coda.optim's update in dW's GEMM, run by the backward over all rows (ops/cross_entropy_fast.py)
    # (reduction="none": dW's GEMM waits for the upstream vector in the backward, whichever optimizer)
    # (under torch.compile: where the graph's backward updates the weight, linear_cross_entropy_update; not "none")
    upd = update_args(weight, when=weight.requires_grad)
    defer = weight.requires_grad and (
        eager_call() and (reduction == "none" or DEFER_BUDGET > 0 and updates_in_backward(weight))
        or len(upd) == 2 and upd[0][0] >= 0 and reduction != "none" and DEFER_BUDGET > 0)  # (torch 2.11's dynamo
    # breaks the graph on bool(list): then the forward graph's saved optimizer token is bumped by the LM head's)
    rows = _fast_rows(x, weight, reduction, label_smoothing, mode, memory_budget, defer=defer)
    if rows is not None:
        need_x, need_w = x.requires_grad, weight.requires_grad
        # under torch.compile the weight coda.optim holds is updated by the backward (linear_cross_entropy_update)
        # exp: whether the exp-stored phases may run (decided here: under CUDA-graph capture they do not, and the
        # op's deferred-dW factors are then left out -- the fake's shape follows this flag, not the run)
        V = weight.shape[0]
        exp = exp_taken(x, float(label_smoothing), softcap, None, V // ALIGN * ALIGN, V)
        loss, *_ = call("linear_cross_entropy_fast", x.reshape(-1, H), weight, target.reshape(-1), ignore_index,
                        reduction, float(label_smoothing), float(z_loss), softcap, rows, check, need_x, need_w, defer,
                        exp, *upd)
        return loss.reshape(target.shape) if reduction == "none" else loss
    loss, _ = call("linear_cross_entropy", x.reshape(-1, H), weight, target.reshape(-1), ignore_index, reduction,
                   float(label_smoothing), float(z_loss), softcap, chunk_size, check)
    return loss.reshape(target.shape) if reduction == "none" else loss
