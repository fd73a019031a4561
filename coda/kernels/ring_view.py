"""Shared-memory buffers that ``GemmSm90``'s epilogue reads or writes element by element -- the TileMN operands'
TMA rings and the half-width / 1 -> 2 outputs' staging -- addressed with the swizzle applied once per thread.

The buffers are allocated with their swizzle in the pointer (``SmemAllocator.allocate_tensor(swizzle=)``: it acts
on the byte address, as TMA's swizzle modes do), so indexing them applied the swizzle to each access's whole
address, buffer base included: three integer instructions (add, shift, xor) a 32-bit access, recomputed for every
buffer. The buffers start at multiples of 1024 bytes, above every bit the swizzle reads or writes (the 32 / 64 /
128-byte modes: bits 4-9), so the swizzle of an element's byte offset inside a buffer is the same in each:
:class:`RingBuffer` applies it to that offset alone -- a function of the thread and the register, which the
compiler then computes once and shares across sub-tiles, tiles and operands of the same layout -- and adds the
buffer's address after.
CPU, sm_90a SASS per accumulator element of the epilogue (``docs/experiments/s45_epi_sass.py``): the SwiGLU
backward 33.0 -> 29.1, the SwiGLU forward (half-width outputs) 9.8 -> 7.6, the norm backward + residual 23.5 ->
22.3; H200 step A/B in docs/NOTES.md (session 45).
"""
import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm


def swizzle(off, bits: int, base: int, shift: int):
    """CuTe's ``Swizzle<bits, base, shift>`` of byte offset ``off`` (int or Int32): bits [base + shift, + bits)
    xor-ed into bits [base, + bits)."""
    return off ^ ((off & (((1 << bits) - 1) << (base + shift))) >> shift)


def check(stride: int, bits: int, base: int, shift: int) -> None:
    """ValueError unless the swizzle of an offset inside a buffer is the same in every buffer: buffers ``stride``
    bytes apart, a multiple of 1024, and a swizzle whose bits all lie below bit 10."""
    if stride % 1024 or bits + base + shift > 10 or shift <= 0:
        raise ValueError(f"RingView: buffers {stride} bytes apart with Swizzle<{bits}, {base}, {shift}>: the "
                         "swizzle of an offset inside a buffer would depend on the buffer")


def _opaque(x):
    """``x`` through an empty inline-asm move: LLVM may not move the addition of the buffer's address into the
    swizzle (its instcombine re-associated ``base + swizzle(off)`` into ``swizzle(base + off)``, the per-read form
    this code removes); pure, so still shared and hoisted like any value."""
    return cutlass.Int32(llvm.inline_asm(cutlass.Int32.mlir_type, [cutlass.Int32(x).ir_value()], "mov.b32 $0, $1;",
                                         "=r,r"))


class RingView:
    """A ring of equal shared-memory buffers (``sT``: allocated with layout ``sl.outer`` (rows, cols, buffers) and
    swizzle ``sl.inner`` in the pointer), addressed as the module docstring says."""

    def __init__(self, sT, sl):
        self.dtype, self.outer, self.sw = sT.element_type, cute.slice_(sl.outer, (None, None, 0)), sl.inner
        self.esize = sT.element_type.width // 8
        self.stride = sl.outer((0, 0, 1)) * self.esize  # bytes between buffers
        check(self.stride, self.sw.num_bits, self.sw.num_base, self.sw.num_shift)
        self.base = sT.iterator.toint()

    def swizzled(self, off):
        return swizzle(off, self.sw.num_bits, self.sw.num_base, self.sw.num_shift)

    def buffer(self, b):
        return RingBuffer(self, self.base + b * self.stride)


class RingBuffer:
    """One buffer of a :class:`RingView`: ``at(row, col, n)`` is the n elements from (row, col) as a tensor (n
    adjacent: the caller keeps them inside one 16-byte chunk of the swizzle, where they stay adjacent)."""

    def __init__(self, view, addr):
        self.view, self.addr = view, addr

    def at(self, row, col, n=1):
        v = self.view
        off = _opaque(v.swizzled(cute.crd2idx((row, col), v.outer) * v.esize))
        ptr = cute.make_ptr(v.dtype, self.addr + off, cute.AddressSpace.smem, assumed_align=n * v.esize)
        return cute.make_tensor(ptr, cute.make_layout(n))
