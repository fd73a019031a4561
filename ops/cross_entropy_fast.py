"""``linear_cross_entropy``'s fast mode: the gradients formed while the forward runs, at the cost of three GEMMs.

The loss is the last op of a training step and, for ``reduction`` "mean" or "sum", its upstream gradient is one
scalar g. So the forward forms d loss / d x and d loss / d W for g = 1 and the backward only scales them by g. Per
chunk of ``rows`` rows [m0, m1) (phases):

1. logits: z = x_c W^T (GEMM 1) stored in x's dtype into one reused chunk buffer (rows x V); its epilogue also
   emits the per-row logsumexp partials (``ce_forward_logits``), finished by ``coda.gemm``; the target logit is
   read back from the stored logits (:func:`target_logit`, one gather per chunk);
2. softmax gradient in place: z <- (p (1 + 2 zl lse) - (1 - eps) [v == t] - eps / V) * s_r with s_r = 1 / n_valid
   ("mean") or 1 ("sum"), 0 on ignored rows (``coda.kernels.ce_grad``: one memory-bound pass over the chunk);
3. dX_c = dz W (GEMM 2, written straight into dx's rows);
4. dW (+)= dz^T x_c (GEMM 3; the first chunk writes dW, later ones add to it through the ``accumulate``
   epilogue: dW is rounded to its dtype once per chunk).

Exp-stored phases 1-2 (``exp_taken``: no label smoothing, no soft-capping, V % 8 == 0, a single-process
vocabulary, bfloat16 -- float32's exponent range -- and not under CUDA-graph capture, which allows no
host synchronisation): phase 1 stores exp(z) = p e^lse of the float32 logit instead of z (``ce_forward_exp``), and
phase 2 is no pass over the chunk: with s_r the row's loss scale and a_r = e^-lse (1 + 2 zl lse) s_r,

    dz = a_r (exp(z) - [v == t] e^lse / (1 + 2 zl lse))

so one element per row is rewritten (the target's, in float32 from the stored exp(z_t)), dX = diag(a) (dz' W) is
GEMM 2 with a row-scale epilogue (``rmsnorm_scale``: acc r) and dW = dz'^T diag(a) x is GEMM 3 on x's rows scaled
(the mean's 1 / n kept as a scalar for the update's epilogue: x's scaled rows stay normal bfloat16). z_t = log exp(z_t) of the
stored value (a bfloat16 exp: within 2^-9 of z_t, torch's bfloat16 logits are within |z_t| 2^-9). The stored exp(z)
is exact where every row's lse lies in [LSE_MIN, LSE_MAX] and its target's exp(z_t) did not underflow: one flag
per chunk, read on the host from pinned memory after an event that precedes phase 3 (the dX GEMM is queued first,
speculatively, so the GPU does not drain while the host waits); a chunk outside (huge logits, NaN, inf) is
recomputed by the stored-logits phases 1-3 above, so results, NaN and inf behave as there. It saves phase 2's read and write of the chunk
(1.4 ms a llama-1b step on the H100: 2 x 2.1 GB).

Deferred dW (``defer``, when ``coda.optim.AdamW`` updates the weight in the backward -- eager, or in a compiled
graph's backward, ``linear_cross_entropy_update`` -- and all M rows are one chunk): GEMM 4 is left for the backward, which runs it once over all rows (K = M) with the AdamW update of the
weight in its epilogue (``epilogues.adamw.adamw_times``: g = acc grad_output) -- no dW is stored, accumulated over
chunks or read back by a K = 0 update pass. The price is memory: the whole dz (M x V in x's dtype) lives until the
backward instead of a chunk until the end of the forward (``cross_entropy.DEFER_BUDGET``), less the V x H dW the
mode no longer stores. Measured in docs/NOTES.md (session 34).

Cost: the three GEMMs of torch's LM head + one read and write of the logits in x's dtype (torch.compile's CE makes
the same pass, plus the logits' float32 upcast), against the lean mode's four GEMMs. Memory: the chunk buffer
(``rows x V x 2`` bytes, at most the budget: 1 GB by default, see ``cross_entropy.MEMORY_BUDGET``), and dx, dW from
the forward on (they are the gradients: the backward scales them by g in place in eager mode, out of place under
torch.compile).
``reduction="none"``: the upstream gradient g is a vector, one value per row: dX's rows are scaled by it in the
backward, and dW = dz^T diag(g) x needs it before GEMM 4, so where the weight needs a gradient the whole dz is kept
(``defer``; eager calls, all rows one chunk within ``DEFER_BUDGET`` or ``memory_budget``, V % 8 == 0) and the
backward runs GEMM 4 on x's rows scaled by g (rounded to x's dtype, as torch rounds its scaled logits gradient).
Not taken (the lean mode runs instead): no gradient needed, a budget too small for ``MIN_ROWS`` rows, or
``reduction="none"`` with a weight gradient where dz cannot be kept (under torch.compile, or too large).
The last V % 8 vocabulary columns (V not a multiple of 8) come from an fp32 GEMM against zero-padded weight rows, as
in the lean mode, with their gradient formed by torch ops.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
from torch import Tensor

from coda import _validate
from coda.runtime import precompile as _precompile
from coda.epilogues import cross_entropy as _epi
from coda.epilogues.cross_entropy import accumulate, ce_forward, ce_forward_exp, ce_forward_logits
from coda.epilogues.rmsnorm import rmsnorm_scale
from coda.kernels.ce_grad import softmax_grad_, softmax_grad_reference_

from ._common import IN_DTYPES, epilogue_pass, gemm_for, kernel_aligned

ALIGN = 8
MIN_ROWS = 1024  # fewer rows per chunk than this: the dW accumulation traffic outweighs the saved GEMM
# the rows' lse the exp-stored phases take (else the stored-logits ones): exp(z) neither overflows the stored
# dtype (e^88.7) nor loses a probability above e^-(87 + LSE_MIN) of the row's sum, and e^-lse scales x's rows within
# bfloat16's normal range
LSE_MIN, LSE_MAX = -20.0, 60.0
EXP_ENV = "CODA_CE_EXP"  # "0": always the stored-logits phases 1-2


def plan_rows(M: int, V: int, esize: int, budget: int, force: bool = False) -> Optional[int]:
    """Rows per chunk so that the chunk buffer (rows x V8 x esize bytes) fits ``budget``: all M rows when they fit,
    else balanced chunks of whole 128-row tiles; None when fewer than min(M, MIN_ROWS) rows fit (unless ``force``:
    then at least 8)."""
    v8 = max(V // ALIGN * ALIGN, ALIGN)
    max_rows = budget // (v8 * esize)
    if max_rows >= M:
        return max(M, 1)
    if max_rows < min(M, MIN_ROWS) and not force:
        return None
    max_rows = max(ALIGN, max_rows // ALIGN * ALIGN)
    n = math.ceil(M / max_rows)
    rows = math.ceil(M / n / 128) * 128
    return rows if rows <= max_rows else max_rows


def target_logit(z: Tensor, tgt: Tensor) -> Tensor:
    """z_t = z[r, tgt[r]] of the stored logits z (rows x v8) in float32, 0 where tgt lies outside [0, v8) (an
    ignored row's -1, a target in the V % 8 tail): the sum over v of [v == t] z_v that the epilogue formed before."""
    if z.shape[1] == 0:  # V < 8: every column is in the tail
        return torch.zeros(tgt.shape, dtype=torch.float32, device=z.device)
    col = tgt.clamp(0, z.shape[1] - 1)  # == tgt exactly where the target is a stored column
    return z.gather(1, col.unsqueeze(1)).squeeze(1).float().masked_fill_(col != tgt, 0.0)


def defer_taken(x: Tensor, V: int, rows: int, need_w: bool, reduction: str) -> bool:
    """Whether :func:`forward_with_grads` takes a requested ``defer``, from shapes, dtypes and strides only (the fake
    implementation under torch.compile asks it too): the weight gradient is needed, all M rows are one chunk,
    V % 8 == 0 and dW = dz^T x meets the kernel's 16-byte rules (``coda._validate.check_gemm_args``: M, H and x's
    row stride multiples of 8; ``reduction="none"``: always, its dW needs dz). A pointer the kernel can't take
    leaves dW's GEMM to ``backward_gemm`` in the backward."""
    M, H = x.shape
    return need_w and rows >= M > 0 and V % ALIGN == 0 and (reduction == "none" or (
        x.dtype in _validate.IN_DTYPES and M % ALIGN == 0 and H % ALIGN == 0 and x.stride(-1) == 1
        and x.stride(0) % ALIGN == 0))


def exp_taken(x: Tensor, eps: float, softcap, combine, v8: int, V: int) -> bool:
    """Whether phases 1-2 store exp(z) (module docstring): no label smoothing or soft-capping, one process's whole
    vocabulary, V % 8 == 0, bfloat16 or float32 (float32's exponent range), not capturing a CUDA graph."""
    if os.environ.get(EXP_ENV, "1") == "0" or eps > 0 or softcap is not None or combine is not None or v8 != V:
        return False
    if x.dtype not in (torch.bfloat16, torch.float32):  # (float16's exp overflows at 11)
        return False
    return not (x.is_cuda and torch.cuda.is_current_stream_capturing())


def pass_ready(t: Tensor) -> bool:
    """Whether ``t`` can be the TileMN of a K = 0 pass on the GPU (the in-place scalings of this mode's
    gradients): a CUDA matrix of a kernel dtype, contiguous, 16-byte rows."""
    return t.is_cuda and t.dim() == 2 and t.dtype in IN_DTYPES and t.is_contiguous() and t.shape[1] % 8 == 0


def scale_rows(x: Tensor, s: Tensor, kernel: bool = True) -> Tensor:
    """x * s[:, None] rounded to x's dtype (s float32), x's rows for dW's GEMM: on a Hopper GPU one K = 0 pass
    (epilogue ``scale_rows``: no float32 copy of x), elsewhere -- CPU tensors, and ``kernel`` False: a backward
    that torch.compile traces, where coda.gemm may not run on its fake tensors -- torch's float32 product (which
    inductor fuses into one kernel)."""
    if kernel and pass_ready(x):
        return epilogue_pass(gemm_for(x.device, "coda.ops.linear_cross_entropy"), x, x.shape[0], x.shape[1],
                             epilogue=_epi.scale_rows, t=x, s=s.contiguous())
    return (x.float() * s.unsqueeze(1)).to(x.dtype)


def _flag_wait(ok: Tensor):
    """A function returning ``bool(ok)`` (a 0-dim device bool) that waits only for the kernels queued before this
    call: on CUDA ``ok`` is copied to pinned host memory behind an event, so kernels queued between this call and
    the returned function's call (the speculative dX GEMM) keep the GPU busy while the host waits."""
    if not ok.is_cuda:
        return lambda: bool(ok)
    key = ok.device
    if key not in _FLAGS:
        _FLAGS[key] = torch.empty((), dtype=torch.bool, pin_memory=True)
    host, ev = _FLAGS[key], torch.cuda.Event()
    host.copy_(ok, non_blocking=True)
    ev.record()

    def wait() -> bool:
        ev.synchronize()
        return bool(host)
    return wait


_FLAGS: dict = {}  # one pinned flag per device, read back before the next chunk's copy is queued


def _exp_phases(gemm, xc, w8, z, tgt, valid_c, scale_c, zl: float, dx_c: Optional[Tensor]):
    """Phases 1-2 exp-stored (module docstring) on one chunk and, speculatively, phase 3 into ``dx_c`` (None: no
    dX): (lse, z_t, a) with z rewritten to dz' in place, or None where a row falls outside the exact range (then z
    and dx_c hold garbage: the caller reruns phases 1-3). The range check is read on the host after phase 3 is
    queued: the host waits for phases 1-2 while the GPU runs the dX GEMM (no drained queue at the check)."""
    lse = torch.log(gemm(xc, w8, epilogue=ce_forward_exp(z.dtype), out=z)["se"])
    col = tgt.clamp_min(0).unsqueeze(1)
    et = z.gather(1, col).squeeze(1).float()  # the stored exp(z_t)
    zf = 1 + 2 * zl * lse
    ok = torch.isfinite(lse) & (lse >= LSE_MIN) & (lse <= LSE_MAX) & (zf >= 0.5) & ((et > 0) | ~valid_c)
    # (a dry run records this path's kernels: the rerun's are for rows outside the range, compiled when met)
    wait = _flag_wait(ok.all()) if _precompile.recorder() is None else (lambda: True)
    zt = torch.where(valid_c, torch.log(et), 0.0)
    fixed = torch.where(valid_c, et - torch.exp(lse) / zf, et)
    z.scatter_(1, col, fixed.to(z.dtype).unsqueeze(1))
    a = torch.exp(-lse) * zf * scale_c
    if dx_c is not None:                                                   # phase 3, before the check
        gemm(z, w8.t(), epilogue=rmsnorm_scale, out=dx_c, r=a)
    return (lse, zt, a) if wait() else None


def forward_with_grads(x: Tensor, weight: Tensor, target: Tensor, valid: Tensor, tcol: Tensor, reduction: str,
                       eps: float, zl: float, rows: int, need_x: bool, need_w: bool, entry: str, tail_logits,
                       softcap: Optional[float] = None, combine=None, defer: bool = False, exp: bool = True):
    """(lse, stats, dx, dw, dz, xs) for g = 1; see the module docstring. ``xs`` (with a deferred dW: M + 1 float32,
    else None): the factors of x's rows for dW's GEMM and, last, the scale of its product (1 / n for the mean).
    ``combine(lse_c, zt_c)`` (``coda.distributed``'s vocabulary-parallel CE, ``weight`` one rank's shard and ``target`` shifted into it): a chunk's per-row
    statistics over every shard, (lse_c, zt_c), between phases 1 and 2 (no label smoothing there).
    ``tail_logits(x_c, weight, v8)`` gives the fp32 logits of the last V % 8 columns (label smoothing with such a tail takes the lean mode: the in-place pass
    would divide eps by the chunk's width). ``softcap``: the stored logits are capped (``softcap * tanh(z /
    softcap)``, in the epilogue) and phase 2 multiplies by their derivative. ``defer``: leave GEMM 4 to the
    caller (dz^T x), returning dz and no dw; taken only where the weight gradient is needed, all rows
    are one chunk (``rows >= M > 0``), V % 8 == 0 and the kernel reads dz^T, x^T as they are (dz None
    otherwise); ``xs`` None where the exp-stored phases did not run. ``exp``: False keeps them off (the op's entry
    decided so: :func:`exp_taken` when it was called)."""
    M, H = x.shape
    V = weight.shape[0]
    v8 = V // ALIGN * ALIGN
    gemm = gemm_for(x.device, entry)
    n_valid = valid.sum()
    scale = valid.to(torch.float32)
    if reduction == "mean":
        scale = scale / n_valid.clamp_min(1).to(torch.float32)
    buf = x.new_empty((rows * v8,))
    defer = defer and defer_taken(x, V, rows, need_w, reduction)
    dx = x.new_empty((M, H)) if need_x else None
    dw = torch.empty((V, H), dtype=weight.dtype, device=weight.device) if need_w and not defer else None
    lse = torch.empty((M,), dtype=torch.float32, device=x.device)
    stats = {"zt": torch.empty_like(lse)}
    if eps > 0:
        stats["zsum"] = torch.empty_like(lse)
    epi = ce_forward_logits(x.dtype, eps > 0, softcap is not None)
    cap = {} if softcap is None else {"cap": softcap}
    w8 = weight[:v8]
    dz = xs = None
    use_exp = exp and exp_taken(x, eps, softcap, combine, v8, V)
    for m0 in range(0, M, rows):
        m1 = min(M, m0 + rows)
        xc, z = x[m0:m1], buf[:(m1 - m0) * v8].view(m1 - m0, v8)
        tgt = torch.where(valid[m0:m1], target[m0:m1], -1)
        dx_c = dx[m0:m1] if need_x else None
        got = _exp_phases(gemm, xc, w8, z, tgt, valid[m0:m1], scale[m0:m1], zl, dx_c) if use_exp else None
        a = dz_tail = None
        xw = xc  # dW's x rows
        if got is not None:  # phases 1-2 exp-stored: dz' in z; dX's row factors a, dW's on x's rows
            lse[m0:m1], stats["zt"][m0:m1], a = got
            if defer:  # (x's rows scaled in the backward; the mean's 1 / n kept apart, xs[M])
                xs = torch.empty((M + 1,), dtype=torch.float32, device=x.device)  # (one chunk: M rows)
                xs[M] = 1 / n_valid.clamp_min(1) if reduction == "mean" else 1.0
                xs[m0:m1] = a / xs[M]
            elif need_w:
                xw = scale_rows(xc, a)
        else:
            res = gemm(xc, w8, epilogue=epi, out=z, **cap)  # phase 1
            lse_c = res["lse"]
            stats["zt"][m0:m1] = target_logit(z, tgt)
            if eps > 0:
                stats["zsum"][m0:m1] = res["zsum"]
            tl = None
            if v8 < V:  # the tail's statistics from the same epilogue program, evaluated by torch (as the lean mode)
                tl = tail_logits(xc, weight, v8)
                tl = tl if softcap is None else softcap * torch.tanh(tl / softcap)  # (the capped logits)
                tres = ce_forward.reference(tl, t=tcol[m0:m1] - v8)
                lse_c = torch.logaddexp(lse_c, tres["lse"])
                stats["zt"][m0:m1] += tres["zt"]
            if combine is not None:  # the vocabulary shards' statistics, before the softmax gradient needs them
                lse_c, stats["zt"][m0:m1] = combine(lse_c, stats["zt"][m0:m1])
            lse[m0:m1] = lse_c
            softmax_grad_(z, lse_c.contiguous(), tgt, scale[m0:m1].contiguous(), label_smoothing=eps,
                          z_loss=zl, softcap=softcap)                      # phase 2 (the reference on CPU tensors)
            dz_tail = None if tl is None else softmax_grad_reference_(tl, lse_c, tgt - v8, scale[m0:m1], z_loss=zl,
                                                                      softcap=softcap)
        if need_x and got is None:                                         # phase 3 (exp-stored: done)
            if dz_tail is None:
                gemm(z, w8.t(), out=dx[m0:m1])
            else:
                acc = gemm(z, w8.t(), out_dtype=torch.float32) if v8 else dz_tail.new_zeros((m1 - m0, H))
                acc.addmm_(dz_tail, weight[v8:].float())
                dx[m0:m1] = acc
        if defer:
            dz = z                                                         # phase 4: the backward's
        elif need_w:                                                       # phase 4
            first = m0 == 0
            if v8 and kernel_aligned(z.t(), xw.t()):
                if first:
                    gemm(z.t(), xw.t(), out=dw[:v8])
                else:
                    gemm(z.t(), xw.t(), epilogue=accumulate, out=dw[:v8], prev=dw[:v8])
            elif v8:
                with torch.autocast(x.device.type, enabled=False):
                    if first:
                        torch.matmul(z.t(), xw, out=dw[:v8])
                    else:
                        dw[:v8].addmm_(z.t(), xw)
            if dz_tail is not None:
                part = dz_tail.t() @ xc.float()
                dw[v8:] = part if first else dw[v8:].float() + part
    if M == 0:
        if need_x:
            dx.zero_()
        if need_w:
            dw.zero_()
    return lse, stats, dx, dw, dz, xs


__all__ = ["plan_rows", "defer_taken", "forward_with_grads", "target_logit", "MIN_ROWS", "exp_taken", "LSE_MIN",
           "LSE_MAX", "EXP_ENV"]
