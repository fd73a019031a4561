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
# the QK-norm variant: xq, xk in place of q, k, then the norm weights, eps and the weight-gradient partials
_launcher_qk = Launcher("rope_grad", _launcher.layout + ((16, 0), (4, 0), (16, 1)))
# the bias variant: then the biases and their gradient's partials (a row per CTA of BIAS_ROWS rows)
_launcher_b = Launcher("rope_grad", _launcher.layout + ((16, 0), (16, 1)))
BIAS_ROWS = 32  # rows a CTA of the bias variant (BIAS_ROWS / WARPS a warp)


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


def _unrotate(dy, pos, freqs, dt):
    """R(-theta) of each column pair of ``dy`` (in ``dt``)."""
    th = _angles(pos, freqs)
    cs, sn = th.cos().to(dt), th.sin().to(dt)
    e, o = dy[:, 0::2], dy[:, 1::2]
    return torch.stack((e * cs + o * sn, o * cs - e * sn), -1).flatten(1)


def _reference(grads, ys, pos, freqs, r):
    dt = torch.promote_types(grads[0].dtype, torch.float32)
    dy = torch.cat([g.to(dt) for g in grads], 1)
    y = torch.cat([t.to(dt) for t in ys], 1)
    rr = r.to(dt)
    dacc = _unrotate(dy, pos, freqs, dt) * rr[:, None]
    return dacc.to(grads[0].dtype), (dy * y).sum(1) / rr


def _bias_reference(grads, ys, pos, freqs, r, bias):
    """:func:`rope_grad_bias`'s torch reference (fp32 math, float64 for float64 parts; angles in float64)."""
    dt = torch.promote_types(grads[0].dtype, torch.float32)
    dy = torch.cat([g.to(dt) for g in grads], 1)
    rr = r.to(dt)
    dn = _unrotate(dy, pos, freqs, dt)
    dot = (dy * torch.cat([t.to(dt) for t in ys], 1)).sum(1) - (dn * bias.to(dt)).sum(1)
    return (dn * rr[:, None]).to(grads[0].dtype), dot / rr, dn.sum(0)


def _qknorm_reference(grads, xs, v, pos, freqs, r, weight, eps, head_dim):
    """:func:`rope_grad_qknorm`'s torch reference (fp32 math, float64 for float64 parts; angles in float64)."""
    dt = torch.promote_types(grads[0].dtype, torch.float32)
    M, d = grads[0].shape[0], head_dim
    rr = r.to(dt)
    dn = _unrotate(torch.cat([g.to(dt) for g in grads], 1), pos, freqs, dt)
    parts, dot, dws, c0 = [], (grads[2].to(dt) * v.to(dt)).sum(1), [], 0
    for i, x in enumerate(xs):
        xh = x.to(dt).reshape(M, -1, d)
        g = dn[:, c0:c0 + x.shape[1]].reshape(M, -1, d)
        w = weight.to(dt)[i * d:(i + 1) * d]
        s = torch.rsqrt(xh.pow(2).mean(-1, keepdim=True) + eps)
        t = (xh * w * g).sum(-1, keepdim=True)
        dx = s * w * g - xh * s ** 3 * t / d
        dot = dot + (dx * xh).sum((1, 2))
        dws.append((xh * s * g).sum((0, 1)))
        parts.append(dx.reshape(M, -1))
        c0 += x.shape[1]
    dacc = torch.cat((*parts, dn[:, c0:]), 1) * rr[:, None]
    return dacc.to(grads[0].dtype), dot / rr, torch.stack(dws)


# ----------------------------------------------------------------------------------------------------------------
# the kernel


def _kernel_class(variant: str = ""):
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from cutlass.memory import SmemAllocator

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
                dot = Float32(0.0)
                off = Int32(0)
                for g_t, y_t in ((mDq, mQ), (mDk, mK), (mDv, mV)):  # the three parts, in turn (unrolled)
                    dot = dot + self._part(g_t, y_t, mOut, mFreq, off, m, lane, pos, rr)
                    off = off + g_t.shape[1]
                self._finish_row(mC, m, lane, dot, rr)

        @cute.jit
        def _part(self, g_t: cute.Tensor, y_t: cute.Tensor, mOut: cute.Tensor, mFreq: cute.Tensor, off: Int32,
                  m: Int32, lane: Int32, pos: Float32, rr: Float32) -> Float32:
            """One part without a norm: its chunks un-rotated and scaled by r into dacc's columns from ``off``;
            returns the lane's sum(dy * y)."""
            out = cute.zipped_divide(mOut[m, None], (VEC,))
            freq = cute.zipped_divide(mFreq, (VEC // 2,))
            grow = cute.zipped_divide(g_t[m, None], (VEC,))
            yrow = cute.zipped_divide(y_t[m, None], (VEC,))
            dot = Float32(0.0)
            for c in range(lane * VEC, g_t.shape[1], 32 * VEC):
                gf = cute.make_rmem_tensor((VEC,), self.dtype)
                yf = cute.make_rmem_tensor((VEC,), self.dtype)
                ff = cute.make_rmem_tensor((VEC // 2,), Float32)
                cute.autovec_copy(grow[None, c // VEC], gf)
                cute.autovec_copy(yrow[None, c // VEC], yf)
                cute.autovec_copy(freq[None, (off + c) // VEC], ff)
                dot = dot + self._chunk(gf, yf, ff, pos, rr)
                cute.autovec_copy(gf, out[None, (off + c) // VEC])
            return dot

        @cute.jit
        def _finish_row(self, mC: cute.Tensor, m: Int32, lane: Int32, dot: Float32, rr: Float32):
            for k in cutlass.range_constexpr(5):  # butterfly: every lane gets the row's sum
                dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=1 << k)
            if lane == 0:
                mC[m] = dot / rr

        @cute.jit
        def _unrotate(self, g, ff: cute.Tensor, pos: Float32, scale: Float32) -> cute.Tensor:
            """The chunk's 4 pairs of ``g`` (fp32) rotated by -theta and times ``scale``: an fp32 register tensor."""
            B = CuteOps()
            r = cute.make_rmem_tensor((VEC,), Float32)
            for i in cutlass.range_constexpr(VEC // 2):
                e, o = g[2 * i], g[2 * i + 1]
                th = reduce_angle(B, 1.0, [pos, ff[i]])
                cs, sn = B.cos_reduced(th), B.sin_reduced(th)
                r[2 * i] = (e * cs + o * sn) * scale
                r[2 * i + 1] = (o * cs - e * sn) * scale
            return r

        @cute.jit
        def _chunk(self, gf: cute.Tensor, yf: cute.Tensor, ff: cute.Tensor, pos: Float32, rr: Float32) -> Float32:
            """Un-rotates the chunk's 4 pairs in ``gf`` and scales them by the row's r (in place); returns sum(dy *
            y) of its 8 elements."""
            g = gf.load().to(Float32)
            y = yf.load().to(Float32)
            dot = Float32(0.0)
            for i in cutlass.range_constexpr(VEC):
                dot = dot + g[i] * y[i]
            gf.store(self._unrotate(g, ff, pos, rr).load().to(self.dtype))
            return dot

    if variant == "bias":
        return _bias_class(RopeGradSm90)
    if variant != "qknorm":
        return RopeGradSm90

    class RopeGradQkNormSm90(RopeGradSm90):
        """The QK-norm variant: one compiled variant per (element type, head_dim). q and k go in as their values
        before the norm (x), every q / k head normed with the weights ``mW`` (q's head_dim values, then k's)."""

        def __init__(self, dtype, head_dim: int):
            super().__init__(dtype)
            self.d = head_dim

        @cute.jit
        def __call__(self, mDq: cute.Tensor, mDk: cute.Tensor, mDv: cute.Tensor, stream: cuda.CUstream,
                     mXq: cute.Tensor, mXk: cute.Tensor, mV: cute.Tensor, mPos: cute.Tensor, mFreq: cute.Tensor,
                     mR: cute.Tensor, mOut: cute.Tensor, mC: cute.Tensor, mW: cute.Tensor, mEps: cute.Tensor,
                     mDw: cute.Tensor):
            M = mDq.shape[0]
            self.kernel(rows(mDq), rows(mDk), rows(mDv), rows(mXq), rows(mXk), rows(mV), mPos, mFreq, mR, rows(mOut),
                        mC, mW, mEps, mDw).launch(
                grid=[cute.ceil_div(M, WARPS), 1, 1], block=[THREADS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mDq: cute.Tensor, mDk: cute.Tensor, mDv: cute.Tensor, mXq: cute.Tensor, mXk: cute.Tensor,
                   mV: cute.Tensor, mPos: cute.Tensor, mFreq: cute.Tensor, mR: cute.Tensor, mOut: cute.Tensor,
                   mC: cute.Tensor, mW: cute.Tensor, mEps: cute.Tensor, mDw: cute.Tensor):
            d = self.d
            tidx, _, _ = cute.arch.thread_idx()
            bx, _, _ = cute.arch.block_idx()
            lane = tidx % 32
            warp = tidx // 32
            m = bx * WARPS + warp
            smem = SmemAllocator()
            sDw = smem.allocate_tensor(Float32, cute.make_layout((WARPS, 2 * d), stride=(2 * d, 1)),
                                       byte_alignment=16)
            hd = (lane * VEC) % d  # the head dims of the lane's 8 columns (the same in every chunk: d | 256)
            eps = mEps[0]
            valid = m < mDq.shape[0]
            pos = Float32(0.0)
            rr = Float32(1.0)
            if valid:
                pos = mPos[m]
                rr = mR[m]
            dot = Float32(0.0)
            for p, (g_t, x_t) in enumerate(((mDq, mXq), (mDk, mXk))):  # q, then k (unrolled)
                w = cute.make_rmem_tensor((VEC,), Float32)
                cute.autovec_copy(cute.zipped_divide(mW, (VEC,))[None, (p * d + hd) // VEC], w)
                dwp = cute.make_rmem_tensor((VEC,), Float32)
                dwp.fill(0.0)
                off = Int32(0) if p == 0 else mDq.shape[1]
                dot = dot + self._norm_part(g_t, x_t, mOut, mFreq, off, m, valid, lane, pos, rr, w, eps, dwp)
                self._stash_dw(sDw, warp, lane, p * d + hd, dwp)
            if valid:
                dot = dot + self._part(mDv, mV, mOut, mFreq, mDq.shape[1] + mDk.shape[1], m, lane, pos, rr)
                self._finish_row(mC, m, lane, dot, rr)
            cute.arch.sync_threads()
            for t in range(tidx, 2 * d, THREADS):  # the CTA's weight-gradient partial: its warps' sums
                acc = Float32(0.0)
                for i in cutlass.range_constexpr(WARPS):
                    acc = acc + sDw[i, t]
                mDw[bx, t] = acc

        @cute.jit
        def _stash_dw(self, sDw: cute.Tensor, warp: Int32, lane: Int32, col: Int32, dwp: cute.Tensor):
            """The warp's sums of its lanes' weight-gradient terms (lanes with the same head dims: xor offsets
            from d / 8 up) into ``sDw[warp, col:col + 8]`` by the first d / 8 lanes."""
            for i in cutlass.range_constexpr(VEC):
                v = dwp[i]
                for k in cutlass.range_constexpr(int(math.log2(self.d // VEC)), 5):
                    v = v + cute.arch.shuffle_sync_bfly(v, offset=1 << k)
                dwp[i] = v
            if lane < self.d // VEC:
                for i in cutlass.range_constexpr(VEC):
                    sDw[warp, col + i] = dwp[i]

        @cute.jit
        def _head_sum(self, v: Float32) -> Float32:
            """The sum of ``v`` over the d / 8 lanes of a head (every lane of the head gets it)."""
            for k in cutlass.range_constexpr(int(math.log2(self.d // VEC))):
                v = v + cute.arch.shuffle_sync_bfly(v, offset=1 << k)
            return v

        @cute.jit
        def _norm_part(self, g_t: cute.Tensor, x_t: cute.Tensor, mOut: cute.Tensor, mFreq: cute.Tensor, off: Int32,
                       m: Int32, valid, lane: Int32, pos: Float32, rr: Float32, w: cute.Tensor, eps: Float32,
                       dwp: cute.Tensor) -> Float32:
            """One normed part (q or k): per chunk dn = R(-theta) dy, the head's s = rsqrt(mean x^2 + eps),
            t = sum_head(x w dn), dx = s w dn - x s^3 t / d, dacc = r dx; adds x s dn to ``dwp``; returns the
            lane's sum(dx * x). Every lane runs every step (the head sums shuffle across lanes); rows past M and
            columns past the part's width read zeros and store nothing."""
            d = self.d
            n = g_t.shape[1]
            out = cute.zipped_divide(mOut[m, None], (VEC,))
            freq = cute.zipped_divide(mFreq, (VEC // 2,))
            grow = cute.zipped_divide(g_t[m, None], (VEC,))
            xrow = cute.zipped_divide(x_t[m, None], (VEC,))
            dot = Float32(0.0)
            for j in range(cute.ceil_div(n, 32 * VEC)):
                c = lane * VEC + j * 32 * VEC
                gf = cute.make_rmem_tensor((VEC,), self.dtype)
                xf = cute.make_rmem_tensor((VEC,), self.dtype)
                ff = cute.make_rmem_tensor((VEC // 2,), Float32)
                gf.fill(0.0)
                xf.fill(0.0)
                ff.fill(0.0)
                if valid:
                    if c < n:
                        cute.autovec_copy(grow[None, c // VEC], gf)
                        cute.autovec_copy(xrow[None, c // VEC], xf)
                        cute.autovec_copy(freq[None, (off + c) // VEC], ff)
                g = gf.load().to(Float32)
                x = xf.load().to(Float32)
                ss = Float32(0.0)
                for i in cutlass.range_constexpr(VEC):
                    ss = ss + x[i] * x[i]
                s = cute.math.rsqrt(self._head_sum(ss) / d + eps)
                dn = self._unrotate(g, ff, pos, Float32(1.0))
                t = Float32(0.0)
                for i in cutlass.range_constexpr(VEC):
                    t = t + x[i] * w[i] * dn[i]
                t = self._head_sum(t) * s * s * s / d
                res = cute.make_rmem_tensor((VEC,), Float32)
                for i in cutlass.range_constexpr(VEC):
                    dx = s * w[i] * dn[i] - x[i] * t
                    dot = dot + dx * x[i]
                    dwp[i] = dwp[i] + x[i] * s * dn[i]
                    res[i] = dx * rr
                if valid:
                    if c < n:
                        gf.store(res.load().to(self.dtype))
                        cute.autovec_copy(gf, out[None, (off + c) // VEC])
            return dot

    return RopeGradQkNormSm90


def _bias_class(base):
    """The q/k/v-bias variant's class (Qwen2: y = RoPE(r acc + b)), on ``base`` (the plain variant's class)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from cutlass.memory import SmemAllocator

    RPW = BIAS_ROWS // WARPS

    class RopeGradBiasSm90(base):
        """A CTA takes BIAS_ROWS rows (warp w rows w, w + 8, ...) and walks the columns in 256-wide chunks (a
        lane's 8 columns, every row of the warp in turn), so that each chunk's bias gradient -- the column sums
        of dn = R(-theta) dy over the CTA's rows -- is summed over its warps in shared memory in a fixed order
        (deterministic) and written as one partial row per CTA. dr gets the bias's term: sum(dy y) - sum(dn b)."""

        @cute.jit
        def __call__(self, mDq: cute.Tensor, mDk: cute.Tensor, mDv: cute.Tensor, stream: cuda.CUstream,
                     mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mPos: cute.Tensor, mFreq: cute.Tensor,
                     mR: cute.Tensor, mOut: cute.Tensor, mC: cute.Tensor, mB: cute.Tensor, mDb: cute.Tensor):
            M = mDq.shape[0]
            self.kernel(rows(mDq), rows(mDk), rows(mDv), rows(mQ), rows(mK), rows(mV), mPos, mFreq, mR, rows(mOut),
                        mC, mB, mDb).launch(
                grid=[cute.ceil_div(M, BIAS_ROWS), 1, 1], block=[THREADS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mDq: cute.Tensor, mDk: cute.Tensor, mDv: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor,
                   mV: cute.Tensor, mPos: cute.Tensor, mFreq: cute.Tensor, mR: cute.Tensor, mOut: cute.Tensor,
                   mC: cute.Tensor, mB: cute.Tensor, mDb: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bx, _, _ = cute.arch.block_idx()
            lane = tidx % 32
            warp = tidx // 32
            smem = SmemAllocator()
            sDb = smem.allocate_tensor(Float32, cute.make_layout((WARPS, 32 * VEC), stride=(32 * VEC, 1)),
                                       byte_alignment=16)
            pos = cute.make_rmem_tensor((RPW,), Float32)
            rr = cute.make_rmem_tensor((RPW,), Float32)
            dot = cute.make_rmem_tensor((RPW,), Float32)
            for i in cutlass.range_constexpr(RPW):
                m = bx * BIAS_ROWS + i * WARPS + warp
                pos[i] = Float32(0.0)
                rr[i] = Float32(1.0)
                dot[i] = Float32(0.0)
                if m < mDq.shape[0]:
                    pos[i] = mPos[m]
                    rr[i] = mR[m]
            off = Int32(0)
            for g_t, y_t in ((mDq, mQ), (mDk, mK), (mDv, mV)):  # the three parts, in turn (unrolled)
                self._bias_part(g_t, y_t, mOut, mFreq, mB, mDb, sDb, off, bx, warp, lane, tidx, pos, rr, dot)
                off = off + g_t.shape[1]
            for i in cutlass.range_constexpr(RPW):
                m = bx * BIAS_ROWS + i * WARPS + warp
                if m < mDq.shape[0]:
                    self._finish_row(mC, m, lane, dot[i], rr[i])

        @cute.jit
        def _bias_part(self, g_t: cute.Tensor, y_t: cute.Tensor, mOut: cute.Tensor, mFreq: cute.Tensor,
                       mB: cute.Tensor, mDb: cute.Tensor, sDb: cute.Tensor, off: Int32, bx: Int32, warp: Int32,
                       lane: Int32, tidx: Int32, pos: cute.Tensor, rr: cute.Tensor, dot: cute.Tensor):
            """One part: per chunk, each of the warp's rows un-rotated (dn) and scaled by its r into dacc, sum(dy
            y) - sum(dn b) added to the row's ``dot``, dn to the lane's column sums; then the CTA's column sums
            of the chunk into ``mDb[bx]``."""
            n = g_t.shape[1]
            freq = cute.zipped_divide(mFreq, (VEC // 2,))
            bias = cute.zipped_divide(mB, (VEC,))
            for j in range(cute.ceil_div(n, 32 * VEC)):
                c = j * 32 * VEC + lane * VEC
                ff = cute.make_rmem_tensor((VEC // 2,), Float32)
                bf = cute.make_rmem_tensor((VEC,), Float32)
                dbp = cute.make_rmem_tensor((VEC,), Float32)
                ff.fill(0.0)
                bf.fill(0.0)
                dbp.fill(0.0)
                if c < n:
                    cute.autovec_copy(freq[None, (off + c) // VEC], ff)
                    cute.autovec_copy(bias[None, (off + c) // VEC], bf)
                for i in cutlass.range_constexpr(RPW):
                    m = bx * BIAS_ROWS + i * WARPS + warp
                    if m < g_t.shape[0]:
                        if c < n:
                            gf = cute.make_rmem_tensor((VEC,), self.dtype)
                            yf = cute.make_rmem_tensor((VEC,), self.dtype)
                            cute.autovec_copy(cute.zipped_divide(g_t[m, None], (VEC,))[None, c // VEC], gf)
                            cute.autovec_copy(cute.zipped_divide(y_t[m, None], (VEC,))[None, c // VEC], yf)
                            g = gf.load().to(Float32)
                            y = yf.load().to(Float32)
                            dn = self._unrotate(g, ff, pos[i], Float32(1.0))
                            s = Float32(0.0)
                            res = cute.make_rmem_tensor((VEC,), Float32)
                            for e in cutlass.range_constexpr(VEC):
                                s = s + g[e] * y[e] - dn[e] * bf[e]
                                dbp[e] = dbp[e] + dn[e]
                                res[e] = dn[e] * rr[i]
                            dot[i] = dot[i] + s
                            gf.store(res.load().to(self.dtype))
                            cute.autovec_copy(gf, cute.zipped_divide(mOut[m, None], (VEC,))[None, (off + c) // VEC])
                cute.autovec_copy(dbp, cute.zipped_divide(sDb[warp, None], (VEC,))[None, lane])
                cute.arch.sync_threads()
                col = j * 32 * VEC + tidx  # (THREADS = 32 * VEC: a thread a column of the chunk)
                if col < n:
                    acc = Float32(0.0)
                    for w in cutlass.range_constexpr(WARPS):
                        acc = acc + sDb[w, tidx]
                    mDb[bx, off + col] = acc
                cute.arch.sync_threads()

    return RopeGradBiasSm90


def compile_kernel(dtype=torch.bfloat16, head_dim: int = 0, bias: bool = False, *, options=None, fake=True,
                   args=None):
    """``cute.compile`` one variant (element type; ``head_dim`` > 0: the QK-norm variant for heads of that size;
    ``bias``: the q/k/v-bias variant).
    ``fake``: shape-symbolic fake tensors (no GPU needed: the CPU tests); else ``args`` = the cute arguments of a
    real call."""
    import cutlass
    import cutlass.cute as cute
    cls = _kernel_class("bias" if bias else "qknorm" if head_dim > 0 else "")
    op = cls(_cutlass_dtype(dtype), head_dim) if head_dim else cls(_cutlass_dtype(dtype))
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
        if bias:  # the biases (N,), their gradient's partials (a row per CTA)
            nb = cute.sym_int32()
            args += [make_fake_compact_tensor(cutlass.Float32, (nb,), assumed_align=16),
                     make_fake_tensor(cutlass.Float32, (cute.sym_int32(), nb), (cute.sym_int64(divisibility=4), 1),
                                      assumed_align=16)]
        if head_dim:  # the norm weights, eps, the weight-gradient partials (a row per CTA)
            args += [make_fake_compact_tensor(cutlass.Float32, (2 * head_dim,), assumed_align=16),
                     make_fake_compact_tensor(cutlass.Float32, (1,), assumed_align=4),
                     make_fake_tensor(cutlass.Float32, (cute.sym_int32(), 2 * head_dim), (2 * head_dim, 1),
                                      assumed_align=16)]
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


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` at a 16-byte aligned address (a copy where it is not)."""
    return t.clone() if t.data_ptr() % 16 else t


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
    views = [*(_as_rows(t.detach()) for t in (*grads, *ys)), pos.detach().contiguous(),
             _aligned(freqs.detach().contiguous()), r.detach().contiguous(), out, c]
    _launcher(views, (out.dtype,))
    return out, c



def rope_grad_qknorm(grads, xs, v, pos, freqs, r, weight, eps: float, head_dim: int):
    """:func:`rope_grad` for q and k with Qwen3's QK-norm between the projection and the rotation (q = RoPE(x
    rsqrt(mean_head x^2 + eps) w), per head of ``head_dim``; ``epilogues.rope.rope_qknorm(head_dim, save_x=True)``):
    ``grads`` (dq, dk, dv), ``xs`` (xq, xk) the values before the norm (r applied, unrotated, adjacent-pairs order),
    ``v``, ``weight`` (2 head_dim,) float32: q's norm weight then k's, in the adjacent-pairs order. Per head,
    with dn = R(-theta) dq and s = rsqrt(mean x^2 + eps): dx = s w dn - x s^3 sum(x w dn) / head_dim, the weights'
    gradient sum over rows and heads of x s dn. Returns (dacc (M, N) = r [dx_q | dx_k | R(-theta) dv], dr (M,) =
    sum(dx x) / r fp32, dweight (2, head_dim) fp32: q's row, then k's). head_dim a multiple of 8 dividing 256; the
    kernel's weight-gradient partials are one row per CTA of 8 rows, summed here."""
    entry = "rope_grad_qknorm"
    M, widths = check_args(grads, (*xs, v), pos, freqs, r, entry)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % VEC or \
            256 % head_dim:
        raise ValueError(f"{entry}: head_dim must be a multiple of {VEC} dividing 256, got {head_dim!r}")
    if widths[0] % head_dim or widths[1] % head_dim:
        raise ValueError(f"{entry}: dq and dk must be whole heads of {head_dim} columns, got widths {widths[:2]}")
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (2 * head_dim,) or \
            weight.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{entry}: weight must be a float32 tensor of shape ({2 * head_dim},) (q's, then k's)")
    if grads[0].device.type != "cuda":
        return _qknorm_reference(grads, xs, v, pos, freqs, r, weight, eps, head_dim)
    if grads[0].dtype not in _DTYPES or widths[2] % VEC:
        raise ValueError(f"{entry}: bfloat16 / float16 parts with widths multiple of {VEC} expected, got "
                         f"{grads[0].dtype} {widths}")
    dev = grads[0].device
    out = torch.empty(M, sum(widths), device=dev, dtype=grads[0].dtype)
    c = torch.empty(M, device=dev, dtype=torch.float32)
    if M == 0:
        return out, c, torch.zeros(2, head_dim, device=dev)
    partials = torch.empty(-(-M // WARPS), 2 * head_dim, device=dev, dtype=torch.float32)
    views = [*(_as_rows(t.detach()) for t in (*grads, *xs, v)), pos.detach().contiguous(),
             _aligned(freqs.detach().contiguous()), r.detach().contiguous(), out, c,
             _aligned(weight.detach().float().contiguous()), torch.full((1,), float(eps), device=dev), partials]
    _launcher_qk(views, (out.dtype, head_dim))
    return out, c, partials.sum(0).view(2, head_dim)


def rope_grad_bias(grads, ys, pos, freqs, r, bias):
    """:func:`rope_grad` for a projection with biases before the rotation (Qwen2: y = RoPE(r acc + b),
    ``epilogues.rope.rope_rmsnorm_bias``): ``bias`` (N,) float32, the q, k, v biases in the output's column
    order. With dn = R(-theta) dy: dacc = r dn, dr = (sum(dy y) - sum(dn b)) / r (y - the rotated bias is the
    rotated r acc), db = sum over rows of dn. Returns (dacc (M, N) in the gradients' dtype, dr (M,) fp32, db (N,)
    fp32); the kernel's bias-gradient partials are one row per CTA of ``BIAS_ROWS`` rows, summed here."""
    entry = "rope_grad_bias"
    M, widths = check_args(grads, ys, pos, freqs, r, entry)
    N = sum(widths)
    if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (N,) or \
            bias.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{entry}: bias must be a float32 (or float64) tensor of shape ({N},) (q's, k's, "
                         "then v's)")
    if grads[0].device.type != "cuda":
        return _bias_reference(grads, ys, pos, freqs, r, bias)
    if grads[0].dtype not in _DTYPES or any(w % VEC for w in widths):
        raise ValueError(f"{entry}: bfloat16 / float16 parts with widths multiple of {VEC} expected, got "
                         f"{grads[0].dtype} {widths}")
    dev = grads[0].device
    out = torch.empty(M, N, device=dev, dtype=grads[0].dtype)
    c = torch.empty(M, device=dev, dtype=torch.float32)
    if M == 0:
        return out, c, torch.zeros(N, device=dev)
    partials = torch.empty(-(-M // BIAS_ROWS), N, device=dev, dtype=torch.float32)
    views = [*(_as_rows(t.detach()) for t in (*grads, *ys)), pos.detach().contiguous(),
             _aligned(freqs.detach().contiguous()), r.detach().contiguous(), out, c,
             _aligned(bias.detach().float().contiguous()), partials]
    _launcher_b(views, (out.dtype, 0, True))
    return out, c, partials.sum(0)
