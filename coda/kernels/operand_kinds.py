"""One object per operand kind of an epilogue, and per reduction axis: everything that depends on the kind.

An epilogue declares each operand by kind (``Operand(name, "vec_m")``, or the DSL's ``x: coda.VecM``); the
declaration stays the string (it is part of compile keys, and ``o.kind == "tile"`` is how callers test it) and
``Operand.spec`` is the kind object below, :data:`KIND_OF` ``[o.kind]``. A kind object carries, in one place:

- its names: ``name`` (the declared string) and ``label`` (the DSL annotation, used in messages);
- host: the shape ``coda.gemm`` expects for (batch, M, N) and the call-time checks (:meth:`OperandKind.check`),
  the kernel argument built from the operand (:meth:`OperandKind.host_arg`, for ``gemm.epilogue_tensors``), whether
  that argument is a view of the operand's memory (``by_view``: a launch plan then reuses it), the torch reference's
  broadcastable form (:meth:`OperandKind.reference`);
- shared memory: the values per tile staged through shared memory (:meth:`OperandKind.staged_values`, fp32);
- kernel (trace time, plain Python dispatch, so the generated code is what the kind emits and nothing else): the
  staged kinds' prefetch of one value before the tile's mainloop (:meth:`OperandKind.prefetch`), the value at an
  accumulator register (:meth:`OperandKind.load`) and which registers share it (:meth:`OperandKind.memo_key`).

The kernel side works on ``sub_tile.SubTile`` (``lazy``): its ``staged`` {name: (smem, slot)}, ``scalars`` {name:
value}, ``tiles`` {name: this sub-tile's ring buffer (``ring_view.RingBuffer``)} and its ``local`` / ``coord``
coordinate helpers. ``cutlass`` is only imported by the kernel-side methods: the host side stays importable without
it.
"""
from __future__ import annotations


class OperandKind:
    """Base of the four kinds; an instance per kind (:data:`VEC_M`, :data:`VEC_N`, :data:`SCALAR`, :data:`TILE`)."""

    name: str = ""  # the declared kind ("vec_m"): Operand.kind
    label: str = ""  # the DSL annotation (coda.VecM), in messages
    by_view: bool = True  # the kernel argument is a view of the operand's memory (its data pointer)

    def __repr__(self):
        return f"<operand kind {self.label}>"

    # -- host -----------------------------------------------------------------------------------------------------
    def shape(self, batch: tuple, M: int, N: int) -> tuple:
        """The operand's expected shape; ``batch`` is () or (L,), ``N`` the operand's columns (N / 2 for pairs)."""
        raise NotImplementedError

    def check(self, name: str, v, batch: tuple, M: int, N: int, device) -> None:
        """Call-time checks of operand ``name`` (value ``v``): type, shape, dtype, device, layout."""
        import torch
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"operand {name!r} ({self.name}): expected a torch tensor, got {type(v).__name__}")
        want = self.shape(batch, M, N)
        if tuple(v.shape) != want:
            raise ValueError(f"operand {name!r} ({self.label}): expected shape {want}, got {tuple(v.shape)}")
        if v.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"operand {name!r}: expected dtype float32, bfloat16 or float16, got {v.dtype}")
        if v.device != device:
            raise ValueError(f"operand {name!r}: on {v.device}, expected {device} (the device of a)")
        if v.numel() and v.data_ptr() % 16:
            raise ValueError(f"operand {name!r}: the data pointer must be 16-byte aligned; got address "
                             f"{v.data_ptr():#x} (offset {v.data_ptr() % 16} bytes, e.g. a slice that starts "
                             "mid-row); CODA never copies an operand silently, call .contiguous()")
        if v.numel() and v.stride(-1) != 1 and v.shape[-1] > 1:
            raise ValueError(f"operand {name!r}: the last dim must be contiguous (stride 1), got strides "
                             f"{tuple(v.stride())}; CODA never copies an operand silently, call .contiguous()")

    def host_arg(self, t, L: int, M: int, N: int, device) -> tuple:
        """(kernel argument, leading dim) of the checked operand ``t`` for an (L, M, N) output (``N``: the operand's
        columns); the leading dim is the argument's contiguous mode."""
        return t, 0

    def reference(self, v, acc):
        """The operand as a torch tensor that broadcasts against the fp32 accumulator ``acc`` (..., M, N)."""
        return v.to(device=acc.device, dtype=acc.dtype)  # VecN (N,) and TileMN (..., M, N) broadcast as they are

    # -- shared memory --------------------------------------------------------------------------------------------
    def staged_values(self, cfg, pair: bool) -> int:
        """fp32 values per tile staged through shared memory (0: not staged); ``pair``: a pairs epilogue."""
        return 0

    def staged_bytes(self, cfg, pair: bool) -> int:
        """Shared memory of the staged values of one consumer tile in flight."""
        return 4 * self.staged_values(cfg, pair)

    # -- kernel (trace time) --------------------------------------------------------------------------------------
    def memo_key(self, rs: int, cs: int) -> tuple:
        """What identifies the operand's value among the registers of thread 0's static (row ``rs``, column
        ``cs``): registers with one key share one load."""
        return (rs, cs)

    def prefetch(self, t, m, n, l, length: int, c):
        """A staged kind's value c of tile (m, n, l) (``length`` values per tile), clamped into the tensor."""
        raise NotImplementedError(f"{self.label} operands are not staged")

    def load(self, lazy, op, t, v, pair: bool, row, col, n_cols):
        """Operand ``op``'s fp32 value at register v of the sub-tile (``t``: its kernel tensor; ``row`` / ``col``:
        callables of the global coordinate; ``n_cols``: the operand's columns)."""
        raise NotImplementedError


class _VecM(OperandKind):
    """One value per output row (length M, or (L, M) when batched); staged, tile_m values per tile."""
    name, label = "vec_m", "VecM"

    def shape(self, batch, M, N):
        return (*batch, M)

    def host_arg(self, t, L, M, N, device):
        return t.reshape(L, M).permute(1, 0), 0  # (M, L)

    def reference(self, v, acc):
        return super().reference(v, acc).unsqueeze(-1)

    def staged_values(self, cfg, pair):
        return cfg.tile_m

    def memo_key(self, rs, cs):
        return (rs,)

    def prefetch(self, t, m, n, l, length, c):
        import cutlass
        return t[cutlass.min(m * length + c, t.shape[0] - 1), l]

    def load(self, lazy, op, t, v, pair, row, col, n_cols):
        sT, slot = lazy.staged[op.name]
        return sT[(lazy.local(v, 0), slot)]


class _VecN(OperandKind):
    """One value per output column (length N; N / 2, one per pair, in a pairs epilogue); staged, tile_n (tile_n / 2)
    values per tile."""
    name, label = "vec_n", "VecN"

    def shape(self, batch, M, N):
        return (N,)

    def staged_values(self, cfg, pair):
        return cfg.tile_n // 2 if pair else cfg.tile_n

    def memo_key(self, rs, cs):
        return (cs,)

    def prefetch(self, t, m, n, l, length, c):
        import cutlass
        return t[cutlass.min(n * length + c, t.shape[0] - 1)]

    def load(self, lazy, op, t, v, pair, row, col, n_cols):
        sT, slot = lazy.staged[op.name]
        c = lazy.local(v, 1)
        return sT[(c // 2 if pair else c, slot)]


class _Scalar(OperandKind):
    """One fp32 number read at run time (a Python number or a 1-element tensor), once per kernel."""
    name, label = "scalar", "Scalar"
    by_view = False  # the kernel argument is a 1-element fp32 tensor made per call

    def shape(self, batch, M, N):
        return (1,)

    def check(self, name, v, batch, M, N, device):
        import torch
        if isinstance(v, bool) or not isinstance(v, (int, float, torch.Tensor)):
            raise TypeError(f"operand {name!r} (Scalar): expected a Python number or a 1-element tensor, "
                            f"got {type(v).__name__}")
        if isinstance(v, torch.Tensor) and v.numel() != 1:
            raise ValueError(f"operand {name!r} (Scalar): expected 1 element, got shape {tuple(v.shape)}")
        if isinstance(v, torch.Tensor) and v.device != device:
            raise ValueError(f"operand {name!r}: on {v.device}, expected {device} (the device of a)")
        if isinstance(v, torch.Tensor) and v.is_cuda and v.dtype == torch.float32 and v.data_ptr() % 16:
            raise ValueError(f"operand {name!r} (Scalar): a float32 device tensor passed as it is must start at a "
                             "16-byte aligned address (e.g. h[i, :1] of an (n, 4) tensor, not h[i] of an (n,) one)")

    def host_arg(self, t, L, M, N, device):
        import torch
        if isinstance(t, torch.Tensor) and t.device == device:
            t = t.to(torch.float32).reshape(1)
        else:  # a number (or a CPU tensor): a fill kernel; a pageable host-to-device copy syncs the stream
            t = torch.full((1,), float(t), dtype=torch.float32, device=device)
        return t, 0

    def reference(self, v, acc):
        import torch
        return torch.as_tensor(v, dtype=acc.dtype, device=acc.device).reshape(())

    def memo_key(self, rs, cs):
        return ()

    def read(self, t):
        """The kernel's run-time value (read once per kernel, before the tile loop)."""
        import cutlass
        return t[0].to(cutlass.Float32)

    def load(self, lazy, op, t, v, pair, row, col, n_cols):
        return lazy.scalars[op.name]


class _TileMN(OperandKind):
    """An M x N tensor (M x N / 2 in a pairs epilogue), (L, M, N) when batched: TMA-loaded into a ring of sub-tile
    buffers (``epilogue.tile_tma_plan``), else read element by element from global memory."""
    name, label = "tile", "TileMN"

    def shape(self, batch, M, N):
        return (*batch, M, N)

    def host_arg(self, t, L, M, N, device):
        return t.reshape(L, M, N).permute(1, 2, 0), 1  # (M, N, L), the kernel's mode order (gemm._mnl)

    def sub_tile_cols(self, cfg, pair: bool) -> int:
        """Columns of the operand's epilogue sub-tile (one value per column pair in a pairs epilogue)."""
        return cfg.epi_n // 2 if pair else cfg.epi_n

    def ring_bytes(self, cfg, pair: bool, elem_bytes: int, ring: int) -> int:
        """Shared memory of one TMA-loaded operand's ring of ``ring`` sub-tile buffers (a multiple of 1024)."""
        return cfg.tile_m * self.sub_tile_cols(cfg, pair) * ring * elem_bytes

    def load(self, lazy, op, t, v, pair, row, col, n_cols):
        import cutlass
        if op.name in lazy.tiles:  # TMA-loaded: this sub-tile's ring buffer
            sT = lazy.tiles[op.name]
            w = lazy.partner(v) if not pair else None
            if w is not None:  # registers w, w + 1: one row, columns c, c + 1 (c even): one 32-bit read for both
                two = lazy.shared(("tile2", op.name, w), lambda: self._load_two(lazy, sT, w))
                return two[v - w].to(cutlass.Float32)
            c = lazy.local(v, 1, sub=True)
            return sT.at(lazy.local(v, 0), c // 2 if pair else c)[0].to(cutlass.Float32)
        # element by element; clamped indices: out-of-range elements are computed but never stored
        return t[cutlass.min(row(), lazy.M - 1), cutlass.min(col(), n_cols - 1), lazy.coord(v, 2)].to(
            cutlass.Float32)

    @staticmethod
    def _load_two(lazy, sT, w):
        """Columns c, c + 1 (c even) of register w's row in the ring buffer, as one vector read (the two lie in
        one 16-byte chunk of the swizzled layout, so they stay adjacent)."""
        import cutlass.cute as cute
        f = cute.make_rmem_tensor((2,), sT.view.dtype)
        cute.autovec_copy(sT.at(lazy.local(w, 0), lazy.local(w, 1, sub=True), 2), f)
        return f


VEC_M, VEC_N, SCALAR, TILE = _VecM(), _VecN(), _Scalar(), _TileMN()
KIND_OF = {k.name: k for k in (VEC_M, VEC_N, SCALAR, TILE)}  # declared string -> kind object


class ReduceAxis:
    """A reduction axis: ``"n"`` (per row, reduced along N: a VecM result) or ``"m"`` (per column: a VecN result).
    The kernel writes one partial per (row, N-tile) or (column, warp of an M-tile); ``coda.gemm`` finishes them."""

    def __init__(self, axis: str, label: str):
        self.axis, self.label = axis, label

    def __repr__(self):
        return f"<reduction axis {self.axis!r} ({self.label})>"

    def length(self, epi, M: int, N: int) -> int:
        """Values of the finished reduction for M rows and an accumulator of N columns (N / 2 pairs)."""
        return M if self.axis == "n" else epi.operand_cols(N)

    def partials(self, epi, cfg, M: int, N: int) -> tuple:
        """(tiles, length) of the kernel's partial buffer: one partial per N-tile of each row, or per warp of each
        M-tile of each column (column pair)."""
        tiles = -(-N // cfg.tile_n) if self.axis == "n" else -(-M // cfg.tile_m) * cfg.warps_per_tile
        return tiles, self.length(epi, M, N)

    @staticmethod
    def kernel_slots(cfg, M: int) -> int:
        """Per-column partial slots the kernel's tile grid can address: the M-tiles rounded up to whole clusters
        (the schedule pads nothing else, ``kernels/schedule.py``), times the warps of a tile."""
        tiles_m = -(-M // cfg.tile_m)
        return -(-tiles_m // cfg.cluster_m) * cfg.cluster_m * cfg.warps_per_tile

    def inside(self, lazy, v):
        """Kernel: register v's element lies inside the output along the reduced axis (padded columns for "n",
        padded rows for "m" contribute the neutral element)."""
        return lazy.coord(v, 1) < lazy.N if self.axis == "n" else lazy.coord(v, 0) < lazy.M


PER_ROW, PER_COL = ReduceAxis("n", "per row"), ReduceAxis("m", "per column")
AXIS_OF = {"n": PER_ROW, "m": PER_COL}
