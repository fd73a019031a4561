"""Evaluate a sympy epilogue expression with a backend: CuTeDSL arithmetic (kernel) or torch ops (reference).

One walker (:func:`evaluate`) maps every node kind the epilogue DSL produces -- and every node sympy's derivatives
produce (Heaviside, sign, Piecewise, relationals) -- onto a small backend interface, so the kernel and the reference
cannot disagree about what an expression means. Conventions shared by both backends: Heaviside(0) = 1/2
(the derivative of min/max at a tie is split between the two sides, as torch.minimum/maximum do; relu at exactly 0
therefore gets 1/2), sign(0) = 0 (abs at 0 has derivative 0, as in torch), max/min propagate NaN.
"""
from __future__ import annotations

import functools
import math

import sympy as sp

from .dsl import CastBF16, CastF16, ProductAngle, Sigmoid
from .dsl_segment import SegmentSum, torch_segment_sum

TWO_PI = 2.0 * math.pi


def evaluate(e, leaves: dict, B, memo: dict):
    """Value of sympy expression ``e`` given ``leaves`` {Symbol: value} on backend ``B``."""
    if e in leaves:
        return leaves[e]
    if e in memo:
        return memo[e]
    r = _node(e, leaves, B, memo)
    memo[e] = r
    return r


def _node(e, leaves, B, memo):
    ev = lambda x: evaluate(x, leaves, B, memo)  # noqa: E731
    if e is sp.true or e is sp.false:
        return B.boolean(bool(e))
    if e.is_Symbol:
        raise KeyError(f"no value for symbol {e}")
    if e.is_number and not isinstance(e, (sp.core.relational.Relational, sp.logic.boolalg.Boolean)):
        # a number; a constant expression (1 / 0.0, log(-0.25), 0.0 * exp(1000.0), ...) is evaluated node by node
        # as written, in the backend's precision, as torch would (inf, NaN); sympy's exact value would differ
        if not e.args:
            return B.const(_num(e))
    if isinstance(e, sp.Add):
        return _fold(B.add, e.args, ev)
    if isinstance(e, sp.Mul):
        num, den = [], []
        for a in e.args:
            if isinstance(a, sp.Pow) and a.exp.is_Integer and a.exp < 0:
                den.append(a.base if a.exp == -1 else sp.Pow(a.base, -a.exp, evaluate=False))
            else:
                num.append(a)
        r = _fold(B.mul, num, ev) if num else None
        if den:
            d = _fold(B.mul, den, ev)
            r = B.div(B.const(1.0), d) if r is None else B.div(r, d)
        return r
    if isinstance(e, sp.Pow):
        base, ex = e.args
        if ex.is_Integer:
            n = int(ex)
            if n < 0:
                return B.div(B.const(1.0), _powi(ev(base), -n, B))
            return _powi(ev(base), n, B)
        if ex == sp.Rational(1, 2):
            return B.sqrt(ev(base))
        if ex == sp.Rational(-1, 2):
            return B.rsqrt(ev(base))
        if base == 2:
            return B.exp2(ev(ex))
        if base.is_number:  # c ** x = exp2(x * log2(c))
            return B.exp2(B.mul(ev(ex), B.const(math.log2(_num(base)))))
        if ex.is_number:  # x ** c (non-integer c) = exp2(c * log2(x))
            return B.exp2(B.mul(B.const(_num(ex)), B.log2(ev(base))))
        raise NotImplementedError(f"power with a traced exponent and base: {e}")
    if isinstance(e, sp.exp):
        return B.exp(ev(e.args[0]))
    if isinstance(e, sp.log):
        return B.log(ev(e.args[0]))
    if isinstance(e, sp.tanh):
        return B.tanh(ev(e.args[0]))
    if isinstance(e, (sp.sin, sp.cos)):
        a = e.args[0]
        if isinstance(a, ProductAngle):  # an angle B.angle reduced to [-pi, pi]: the backend's reduced-range form
            return (B.sin_reduced if isinstance(e, sp.sin) else B.cos_reduced)(ev(a))
        return (B.sin if isinstance(e, sp.sin) else B.cos)(ev(a))
    if isinstance(e, ProductAngle):  # the reduced angle of sin / cos of a product (coda.dsl.with_product_angles)
        # numbers merged into the coefficient (exactly: 1/3, 2*pi); a constant expression without a finite float in
        # sympy (tanh(sigmoid(0.0)), built unevaluated; 1 / 0.0) is a factor evaluated as written, like a traced one
        nums, factors = [], []
        for a in e.args:
            (nums if a.is_number and _finite_float(a) else factors).append(a)
        return B.angle(float(sp.Mul(*nums)), [ev(a) for a in factors])
    if isinstance(e, sp.erf):
        return B.erf(ev(e.args[0]))
    if isinstance(e, Sigmoid):
        return B.sigmoid(ev(e.args[0]))
    if isinstance(e, CastBF16):
        return B.cast(ev(e.args[0]), "bf16")
    if isinstance(e, CastF16):
        return B.cast(ev(e.args[0]), "f16")
    if isinstance(e, sp.Abs):
        return B.abs(ev(e.args[0]))
    if isinstance(e, (sp.Max, sp.Min)):
        return _fold(B.max if isinstance(e, sp.Max) else B.min, e.args, ev)
    if isinstance(e, sp.Heaviside):  # H(0) = 1/2 (sympy's default): a tie of min/max splits the gradient
        x = ev(e.args[0])
        h0 = _num(e.args[1]) if len(e.args) > 1 else 0.5
        zero = B.const(0.0)
        return B.select(B.cmp(">", x, zero), B.const(1.0), B.select(B.cmp("==", x, zero), B.const(h0), zero))
    if isinstance(e, sp.sign):
        x = ev(e.args[0])
        zero = B.const(0.0)
        return B.select(B.cmp(">", x, zero), B.const(1.0), B.select(B.cmp("<", x, zero), B.const(-1.0), zero))
    if isinstance(e, sp.Piecewise):
        r = None
        for val, cond in reversed(e.args):
            if r is None:
                r = ev(val)  # the last piece's condition is True by construction
                if cond is not sp.true:
                    r = B.select(ev(cond), r, B.const(math.nan))
            else:
                r = B.select(ev(cond), ev(val), r)
        return r
    if isinstance(e, sp.core.relational.Relational):
        op = {sp.StrictLessThan: "<", sp.LessThan: "<=", sp.StrictGreaterThan: ">", sp.GreaterThan: ">=",
              sp.Equality: "==", sp.Unequality: "!="}[type(e)]
        return B.cmp(op, ev(e.lhs), ev(e.rhs))
    if isinstance(e, (sp.And, sp.Or)):
        return _fold(B.and_ if isinstance(e, sp.And) else B.or_, e.args, ev)
    if isinstance(e, SegmentSum):
        return B.segment_sum(ev(e.args[0]), int(e.args[1]))
    if isinstance(e, sp.ITE):
        return B.select(ev(e.args[0]), ev(e.args[1]), ev(e.args[2]))
    if isinstance(e, sp.Not):
        return B.not_(ev(e.args[0]))
    raise NotImplementedError(f"CODA cannot evaluate {type(e).__name__}: {e}")


def _finite_float(e) -> bool:
    """Whether sympy gives the constant expression ``e`` a finite float."""
    try:
        return math.isfinite(float(e))
    except Exception:  # noqa: BLE001 - no float (TypeError), 1 / 0.0 (ZeroDivisionError), overflow, ...
        return False


def _fold(f, args, ev):
    """f(...f(f(a0, a1), a2)..., an) over the evaluated args, left to right."""
    return functools.reduce(f, (ev(a) for a in args))


def _num(e) -> float:
    if e is sp.oo:
        return math.inf
    if e is -sp.oo:
        return -math.inf
    if e is sp.nan:
        return math.nan
    return float(e)


def _powi(x, n: int, B):
    """x ** n (n >= 0) by repeated squaring."""
    if n == 0:
        return B.const(1.0)
    r, p = None, x
    while n:
        if n & 1:
            r = p if r is None else B.mul(r, p)
        n >>= 1
        if n:
            p = B.mul(p, p)
    return r


class TorchOps:
    """fp32 torch ops (the reference). Constants and booleans are 0-d tensors on ``like``'s device made by a fill
    (``torch.full``), not ``torch.tensor``: on a GPU the latter is a host-to-device copy that synchronizes the
    stream, and this path runs inside training steps (ops.linear's elementwise backward, the CE tail)."""

    def __init__(self, like):
        import torch
        self.t = torch
        self.like = like

    def const(self, v): return self.t.full((), v, dtype=self.like.dtype, device=self.like.device)
    def boolean(self, v): return self.t.full((), bool(v), dtype=self.t.bool, device=self.like.device)
    def add(self, a, b): return a + b
    def mul(self, a, b): return a * b
    def div(self, a, b): return a / b
    def sqrt(self, x): return self.t.sqrt(x)
    def rsqrt(self, x): return self.t.rsqrt(x)
    def exp(self, x): return self.t.exp(x)
    def exp2(self, x): return self.t.exp2(x)
    def log(self, x): return self.t.log(x)
    def log2(self, x): return self.t.log2(x)
    def tanh(self, x): return self.t.tanh(x)
    def sin(self, x): return self.t.sin(x)
    def cos(self, x): return self.t.cos(x)
    sin_reduced, cos_reduced = sin, cos  # of an angle already reduced to [-pi, pi] (``angle``)
    def erf(self, x): return self.t.erf(x)
    def sigmoid(self, x): return self.t.sigmoid(x)
    def abs(self, x): return self.t.abs(x)
    def max(self, a, b): return self.t.maximum(a, b)
    def min(self, a, b): return self.t.minimum(a, b)
    def select(self, c, a, b): return self.t.where(c, a, b)
    def and_(self, a, b): return a & b
    def or_(self, a, b): return a | b
    def not_(self, a): return ~a

    def cmp(self, op, a, b):
        return {"<": self.t.lt, "<=": self.t.le, ">": self.t.gt, ">=": self.t.ge, "==": self.t.eq,
                "!=": self.t.ne}[op](a, b)

    def cast(self, x, dt):
        return x.to(self.t.bfloat16 if dt == "bf16" else self.t.float16).to(x.dtype)

    def segment_sum(self, x, size: int):
        return torch_segment_sum(self.t, x, size, self.like.shape)

    def angle(self, coef: float, factors):
        """``coef * prod(factors)`` reduced to about [-pi, pi]: product and reduction in float64 (a product of two
        fp32 values is exact there; the float64 remainder is off by ~1e-16 |p|, 1e-11 rad at p = 1.3e5), then
        rounded once to the reference's dtype. The kernel gets within a few 1e-7 rad of this (reduce_angle)."""
        p = functools.reduce(lambda a, b: a * b, [self.t.as_tensor(f).double() for f in factors]) * coef
        return (p - TWO_PI * self.t.round(p / TWO_PI)).to(self.like.dtype)


class CuteOps:
    """CuTeDSL fp32 scalar arithmetic, emitted while the GEMM kernel is traced."""

    def __init__(self, fastmath: bool = False):
        import cutlass
        import cutlass.cute as cute
        self.c, self.cute = cutlass, cute
        self.F = cutlass.Float32
        self.fastmath = fastmath  # DslEpilogue(fastmath=True): div.approx.ftz.f32 and sqrt.approx.ftz.f32

    def const(self, v): return self.F(v)
    def boolean(self, v): return self.c.Boolean(v)

    def segment_sum(self, x, size):  # the kernel's sums are leaves from the consumer epilogue's pre-pass
        raise NotImplementedError("coda.segment_sum: the sums reach the kernel as leaves formed by the consumer "
                                  "epilogue's pre-pass (coda/kernels/segment.py), which this kernel did not run")
    def add(self, a, b): return a + b
    def mul(self, a, b): return a * b
    def div(self, a, b): return self.cute.math.div(a, b, approx=True, ftz=True) if self.fastmath else a / b

    def sqrt(self, x):
        return self.cute.math.sqrt(x, approx=True, ftz=True) if self.fastmath else self.cute.math.sqrt(x)

    def rsqrt(self, x): return self.cute.math.rsqrt(x)
    def exp(self, x): return self.cute.math.exp(x, fastmath=True)
    def exp2(self, x): return self.cute.math.exp2(x, fastmath=True)
    def log(self, x): return self.cute.math.log(x, fastmath=True)
    def log2(self, x): return self.cute.math.log2(x, fastmath=True)
    def tanh(self, x): return self.cute.math.tanh(x)
    def erf(self, x): return self.cute.math.erf(x)
    def abs(self, x): return self.cute.math.abs(x)
    def max(self, a, b): return self.cute.arch.fmax(a, b, nan=True)
    def min(self, a, b): return self.cute.arch.fmin(a, b, nan=True)
    def select(self, c, a, b): return self.c.select_(c, a, b)
    def and_(self, a, b): return a & b
    def or_(self, a, b): return a | b
    def not_(self, a): return self.c.select_(a, self.c.Boolean(False), self.c.Boolean(True))

    def sigmoid(self, x):
        # rcp.approx (1 ulp) instead of an IEEE division: 1 + exp(-x) >= 1, so no cancellation; -> 0 for x -> -inf
        return self.cute.arch.rcp_approx(self.F(1.0) + self.cute.math.exp(-x, fastmath=True))

    def cmp(self, op, a, b):
        if op == "<":
            return a < b
        if op == "<=":
            return a <= b
        if op == ">":
            return a > b
        if op == ">=":
            return a >= b
        if op == "==":
            return a == b
        return a != b

    def cast(self, x, dt):
        t = self.c.BFloat16 if dt == "bf16" else self.c.Float16
        return x.to(t).to(self.F)

    def sin(self, x): return self._sincos(x)[0]
    def cos(self, x): return self._sincos(x)[1]

    def _sincos(self, x):
        """Full-precision sin and cos (libdevice sincosf, not sin.approx), computed once per argument: the two
        share one range reduction (half the code of separate sin / cos calls)."""
        memo = self.__dict__.setdefault("_sincos_memo", {})
        hit = memo.get(id(x))
        if hit is None or hit[0] is not x:
            hit = memo[id(x)] = (x, *self.cute.math.sincos(x))
        return hit[1:]

    # of an angle :meth:`angle` reduced to [-pi, pi] (RoPE's): the SFU's sin.approx / cos.approx (absolute error
    # <= 2^-20.9 there, PTX ISA; one instruction each) instead of sincosf's ~40, which made RoPE's K = 0 backward
    # pass instruction-bound (836 GB/s on the H100, session 20)
    def sin_reduced(self, x): return self.cute.math.sin(x, approx=True)
    def cos_reduced(self, x): return self.cute.math.cos(x, approx=True)

    def angle(self, coef: float, factors):
        return reduce_angle(self, coef, factors)  # see reduce_angle: two-float product + Cody-Waite reduction

    def mul_rn(self, a, b): return self.cute.math.mul(a, b, rounding=self.cute.math.RoundingMode.NEAREST_EVEN)
    def add_rn(self, a, b): return self.cute.math.add(a, b, rounding=self.cute.math.RoundingMode.NEAREST_EVEN)
    def fma(self, a, b, c): return self.cute.math.fma(a, b, c)
    def rint(self, x): return self.cute.math.roundeven(x)  # cvt.rni (round to nearest even)


def reduce_angle(B, coef: float, factors):
    """``coef * prod(factors)`` reduced modulo 2*pi with fp32 arithmetic of backend ``B`` (``const``, ``mul_rn``,
    ``add_rn``, ``fma``, ``rint``), accurate where a plain fp32 product is not. The kernel runs it through
    ``CuteOps``; tests/test_rope.py runs the same code on a float32 emulation to measure it. Products and the sum
    are ``mul.rn`` / ``add.rn``: PTX's plain ``mul.f32`` may be contracted into an FMA by ptxas, which would break
    the error-free product.

    Why: RoPE's angle is pos * freq with pos up to 131072; the fp32 product alone is rounded by up to half an ulp
    (2^-8 = 0.0039 rad for products just below 131072), and ``sin`` of that rounded value inherits the error however
    exactly ``sin`` itself is computed. So the product is carried unrounded as two floats and reduced before it is rounded:

    1. exact product (FMA two-product): ``hi = x * y``, ``lo = fma(x, y, -hi)``, hi + lo == x * y exactly. More
       factors fold in the same way (``lo = fma(lo, z, fma(hi, z, -hi*z))``); a numeric coefficient c (e.g. 2*pi
       or 1/2 that sympy merged into the product) is split at trace time into fp32 c_hi + c_lo and applied the same
       way, so constants do not bring the error back.
    2. Cody-Waite reduction: ``k = rint(hi / 2pi)``, ``r = fma(-k, C1, hi)``, ``r = fma(-k, C2, r)``, ``r += lo``,
       C1 = fp32(2pi), C2 = fp32(2pi - C1). The first FMA is exact (for |hi| >= 4, hi and k*C1 are multiples of
       ulp(C1) = 2^-21 and their difference is below ~pi, so it fits in 24 bits), the other two round once each on
       a value below ~pi (<= 1.2e-7 rad each), and C1 + C2 misses 2pi by ~1e-15 (~1e-11 rad at k = 2e4). Total:
       a few 1e-7 rad for |angle| up to ~1e6 rad. Measured on every position 0..131072 x Llama's 64 frequencies
       (tests/test_rope.py, float32 emulation of this code): max |error| of cos / sin 2.4e-7, vs 3.9e-3 for sin /
       cos of the plain fp32 product.
    ``sin`` / ``cos`` then get r (the SFU approximations, ``CuteOps.sin_reduced``). A non-finite product gives NaN,
    as sin(inf) does."""
    hi, lo = factors[0], None
    neg1 = B.const(-1.0)
    for f in factors[1:]:
        p = B.mul_rn(hi, f)
        e = B.fma(hi, f, B.mul_rn(p, neg1))
        lo, hi = (e if lo is None else B.fma(lo, f, e)), p
    if coef != 1.0:
        c_hi = _f32(coef)
        c_lo = _f32(coef - c_hi)
        p = B.mul_rn(hi, B.const(c_hi))
        e = B.fma(hi, B.const(c_hi), B.mul_rn(p, neg1))
        if c_lo != 0.0:
            e = B.fma(hi, B.const(c_lo), e)
        lo, hi = (e if lo is None else B.fma(lo, B.const(c_hi), e)), p
    mk = B.mul_rn(B.rint(B.mul_rn(hi, B.const(_INV_2PI))), neg1)  # -k
    r = B.fma(mk, B.const(_C1), hi)
    r = B.fma(mk, B.const(_C2), r)
    return r if lo is None else B.add_rn(r, lo)


def _f32(v: float) -> float:
    """``v`` rounded to the nearest fp32 (as a Python float)."""
    import struct
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


_C1 = _f32(TWO_PI)
_C2 = _f32(TWO_PI - _C1)
_INV_2PI = _f32(1.0 / TWO_PI)
