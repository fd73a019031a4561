"""The attention QKV projection's backward prologue, one pass: RoPE un-rotation of the q, k, v gradients into one
M x N gradient of the QKV GEMM's accumulator, and the gradient of the RMSNorm's row scale r.

The fused QKV GEMM (``ops.attention``) writes y = [q | k | v] = RoPE(r acc) (M x N, N = nq + nk + nv columns; acc =
h (W diag(gamma))^T, r the norm's row scale), q and k rotated per column pair (2j, 2j + 1) at angle theta = pos[m] *
freq[j] (``epilogues/rope.py``; freq = 0 for v). Its backward needs, from the gradients dq, dk, dv of the three
parts (whatever row strides the attention backward gave them, 16-byte rows):

    dacc[m, 2j], dacc[m, 2j+1] = r[m] R(-theta) (dy[m, 2j], dy[m, 2j+1])     dy = [dq | dk | dv]     (M x N)
    dr[m] = sum_n dy[m, n] y[m, n] / r[m]                                     (= sum_n R(-theta) dy acc: the ZdZ)

(the rotation preserves each pair's dot product, so dr can be formed from the rotated values). dacc is the
gradient of the accumulator itself (r applied): the dX GEMM then runs ``rms_radial`` on the unfolded weight and the
dW GEMM the folded weight's ``fold_grads`` / ``adamw_fold`` (``ops.mlp.rmsnorm_fold_grads``), so no normalised
activation is ever written. Before this kernel it
took four passes: torch's cat of dq, dk, dv (split's backward), two deinterleaving copies, the K = 0 un-rotation
GEMM pass and a K = 0 row-dot pass -- ~0.2 ms a layer at llama-1b's 8192 x 3072 (H100, session 23's step profile).
This pass reads dq, dk, dv and y once and writes dacc once (150 MB there).

Kernel (memory-bound): a warp per row, 8 warps a CTA; a lane takes 8 columns (16-byte loads of dy and y, one
16-byte load of the 4 pairs' frequencies, a 16-byte store), 256 columns a warp step, the row's three parts in
turn; angles as the GEMM epilogue forms them (``coda._eval.reduce_angle``: an error-free product pos * freq reduced
modulo 2 pi, then the SFU's sin / cos of the reduced angle); c's partials summed in fp32 by a butterfly shuffle.
The widths of the three parts must be multiples of 8 (whole 16-byte chunks); row strides multiples of 8 elements.

:func:`rope_grad` runs it on CUDA tensors (Hopper, one compile per dtype) and :func:`rope_grad_reference` (torch,
angles in float64, the CPU reference path) on CPU tensors. ``python -m coda.bench.rope_grad`` times it.
"""

import math

import torch

from .ce_grad import _cutlass_dtype  # (the 16-bit element types, one table)
from .row_kernel import VEC, Launcher, rows

THREADS = 256
WARPS = THREADS // 32
_DTYPES = (torch.bfloat16, torch.float16)
# dq, dk, dv, q, k, v as 16-byte rows; pos, freqs, r, dacc, dr
_launcher = Launcher("rope_grad", ((16, 1),) * 6 + ((4, 0), (16, 0), (4, 0), (16, 1), (4, 0)))


def check_args(grads, ys, pos, freqs, r, entry: str = "rope_grad") -> tuple:
    """Validate :func:`rope_grad`'s arguments; returns (M, widths). ``grads`` / ``ys``: three (M, n_i) tensors each
    (dq, dk, dv; q, k, v), ``pos`` (M,) fp32, ``freqs`` (N/2,) fp32, ``r`` (M,) fp32 (float64 with float64 parts)."""
    names = ("dq", "dk", "dv", "q", "k", "v")
    ts = (*grads, *ys)
    for name, t in zip(names, ts):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{entry}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{entry}: {name} must be 2-D (M, columns), got shape {tuple(t.shape)}")
    M = grads[0].shape[0]
    widths = tuple(g.shape[1] for g in grads)
    for name, g, y in zip(names, grads, ys):
        if tuple(g.shape) != tuple(y.shape) or g.shape[0] != M:
            raise ValueError(f"{entry}: {name} and its forward value must be ({M}, n) alike, got {tuple(g.shape)} "
                             f"and {tuple(y.shape)}")
        if g.dtype != ys[0].dtype or y.dtype != ys[0].dtype:
            raise TypeError(f"{entry}: {name}: expected dtype {ys[0].dtype}, got {g.dtype} / {y.dtype}")
    for name, t, n in (("pos", pos, (M,)), ("freqs", freqs, (sum(widths) // 2,)), ("r", r, (M,))):
        ok = (torch.float32, torch.float64) if name == "r" and ys[0].dtype == torch.float64 else (torch.float32,)
        if not isinstance(t, torch.Tensor) or t.dtype not in ok or tuple(t.shape) != n:
            raise ValueError(f"{entry}: {name} must be a float32 tensor of shape {n}")
    return M, widths


def _angles(pos: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """theta reduced to about [-pi, pi] in float64 (as ``coda._eval.TorchOps.angle``), (M, N/2)."""
    p = pos.double()[:, None] * freqs.double()[None, :]
    return p - 2 * math.pi * torch.round(p / (2 * math.pi))


def rope_grad_reference(grads, ys, pos, freqs, r):
    """The torch reference of :func:`rope_grad` (any device; fp32 math -- float64 for float64 parts -- angles in
    float64): (dacc (M, N) in the gradients' dtype, dr (M,) fp32, float64 for float64 parts)."""
    check_args(grads, ys, pos, freqs, r)
    return _reference(grads, ys, pos, freqs, r)


def _reference(grads, ys, pos, freqs, r):
    dt = torch.promote_types(grads[0].dtype, torch.float32)
    dy = torch.cat([g.to(dt) for g in grads], 1)
    y = torch.cat([t.to(dt) for t in ys], 1)
    th = _angles(pos, freqs)
    cs, sn = th.cos().to(dt), th.sin().to(dt)
    e, o = dy[:, 0::2], dy[:, 1::2]
    rr = r.to(dt)
    dacc = torch.stack((e * cs + o * sn, o * cs - e * sn), -1).flatten(1) * rr[:, None]
    return dacc.to(grads[0].dtype), (dy * y).sum(1) / rr


# ----------------------------------------------------------------------------------------------------------------
# the kernel


def _kernel_class():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from coda._eval import CuteOps, reduce_angle

    class RopeGradSm90:
        """One compiled variant per element type."""

        def __init__(self, dtype):
            self.dtype = dtype

        @cute.jit
        def __call__(self, mDq: cute.Tensor, mDk: cute.Tensor, mDv: cute.Tensor, stream: cuda.CUstream,
                     mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mPos: cute.Tensor, mFreq: cute.Tensor,
                     mR: cute.Tensor, mOut: cute.Tensor, mC: cute.Tensor):
            # (the stream fourth, every other argument a tensor: the argument order of coda._launch.Plan)
            M = mDq.shape[0]
            self.kernel(rows(mDq), rows(mDk), rows(mDv), rows(mQ), rows(mK), rows(mV), mPos, mFreq, mR, rows(mOut),
                        mC).launch(
                grid=[cute.ceil_div(M, WARPS), 1, 1], block=[THREADS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mDq: cute.Tensor, mDk: cute.Tensor, mDv: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor,
                   mV: cute.Tensor, mPos: cute.Tensor, mFreq: cute.Tensor, mR: cute.Tensor, mOut: cute.Tensor,
                   mC: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bx, _, _ = cute.arch.block_idx()
            lane = tidx % 32
            m = bx * WARPS + tidx // 32
            if m < mDq.shape[0]:
                pos = mPos[m]
                rr = mR[m]
                out = cute.zipped_divide(mOut[m, None], (VEC,))
                freq = cute.zipped_divide(mFreq, (VEC // 2,))
                dot = Float32(0.0)
                off = Int32(0)
                for g_t, y_t in ((mDq, mQ), (mDk, mK), (mDv, mV)):  # the three parts, in turn (unrolled)
                    n = g_t.shape[1]
                    grow = cute.zipped_divide(g_t[m, None], (VEC,))
                    yrow = cute.zipped_divide(y_t[m, None], (VEC,))
                    for c in range(lane * VEC, n, 32 * VEC):
                        gf = cute.make_rmem_tensor((VEC,), self.dtype)
                        yf = cute.make_rmem_tensor((VEC,), self.dtype)
                        ff = cute.make_rmem_tensor((VEC // 2,), Float32)
                        cute.autovec_copy(grow[None, c // VEC], gf)
                        cute.autovec_copy(yrow[None, c // VEC], yf)
                        cute.autovec_copy(freq[None, (off + c) // VEC], ff)
                        dot = dot + self._chunk(gf, yf, ff, pos, rr)
                        cute.autovec_copy(gf, out[None, (off + c) // VEC])
                    off = off + n
                for k in cutlass.range_constexpr(5):  # butterfly: every lane gets the row's sum
                    dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=1 << k)
                if lane == 0:
                    mC[m] = dot / rr

        @cute.jit
        def _chunk(self, gf: cute.Tensor, yf: cute.Tensor, ff: cute.Tensor, pos: Float32, rr: Float32) -> Float32:
            """Un-rotates the chunk's 4 pairs in ``gf`` and scales them by the row's r (in place); returns sum(dy *
            y) of its 8 elements."""
            B = CuteOps()
            g = gf.load().to(Float32)
            y = yf.load().to(Float32)
            r = cute.make_rmem_tensor((VEC,), Float32)
            dot = Float32(0.0)
            for i in cutlass.range_constexpr(VEC // 2):
                e, o = g[2 * i], g[2 * i + 1]
                dot = dot + e * y[2 * i] + o * y[2 * i + 1]
                th = reduce_angle(B, 1.0, [pos, ff[i]])
                cs, sn = B.cos_reduced(th), B.sin_reduced(th)
                r[2 * i] = (e * cs + o * sn) * rr
                r[2 * i + 1] = (o * cs - e * sn) * rr
            gf.store(r.load().to(self.dtype))
            return dot

    return RopeGradSm90


def compile_kernel(dtype=torch.bfloat16, *, options=None, fake=True, args=None):
    """``cute.compile`` one variant (element type). ``fake``: shape-symbolic fake tensors (no GPU
    needed: the CPU tests); else ``args`` = the cute arguments of a real call."""
    import cutlass
    import cutlass.cute as cute
    op = _kernel_class()(_cutlass_dtype(dtype))
    kw = {"options": options} if options else {}
    if fake:
        import cutlass.runtime as crt
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor
        M = cute.sym_int32()
        rows = [make_fake_tensor(_cutlass_dtype(dtype), (M, cute.sym_int32()), (cute.sym_int64(divisibility=VEC), 1),
                                 assumed_align=16) for _ in range(7)]
        f32 = make_fake_compact_tensor(cutlass.Float32, (M,), assumed_align=4)
        fr = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int32(),), assumed_align=16)
        args = [*rows[:3], crt.make_fake_stream(), *rows[3:6], f32, fr, f32, rows[6], f32]
    return cute.compile(op, *args, **kw)


def _rows_ok(t: torch.Tensor) -> bool:
    return (t.stride(1) == 1 or t.shape[1] <= 1) and (t.shape[0] <= 1 or t.stride(0) % VEC == 0) \
        and t.data_ptr() % 16 == 0


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernel reads it: 16-byte aligned rows, stride 1 within a row, a row stride that is a multiple of
    8 (a copy where ``t`` is not so; the attention backward's gradients normally are)."""
    if not _rows_ok(t):
        t = t.contiguous()
    if t.shape[0] <= 1:  # a single row: any multiple-of-8 stride will do (never used)
        t = t.as_strided(t.shape, (-(-max(t.shape[1], 1) // VEC) * VEC, 1))
    return t


def rope_grad(grads, ys, pos, freqs, r):
    """(dacc, dr) of the module docstring. ``grads``: (dq, dk, dv), ``ys``: (q, k, v), each (M, n_i) bf16 / fp16
    with n_i a multiple of 8; ``pos`` (M,) fp32; ``freqs`` (N/2,) fp32, N = sum n_i; ``r`` (M,) fp32, the rows'
    scale (positive). Returns dacc (M, N) in the gradients' dtype and dr (M,) fp32. CUDA tensors run the kernel
    (Hopper), CPU tensors :func:`rope_grad_reference`."""
    M, widths = check_args(grads, ys, pos, freqs, r)
    if grads[0].device.type != "cuda":
        return _reference(grads, ys, pos, freqs, r)  # (arguments checked above)
    if grads[0].dtype not in _DTYPES or any(w % VEC for w in widths):
        raise ValueError(f"rope_grad: bfloat16 / float16 parts with widths multiple of {VEC} expected, got "
                         f"{grads[0].dtype} {widths}")
    N = sum(widths)
    out = torch.empty(M, N, device=grads[0].device, dtype=grads[0].dtype)
    c = torch.empty(M, device=out.device, dtype=torch.float32)
    if M == 0:
        return out, c
    f = freqs.detach().contiguous()
    if f.data_ptr() % 16:
        f = f.clone()
    views = [*(_as_rows(t.detach()) for t in (*grads, *ys)), pos.detach().contiguous(), f, r.detach().contiguous(),
             out, c]
    _launcher(views, (out.dtype,))
    return out, c

