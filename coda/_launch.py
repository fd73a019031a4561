"""Launch plans: what ``coda.gemm`` caches so that a repeated call skips everything but the pointers.

A compiled CuTeDSL function is called with cute tensors (``from_dlpack(t).mark_layout_dynamic(...)``, about 6 us
each) that its argument marshalling turns into pointers to *memref descriptors*; with the kernel's 16 parameters
that marshalling costs about 30 us more per call (measured on this machine's CPU, see docs/NOTES.md). A descriptor
is the C struct the DSL documents for AOT export (``base_dsl/export/c_header_generator.py``)::

    struct { void *data; int32_t dynamic_shapes[n]; int64_t dynamic_strides[m]; }

For one (shapes, strides, dtypes, epilogue, config) everything in those structs but ``data`` is fixed, so a
:class:`Plan` owns one struct per tensor, built once, and each call writes the data pointers and the stream handle
into them and calls the compiled host function directly (``JitCompiledFunction.run_compiled_program``).

A plan is only used after it was checked against the DSL's own marshalling of the first call's arguments: every
struct's fields (data pointer, shapes, strides; not the padding bytes, which hold whatever the DSL's allocation
held) must equal the descriptor ``generate_execution_args`` built, and the argument list must have the same length
and order. If anything differs (a future DSL changes the layout), no plan is made and ``coda.gemm``
keeps the ordinary path. Plans hold no reference to any tensor of the call that built them.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Optional, Sequence

import torch

_desc_classes: dict = {}


class PlanError(RuntimeError):
    """The DSL's argument marshalling is not what a plan reproduces (no plan is made)."""


def descriptor_class(n_shapes: int, n_strides: int, shape64: bool = False, stride64: bool = True):
    key = (n_shapes, n_strides, shape64, stride64)
    cls = _desc_classes.get(key)
    if cls is None:
        fields = [("data", ctypes.c_void_p)]
        if n_shapes:
            fields.append(("shapes", (ctypes.c_int64 if shape64 else ctypes.c_int32) * n_shapes))
        if n_strides:
            fields.append(("strides", (ctypes.c_int64 if stride64 else ctypes.c_int32) * n_strides))
        cls = type(f"MemrefDesc_{n_shapes}_{n_strides}", (ctypes.Structure,), {"_fields_": fields})
        _desc_classes[key] = cls
    return cls


def fields(d) -> tuple:
    """(data, shapes, strides) of a descriptor struct: what the compiled function reads of it."""
    return d.data, tuple(getattr(d, "shapes", ())), tuple(getattr(d, "strides", ()))


def make_descriptor(view: torch.Tensor, shapes_mask: Sequence[int], strides_mask: Sequence[int],
                    stride64: bool = True):
    """The memref descriptor of ``view`` (the exact tensor handed to ``from_dlpack``) for the given dynamic masks."""
    shapes = [s for s, dyn in zip(view.shape, shapes_mask) if dyn]
    strides = [s for s, dyn in zip(view.stride(), strides_mask) if dyn]
    d = descriptor_class(len(shapes), len(strides), False, stride64)()
    d.data = view.data_ptr()
    for i, s in enumerate(shapes):
        d.shapes[i] = s
    for i, s in enumerate(strides):
        d.strides[i] = s
    return d


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_handle(device_index: int) -> int:
    """The raw handle of the current CUDA stream of ``device_index`` (what ``torch.cuda.current_stream`` gives;
    through ``torch._C._cuda_getCurrentRawStream`` when available, which builds no Stream object)."""
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


class Plan:
    """One launch of one compiled kernel for fixed shapes/strides/dtypes: descriptor structs + a stream slot.

    ``cute_args``: what the compiled function was (or would be) called with, ``[mA, mB, mD, stream, *xs]``;
    ``views``: the torch tensors behind each cute tensor, in the same order without the stream. Raises
    :class:`PlanError` if the structs built here differ from the DSL's marshalling of ``cute_args``.
    """

    STREAM_INDEX = 3

    def __init__(self, fn: Any, cute_args: Sequence[Any], views: Sequence[torch.Tensor], stream: int):
        # what JitCompiledFunction.__call__ does besides marshalling: workspace arguments and PyIR re-entry checks
        if getattr(fn, "total_added_arguments", 0) or getattr(fn, "_pyir_spec", None) is not None:
            raise PlanError("the compiled function takes workspace arguments or checks re-entry specs")
        exe_args, _keep = fn.generate_execution_args(*cute_args)
        tensors = [t for i, t in enumerate(cute_args) if i != self.STREAM_INDEX]
        if len(exe_args) != len(cute_args) or len(tensors) != len(views):
            raise PlanError(f"the compiled function takes {len(exe_args)} pointers for {len(cute_args)} arguments")
        self.descs = []
        for i, (t, v) in enumerate(zip(tensors, views)):
            d = make_descriptor(v, t.dynamic_shapes_mask, t.dynamic_strides_mask,
                                stride64=not getattr(t, "_use_32bit_stride", False))
            j = i if i < self.STREAM_INDEX else i + 1
            # field by field, not byte by byte: the struct's padding (after an odd number of int32 shapes) is
            # whatever the DSL's allocation held, and no callee reads it
            theirs, ours = fields(type(d).from_address(exe_args[j])), fields(d)
            if theirs != ours:
                raise PlanError(f"descriptor of argument {j} differs from the DSL's: {theirs} vs {ours}")
            self.descs.append(d)
        theirs = ctypes.c_void_p.from_address(exe_args[self.STREAM_INDEX]).value or 0
        if theirs != stream:
            raise PlanError(f"stream argument: {theirs:#x} vs {stream:#x}")
        self.stream = ctypes.c_void_p(stream)
        args = [ctypes.c_void_p(ctypes.addressof(d)) for d in self.descs]
        args.insert(self.STREAM_INDEX, ctypes.c_void_p(ctypes.addressof(self.stream)))
        self.exe_args = args
        self.fn = fn
        self.lock = threading.Lock()
        self.run = fn.run_compiled_program  # replaced by tests / the CPU micro-benchmark
        # set by coda.gemm: the validated problem, config, epilogue and byte extents for the overlap check
        self.prob = self.cfg = self.epi = None
        self.extents: tuple = ()
        self.device_index = 0
        self.has_epi_args = len(views) > 3

    def fill(self, ptrs: Sequence[int], stream: int) -> None:
        for d, p in zip(self.descs, ptrs):
            d.data = p
        self.stream.value = stream

    def launch(self, ptrs: Sequence[int], stream: int) -> None:
        """Write the data pointers (A, B, D, epilogue tensors) and the stream, then call the host function."""
        with self.lock:  # the structs are shared: fill + call must not interleave between threads
            self.fill(ptrs, stream)
            self.run(self.exe_args)


def tensor_sig(t: torch.Tensor) -> tuple:
    # requires_grad: from_dlpack refuses such tensors on the full path, so a plan must not accept them either
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


def plan_key(a: Any, b: Any, epi_key: Any, out: Any, out_dtype: Any, config: Any, operands: dict) -> Optional[tuple]:
    """Everything that decides a launch except the data pointers; None if the call is not plannable."""
    if type(a) is not torch.Tensor or type(b) is not torch.Tensor:
        return None
    if out is not None and type(out) is not torch.Tensor:
        return None
    ops = ()
    if operands:
        items = []
        for name, v in operands.items():
            if isinstance(v, torch.Tensor):
                items.append((name, tensor_sig(v)))
            elif type(v) in (int, float):
                items.append((name, type(v)))
            else:
                return None
        ops = tuple(items)
    return (tensor_sig(a), tensor_sig(b), None if out is None else tensor_sig(out), out_dtype, epi_key, config, ops)


def byte_extent(t: torch.Tensor) -> int:
    """Bytes spanned by ``t`` from its data pointer (0 if it has no elements)."""
    if t.numel() == 0:
        return 0
    last = sum((sz - 1) * st for sz, st in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def overlap(p0: int, n0: int, p1: int, n1: int) -> bool:
    return n0 > 0 and n1 > 0 and p0 < p1 + n1 and p1 < p0 + n0
