"""Cross-entropy logits gradient, in place: ``z[r, v] <- dL/dz[r, v]`` from the stored logits, one pass over ``z``.

For a chunk of R rows of logits ``z`` (R x V, bf16 / fp16, row stride ``ld``) with their logsumexp ``lse`` (fp32),
``target`` (int64) and per-row factor ``row_scale`` (fp32, 0 for ignored rows), every element becomes (in fp32,
written back in z's dtype)::

    p = exp(z - lse[r])
    g = row_scale[r] * (p * (1 + 2 * z_loss * lse[r]) - (1 - eps) * [v == target[r]] - eps / V)
    g = g * (1 - (z / softcap) ** 2)        # only with a softcap (z is the capped logit c * tanh(raw / c))

:func:`softmax_grad_` runs the CuTeDSL kernel on CUDA tensors (Hopper, compiled once per dtype and options) and
:func:`softmax_grad_reference_` (pure torch, the same expression in fp32: the library's CPU reference path) on CPU
tensors. NaN / inf follow the torch expression: no step of the kernel turns a NaN into a number (the only select
picks between constants, and ``z_loss = 0`` still multiplies ``lse``, so ``lse = inf`` gives NaN as in torch).

Kernel (memory-bound: read 2 bytes, write 2 bytes per element; near copy bandwidth is the goal):

- grid ``(ceil(V / COLS_PER_CTA), min(R, 65535))``, 256 threads; a CTA owns COLS_PER_CTA = 256 * 8 * UNROLL
  columns of one row (rows beyond the grid's y extent are looped over with stride gridDim.y);
- each thread issues UNROLL 128-bit loads (8 x 16-bit each, lanes of a warp on consecutive 16-byte chunks, the
  UNROLL chunks of a thread 256 * 8 columns apart) before any arithmetic, then UNROLL 128-bit stores: 4 x 16 B in
  flight per thread, 16 KB per CTA; 78-80 registers, no spills (``python -m coda.kernels.ce_grad --check``), so
  3 CTAs (768 threads, 48 KB of loads in flight) per SM;
- the per-row values (lse, target, scale, 1 + 2 zl lse) are read once per CTA; the target column is compared in
  int32 after mapping an out-of-range int64 target to -1 (no false match from truncation);
- ``p = exp2((z - lse) * log2e)`` (``ex2.approx.ftz``; (z - lse) first, exact for z near lse);
- a CTA whose columns all lie below V takes the unpredicated path; the last column block of a row checks each
  8-wide chunk (all in bounds: vector; straddling V: element-wise loads and stores; past V: nothing), so nothing
  beyond column V - 1 of a row (the row padding up to ld) is read or written;
- 16-byte accesses need a 16-byte aligned base and ``ld % 8 == 0`` (checked on the host; the kernel's layout
  carries ``ld`` divisible by 8 so the compiler proves the alignment).

``python -m coda.kernels.ce_grad --bench`` times 4096 x 128256 (GB/s next to a same-size ``copy_``).
"""
import math
import os
import sys
import threading
import time
from typing import Optional

import torch

LOG2E = 1.4426950408889634
THREADS = 256
VEC = 8  # 16-bit elements per 128-bit access
UNROLL = 4
COLS_PER_CTA = THREADS * VEC * UNROLL
MAX_GRID_Y = 65535

_DTYPES = (torch.bfloat16, torch.float16)
_compiled: dict = {}
_lock = threading.Lock()


# ----------------------------------------------------------------------------------------------------------------
# argument checks and the torch reference


def _check_options(label_smoothing, z_loss, softcap):
    for name, v in (("label_smoothing", label_smoothing), ("z_loss", z_loss)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name}: expected a float, got {type(v).__name__}")
        if not math.isfinite(float(v)):
            raise ValueError(f"{name}: expected a finite float, got {v}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing: expected a value in [0, 1], got {label_smoothing}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"softcap: expected a float or None, got {type(softcap).__name__}")
        if not (math.isfinite(float(softcap)) and float(softcap) > 0):
            raise ValueError(f"softcap: expected a finite float > 0 or None, got {softcap}")
    return float(label_smoothing), float(z_loss), (None if softcap is None else float(softcap))


def check_args(z, lse, target, row_scale, label_smoothing=0.0, z_loss=0.0, softcap=None, *, kernel=None):
    """Validate the arguments of :func:`softmax_grad_`; returns the options as floats (eps, zl, softcap).

    ``kernel``: also check what the CUDA kernel needs (16-byte aligned data, a row stride that is a multiple of 8);
    by default, where ``z`` is a CUDA tensor."""
    for name, t in (("z", z), ("lse", lse), ("target", target), ("row_scale", row_scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if kernel is None:
        kernel = z.device.type == "cuda"
    if z.dtype not in _DTYPES and (kernel or z.dtype not in (torch.float32, torch.float64)):
        raise TypeError(f"z: expected dtype torch.bfloat16 or torch.float16 (float32 / float64 too on the reference "
                        f"path), got {z.dtype}")
    if lse.dtype != torch.float32:
        raise TypeError(f"lse: expected dtype torch.float32, got {lse.dtype}")
    if target.dtype != torch.int64:
        raise TypeError(f"target: expected dtype torch.int64, got {target.dtype}")
    if row_scale.dtype != torch.float32:
        raise TypeError(f"row_scale: expected dtype torch.float32, got {row_scale.dtype}")
    if z.dim() != 2:
        raise ValueError(f"z: expected a 2-D tensor (R, V), got shape {tuple(z.shape)}")
    R, V = z.shape
    for name, t in (("lse", lse), ("target", target), ("row_scale", row_scale)):
        if tuple(t.shape) != (R,):
            raise ValueError(f"{name}: expected shape ({R},) (one value per row of z), got {tuple(t.shape)}")
        if t.device != z.device:
            raise ValueError(f"{name}: expected a tensor on {z.device} (z's device), got {t.device}")
    if z.requires_grad and torch.is_grad_enabled():
        raise ValueError("z: an in-place update of a tensor that requires grad; pass z.detach()")
    eps, zl, cap = _check_options(label_smoothing, z_loss, softcap)
    if kernel is None:
        kernel = z.device.type == "cuda"
    if kernel and z.numel() > 0:
        if z.stride(1) != 1:
            raise ValueError(f"z: expected a contiguous last dim (stride 1), got strides {tuple(z.stride())}")
        ld = z.stride(0)
        if R > 1 and (ld < V or ld % VEC):
            raise ValueError(f"z: expected a row stride >= V and a multiple of {VEC}, got {ld} (V = {V})")
        if z.data_ptr() % 16:
            raise ValueError(f"z: expected 16-byte aligned data, got address {z.data_ptr():#x}")
        if V >= 2 ** 31 - COLS_PER_CTA or R * max(ld, V) >= 2 ** 62:
            raise ValueError(f"z: too large ({R} x {V})")
    return eps, zl, cap


def softmax_grad_reference_(z, lse, target, row_scale, *, label_smoothing=0.0, z_loss=0.0, softcap=None):
    """The CPU reference of :func:`softmax_grad_` (any device): the same expression in fp32 torch, written into
    ``z`` in place; returns ``z``."""
    eps, zl, cap = check_args(z, lse, target, row_scale, label_smoothing, z_loss, softcap, kernel=False)
    R, V = z.shape
    if z.numel() == 0:
        return z
    zf = z.float()
    lse_, scale = lse.unsqueeze(1), row_scale.unsqueeze(1)
    p = torch.exp(zf - lse_)
    cols = torch.arange(V, device=z.device)
    onehot = (cols.unsqueeze(0) == target.unsqueeze(1)).float()
    g = scale * (p * (1 + 2 * zl * lse_) - (1 - eps) * onehot - eps / V)
    if cap is not None:
        g = g * (1 - (zf / cap) ** 2)
    z.copy_(g)
    return z


# ----------------------------------------------------------------------------------------------------------------
# the kernel


def _kernel_class():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    class CeGradSm90:
        """One compiled variant: z's element type and the compile-time options."""

        def __init__(self, dtype, eps: float, zl: float, softcap: Optional[float]):
            self.dtype, self.eps, self.zl, self.softcap = dtype, eps, zl, softcap

        @cute.jit
        def __call__(self, mZ: cute.Tensor, mLse: cute.Tensor, mTgt: cute.Tensor, mScale: cute.Tensor,
                     eps_over_v: Float32, stream: cuda.CUstream):
            R, V = mZ.shape[0], mZ.shape[1]
            ld = cute.assume(mZ.stride[0], divby=VEC)
            z = cute.make_tensor(mZ.iterator, cute.make_layout((R, V), stride=(ld, 1)))
            grid_y = cutlass.min(R, MAX_GRID_Y)
            self.kernel(z, mLse, mTgt, mScale, eps_over_v).launch(
                grid=[cute.ceil_div(V, COLS_PER_CTA), grid_y, 1], block=[THREADS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mZ: cute.Tensor, mLse: cute.Tensor, mTgt: cute.Tensor, mScale: cute.Tensor,
                   eps_over_v: Float32):
            tidx, _, _ = cute.arch.thread_idx()
            bx, by, _ = cute.arch.block_idx()
            _, gy, _ = cute.arch.grid_dim()
            R, V = mZ.shape[0], mZ.shape[1]
            c0 = bx * COLS_PER_CTA + tidx * VEC  # first column of the thread's first chunk
            full = (bx + 1) * COLS_PER_CTA <= V
            for r in range(by, R, gy):
                lse = mLse[r]
                scale = mScale[r]
                k = Float32(1.0) + Float32(2.0 * self.zl) * lse  # literal: 0 * inf = NaN as in torch
                t64 = mTgt[r]
                tgt = Int32(-1)
                if t64 >= Int64(0) and t64 < Int64(V):
                    tgt = Int32(t64)
                # the row as (8, chunks): chunk j = columns 8j .. 8j + 7 (16-byte aligned)
                row = cute.zipped_divide(mZ[r, None], (VEC,))
                if full:
                    frags = []
                    for u in cutlass.range_constexpr(UNROLL):
                        f = cute.make_rmem_tensor((VEC,), self.dtype)
                        cute.autovec_copy(row[None, (c0 + u * THREADS * VEC) // VEC], f)
                        frags.append(f)
                    for u in cutlass.range_constexpr(UNROLL):
                        self._chunk(frags[u], c0 + u * THREADS * VEC, lse, scale, k, tgt, eps_over_v)
                        cute.autovec_copy(frags[u], row[None, (c0 + u * THREADS * VEC) // VEC])
                else:  # the row's last column block: chunk by chunk, loads first
                    frags = []
                    for u in cutlass.range_constexpr(UNROLL):
                        f = cute.make_rmem_tensor((VEC,), self.dtype)
                        c = c0 + u * THREADS * VEC
                        if c + VEC <= V:
                            cute.autovec_copy(row[None, c // VEC], f)
                        frags.append(f)
                    for u in cutlass.range_constexpr(UNROLL):
                        c = c0 + u * THREADS * VEC
                        if c + VEC <= V:
                            self._chunk(frags[u], c, lse, scale, k, tgt, eps_over_v)
                            cute.autovec_copy(frags[u], row[None, c // VEC])
                        elif c < V:  # the chunk that straddles V: element by element
                            zr = mZ[r, None]
                            for i in cutlass.range_constexpr(VEC):
                                if c + i < V:
                                    zr[c + i] = self.dtype(self._elem(zr[c + i].to(Float32), c + i, lse, scale, k,
                                                                      tgt, eps_over_v))

        @cute.jit
        def _elem(self, x: Float32, col: Int32, lse: Float32, scale: Float32, k: Float32, tgt: Int32,
                  eps_over_v: Float32) -> Float32:
            p = cute.math.exp2((x - lse) * Float32(LOG2E), fastmath=True)
            hit = cutlass.select_(col == tgt, Float32(1.0 - self.eps), Float32(0.0))
            g = scale * ((p * k - hit) - eps_over_v)
            if cutlass.const_expr(self.softcap is not None):
                y = x * Float32(1.0 / self.softcap)
                g = g * (Float32(1.0) - y * y)
            return g

        @cute.jit
        def _chunk(self, f: cute.Tensor, c: Int32, lse: Float32, scale: Float32, k: Float32, tgt: Int32,
                   eps_over_v: Float32):
            xs = f.load().to(Float32)
            g = cute.make_rmem_tensor((VEC,), Float32)
            for i in cutlass.range_constexpr(VEC):
                g[i] = self._elem(xs[i], c + i, lse, scale, k, tgt, eps_over_v)
            f.store(g.load().to(self.dtype))

    return CeGradSm90


def _cutlass_dtype(dtype):
    import cutlass
    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]


def compile_kernel(dtype=torch.bfloat16, label_smoothing=0.0, z_loss=0.0, softcap=None, *, options=None,
                   fake=True, args=None):
    """``cute.compile`` one variant. ``fake``: trace with shape-symbolic fake tensors (R, V, ld dynamic; no GPU
    needed, what the CPU tests and ``--check`` do); else ``args`` = the cute arguments of a real call."""
    import cutlass
    import cutlass.cute as cute
    Op = _kernel_class()
    op = Op(_cutlass_dtype(dtype), float(label_smoothing), float(z_loss), None if softcap is None else float(softcap))
    kw = {"options": options} if options else {}
    if fake:
        import cutlass.runtime as crt
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor
        R, V, ld = cute.sym_int32(), cute.sym_int32(), cute.sym_int64(divisibility=VEC)
        z = make_fake_tensor(_cutlass_dtype(dtype), (R, V), (ld, 1), assumed_align=16)
        f32 = make_fake_compact_tensor(cutlass.Float32, (R,), assumed_align=4)
        i64 = make_fake_compact_tensor(cutlass.Int64, (R,), assumed_align=8)
        args = [z, f32, i64, f32, cutlass.Float32(0.0), crt.make_fake_stream()]
    return cute.compile(op, *args, **kw)


def _kernel_view(z: torch.Tensor) -> torch.Tensor:
    """z as the kernel reads it: (R, V) with strides (ld, 1); a single row (or a single column) gets the stride
    the kernel assumes (its stride is never used), so torch's arbitrary strides of size-1 dims pass."""
    R, V = z.shape
    ld = z.stride(0) if R > 1 else -(-V // VEC) * VEC
    return z.as_strided((R, V), (ld, 1))


def _vec(t: torch.Tensor) -> torch.Tensor:
    """A per-row vector with stride 1 (a copy if it has another stride; a single value gets stride 1)."""
    t = t.contiguous()
    return t if t.stride(0) == 1 else t.as_strided(t.shape, (1,))


def _cute_args(z, lse, target, row_scale, eps):
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass.cute.runtime import from_dlpack
    zv = _kernel_view(z)
    mz = from_dlpack(zv, assumed_align=16).mark_layout_dynamic(leading_dim=1)
    vecs = [from_dlpack(_vec(t)).mark_layout_dynamic(leading_dim=0) for t in (lse, target, row_scale)]
    index = z.device.index if z.device.index is not None else torch.cuda.current_device()
    stream = cuda.CUstream(torch.cuda.current_stream(index).cuda_stream)
    return [mz, *vecs, cutlass.Float32(eps / z.shape[1]), stream]


def _compiled_for(key, args, device):
    """The compiled variant ``key`` = (dtype, eps, zl, softcap): in memory, else the disk cache, else compiled (and
    stored); in a dry run (``coda.runtime.precompile``) its recipe is recorded and a no-op returned."""
    from coda.runtime.precompile import compiled_variant
    return compiled_variant("ce_grad", key, args, device, _compiled, _lock)


def softmax_grad_(z, lse, target, row_scale, *, label_smoothing=0.0, z_loss=0.0, softcap=None):
    """The cross-entropy gradient w.r.t. the logits, written into ``z`` in place; returns ``z``.

    z: (R, V) bf16 / fp16 logits (row stride ld >= V, a multiple of 8, last dim contiguous, data 16-byte aligned
    on CUDA); lse: (R,) fp32 logsumexp of each row; target: (R,) int64 (a target outside [0, V) matches no column);
    row_scale: (R,) fp32 per-row factor (0 for ignored rows). ``label_smoothing`` eps, ``z_loss`` zl and ``softcap``
    c (None: no softcap; z is then the capped logit c tanh(raw / c)) are compile-time options::

        z[r, v] = row_scale[r] * (exp(z - lse[r]) * (1 + 2 zl lse[r]) - (1 - eps) [v == target[r]] - eps / V)
                  * (1 - (z / c) ** 2)

    CUDA tensors run the CuTeDSL kernel (a Hopper GPU, one compile per dtype and options, on the current stream);
    CPU tensors run :func:`softmax_grad_reference_`."""
    if not isinstance(z, torch.Tensor) or z.device.type != "cuda":
        return softmax_grad_reference_(z, lse, target, row_scale, label_smoothing=label_smoothing, z_loss=z_loss,
                                       softcap=softcap)
    eps, zl, cap = check_args(z, lse, target, row_scale, label_smoothing, z_loss, softcap, kernel=True)
    if z.numel() == 0:
        return z
    from coda import _device
    _device.require_hopper(z.device, "coda.kernels.ce_grad.softmax_grad_")
    with torch.cuda.device(z.device):
        args = _cute_args(z, lse, target, row_scale, eps)
        fn = _compiled_for((z.dtype, eps, zl, cap), args, z.device)
        fn(*args)
    return z


# ----------------------------------------------------------------------------------------------------------------
# CPU evidence (compile for sm_90a, registers / spills) and the GPU benchmark


def _ptxas_v(ptx: str, arch: str):
    """``ptxas -v``'s report for a PTX file, or None where no ptxas on PATH reads it."""
    import shutil
    import subprocess
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    r = subprocess.run([ptxas, f"-arch={arch}", "-v", ptx, "-o", os.devnull], capture_output=True, text=True)
    return None if r.returncode else r.stderr


def check(arch="sm_90a", variants=None) -> list:
    """Compile each variant for ``arch`` with fake tensors (no GPU needed); returns one dict per variant with the
    PTX's 128-bit global loads / stores, and registers and spill bytes from ``ptxas -v`` (or the cubin)."""
    import re
    import tempfile
    if variants is None:
        variants = [(dt, 0.0, 0.0, None) for dt in _DTYPES] + [(dt, 0.1, 1e-4, 30.0) for dt in _DTYPES]
    rows = []
    for dtype, eps, zl, cap in variants:
        row = dict(dtype=str(dtype).replace("torch.", ""), eps=eps, z_loss=zl, softcap=cap)
        with tempfile.TemporaryDirectory() as d:
            compile_kernel(dtype, eps, zl, cap, options=f"--gpu-arch={arch} --keep-ptx --keep-cubin --dump-dir={d}")
            ptx = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".ptx")]
            cubin = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".cubin")]
            text = open(ptx[0]).read()
            row["ld_v4"] = len(re.findall(r"ld\.global[.a-z0-9]*\.v4\.b32", text))
            row["st_v4"] = len(re.findall(r"st\.global[.a-z0-9]*\.v4\.b32", text))
            row["ex2"] = text.count("ex2.approx")
            row["local"] = len(re.findall(r"\b(?:ld|st)\.local", text))
            out = _ptxas_v(ptx[0], arch)
            if out is not None:
                row["registers"] = int(re.search(r"Used (\d+) registers", out).group(1))
                row["spill_bytes"] = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", out))
                row["stack"] = int(re.search(r"(\d+) bytes stack frame", out).group(1))
                row["via"] = "ptxas -v"
            else:  # no ptxas that reads this PTX: the cubin's .nv.info (spills live in the stack frame)
                from coda.check import cubin_resources
                row["registers"], row["stack"] = cubin_resources(open(cubin[0], "rb").read())
                row["spill_bytes"] = row["stack"]
                row["via"] = "cubin"
        rows.append(row)
    return rows


def bench(R=4096, V=128256, dtype=torch.bfloat16, iters=50, **options) -> dict:
    """Time :func:`softmax_grad_` on an R x V chunk (CUDA events, median of ``iters``) next to a same-size
    ``copy_`` (the bandwidth bound: read + write each element once); prints and returns ms and GB/s."""
    dev = torch.device("cuda")
    ld = -(-V // VEC) * VEC  # V not a multiple of 8: a view of a padded buffer (the kernel needs ld % 8 == 0)
    z = torch.randn(R, ld, device=dev).to(dtype)[:, :V]
    z2 = torch.empty_like(z)
    lse = torch.logsumexp(z.float(), -1)
    target = torch.randint(0, V, (R,), device=dev)
    scale = torch.full((R,), 1.0 / R, device=dev)
    nbytes = 2 * R * V * z.element_size()

    def timed(fn, reps=10):
        """ms per call: ``reps`` back-to-back calls between two events (host overhead overlaps the GPU), the
        median over ``iters`` such groups."""
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(max(1, iters // reps)):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / reps)
        return sorted(ts)[len(ts) // 2]

    # the kernel rewrites z with gradients each time: the timing does not depend on the values
    t_k = timed(lambda: softmax_grad_(z, lse, target, scale, **options))
    t_c = timed(lambda: z2.copy_(z))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        softmax_grad_(z, lse, target, scale, **options)
    host_us = (time.perf_counter() - t0) / 20 * 1e6  # the host side of a call (launches queue behind the GPU)
    torch.cuda.synchronize()
    res = dict(R=R, V=V, dtype=str(dtype), ms=t_k, gbps=nbytes / t_k / 1e6, copy_ms=t_c, copy_gbps=nbytes / t_c / 1e6,
               host_us=host_us)
    print(f"softmax_grad_ {R} x {V} {dtype} {options or ''}: {t_k:.3f} ms  {res['gbps']:.0f} GB/s   "
          f"(copy_: {t_c:.3f} ms {res['copy_gbps']:.0f} GB/s, kernel at {t_c / t_k:.0%} of copy; "
          f"host {host_us:.0f} us/call)")
    return res


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description="coda.kernels.ce_grad: compile check (CPU) or benchmark (GPU)")
    ap.add_argument("--bench", action="store_true", help="time 4096 x 128256 bf16 (and variants) on the GPU")
    ap.add_argument("--check", action="store_true", help="compile every variant for sm_90a; registers, spills")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    a = ap.parse_args(argv)
    if a.check or not a.bench:
        bad = 0
        for row in check():
            ok = row["ld_v4"] > 0 and row["st_v4"] > 0 and not row["spill_bytes"] and not row["local"]
            bad += not ok
            print(("ok   " if ok else "FAIL ") + " ".join(f"{k}={v}" for k, v in row.items()))
        if bad:
            return 1
    if a.bench:
        bench(a.rows, a.vocab, torch.bfloat16)
        bench(a.rows, a.vocab, torch.float16)
        bench(a.rows, a.vocab, torch.bfloat16, label_smoothing=0.1, z_loss=1e-4, softcap=30.0)
        bench(a.rows, a.vocab - 5, torch.bfloat16)  # V not a multiple of 8 (ld = V rounded up: a padded view)
    return 0


if __name__ == "__main__":
    sys.exit(main())
