"""Argument checks shared by :func:`coda.gemm` and :func:`coda.reference.gemm`.

Every rule is checked before anything is compiled or launched, and both entry points raise the same errors:

- ``TypeError`` for a wrong type or dtype (``a``, ``b``, ``out``, ``out_dtype``);
- ``ValueError`` for shapes, devices, strides, alignment and memory overlap.

Each message names the offending argument and says what was expected and what was found. CODA never copies an
operand silently: a layout the kernel cannot read is an error, and the message suggests ``.contiguous()``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

IN_DTYPES = (torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ALIGN_BYTES = 16  # TMA: global address and every non-unit stride must be multiples of 16 bytes

_NO_COPY = "CODA never copies an operand silently; call .contiguous() on it if a copy is acceptable"


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    """A validated GEMM ``D = a @ b.T`` (per batch when batched).

    ``L`` is None when unbatched. ``b_broadcast``: ``a`` is (L, M, K) and ``b`` is (N, K), one weight shared by
    every batch. ``empty_result``: M == 0 or N == 0 (or L == 0), the result is an empty tensor and nothing should be
    launched. ``zero_k``: K == 0 and the result is not empty; the accumulator is all zeros (the epilogue still
    applies) and no mainloop should be launched.
    """

    L: Optional[int]
    M: int
    N: int
    K: int
    in_dtype: torch.dtype
    out_dtype: torch.dtype
    batched: bool
    device: torch.device
    b_broadcast: bool = False
    a_major: str = "k"  # "k": K contiguous (nn.Linear layout); "mn": M (of a) / N (of b) contiguous
    half_out: bool = False  # the epilogue writes one value per column pair: N/2 output columns
    wide_out: bool = False  # a 1 -> 2 (expand) epilogue writes two values per element: 2N output columns
    b_major: str = "k"
    empty_result: bool = False
    zero_k: bool = False

    @property
    def out_shape(self) -> Tuple[int, ...]:
        """Shape of the result: (M, N), or (L, M, N) when batched (N/2 columns for a pairs epilogue)."""
        n = self.N // 2 if self.half_out else 2 * self.N if self.wide_out else self.N
        return (self.L, self.M, n) if self.batched else (self.M, n)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_layout(name: str, t: torch.Tensor, what: str, other: Optional[str] = None) -> str:
    """One of the two matrix dims contiguous; other strides and the base address multiples of 16 bytes.

    The last dim (``what``) contiguous is the default ("k" for a/b: K-major). When ``other`` names the row dim
    (M of ``a``, N of ``b``), a tensor whose rows dim is contiguous instead is accepted too ("mn": MN-major, e.g.
    ``w.t()``; the kernel reads it with transposed shared-memory tiles). Returns "k" or "mn".
    Strides of size-1 dims are ignored (they address nothing, and torch gives them arbitrary values even for
    tensors it calls contiguous); a tensor with no elements has no layout to check.
    """
    if t.numel() == 0:
        return "k"
    esize = t.element_size()
    shape, strides = tuple(t.shape), tuple(t.stride())
    major, lead = "k", t.dim() - 1
    if shape[-1] != 1 and strides[-1] != 1:
        if other is not None and (shape[-2] == 1 or strides[-2] == 1):
            major, lead = "mn", t.dim() - 2
        else:
            also = f" or the {other} dim (dim -2)" if other else ""
            raise ValueError(
                f"{name}: the last dim ({what}){also} must be contiguous (stride 1); got shape {shape} with strides "
                f"{strides}. {_NO_COPY}"
            )
    labels = {2: ("row", "column"), 3: ("batch", "row", "column")}[t.dim()]
    for i, (label, size, stride) in enumerate(zip(labels, shape, strides)):
        if i != lead and size != 1 and (stride * esize) % ALIGN_BYTES:
            raise ValueError(
                f"{name}: the {label} stride must be a multiple of {ALIGN_BYTES} bytes; got shape {shape} with "
                f"strides {strides} ({label} stride {stride} x {esize} bytes = {stride * esize} bytes). {_NO_COPY}"
            )
    if t.data_ptr() % ALIGN_BYTES:
        raise ValueError(
            f"{name}: the data pointer must be {ALIGN_BYTES}-byte aligned; got address {t.data_ptr():#x} "
            f"(offset {t.data_ptr() % ALIGN_BYTES} bytes; e.g. a slice that starts mid-row). {_NO_COPY}"
        )
    return major


def _has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether two distinct indices of ``t`` address the same element (e.g. an expanded tensor)."""
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1)
    span = 1  # elements covered by the dims seen so far
    for stride, size in dims:
        if stride < span:
            return True
        span = stride * (size - 1) + span
    return False


def _byte_range(t: torch.Tensor) -> Tuple[int, int]:
    start = t.data_ptr()
    last = sum((sz - 1) * st for sz, st in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _overlaps(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.numel() == 0 or y.numel() == 0 or x.device != y.device:
        return False
    x0, x1 = _byte_range(x)
    y0, y1 = _byte_range(y)
    return x0 < y1 and y0 < x1


def check_gemm_args(
    a: torch.Tensor,
    b: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    half_out: bool = False,
    wide_out: bool = False,
) -> GemmProblem:
    """Validate the operands of ``a @ b.T`` and return the problem they describe.

    ``a``: (M, K) or (L, M, K); ``b``: (N, K), or (L, N, K) when ``a`` is batched (a 2-D ``b`` with a 3-D ``a`` is
    one weight broadcast over L). Both bf16 or both fp16. ``out_dtype`` in {bf16, fp16, fp32}, default ``out.dtype``
    if ``out`` is given, else ``a.dtype``. ``out``, if given: shape (M, N) / (L, M, N), dtype ``out_dtype``, same
    device, no memory shared with ``a`` or ``b``. ``half_out``: the epilogue writes one value per column pair
    (``coda.pairs``), so the output has N/2 columns (N must be even); ``wide_out``: two values per element (a 1 -> 2
    epilogue), 2N columns. Raises TypeError / ValueError (see the
    module docstring).
    """
    # --- types and ranks
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor; got {type(t).__name__}")
    if a.dim() not in (2, 3):
        raise ValueError(f"a: expected a 2-D (M, K) or 3-D (L, M, K) tensor; got {a.dim()}-D shape {tuple(a.shape)}")
    if b.dim() not in (2, 3):
        raise ValueError(f"b: expected a 2-D (N, K) or 3-D (L, N, K) tensor; got {b.dim()}-D shape {tuple(b.shape)}")
    if b.dim() == 3 and a.dim() == 2:
        raise ValueError(
            f"b: a 3-D (L, N, K) b needs a 3-D (L, M, K) a; got a {tuple(a.shape)} and b {tuple(b.shape)}"
        )

    # --- dtypes
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in IN_DTYPES:
            raise TypeError(f"{name}: expected dtype bfloat16 or float16; got {_dtype_name(t.dtype)}")
    if a.dtype != b.dtype:
        raise TypeError(
            f"a and b must have the same dtype; got a {_dtype_name(a.dtype)} and b {_dtype_name(b.dtype)}"
        )
    if out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor or None; got {type(out).__name__}")
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected bfloat16, float16 or float32; got {out_dtype!r}")
    if out is not None:
        if out.dtype not in OUT_DTYPES:
            raise TypeError(f"out: expected dtype bfloat16, float16 or float32; got {_dtype_name(out.dtype)}")
        if out_dtype is not None and out.dtype != out_dtype:
            raise TypeError(
                f"out: dtype {_dtype_name(out.dtype)} does not match out_dtype={_dtype_name(out_dtype)}"
            )
        out_dtype = out.dtype
    if out_dtype is None:
        out_dtype = a.dtype

    # --- devices
    if a.device != b.device:
        raise ValueError(f"a and b must be on the same device; got a on {a.device} and b on {b.device}")
    if out is not None and out.device != a.device:
        raise ValueError(f"out: must be on the operands' device {a.device}; got {out.device}")

    # --- shapes
    batched = a.dim() == 3
    b_broadcast = batched and b.dim() == 2
    L = a.shape[0] if batched else None
    M, K = a.shape[-2], a.shape[-1]
    N, Kb = b.shape[-2], b.shape[-1]
    if batched and not b_broadcast and b.shape[0] != L:
        raise ValueError(
            f"b: batch size L must match a's; got a {tuple(a.shape)} (L={L}) and b {tuple(b.shape)} (L={b.shape[0]})"
        )
    if K != Kb:
        raise ValueError(
            f"a and b must have the same K (last dim); got a {tuple(a.shape)} (K={K}) and b {tuple(b.shape)} (K={Kb})"
        )
    esize = a.element_size()
    if (K * esize) % ALIGN_BYTES:
        raise ValueError(
            f"a/b: rows must be {ALIGN_BYTES}-byte aligned: K={K} (need K % {ALIGN_BYTES // esize} == 0 for "
            f"bf16/fp16)"
        )
    if half_out and N % 2:
        raise ValueError(f"b: N={N} (b.shape[-2]) must be even for an epilogue over column pairs (coda.pairs)")
    out_n = N // 2 if half_out else 2 * N if wide_out else N
    out_esize = torch.empty((), dtype=out_dtype).element_size()
    if (out_n * out_esize) % ALIGN_BYTES:
        what = f"N/2={out_n} (pairs: half of b.shape[-2])" if half_out else f"N={N} (b.shape[-2])"
        raise ValueError(
            f"b: {what} gives output rows of {out_n * out_esize} bytes, which must be {ALIGN_BYTES}-byte "
            f"aligned: need {'N/2' if half_out else 'N'} % {ALIGN_BYTES // out_esize} == 0 for "
            f"{_dtype_name(out_dtype)} output"
        )

    # --- layouts
    a_major = _check_layout("a", a, "K", other="M")
    b_major = _check_layout("b", b, "K", other="N")
    if b_broadcast and a_major == "mn" and L > 1 and M > 1:
        raise ValueError(
            f"a: an M-contiguous (MN-major) batched a {tuple(a.shape)} with a 2-D b shared by every batch is not "
            f"supported (the batch is folded into M, which needs K-contiguous rows). {_NO_COPY}"
        )

    # --- out
    out_shape = (L, M, out_n) if batched else (M, out_n)
    if out is not None:
        if tuple(out.shape) != out_shape:
            raise ValueError(f"out: expected shape {out_shape}; got {tuple(out.shape)}")
        _check_layout("out", out, "N")
        if _has_internal_overlap(out):
            raise ValueError(
                f"out: elements overlap in memory (shape {tuple(out.shape)}, strides {tuple(out.stride())}; "
                "e.g. an expanded tensor); every output element needs its own memory"
            )
        for name, t in (("a", a), ("b", b)):
            if _overlaps(out, t):
                raise ValueError(f"out: must not share memory with {name} (in-place GEMM is not supported)")

    empty = M == 0 or N == 0 or (batched and L == 0)
    return GemmProblem(
        L=L,
        M=M,
        N=N,
        K=K,
        in_dtype=a.dtype,
        out_dtype=out_dtype,
        batched=batched,
        device=a.device,
        b_broadcast=b_broadcast,
        a_major=a_major,
        b_major=b_major,
        half_out=half_out,
        wide_out=wide_out,
        empty_result=empty,
        zero_k=(K == 0 and not empty),
    )
