"""``@coda.epilogue``: a plain Python function over the accumulator becomes a fused GEMM epilogue.

Tracing
    The decorated function is called once, at decoration time, with symbolic values: ``acc`` (the fp32
    accumulator element), one symbol per annotated operand and, on request, ``coda.row()`` / ``coda.col()``. The
    arithmetic builds a sympy expression per output, unevaluated: what was written, no sympy rewrites (they are not
    IEEE-safe), only the two arguments of ``a + b``, ``a * b``, ... in a canonical order. The expressions, operand
    names/kinds, outputs and reductions form the semantic key of the compile cache.

Three programs come out of one trace
    - the kernel code: :meth:`DslEpilogue.visit` evaluates the expressions with CuTeDSL arithmetic while the GEMM is
      being traced (each distinct subexpression evaluated once);
    - the torch reference: :meth:`DslEpilogue.reference` evaluates the same expressions with torch ops;
    - the backward: :func:`coda.autodiff.backward_epilogue` differentiates the expressions with sympy.
    The two evaluations read ``sin`` / ``cos`` of a product through :class:`ProductAngle` (an exactly formed,
    reduced angle; :func:`with_product_angles`), which is not part of the traced math, the key or the derivative.

Operand kinds are declared by annotation (never guessed from shapes): ``VecM`` (one value per output row),
``VecN`` (one per column), ``Scalar`` (read at run time from a Python number or a 0-d/1-element tensor), ``TileMN``
(an M x N tensor such as a residual).
"""
from __future__ import annotations

import inspect
import math
import re
import sys
import threading
from typing import Callable, Optional

import sympy as sp

from .dsl_nodes import _add, _div, _mul, _neg, _node, CastBF16, CastF16, Piecewise, Sigmoid, with_product_angles
from .dsl_nodes import ProductAngle, rebuild  # noqa: F401 (re-exported: coda._eval, coda.autodiff import them here)
from .kernels.epilogue import ODD_OUT, ODD_SUFFIX, Epilogue, Operand, Reduction, odd_key
from .kernels.operand_kinds import SCALAR, TILE, VEC_M, VEC_N

__all__ = ["VecM", "VecN", "Scalar", "TileMN", "epilogue", "row", "col", "reduce_n", "reduce_m", "exp", "exp2", "log",
           "log2", "sqrt", "rsqrt", "sigmoid", "tanh", "sin", "cos", "silu", "gelu", "relu", "abs", "minimum",
           "maximum", "where", "cast", "EpilogueError", "DslEpilogue"]


# ----------------------------------------------------------------------------------------------- operand kinds
# annotations only: what a kind means (shapes, checks, kernel loads) is its object in coda/kernels/operand_kinds.py
class _Kind:
    kind = ""


class VecM(_Kind):
    """One value per output row (length M, or (L, M) when batched)."""
    kind = VEC_M.name


class VecN(_Kind):
    """One value per output column (length N)."""
    kind = VEC_N.name


class Scalar(_Kind):
    """One number, read at run time (a Python number or a 1-element tensor)."""
    kind = SCALAR.name


class TileMN(_Kind):
    """An M x N tensor (e.g. a residual), read at each element."""
    kind = TILE.name


_KINDS = {k: k.kind for k in (VecM, VecN, Scalar, TileMN)}
_BACKWARD_PREFIXES = ("grad_", "value_", "tie_")  # operand names of the backward (coda.autodiff.RESERVED_PREFIXES)


class EpilogueError(TypeError):
    """A decoration-time error in an epilogue function (names the epilogue and the offending line)."""


ACC = sp.Symbol("acc", real=True)
ROW = sp.Symbol("_row", real=True)
COL = sp.Symbol("_col", real=True)


# coda.pairs(acc): the accumulator columns 2j and 2j+1 (one output column j per pair)
ACC_EVEN = sp.Symbol("acc_even", real=True)
ACC_ODD = sp.Symbol("acc_odd", real=True)


def operand_symbol(name: str) -> sp.Symbol:
    return sp.Symbol(f"op_{name}", real=True)




# ----------------------------------------------------------------------------------------------- tracing
_state = threading.local()
_OP_NAMES: dict = {}  # DslEpilogue key -> op_name
_BY_OP_NAME: dict = {}  # op_name -> the first DslEpilogue of that key


def by_op_name(name: str) -> "DslEpilogue":
    """The epilogue program registered under ``DslEpilogue.op_name`` (``coda.ops.linear``'s custom op)."""
    return _BY_OP_NAME[name]


def _tracing():
    t = getattr(_state, "trace", None)
    if t is None:
        raise EpilogueError("coda.row(), coda.col() and the coda math functions are only valid inside an epilogue "
                            "function while @coda.epilogue traces it")
    return t


class _Trace:
    def __init__(self, name: str, code):
        self.name, self.code = name, code
        self.used_pairs = False  # coda.pairs(acc) was called: a pairs epilogue even if the math ignores a value

    def frame(self):
        """The frame of the epilogue function being executed (None if it is not on the stack)."""
        f = sys._getframe(1)
        while f is not None and f.f_code is not self.code:
            f = f.f_back
        return f

    def builtin_compare(self):
        """'max' / 'min' when the epilogue's current instruction is a call of the built-in max / min (which makes
        the truth test of a traced comparison), else None."""
        import dis
        f = self.frame()
        if f is None:
            return None
        ins = next((i for i in dis.get_instructions(f.f_code) if i.offset == f.f_lasti), None)
        if ins is None or not ins.opname.startswith("CALL"):
            return None  # (if / while / and / or / not test in the function's own code)
        m = re.search(r"(?<![\w.])(max|min)\s*\(", _source_line(f))
        if m:
            return m.group(1)
        return next((n for n in ("max", "min") if n in f.f_code.co_names), None)

    def line(self) -> str:
        """The line of the epilogue function being executed (for error messages)."""
        f = self.frame()
        if f is None:
            return f"epilogue {self.name!r}"
        return f"epilogue {self.name!r}, line {f.f_lineno}: {_source_line(f)}"


def _source_line(frame) -> str:
    try:
        import linecache
        return linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    except Exception:  # pragma: no cover - best effort only
        return ""


def _err(msg: str):
    t = getattr(_state, "trace", None)
    where = t.line() if t is not None else "epilogue"
    return EpilogueError(f"{where}: {msg}")


def _expr(x) -> sp.Expr:
    if isinstance(x, Value):
        return x.e
    if isinstance(x, bool):
        return sp.true if x else sp.false
    if isinstance(x, (int, float)):
        if isinstance(x, float) and not math.isfinite(x):
            return sp.oo if x > 0 else (-sp.oo if x < 0 else sp.nan)
        return sp.Integer(x) if isinstance(x, int) else sp.Float(x)
    if isinstance(x, Reduced):
        raise _err("a reduction (coda.reduce_n / reduce_m) can only be returned, not used in arithmetic")
    raise _err(f"unsupported value of type {type(x).__name__} in epilogue arithmetic")


class Value:
    """A traced fp32 value (wraps a sympy expression, built unevaluated: see :func:`_node`). Arithmetic builds
    expressions; truth tests are errors."""
    __slots__ = ("e",)
    __array_priority__ = 1000

    def __init__(self, e):
        self.e = e

    # arithmetic
    def __add__(self, o): return Value(_add(self.e, _expr(o)))
    def __radd__(self, o): return Value(_add(_expr(o), self.e))
    def __sub__(self, o): return Value(_add(self.e, _neg(_expr(o))))
    def __rsub__(self, o): return Value(_add(_expr(o), _neg(self.e)))
    def __mul__(self, o): return Value(_mul(self.e, _expr(o)))
    def __rmul__(self, o): return Value(_mul(_expr(o), self.e))
    def __truediv__(self, o): return Value(_div(self.e, _expr(o)))
    def __rtruediv__(self, o): return Value(_div(_expr(o), self.e))
    def __neg__(self): return Value(_neg(self.e))
    def __pos__(self): return self
    def __abs__(self): return Value(_node(sp.Abs, self.e))

    def __pow__(self, o):
        if isinstance(o, Value) or not float(o).is_integer():
            raise _err("only integer powers are supported (x ** 2, x ** -1); use coda.sqrt / rsqrt / exp / log")
        return Value(sp.Pow(self.e, sp.Integer(int(o)), evaluate=False))

    def __rpow__(self, o):
        raise _err("a number to a traced power: use coda.exp2(x) or coda.exp(x)")

    # comparisons give traced booleans (for coda.where)
    def __lt__(self, o): return Value(sp.Lt(self.e, _expr(o), evaluate=False))
    def __le__(self, o): return Value(sp.Le(self.e, _expr(o), evaluate=False))
    def __gt__(self, o): return Value(sp.Gt(self.e, _expr(o), evaluate=False))
    def __ge__(self, o): return Value(sp.Ge(self.e, _expr(o), evaluate=False))
    def __eq__(self, o): return Value(sp.Eq(self.e, _expr(o), evaluate=False))  # noqa: E704
    def __ne__(self, o): return Value(sp.Ne(self.e, _expr(o), evaluate=False))  # noqa: E704
    def __and__(self, o): return Value(_node(sp.And, self.e, _expr(o)))
    def __or__(self, o): return Value(_node(sp.Or, self.e, _expr(o)))
    def __invert__(self): return Value(sp.Not(self.e, evaluate=False))
    __hash__ = object.__hash__

    def __bool__(self):
        t = getattr(_state, "trace", None)
        fn = t.builtin_compare() if t is not None else None
        if fn is not None:
            raise _err(f"the built-in {fn}() compares traced values, which tracing cannot follow; use "
                       f"coda.{'maximum' if fn == 'max' else 'minimum'}(a, b)")
        raise _err("Python control flow (if / while / and / or / not) on a traced value is not allowed; "
                   "use coda.where(cond, a, b)")

    def __float__(self):
        raise _err("a traced value was passed to a function CODA does not know (e.g. math.* or torch.*); "
                   "use the coda math functions (coda.exp, coda.log, coda.tanh, ...)")

    __int__ = __index__ = __float__

    def __array__(self, *a, **k):
        raise _err("a traced value was passed to numpy; use the coda math functions")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise _err(f"torch.{getattr(func, '__name__', func)} cannot take a traced value; use the coda math "
                   "functions (coda.exp, coda.sigmoid, ...)")

    def __repr__(self):
        return f"Value({self.e})"


class Reduced:
    """The marker returned by :func:`reduce_n` / :func:`reduce_m`: valid only as a returned dict entry."""

    def __init__(self, e, axis: str, op: str):
        self.e, self.axis, self.op = e, axis, op

    def __bool__(self):
        raise _err("a reduction can only be returned")

    def _no(self, *a):
        raise _err("a reduction (coda.reduce_n / reduce_m) can only be returned, not used in arithmetic")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = __neg__ = _no


def _is_bool(e) -> bool:
    from sympy.logic.boolalg import BooleanAtom, BooleanFunction
    return isinstance(e, (sp.core.relational.Relational, BooleanFunction, BooleanAtom))


def _v(x) -> sp.Expr:
    _tracing()
    return _expr(x)


# ----------------------------------------------------------------------------------------------- public math
def row() -> Value:
    """The global row index of the element (as fp32; exact below 2**24)."""
    _tracing()
    return Value(ROW)


def col() -> Value:
    """The global column index of the element (as fp32; exact below 2**24); in a pairs epilogue, the pair's
    index j (columns 2j, 2j+1)."""
    _tracing()
    return Value(COL)


def pairs(acc):
    """``g, u = coda.pairs(acc)``: the accumulator's adjacent columns (2j, 2j+1), which the kernel holds in one
    thread. An epilogue over pairs is indexed by the pair j: its VecN operands have N/2 values, TileMN operands
    are M x N/2, ``coda.col()`` is j. Returning one expression gives an M x N/2 output (gated activations:
    ``silu(g) * u``); returning a tuple of two gives an M x N output with the two values at 2j, 2j+1 (a 2 -> 2
    transform such as a rotation)."""
    t = _tracing()
    if not isinstance(acc, Value) or acc.e != ACC:
        raise _err("coda.pairs takes the accumulator (the epilogue's first argument) itself")
    t.used_pairs = True
    return Value(ACC_EVEN), Value(ACC_ODD)


def exp(x): return Value(sp.exp(_v(x), evaluate=False))
def exp2(x): return Value(sp.Pow(sp.Integer(2), _v(x), evaluate=False))
def log(x): return Value(sp.log(_v(x), evaluate=False))
def log2(x): return Value(_div(sp.log(_v(x), evaluate=False), sp.Float(math.log(2.0))))
def sqrt(x): return Value(sp.Pow(_v(x), sp.S.Half, evaluate=False))
def rsqrt(x): return Value(sp.Pow(_v(x), sp.Rational(-1, 2), evaluate=False))
def sigmoid(x): return Value(Sigmoid(_v(x), evaluate=False))
def tanh(x): return Value(sp.tanh(_v(x), evaluate=False))
def relu(x): return Value(_node(sp.Max, _v(x), sp.S.Zero))
def abs(x): return Value(_node(sp.Abs, _v(x)))  # noqa: A001 - mirrors the builtin on traced values
def minimum(a, b): return Value(_node(sp.Min, _v(a), _v(b)))
def maximum(a, b): return Value(_node(sp.Max, _v(a), _v(b)))


def sin(x):
    """sin(x), full precision in the kernel (not sin.approx). A product argument (``coda.sin(pos * freq)``, also
    with constants merged in) is formed and reduced modulo 2*pi in extended precision (``reduce_angle`` in
    coda/_eval.py): a few 1e-7 rad at angles of 10^5 rad, e.g. RoPE at position 131072, where the plain fp32
    product is off by up to 4e-3 rad. The reference forms such angles in float64."""
    return Value(sp.sin(_v(x), evaluate=False))


def cos(x):
    """cos(x); as :func:`sin` (a sin and cos of the same argument share the angle and one sincos evaluation)."""
    return Value(sp.cos(_v(x), evaluate=False))


def silu(x):
    e = _v(x)
    return Value(_mul(e, Sigmoid(e, evaluate=False)))


def gelu(x, approximate: str = "tanh"):
    """GELU; ``approximate="tanh"`` (default, as in GPT-2 / Gemma) or ``"none"`` (erf)."""
    e = _v(x)
    if approximate == "tanh":
        # x (1 + tanh(u)) / 2 == x sigmoid(2u): the same function, written as one Sigmoid node so the kernel
        # evaluates it with ex2 + rcp (a few instructions) instead of a full-precision tanh (~30)
        inner = _add(e, _mul(sp.Float(0.044715), sp.Pow(e, 3, evaluate=False)))
        return Value(_mul(e, Sigmoid(_mul(sp.Float(2 * math.sqrt(2 / math.pi)), inner), evaluate=False)))
    if approximate == "none":
        half = _mul(sp.Rational(1, 2), e)
        return Value(_mul(half, _add(sp.S.One, sp.erf(_div(e, sp.Float(math.sqrt(2.0))), evaluate=False))))
    raise _err(f"gelu: approximate must be 'tanh' or 'none', got {approximate!r}")


def where(cond, a, b):
    """``a`` where ``cond`` holds, else ``b`` (elementwise; the traced replacement for ``if``)."""
    c = _v(cond)
    if not _is_bool(c):
        raise _err("coda.where: the condition must be a comparison (e.g. acc > 0)")
    return Value(Piecewise((_v(a), c), (_v(b), sp.true)))


def cast(x, dtype):
    """Round to ``dtype`` (torch.bfloat16 / torch.float16) and back to fp32; the derivative passes through."""
    name = str(dtype).replace("torch.", "")
    fn = {"bfloat16": CastBF16, "float16": CastF16, "float32": None}
    if name not in fn:
        raise _err(f"coda.cast: dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
    e = _v(x)
    return Value(e if fn[name] is None else fn[name](e))


REDUCE_N_OPS = ("sum", "max", "logsumexp")


def reduce_n(x, op: str = "sum") -> Reduced:
    """Reduce along N (over a row's columns): one value per row (a VecM result)."""
    if op not in REDUCE_N_OPS:
        raise _err(f"reduce_n: op must be one of {REDUCE_N_OPS}, got {op!r}")
    return Reduced(_v(x), "n", op)


def reduce_m(x, op: str = "sum") -> Reduced:
    """Reduce along M (over a column's rows): one value per column (a VecN result)."""
    if op != "sum":
        raise _err(f"reduce_m: op must be 'sum', got {op!r}")
    return Reduced(_v(x), "m", op)


# ----------------------------------------------------------------------------------------------- the epilogue
def _dag_key(exprs):
    """A canonical serialisation of the expressions as a DAG: each distinct subexpression once, in post-order,
    arguments by index (sympy keeps Add/Mul arguments in canonical order). ``srepr`` prints the tree, which grows
    exponentially with nesting when values are reused (``gelu(gelu(...))``). Also returns the set of symbols."""
    ids: dict = {}
    nodes: list = []

    def visit(e):
        i = ids.get(e)
        if i is None:
            node = sp.srepr(e) if not e.args else (type(e).__name__, tuple(visit(a) for a in e.args))
            i = ids[e] = len(nodes)
            nodes.append(node)
        return i

    roots = tuple(visit(e) for e in exprs)
    return (roots, tuple(nodes)), {e for e in ids if isinstance(e, sp.Symbol)}


class DslEpilogue(Epilogue):
    """An epilogue traced from a Python function (see the module docstring). Also usable as a plain object:
    ``DslEpilogue(name, operands, outputs={"out": expr, ...}, reductions={name: (axis, op, expr)})``."""

    def __init__(self, name: str, operands: tuple, outputs: dict, reductions: dict, fn: Optional[Callable] = None,
                 pair_mode: Optional[str] = None, expand: bool = False, fastmath: bool = False):
        if not outputs and not reductions:
            raise EpilogueError(f"epilogue {name!r}: no outputs and no reductions")
        self.name = name
        self.fn = fn
        self.operands = tuple(operands)
        self.exprs = dict(outputs)
        self.red_specs = dict(reductions)
        # the second values of 2 -> 2 pairs outputs (k and odd_key(k): columns 2j, 2j + 1) are not outputs of their own
        self.outputs = tuple(k for k in outputs if k != "out" and not _is_odd(k, outputs))
        self.stores_out = "out" in outputs  # no "out": nothing M x N stored but the extra outputs
        for o in self.operands:  # an extra output named like a TileMN operand updates it in place (Epilogue.inplace)
            if o.name in self.outputs and o.kind != "tile":
                raise EpilogueError(f"epilogue {name!r}: output {o.name!r} has the name of a {o.kind} operand; only "
                                    "a TileMN operand can be updated in place")
        self.reductions = tuple(Reduction(k, axis, op) for k, (axis, op, _) in reductions.items())
        keys = list(self.exprs) + list(self.red_specs)
        exprs = [self.exprs[k] for k in self.exprs] + [e for (_, _, e) in self.red_specs.values()]
        memo: dict = {}  # sin / cos of products: accurate angle reduction (evaluation only, not in the key)
        # common subexpressions: every distinct node is evaluated once (evaluate's memo over all the outputs); no
        # sympy cse, whose rebuilding re-evaluates the expressions (see _node)
        self._cse_repl = []
        self._cse_out = dict(zip(keys, [with_product_angles(e, memo) for e in exprs]))
        dag, self.symbols = _dag_key(exprs)  # symbols: the leaves visit/reference must provide
        # pairs: None, "half" (one value per pair: M x N/2 outputs) or "full" (two values per pair: M x N)
        # (explicit for derived epilogues whose math may not use the pair values, e.g. a rotation's backward)
        self.pair_mode = pair_mode
        if pair_mode or self.symbols & {ACC_EVEN, ACC_ODD}:
            self.pair_mode = "full" if ODD_OUT in outputs else "half"
            where = f"epilogue {name!r}"
            if ACC in self.symbols:
                raise EpilogueError(f"{where}: uses both coda.pairs(acc) and acc itself; use the pair values")
            if self.pair_mode == "full" and (not self.stores_out or any(odd_key(k) not in outputs
                                                                        for k in self.outputs)):
                raise EpilogueError(f"{where}: a 2 -> 2 pairs epilogue returns two values for the main output and "
                                    "for each extra output")
            if self.pair_mode == "half" and any(_is_odd(k, outputs) for k in outputs):
                raise EpilogueError(f"{where}: an extra output of two values (a pair) needs a main output of two "
                                    "(a 2 -> 2 pairs epilogue)")
        elif any(_is_odd(k, outputs) for k in outputs) and not expand:
            raise EpilogueError(f"epilogue {name!r}: a tuple of two outputs needs coda.pairs(acc)")
        # 1 -> 2 (Epilogue.expand): "out" and ODD_OUT of one accumulator element, stored at columns 2j, 2j + 1
        self.expand = bool(expand)
        self.fastmath = bool(fastmath)  # division and square root by the approximate instructions (CuteOps)
        if self.expand and (self.pair_mode or self.outputs or set(self.exprs) != {"out", ODD_OUT}):
            raise EpilogueError(f"epilogue {name!r}: a 1 -> 2 epilogue returns exactly two values of acc (no pairs)")
        self._key = ("coda.dsl", tuple((o.name, o.kind) for o in self.operands),
                     tuple(self.exprs), tuple((k, a, op) for k, (a, op, _) in self.red_specs.items()), dag,
                     self.pair_mode) + (("expand",) if self.expand else ()) + \
            (("fastmath",) if self.fastmath else ())
        # the name under which the torch custom op coda::linear finds this program (custom ops take strings, not
        # objects); set here, outside any torch.compile trace; programs with equal keys share one name
        self.op_name = _OP_NAMES.setdefault(self._key, f"{name}#{len(_OP_NAMES)}")
        _BY_OP_NAME.setdefault(self.op_name, self)

    def __repr__(self):
        return f"<coda epilogue {self.name!r}: {self.exprs.get('out', sorted(self.exprs) + sorted(self.red_specs))}>"

    def __call__(self, *a, **k):
        raise TypeError(f"epilogue {self.name!r} is not called directly; pass it to coda.gemm(a, b, epilogue=...) "
                        "or coda.ops.linear")

    def key(self) -> tuple:
        return self._key

    def check_operands(self, operands, L, M, N, device) -> None:
        """The base checks, and: a Scalar operand given as a tensor must be a floating-point one (an int, bool or
        complex tensor would be converted silently, or lose its imaginary part)."""
        super().check_operands(operands, L, M, N, device)
        import torch
        for o in self.operands:
            v = operands[o.name]
            if o.spec is SCALAR and isinstance(v, torch.Tensor) and not v.dtype.is_floating_point:
                raise TypeError(f"operand {o.name!r} (Scalar): expected a floating-point tensor, got {v.dtype}")

    @property
    def result_keys(self) -> list:
        """The results in order: main output (when stored), extra outputs, reductions."""
        return ["out"] * self.stores_out + [*self.outputs, *(r.name for r in self.reductions)]

    # -- kernel (CuTeDSL, trace time) -------------------------------------------------------------------------
    def visit(self, acc, env):
        """``acc``: the element's fp32 accumulator, or in a pairs epilogue the pair (even, odd); ``env.col`` is
        then the pair index j. ``env.segments``: the element's segment sums, formed by the kernel before
        (coda.dsl_segment), as leaves."""
        from ._eval import CuteOps
        leaves = self.kernel_leaves(acc, env)
        leaves.update(env.segments or {})
        return self._evaluate(leaves, CuteOps(fastmath=self.fastmath))

    def kernel_leaves(self, acc, env) -> dict:
        """{symbol: value} of one element in the kernel (the accumulator, coordinates and operands it uses)."""
        import cutlass
        leaves = {ACC_EVEN: acc[0], ACC_ODD: acc[1]} if self.pair_mode else {ACC: acc}
        used = self.symbols
        if ROW in used:
            leaves[ROW] = env.row.to(cutlass.Float32)
        if COL in used:
            leaves[COL] = env.col.to(cutlass.Float32)
        for o in self.operands:
            s = operand_symbol(o.name)
            if s in used:
                leaves[s] = env[o.name]
        return leaves

    def _evaluate(self, leaves, ops):
        from ._eval import evaluate
        memo = {}
        for sym, e in self._cse_repl:
            leaves[sym] = evaluate(e, leaves, ops, memo)
        return {k: evaluate(e, leaves, ops, memo) for k, e in self._cse_out.items()}

    # -- torch reference ------------------------------------------------------------------------------------------
    def reference(self, acc, **operands):
        """fp32 torch evaluation; returns {"out", extra outputs..., finished reductions...}."""
        import torch
        from ._eval import TorchOps
        full = acc
        if self.pair_mode:  # one element per pair j: the even / odd accumulator columns
            acc = full[..., 0::2]
            leaves = {ACC_EVEN: acc, ACC_ODD: full[..., 1::2]}
        else:
            leaves = {ACC: acc}
        M, N = acc.shape[-2:]
        used = self.symbols
        if ROW in used:
            leaves[ROW] = torch.arange(M, device=acc.device, dtype=acc.dtype).unsqueeze(-1)
        if COL in used:
            leaves[COL] = torch.arange(N, device=acc.device, dtype=acc.dtype)
        for o in self.operands:
            leaves[operand_symbol(o.name)] = o.spec.reference(operands[o.name], acc)
        vals = self._evaluate(leaves, TorchOps(acc))
        out = {}
        for k in self.exprs:
            out[k] = torch.broadcast_to(vals[k], acc.shape)
        if self.pair_mode == "full" or self.expand:  # the two values of pair / element j at columns 2j, 2j+1
            for k in ("out", *self.outputs):
                out[k] = torch.stack((out[k], out.pop(odd_key(k))), -1).flatten(-2)
        for k, (axis, op, _) in self.red_specs.items():
            v = torch.broadcast_to(vals[k], acc.shape)
            dim = -1 if axis == "n" else -2
            if v.shape[dim] == 0:  # a reduction over nothing: the neutral element (what the kernel path returns)
                shape = v.shape[:dim] + (v.shape[dim + 1:] if dim == -2 else ())
                out[k] = torch.full(shape, 0.0 if op == "sum" else -math.inf, dtype=acc.dtype, device=acc.device)
                continue
            out[k] = {"sum": lambda t: t.sum(dim), "max": lambda t: t.amax(dim),
                      "logsumexp": lambda t: torch.logsumexp(t, dim)}[op](v)
        return out


def trace(fn: Callable, name: Optional[str] = None, fastmath: bool = False) -> DslEpilogue:
    """Trace ``fn(acc, **operands)`` into a :class:`DslEpilogue` (what ``@coda.epilogue`` does)."""
    name = name or fn.__name__
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    where_def = f"epilogue {name!r} (line {fn.__code__.co_firstlineno})"
    if not params:
        raise EpilogueError(f"{where_def}: the first parameter must be the accumulator")
    try:
        hints = _annotations(fn)
    except Exception as e:
        raise EpilogueError(f"{where_def}: cannot resolve the annotations: {e}") from None
    operands = []
    for p in params[1:]:
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise EpilogueError(f"{where_def}: parameter {p.name!r}: *args / **kwargs are not supported")
        ann = hints.get(p.name, inspect.Parameter.empty)
        if ann is inspect.Parameter.empty:
            raise EpilogueError(f"{where_def}: operand {p.name!r} has no annotation; declare its kind: "
                                f"{p.name}: coda.VecM | coda.VecN | coda.Scalar | coda.TileMN")
        if ann not in _KINDS:
            raise EpilogueError(f"{where_def}: operand {p.name!r} has an unsupported annotation {ann!r}; use "
                                "coda.VecM, coda.VecN, coda.Scalar or coda.TileMN")
        if p.name in ("out", "a", "b", "epilogue", "config", "out_dtype"):
            raise EpilogueError(f"{where_def}: operand name {p.name!r} is reserved by coda.gemm")
        if p.name.startswith(_BACKWARD_PREFIXES):
            raise EpilogueError(f"{where_def}: operand name {p.name!r}: names starting with "
                                f"{', '.join(_BACKWARD_PREFIXES)} are reserved for the derived backward")
        operands.append(Operand(p.name, _KINDS[ann]))
    args = [Value(ACC)] + [Value(operand_symbol(o.name)) for o in operands]
    prev = getattr(_state, "trace", None)
    _state.trace = tr = _Trace(name, fn.__code__)
    try:
        res = fn(*args)
        outputs, reductions = _outputs(res, name)
    except EpilogueError:
        raise
    except Exception as e:
        raise _err(f"{type(e).__name__}: {e}") from e
    finally:
        _state.trace = prev
    return DslEpilogue(name, tuple(operands), outputs, reductions, fn, pair_mode="half" if tr.used_pairs else None,
                       fastmath=fastmath)


def _annotations(fn):
    import typing
    try:
        return typing.get_type_hints(fn)
    except Exception:
        return dict(getattr(fn, "__annotations__", {}))


def _is_odd(k: str, outputs) -> bool:
    """Whether output key ``k`` is the second value of a 2 -> 2 pairs output present in ``outputs``."""
    return k.endswith(ODD_SUFFIX) and k[:-len(ODD_SUFFIX)] in outputs


def _outputs(res, name):
    def value_expr(key, v):
        if isinstance(v, Reduced):
            raise _err(f"output {key!r} is a reduction; reductions are extra dict entries, the main output "
                       "('out') is an M x N value")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return _expr(v)
        if not isinstance(v, Value):
            raise _err(f"output {key!r} must be a traced value (an expression of acc and the operands), got "
                       f"{type(v).__name__}")
        if _is_bool(v.e):
            raise _err(f"output {key!r} is a comparison; use coda.where(cond, 1.0, 0.0) for a 0/1 value")
        return v.e

    if isinstance(res, dict):
        if not res:
            raise _err("the returned dict is empty; return the main output under 'out', extra outputs or "
                       "reductions")
        outputs, reductions = {}, {}
        for k, v in res.items():
            if not isinstance(k, str) or not k.isidentifier():
                raise _err(f"output names must be identifiers, got {k!r}")
            if isinstance(v, tuple):  # two values: a 2 -> 2 pairs output (columns 2j, 2j + 1)
                if len(v) != 2 or k.endswith(ODD_SUFFIX):
                    raise _err(f"output {k!r}: a tuple is the two values of a 2 -> 2 pairs output (coda.pairs); "
                               "give exactly two")
                outputs[k], outputs[odd_key(k)] = value_expr(k, v[0]), value_expr(k, v[1])
            elif isinstance(v, Reduced):
                if k == "out":
                    raise _err("'out' is the main M x N output and cannot be a reduction; return the reduction "
                               "under another name (e.g. {'out': y, 's': coda.reduce_n(y)}, or {'s': ...} alone "
                               "for no main output)")
                reductions[k] = (v.axis, v.op, v.e)
            else:
                outputs[k] = value_expr(k, v)
        return outputs, reductions
    if isinstance(res, tuple):
        if len(res) != 2:
            raise _err("return one expression (the main output) or a dict; a tuple of two is a 2 -> 2 pairs "
                       "output (coda.pairs)")
        return {"out": value_expr("out", res[0]), ODD_OUT: value_expr("out", res[1])}, {}
    return {"out": value_expr("out", res)}, {}


def epilogue(fn: Optional[Callable] = None, *, name: Optional[str] = None, fastmath: bool = False):
    """Decorator: ``@coda.epilogue`` over ``def f(acc, x: coda.VecN, ...)`` gives a fused-epilogue object for
    ``coda.gemm(a, b, epilogue=f, x=...)``, ``coda.reference.gemm`` and ``coda.ops.linear``.
    ``fastmath=True``: division and square root as nvcc's ``--use_fast_math`` has them (``div.approx.ftz.f32``: 2 ulp,
    0 for a divisor above 2^126; ``sqrt.approx.ftz.f32``; subnormals flushed; zero, inf and NaN as IEEE's), not the
    IEEE-rounded instructions, whose range checks branch per element; the reference is unchanged."""
    if fn is None:
        return lambda f: trace(f, name, fastmath)
    return trace(fn, name, fastmath)
