"""The epilogue hook of CODA's GEMM: what an epilogue declares and how the kernel calls it.

An epilogue is a compile-time Python object. The GEMM's consumer warpgroups call :meth:`Epilogue.visit` once per
accumulator element of each epilogue sub-tile, *while tracing the kernel*: whatever CuTeDSL arithmetic ``visit``
emits becomes part of the fused kernel. ``visit`` receives the fp32 accumulator value and an :class:`EpiEnv` that
gives the element's global row/column and the values of the declared operands at that element; it returns a dict:

- ``"out"``: the value stored to the main output D (cast to D's dtype, TMA-stored);
- one key per extra tile output (``outputs``): an M x N tensor written beside D, also by TMA;
- one key per reduction (``reductions``): the element's contribution to a per-row (``axis="n"``) or per-column
  (``axis="m"``) reduction. The kernel reduces it over each CTA tile deterministically (registers, warp shuffles,
  shared memory; no atomics) and writes one partial per (row, N-tile) or (column, M-tile); the host finishes the
  reduction over the tiles (:func:`finish_reduction`).

Operand kinds (declared, never guessed from shapes; one object each in :mod:`.operand_kinds`, ``Operand.spec``):

- ``vec_m``  one value per output row (length M, or (L, M) when batched),
- ``vec_n``  one value per output column (length N),
- ``scalar`` a run-time fp32 scalar (a Python number that is baked in is simply a constant inside ``visit``),
- ``tile``   an M x N tensor (a residual), read at each element.

The identity epilogue (``Epilogue()``) is the plain GEMM.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional

from .operand_kinds import AXIS_OF, KIND_OF, TILE, OperandKind, ReduceAxis

MAX_EPI_TENSORS = 20  # operands + extra outputs + reduction partials: the x0..x19 slots of GemmSm90.__call__
KINDS = tuple(KIND_OF)  # ("vec_m", "vec_n", "scalar", "tile")
REDUCE_OPS = ("sum", "max", "logsumexp")  # logsumexp: per-row (axis n) only


@dataclasses.dataclass(frozen=True)
class Operand:
    name: str
    kind: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"operand {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def spec(self) -> OperandKind:
        """The kind object (validation, host argument, shared memory, kernel loads); ``kind`` stays the string."""
        return KIND_OF[self.kind]


@dataclasses.dataclass(frozen=True)
class Reduction:
    name: str
    axis: str  # "n": one value per row (reduced along N); "m": one value per column
    op: str = "sum"

    def __post_init__(self):
        if self.axis not in ("n", "m"):
            raise ValueError(f"reduction {self.name!r}: axis must be 'n' or 'm', got {self.axis!r}")
        if self.op not in REDUCE_OPS:
            raise ValueError(f"reduction {self.name!r}: op must be one of {REDUCE_OPS}, got {self.op!r}")
        if self.op == "logsumexp" and self.axis != "n":
            raise ValueError(f"reduction {self.name!r}: logsumexp is supported along N only (axis='n')")

    @property
    def spec(self) -> ReduceAxis:
        """The axis object (partial buffer shape, finished length, the kernel's padding mask)."""
        return AXIS_OF[self.axis]


class EpiEnv:
    """What ``visit`` sees of one accumulator element: its coordinates and operand values (loaded lazily)."""

    def __init__(self, row, col, loaders: Mapping[str, Callable[[], Any]], segments: Optional[dict] = None):
        # row / col may be zero-argument callables: coordinates are then only computed (traced) when used
        self._row, self._col = row, col
        self._loaders, self._cache = loaders, {}
        self.segments = segments  # {SegmentSum node: value} formed by kernels/segment.py's pre-pass, if any

    @property
    def row(self):
        if callable(self._row):
            self._row = self._row()
        return self._row

    @property
    def col(self):
        if callable(self._col):
            self._col = self._col()
        return self._col

    def __getitem__(self, name: str):
        if name not in self._cache:
            self._cache[name] = self._loaders[name]()
        return self._cache[name]


ODD_SUFFIX = "_odd_"


def odd_key(name: str) -> str:
    """The key of a 2 -> 2 pairs epilogue's second value (column 2j+1) of output ``name`` in ``visit`` results."""
    return name + ODD_SUFFIX


ODD_OUT = odd_key("out")  # the main output's second value


class Epilogue:
    """Base class (and identity epilogue). Subclasses set the declarations and override ``visit``/``reference``."""

    name: str = "identity"
    operands: tuple[Operand, ...] = ()
    outputs: tuple[str, ...] = ()
    reductions: tuple[Reduction, ...] = ()
    stores_out: bool = True  # False: no main output D (e.g. only reductions: logits reduced, never stored)
    # column pairs (coda.pairs): None; "half": visit gets (acc_2j, acc_2j+1) and returns one value per pair
    # (outputs of N/2 columns); "full": it returns "out" and ODD_OUT, the values of columns 2j and 2j+1, and so for
    # each extra output k (k and odd_key(k): M x N, like the main one).
    # VecN / TileMN operands of a pairs epilogue hold one value per pair.
    pair_mode: Optional[str] = None
    # 1 -> 2 ("expand"): visit gets one accumulator element (operands indexed as usual) and returns "out" and
    # ODD_OUT, stored at output columns 2j and 2j+1 (outputs of 2N columns). E.g. the SwiGLU backward fused into
    # the GEMM that forms da: each da_j gives the interleaved pair (dg_j, du_j).
    expand: bool = False

    def key(self) -> tuple:
        """Identifies the generated code in compile caches: must change whenever ``visit`` emits other code."""
        return (type(self).__module__, type(self).__qualname__, self.name, self.operands, self.outputs,
                self.reductions, self.stores_out, self.pair_mode) + (("expand",) if self.expand else ())

    # -- device (trace time) --------------------------------------------------------------------------------------
    def visit(self, acc, env: EpiEnv) -> dict:
        return {"out": acc}

    # -- torch reference (fp32 math, any device) ------------------------------------------------------------------
    def reference(self, acc, **operands) -> dict:
        """``acc``: fp32 (..., M, N) tensor; operands as passed to ``coda.gemm``; returns the same keys as visit,
        with reductions already finished (VecM / VecN tensors)."""
        return {"out": acc}

    @property
    def inplace(self) -> tuple:
        """Extra outputs written back into the TileMN operand of the same name (e.g. an optimizer's moments): the
        kernel stores them into the operand's memory; each element is read by the thread that later stores it."""
        tiles = {o.name for o in self.operands if o.spec is TILE}
        return tuple(k for k in self.outputs if k in tiles)

    def out_cols(self, N: int) -> int:
        """Columns of the main / extra outputs for an accumulator of N columns."""
        return N // 2 if self.pair_mode == "half" else 2 * N if self.expand else N

    def operand_cols(self, N: int) -> int:
        """Length of a VecN operand / columns of a TileMN operand for an accumulator of N columns."""
        return N // 2 if self.pair_mode else N

    def check_operands(self, operands: Mapping[str, Any], L: Optional[int], M: int, N: int, device) -> None:
        """Call-time checks of the operands against the declared kinds (before any launch): names, shapes,
        dtypes, devices, layouts. ``L`` is None when unbatched; ``N`` is the accumulator's columns."""
        if self.pair_mode and N % 2:
            raise ValueError(f"epilogue {self.name!r} works on column pairs (coda.pairs): N must be even, "
                             f"got N={N}")
        N = self.operand_cols(N)
        names = {o.name for o in self.operands}
        missing, extra = sorted(names - set(operands)), sorted(set(operands) - names)
        if missing or extra:
            raise TypeError(f"epilogue {self.name!r}: missing operands {missing}, unexpected {extra} "
                            f"(declared: {sorted(names)})")
        batch = () if L is None else (L,)
        for o in self.operands:
            o.spec.check(o.name, operands[o.name], batch, M, N, device)

    def kernel_reductions(self) -> tuple:
        """The reductions in the order of the kernel's partial buffers: per-row (axis n) first, then per-column."""
        return tuple(r for r in self.reductions if r.axis == "n") + tuple(r for r in self.reductions if r.axis == "m")

    @property
    def is_identity(self) -> bool:
        return type(self) is Epilogue


IDENTITY = Epilogue()


def staged_operands(epi: Epilogue, cfg) -> list:
    """[(operand index, values per tile)] of the VecN / VecM operands the kernel stages through shared memory: a
    tile's values (tile_n columns -- tile_n / 2 pairs in a pairs epilogue -- or tile_m rows) are loaded from global
    memory before the tile's mainloop and read by the epilogue at shared-memory latency."""
    pair = bool(epi.pair_mode)
    return [(i, o.spec.staged_values(cfg, pair)) for i, o in enumerate(epi.operands)
            if o.spec.staged_values(cfg, pair)]


def tile_operand_cols(epi: Epilogue, cfg) -> int:
    """Columns of a TileMN operand's epilogue sub-tile (one value per column pair in a pairs epilogue)."""
    return TILE.sub_tile_cols(cfg, bool(epi.pair_mode))


def staged_smem_bytes(epi: Epilogue, cfg, tile_bytes, ring: int = 2) -> int:
    """Shared memory of the epilogue's operands besides the output buffers: staged VecN / VecM values (fp32) and
    the TMA ring of TileMN operands (``ring`` sub-tile buffers each, ``tile_bytes``: the element size of each
    TMA-loaded TileMN operand) and its mbarriers, per consumer tile in flight. Alignment padding is covered by
    ``GemmConfig.derive_stages``' reserve."""
    in_flight = 2 if cfg.pingpong else 1
    n = sum(o.spec.staged_bytes(cfg, bool(epi.pair_mode)) for o in epi.operands)
    if tile_bytes:  # ring buffers are multiples of 1024 bytes (no alignment padding after the output buffers)
        n += sum(TILE.ring_bytes(cfg, bool(epi.pair_mode), b, ring) for b in tile_bytes) + 8 * ring
    return n * in_flight


def tile_ring(epi: Epilogue, cfg, tile_bytes, out_bytes, in_bytes: int = 2) -> int:
    """Sub-tile buffers in each TMA-loaded TileMN operand's ring (``tile_bytes``: their element sizes): the deepest
    of 8, 4 (at most the sub-tiles of one tile) that leaves the pipeline stage count as it is with 2, else 2. So
    the ring deepens where the stage count is fixed and shared memory is left (a K = 0 launch: 2 stages, an
    epilogue that is all memory traffic), and never costs a K > 0 GEMM a stage."""
    if not tile_bytes:
        return 2
    def stages(ring):
        return cfg.fit_stages(out_bytes, staged_smem_bytes(epi, cfg, tile_bytes, ring), in_bytes)
    base = stages(2)
    for ring in (8, 4):
        if base and ring <= cfg.tile_n // cfg.epi_n and stages(ring) == base:
            return ring
    return 2


def tile_tma_plan(epi: Epilogue, cfg, aligned, tile_bytes, out_bytes, in_bytes: int = 2):
    """``(flags, extra_smem)``: which TileMN operands (declaration order) the kernel TMA-loads, and the shared
    memory of the epilogue's operands then. An operand is TMA-loaded when it is 16-byte aligned (``aligned``) and
    its ring leaves the mainloop min(3, stages without any ring) pipeline stages; the others are read element by
    element (``tile_bytes``: element size of each TileMN operand; ``out_bytes``: of each tile output)."""
    def stages(chosen):
        return cfg.fit_stages(out_bytes, staged_smem_bytes(epi, cfg, chosen), in_bytes)
    target = min(3, stages([]))
    flags, chosen = [], []
    for ok, b in zip(aligned, tile_bytes):
        take = bool(ok) and stages(chosen + [b]) >= target
        flags.append(take)
        chosen += [b] if take else []
    return tuple(flags), staged_smem_bytes(epi, cfg, chosen)


def out_col_bytes(epi: Epilogue, out_bytes) -> tuple:
    """Shared memory per accumulator column of each tile output's sub-tile buffer (``out_bytes``: element sizes):
    the element size, half of it for a half-width output (element bits // 16, else // 8), twice it for a 1 -> 2
    (expand) epilogue's double-width output."""
    return tuple(b * 8 // (16 if epi.pair_mode == "half" else 4 if epi.expand else 8) for b in out_bytes)


@dataclasses.dataclass(frozen=True)
class SmemPlan:
    """How one kernel variant spends its shared memory (:func:`smem_plan`)."""
    out_bytes: tuple  # shared memory per accumulator column of each stored tile output's sub-tile buffer
    tma_flags: tuple  # per TileMN operand (declaration order): TMA-loaded through a ring of sub-tile buffers
    ring: int  # sub-tile buffers in each TMA-loaded TileMN operand's ring (per consumer tile in flight)
    extra_smem: int  # bytes of the staged VecN / VecM values and TileMN rings (staged_smem_bytes)
    epi_buffers: int  # sub-tile buffers per tile output and consumer tile in flight (2 or 4)
    stages: int  # mainloop pipeline stages


def smem_plan(epi: Epilogue, cfg, out_bytes, tile_bytes, tile_aligned, in_bytes: int = 2) -> SmemPlan:
    """The shared-memory plan of the kernel (``GemmSm90.__call__``) and of the autotuner's pruning: one function so
    that both agree. ``out_bytes``: element size of each tile output the kernel stores (D if ``epi.stores_out``,
    then the extra outputs); ``tile_bytes`` / ``tile_aligned``: element size and 16-byte alignment of each TileMN
    operand; ``in_bytes``: of A and B. In order: which TileMN operands are TMA-loaded (:func:`tile_tma_plan`),
    their ring depth (:func:`tile_ring`), the operands' shared memory (:func:`staged_smem_bytes`), the output
    buffers (``GemmConfig.epi_buffers``), the pipeline stages (``GemmConfig.derive_stages``; its ValueError when
    they do not fit). A half-width output (``pair_mode == "half"``) takes half its element size per accumulator
    column (its sub-tile is tile_m x epi_n / 2)."""
    out_b = list(out_col_bytes(epi, out_bytes))
    if cfg.epi_wg:  # the epilogue warps: the staged accumulator tile and the operands' ring (kernels/epilogue_wg.py)
        from .epilogue_wg import ring_bytes, staging_bytes
        extra = staging_bytes(cfg) + ring_bytes(epi, cfg, tuple(tile_bytes), tuple(tile_aligned), in_bytes)
        st = cfg.derive_stages([], extra_smem=extra, in_bytes=in_bytes, epi_stages=0)
        return SmemPlan(tuple(out_b), (False,) * len(tuple(tile_bytes)), 2, extra, 0, st)
    tile_bytes, tile_aligned = tuple(tile_bytes), tuple(tile_aligned)
    if len(tile_bytes) != len(tile_aligned):
        raise ValueError(f"smem_plan: {len(tile_bytes)} TileMN element sizes for {len(tile_aligned)} alignment flags")
    flags, _ = tile_tma_plan(epi, cfg, tile_aligned, tile_bytes, out_b, in_bytes)
    chosen = [b for f, b in zip(flags, tile_bytes) if f]
    ring = tile_ring(epi, cfg, chosen, out_b, in_bytes)
    extra = staged_smem_bytes(epi, cfg, chosen, ring)
    bufs = cfg.epi_buffers(out_b, extra, in_bytes)
    stages = cfg.derive_stages(out_b, extra_smem=extra, in_bytes=in_bytes, epi_stages=bufs)
    return SmemPlan(tuple(out_b), tuple(flags), ring, extra, bufs, stages)


def finish_reduction(partials, op: str):
    """Finish a tile-partial reduction: partials (L, tiles, len) -> (L, len). Deterministic (fixed order).
    ``partials`` is consumed (a logsumexp overwrites it)."""
    if op == "sum":
        return _sum_tiles(partials)
    if op == "max":
        return partials.amax(dim=1)
    if op == "logsumexp":  # torch.logsumexp's algorithm in place (the partials are the call's own buffer):
        if partials.numel() == 0:  # its (x - max).exp() would be one more tensor of the partials' size
            return partials.logsumexp(dim=1)
        m = partials.amax(dim=1, keepdim=True)
        m.masked_fill_(m.abs() == float("inf"), 0.0)
        return partials.sub_(m).exp_().sum(dim=1).log_().add_(m.squeeze(1))
    raise ValueError(f"unknown reduction op {op!r}")


_ONES: dict = {}  # (device, length) -> a float32 vector of ones, made outside CUDA-graph capture


def _sum_tiles(partials):
    """partials.sum(dim=1); for one float32 CUDA batch of >= 16 tiles as a matrix-vector product with a vector of
    ones (cuBLAS SGEMV: fp32 arithmetic whatever the TF32 setting, deterministic), which for the (1, 512, 2048)
    column partials of a llama-1b step takes half of torch's reduction kernel (H100, ``python -m
    coda.bench.finish``: 11.2 vs 22.8 us). Under CUDA-graph capture the ones vector must exist already (it is made
    by the warm-up step outside the capture); else torch's sum."""
    import torch
    L, tiles, n = partials.shape
    if not (partials.is_cuda and partials.dtype == torch.float32 and L == 1 and tiles >= 16 and n > 0):
        return partials.sum(dim=1)
    key = (partials.device, tiles)
    ones = _ONES.get(key)
    if ones is None:
        if torch.cuda.is_current_stream_capturing():
            return partials.sum(dim=1)
        ones = _ONES[key] = torch.ones(tiles, device=partials.device, dtype=torch.float32)
    return torch.mv(partials[0].t(), ones).unsqueeze(0)


def check_epilogue(epilogue: Optional[Epilogue]) -> Epilogue:
    if epilogue is None:
        return IDENTITY
    if not isinstance(epilogue, Epilogue):
        raise TypeError(f"epilogue must be a coda Epilogue (e.g. made with @coda.epilogue), got {type(epilogue)}")
    return epilogue


def check_call(epi: Epilogue, prob, out, operands: Mapping[str, Any]) -> None:
    """The epilogue-dependent checks of one call, shared by ``coda.gemm`` and ``coda.reference.gemm`` and run
    before the architecture check: operands against their kinds, ``out=`` for an epilogue without a main output
    or sharing memory with an operand, the kernel's tensor limit, per-column reductions with a shared weight."""
    import torch

    from coda._validate import _overlaps
    if out is not None and not epi.stores_out:
        raise ValueError(f"out: epilogue {epi.name!r} stores no main output (it returns only "
                         f"{list(epi.outputs) + [r.name for r in epi.reductions]}); pass out=None")
    epi.check_operands(operands, prob.L, prob.M, prob.N, prob.device)
    if out is not None:
        kinds = {o.name: o.spec for o in epi.operands}
        for name, v in operands.items():
            if not isinstance(v, torch.Tensor) or not _overlaps(out, v):
                continue
            # add-to-output: a TileMN operand that *is* out (same memory, shape, strides, dtype) is read by the thread
            # that later stores the element, before the store; any other overlap races with other tiles' stores
            same = (kinds.get(name) is TILE and v.data_ptr() == out.data_ptr() and v.shape == out.shape
                    and v.stride() == out.stride() and v.dtype == out.dtype)
            if not same:
                raise ValueError(f"out: must not share memory with operand {name!r} (the kernel reads operands "
                                 "while it writes out); only a TileMN operand that is exactly out (add-to-output) "
                                 "may")
    for name in epi.inplace:
        _check_inplace(epi, prob, name, operands, out)
    n_tensors = len(epi.operands) + len(epi.outputs) + len(epi.reductions)
    if n_tensors > MAX_EPI_TENSORS:
        raise ValueError(f"epilogue {epi.name!r} needs {n_tensors} tensors (operands + extra outputs + reductions); "
                         f"the kernel takes at most {MAX_EPI_TENSORS}")
    if prob.b_broadcast and any(r.axis == "m" for r in epi.reductions):
        raise ValueError(f"b: an epilogue with a per-column (axis m) reduction needs b batched like a; b of shape "
                         f"(N, K) = ({prob.N}, {prob.K}) is shared by every batch of a (L={prob.L})")


def _check_inplace(epi: Epilogue, prob, name: str, operands, out) -> None:
    """An in-place extra output (``Epilogue.inplace``): its TileMN operand (the output's shape, checked with the
    operands) must be of an epilogue of one value per element (no pairs or 1 -> 2), of a stored dtype, and share
    memory with nothing else the kernel reads or writes, nor between its own elements."""
    import torch

    from coda._validate import _overlaps
    v = operands[name]
    if epi.pair_mode or epi.expand:
        raise ValueError(f"operand {name!r}: in-place outputs need an epilogue of one value per element (no "
                         "coda.pairs / 1 -> 2)")
    if v.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"operand {name!r}: updated in place, so it must be bfloat16, float16 or float32, got "
                        f"{v.dtype}")
    if prob.in_dtype in (torch.bfloat16, torch.float16) and v.dtype != prob.out_dtype:
        # the kernel stores every tile output in the main output's dtype (the reference path stores any)
        raise TypeError(f"operand {name!r}: updated in place, so it must have the output's dtype "
                        f"{str(prob.out_dtype).replace('torch.', '')}, got {str(v.dtype).replace('torch.', '')}")
    if torch._debug_has_internal_overlap(v) != 0:  # e.g. an expanded (stride-0) view: one element, many stores
        raise ValueError(f"operand {name!r}: updated in place, so its elements must not share memory (got strides "
                         f"{tuple(v.stride())})")
    others = [(k, t) for k, t in operands.items() if k != name and isinstance(t, torch.Tensor)]
    if out is not None:
        others.append(("out", out))
    for k, t in others:
        if _overlaps(v, t):
            raise ValueError(f"operand {name!r}: updated in place, so it must not share memory with {k!r}")


def empty_reductions(epi: Epilogue, prob) -> dict:
    """The reductions of a call with nothing to launch (M == 0 or N == 0), in the (batch, length) form the kernel's
    finished partials have: the neutral element where the reduced dim is empty (0 for sum, -inf for max and
    logsumexp), empty where the kept dim is."""
    import torch
    L = 1 if (prob.L is None or prob.b_broadcast) else prob.L
    M = prob.M * (prob.L if prob.b_broadcast else 1)
    res = {}
    for r in epi.reductions:
        length = r.spec.length(epi, M, prob.N)  # per row, per column, or per pair j
        fill = 0.0 if r.op == "sum" else -math.inf
        res[r.name] = torch.full((L, length), fill, dtype=torch.float32, device=prob.device)
    return res


def half_out(epilogue) -> bool:
    """Whether the epilogue writes one value per column pair (``coda.pairs``): outputs of N/2 columns."""
    return getattr(epilogue, "pair_mode", None) == "half"


def wide_out(epilogue) -> bool:
    """Whether the epilogue writes two values per accumulator element (``Epilogue.expand``): outputs of 2N columns."""
    return bool(getattr(epilogue, "expand", False))


def out_flags(epilogue) -> dict:
    """``check_gemm_args``'s output-width flags for ``epilogue`` (None: the identity): every caller passes both."""
    return dict(half_out=half_out(epilogue), wide_out=wide_out(epilogue))
