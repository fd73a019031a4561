"""The input embedding's backward and its AdamW step in one pass (``coda.optim``'s in-backward update of an
embedding: ``coda.ops.embedding``).

Stock, the embedding's gradient is a V x H tensor: zero-filled, the token rows' gradients scattered into it (a sort
and two scatter kernels), then read by the optimizer's pass over p, m, v and g -- in a llama-1b step on the H100
(V 128256, H 2048, 8192 tokens) 2.4 ms of torch's fused AdamW, 0.16 ms of fill and 0.3 ms of scatter (session 32's
profile). Only the rows of the step's tokens have a nonzero gradient, but AdamW moves every row (its moments decay,
the weight decays), so the floor is one pass over p, m, v: 12 bytes an element instead of 14 + 4 of the gradient's
fill, scatter and read. Here, for every row v of the weight::

    g = sum_{i : ids[i] = v} dy[i]                      (fp32; zero for the rows no token used, and for padding_idx)
    m' = b1 m + (1 - b1) g     v' = b2 v + (1 - b2) g^2
    p' = p (1 - lr wd) - step_size m' / (sqrt(v') c2 + eps)

the update of ``epilogues/adamw.py`` (its hyper-parameter operands, in coda.optim's order), p, m, v updated in
place; as there, g is not rounded to the weight's dtype before the update (torch rounds it into ``.grad``).

Host side (no sync, fixed shapes: capturable in a CUDA graph): the tokens sorted by id (``torch.sort``) and each
row's segment of the sorted order from one ``searchsorted`` over 0..V (V + 1 int32 offsets). Kernel (memory-bound):
a warp per weight row, 8 warps a CTA; a lane takes 8 columns (16-byte loads of p, m, v and of the segment's dy
rows, 16-byte stores), 256 columns a warp step.

:func:`embedding_adamw` runs it on CUDA tensors (Hopper, one compile per dtype) and :func:`_reference` (torch, fp32
math; float64 for float64 weights) on CPU tensors.
"""

import torch

from .ce_grad import _cutlass_dtype  # (the 16-bit element types, one table)
from .row_kernel import VEC, Launcher, rows

THREADS = 256
WARPS = THREADS // 32
N_HYPER = 8  # b1, b1c, b2, b2c, c2, eps, step_size, decay (epilogues.adamw.HYPER)
_DTYPES = (torch.bfloat16, torch.float16)
# dy (16-byte rows), perm, start, p, m, v (16-byte rows), hyper
_launcher = Launcher("embedding_adamw", ((16, 1), (4, 0), (4, 0), (16, 1), (16, 1), (16, 1), (16, 0)))


def check_args(dy, ids, p, m, v, hyper, entry: str = "embedding_adamw") -> None:
    """``dy`` (T, H) and ``ids`` (T,) int64 in [0, V); ``p``, ``m``, ``v`` (V, H) contiguous alike; ``hyper`` (8,)
    float32 (float64 for float64 weights), the values of ``epilogues.adamw.HYPER``."""
    for name, t in (("dy", dy), ("ids", ids), ("p", p), ("m", m), ("v", v), ("hyper", hyper)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{entry}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if p.dim() != 2:
        raise ValueError(f"{entry}: p must be 2-D (V, H), got shape {tuple(p.shape)}")
    V, H = p.shape
    for name, t in (("m", m), ("v", v)):
        if tuple(t.shape) != (V, H) or t.dtype != p.dtype or not t.is_contiguous():
            raise ValueError(f"{entry}: {name} must be a contiguous ({V}, {H}) {p.dtype} tensor like p")
    if not p.is_contiguous():
        raise ValueError(f"{entry}: p must be contiguous")
    if dy.dim() != 2 or dy.shape[1] != H or dy.dtype != p.dtype:
        raise ValueError(f"{entry}: dy must be (T, {H}) {p.dtype}, got {tuple(dy.shape)} {dy.dtype}")
    if ids.dim() != 1 or ids.shape[0] != dy.shape[0] or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{entry}: ids must be ({dy.shape[0]},) int64 or int32, got {tuple(ids.shape)} {ids.dtype}")
    want = torch.float64 if p.dtype == torch.float64 else torch.float32
    if hyper.dtype != want or tuple(hyper.shape) != (N_HYPER,):
        raise ValueError(f"{entry}: hyper must be a ({N_HYPER},) {want} tensor, got {tuple(hyper.shape)} "
                         f"{hyper.dtype}")


def _reference(dy, ids, p, m, v, hyper, padding_idx) -> None:
    """The rows' gradients summed in fp32 (float64 for float64 weights), then ``epilogues.adamw.update``'s
    arithmetic in the same order (restated: the core does not import the epilogues package, tests/test_package.py),
    rounded into p, m, v."""
    dt = torch.promote_types(p.dtype, torch.float32)
    g = torch.zeros(p.shape, dtype=dt, device=p.device)
    g.index_add_(0, ids.long(), dy.to(dt))
    if padding_idx is not None:
        g[padding_idx] = 0
    b1, b1c, b2, b2c, c2, eps, step_size, decay = hyper.to(dt).unbind()
    m2 = b1 * m.to(dt) + b1c * g
    v2 = b2 * v.to(dt) + b2c * g * g
    p.copy_(p.to(dt) * decay - step_size * m2 / (v2.sqrt() * c2 + eps))
    m.copy_(m2)
    v.copy_(v2)


# ----------------------------------------------------------------------------------------------------------------
# the kernel


def _kernel_class():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32

    from coda._eval import CuteOps

    class EmbeddingAdamWSm90:
        """One compiled variant per element type."""

        def __init__(self, dtype):
            self.dtype = dtype

        @cute.jit
        def __call__(self, mDy: cute.Tensor, mPerm: cute.Tensor, mStart: cute.Tensor, stream: cuda.CUstream,
                     mP: cute.Tensor, mM: cute.Tensor, mV: cute.Tensor, mHyper: cute.Tensor):
            # (the stream fourth, every other argument a tensor: the argument order of coda._launch.Plan)
            V = mP.shape[0]
            self.kernel(rows(mDy), mPerm, mStart, rows(mP), rows(mM), rows(mV), mHyper).launch(grid=[cute.ceil_div(V, WARPS), 1, 1], block=[THREADS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mDy: cute.Tensor, mPerm: cute.Tensor, mStart: cute.Tensor, mP: cute.Tensor,
                   mM: cute.Tensor, mV: cute.Tensor, mHyper: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bx, _, _ = cute.arch.block_idx()
            lane = tidx % 32
            row = bx * WARPS + tidx // 32
            if row < mP.shape[0]:
                s0 = mStart[row]
                s1 = mStart[row + 1]
                h = [mHyper[i] for i in range(N_HYPER)]
                prow = cute.zipped_divide(mP[row, None], (VEC,))
                mrow = cute.zipped_divide(mM[row, None], (VEC,))
                vrow = cute.zipped_divide(mV[row, None], (VEC,))
                for c in range(lane * VEC, mP.shape[1], 32 * VEC):
                    g = cute.make_rmem_tensor((VEC,), Float32)
                    g.fill(0.0)
                    for j in range(s0, s1):  # the tokens of this row (none for most rows)
                        dyf = cute.make_rmem_tensor((VEC,), self.dtype)
                        cute.autovec_copy(cute.zipped_divide(mDy[mPerm[j], None], (VEC,))[None, c // VEC], dyf)
                        g.store(g.load() + dyf.load().to(Float32))
                    pf = cute.make_rmem_tensor((VEC,), self.dtype)
                    mf = cute.make_rmem_tensor((VEC,), self.dtype)
                    vf = cute.make_rmem_tensor((VEC,), self.dtype)
                    cute.autovec_copy(prow[None, c // VEC], pf)
                    cute.autovec_copy(mrow[None, c // VEC], mf)
                    cute.autovec_copy(vrow[None, c // VEC], vf)
                    self._update(g, pf, mf, vf, h)
                    cute.autovec_copy(pf, prow[None, c // VEC])
                    cute.autovec_copy(mf, mrow[None, c // VEC])
                    cute.autovec_copy(vf, vrow[None, c // VEC])

        @cute.jit
        def _update(self, g: cute.Tensor, pf: cute.Tensor, mf: cute.Tensor, vf: cute.Tensor, h: list):
            """The AdamW step of 8 elements (``epilogues.adamw.update``'s arithmetic and, as there, fast division and
            square root: ``div.approx.ftz`` / ``sqrt.approx.ftz``, no per-element slow-path branch), in place on
            pf, mf, vf."""
            B = CuteOps(fastmath=True)
            b1, b1c, b2, b2c, c2, eps, step_size, decay = h
            gg = g.load()
            p = pf.load().to(Float32)
            m = mf.load().to(Float32)
            v = vf.load().to(Float32)
            po = cute.make_rmem_tensor((VEC,), Float32)
            mo = cute.make_rmem_tensor((VEC,), Float32)
            vo = cute.make_rmem_tensor((VEC,), Float32)
            for i in cutlass.range_constexpr(VEC):
                m2 = b1 * m[i] + b1c * gg[i]
                v2 = b2 * v[i] + b2c * gg[i] * gg[i]
                po[i] = p[i] * decay - B.div(step_size * m2, B.sqrt(v2) * c2 + eps)
                mo[i] = m2
                vo[i] = v2
            pf.store(po.load().to(self.dtype))
            mf.store(mo.load().to(self.dtype))
            vf.store(vo.load().to(self.dtype))

    return EmbeddingAdamWSm90


def compile_kernel(dtype=torch.bfloat16, *, options=None, fake=True, args=None):
    """``cute.compile`` one variant (element type). ``fake``: shape-symbolic fake tensors (no GPU needed: the CPU
    tests); else ``args`` = the cute arguments of a real call."""
    import cutlass
    import cutlass.cute as cute
    op = _kernel_class()(_cutlass_dtype(dtype))
    kw = {"options": options} if options else {}
    if fake:
        import cutlass.runtime as crt
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor
        H = cute.sym_int32()
        T, V = cute.sym_int32(), cute.sym_int32()
        dy = make_fake_tensor(_cutlass_dtype(dtype), (T, H), (cute.sym_int64(divisibility=VEC), 1), assumed_align=16)
        pmv = [make_fake_tensor(_cutlass_dtype(dtype), (V, H), (cute.sym_int64(divisibility=VEC), 1),
                                assumed_align=16) for _ in range(3)]
        perm = make_fake_compact_tensor(cutlass.Int32, (T,), assumed_align=4)
        start = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int32(),), assumed_align=4)
        hyper = make_fake_compact_tensor(cutlass.Float32, (N_HYPER,), assumed_align=16)
        args = [dy, perm, start, crt.make_fake_stream(), *pmv, hyper]
    return cute.compile(op, *args, **kw)


def segments(ids: torch.Tensor, V: int, padding_idx=None) -> tuple:
    """(perm, start): the tokens in the order of their ids (int32) and, for each row v, ``start[v] .. start[v+1]``
    its tokens in that order (V + 1 int32 offsets); tokens of ``padding_idx`` belong to no row. Fixed shapes, no
    host sync."""
    ids = ids.int()  # 32-bit keys: half the radix sort's passes of int64 (V < 2**31)
    if padding_idx is not None:
        ids = torch.where(ids == padding_idx, V, ids)  # past every row's segment
    key, perm = torch.sort(ids)
    start = torch.searchsorted(key, torch.arange(V + 1, device=ids.device, dtype=torch.int32), out_int32=True)
    return perm.int(), start


def embedding_adamw(dy, ids, p, m, v, hyper, padding_idx=None) -> None:
    """The module docstring's update of p, m, v (in place) from the embedding's output gradient ``dy`` (T, H) and
    its token ids ``ids`` (T,). CUDA tensors run the kernel (Hopper; bf16 / fp16, H a multiple of 8), CPU tensors
    the torch reference."""
    check_args(dy, ids, p, m, v, hyper)
    if p.device.type != "cuda":
        return _reference(dy, ids, p, m, v, hyper, padding_idx)
    V, H = p.shape
    if p.dtype not in _DTYPES or H % VEC:
        raise ValueError(f"embedding_adamw: a bfloat16 / float16 weight with H a multiple of {VEC} expected, got "
                         f"{p.dtype} H {H}")
    for name, t in (("p", p), ("m", m), ("v", v)):
        if t.data_ptr() % 16:
            raise ValueError(f"embedding_adamw: {name} must start on a 16-byte boundary (the kernel's 16-byte "
                             "accesses)")
    if V == 0 or H == 0:
        return None
    perm, start = segments(ids, V, padding_idx)
    dy = dy if (dy.stride(1) == 1 and dy.stride(0) % VEC == 0 and dy.data_ptr() % 16 == 0) else dy.contiguous()
    _launcher([dy, perm, start, p, m, v, hyper.contiguous()], (p.dtype,))
    return None
