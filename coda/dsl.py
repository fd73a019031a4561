"""``@coda.epilogue``: a plain Python function over the accumulator becomes a fused GEMM epilogue.

Tracing
    The decorated function is called once, at decoration time, with symbolic values: ``acc`` (the fp32
    accumulator element), one symbol per annotated operand and, on request, ``coda.row()`` / ``coda.col()``. The
    arithmetic builds a sympy expression per output (sympy canonicalises it: ``a + b`` and ``b + a`` are the same
    expression). The canonical expressions, operand names/kinds, outputs and reductions form the semantic key of the
    compile cache.

Three programs come out of one trace
    - the kernel code: :meth:`DslEpilogue.visit` evaluates the expressions with CuTeDSL arithmetic while the GEMM is
      being traced (common subexpressions eliminated once, at decoration);
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
import sys
import threading
from typing import Callable, Optional

import sympy as sp

from .kernels.epilogue import ODD_OUT, Epilogue, Operand, Reduction

__all__ = ["VecM", "VecN", "Scalar", "TileMN", "epilogue", "row", "col", "reduce_n", "reduce_m", "exp", "exp2", "log",
           "log2", "sqrt", "rsqrt", "sigmoid", "tanh", "sin", "cos", "silu", "gelu", "relu", "abs", "minimum",
           "maximum", "where", "cast", "EpilogueError", "DslEpilogue"]


# ----------------------------------------------------------------------------------------------- operand kinds
class _Kind:
    kind = ""


class VecM(_Kind):
    """One value per output row (length M, or (L, M) when batched)."""
    kind = "vec_m"


class VecN(_Kind):
    """One value per output column (length N)."""
    kind = "vec_n"


class Scalar(_Kind):
    """One number, read at run time (a Python number or a 1-element tensor)."""
    kind = "scalar"


class TileMN(_Kind):
    """An M x N tensor (e.g. a residual), read at each element."""
    kind = "tile"


_KINDS = {VecM: "vec_m", VecN: "vec_n", Scalar: "scalar", TileMN: "tile"}


class EpilogueError(TypeError):
    """A decoration-time error in an epilogue function (names the epilogue and the offending line)."""


# ------------------------------------------------------------------------------------ sympy functions we add
class Sigmoid(sp.Function):
    """1 / (1 + exp(-x)), kept as one node so the kernel evaluates it directly."""
    nargs = 1

    def fdiff(self, argindex=1):
        s = Sigmoid(self.args[0])
        return s * (1 - s)

    def _eval_is_extended_real(self):
        return self.args[0].is_extended_real

    @classmethod
    def eval(cls, x):
        if x.is_number:
            return 1 / (1 + sp.exp(-x))
        return None


def _round_const(x, dtype: str):
    import torch
    return sp.Float(float(torch.tensor(float(x), dtype=torch.float32).to(getattr(torch, dtype)).float()))


class _Cast(sp.Function):
    """Round to ``dtype`` and back (straight-through derivative); subclasses name the dtype."""
    nargs = 1
    dtype = ""

    @classmethod
    def eval(cls, x):
        return _round_const(x, cls.dtype) if x.is_number else None

    def fdiff(self, argindex=1):
        return sp.Integer(1)

    def _eval_is_extended_real(self):
        return self.args[0].is_extended_real


class ProductAngle(sp.Function):
    """Evaluation-only node: the product of its arguments (numbers and traced factors) reduced modulo 2*pi.

    Never part of a traced expression, a semantic key or a derivative: :func:`with_product_angles` puts it under
    ``sin`` / ``cos`` of a product just before the expressions are compiled into the kernel / reference programs,
    so that the product is formed and reduced accurately (``coda/_eval.py``: ``reduce_angle`` in the kernel,
    float64 in ``TorchOps.angle``) and shared by a ``sin`` and ``cos`` of the same angle."""

    @classmethod
    def eval(cls, *args):
        return None

    def _eval_is_extended_real(self):
        return True


def with_product_angles(e, memo: dict):
    """``e`` with every ``sin(a*b*...)`` / ``cos(a*b*...)`` (a product argument that is not a number) written as
    ``sin(ProductAngle(a, b, ...))``. A memoised walk over the DAG (sympy's ``replace`` walks the tree, exponential
    for reused values); expressions without such a node come back as the same object."""
    r = memo.get(e)
    if r is not None:
        return r
    if not e.args:
        r = e
    else:
        args = tuple(with_product_angles(a, memo) for a in e.args)
        if isinstance(e, (sp.sin, sp.cos)) and isinstance(args[0], sp.Mul) and not args[0].is_number:
            r = e.func(ProductAngle(*args[0].args), evaluate=False)
        elif args == e.args:
            r = e
        else:
            r = e.func(*args)
    memo[e] = r
    return r


class CastBF16(_Cast):
    dtype = "bfloat16"


class CastF16(_Cast):
    dtype = "float16"


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

    def line(self) -> str:
        """The line of the epilogue function being executed (for error messages)."""
        f = sys._getframe(1)
        while f is not None and f.f_code is not self.code:
            f = f.f_back
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
    """A traced fp32 value (wraps a sympy expression). Arithmetic builds expressions; truth tests are errors."""
    __slots__ = ("e",)
    __array_priority__ = 1000

    def __init__(self, e):
        self.e = e

    # arithmetic
    def __add__(self, o): return Value(self.e + _expr(o))
    def __radd__(self, o): return Value(_expr(o) + self.e)
    def __sub__(self, o): return Value(self.e - _expr(o))
    def __rsub__(self, o): return Value(_expr(o) - self.e)
    def __mul__(self, o): return Value(self.e * _expr(o))
    def __rmul__(self, o): return Value(_expr(o) * self.e)
    def __truediv__(self, o): return Value(self.e / _expr(o))
    def __rtruediv__(self, o): return Value(_expr(o) / self.e)
    def __neg__(self): return Value(-self.e)
    def __pos__(self): return self
    def __abs__(self): return Value(sp.Abs(self.e))

    def __pow__(self, o):
        if isinstance(o, Value) or not float(o).is_integer():
            raise _err("only integer powers are supported (x ** 2, x ** -1); use coda.sqrt / rsqrt / exp / log")
        return Value(self.e ** sp.Integer(int(o)))

    def __rpow__(self, o):
        raise _err("a number to a traced power: use coda.exp2(x) or coda.exp(x)")

    # comparisons give traced booleans (for coda.where)
    def __lt__(self, o): return Value(sp.Lt(self.e, _expr(o)))
    def __le__(self, o): return Value(sp.Le(self.e, _expr(o)))
    def __gt__(self, o): return Value(sp.Gt(self.e, _expr(o)))
    def __ge__(self, o): return Value(sp.Ge(self.e, _expr(o)))
    def __eq__(self, o): return Value(sp.Eq(self.e, _expr(o)))  # noqa: E704
    def __ne__(self, o): return Value(sp.Ne(self.e, _expr(o)))  # noqa: E704
    def __and__(self, o): return Value(sp.And(self.e, _expr(o)))
    def __or__(self, o): return Value(sp.Or(self.e, _expr(o)))
    def __invert__(self): return Value(sp.Not(self.e))
    __hash__ = object.__hash__

    def __bool__(self):
        raise _err("Python control flow (if / while / and / or / not) on a traced value is not allowed; "
                   "use coda.where(cond, a, b)")

    def __float__(self):
        raise _err("a traced value was passed to a function CODA does not know (e.g. math.* or torch.*); "
                   "use the coda math functions (coda.exp, coda.log, coda.tanh, ...)")

    __int__ = __index__ = __float__

    def __array__(self, *a, **k):
        raise _err("a traced value was passed to numpy; use the coda math functions")

    def __torch_function__(self, func, types, args=(), kwargs=None):
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


def exp(x): return Value(sp.exp(_v(x)))
def exp2(x): return Value(sp.Integer(2) ** _v(x))
def log(x): return Value(sp.log(_v(x)))
def log2(x): return Value(sp.log(_v(x)) / sp.log(2))
def sqrt(x): return Value(sp.sqrt(_v(x)))
def rsqrt(x): return Value(1 / sp.sqrt(_v(x)))
def sigmoid(x): return Value(Sigmoid(_v(x)))
def tanh(x): return Value(sp.tanh(_v(x)))
def relu(x): return Value(sp.Max(_v(x), 0))
def abs(x): return Value(sp.Abs(_v(x)))  # noqa: A001 - mirrors the builtin on traced values
def minimum(a, b): return Value(sp.Min(_v(a), _v(b)))
def maximum(a, b): return Value(sp.Max(_v(a), _v(b)))


def sin(x):
    """sin(x), full precision in the kernel (not sin.approx). A product argument (``coda.sin(pos * freq)``, also
    with constants merged in) is formed and reduced modulo 2*pi in extended precision (``reduce_angle`` in
    coda/_eval.py): a few 1e-7 rad at angles of 10^5 rad, e.g. RoPE at position 131072, where the plain fp32
    product is off by up to 4e-3 rad. The reference forms such angles in float64."""
    return Value(sp.sin(_v(x)))


def cos(x):
    """cos(x); as :func:`sin` (a sin and cos of the same argument share the angle and one sincos evaluation)."""
    return Value(sp.cos(_v(x)))


def silu(x):
    e = _v(x)
    return Value(e * Sigmoid(e))


def gelu(x, approximate: str = "tanh"):
    """GELU; ``approximate="tanh"`` (default, as in GPT-2 / Gemma) or ``"none"`` (erf)."""
    e = _v(x)
    if approximate == "tanh":
        # x (1 + tanh(u)) / 2 == x sigmoid(2u): the same function, written as one Sigmoid node so the kernel
        # evaluates it with ex2 + rcp (a few instructions) instead of a full-precision tanh (~30)
        k = sp.sqrt(2 / sp.pi)
        return Value(e * Sigmoid(2 * k * (e + sp.Float(0.044715) * e ** 3)))
    if approximate == "none":
        return Value(sp.Rational(1, 2) * e * (1 + sp.erf(e / sp.sqrt(2))))
    raise _err(f"gelu: approximate must be 'tanh' or 'none', got {approximate!r}")


def where(cond, a, b):
    """``a`` where ``cond`` holds, else ``b`` (elementwise; the traced replacement for ``if``)."""
    c = _v(cond)
    if not _is_bool(c):
        raise _err("coda.where: the condition must be a comparison (e.g. acc > 0)")
    try:
        return Value(sp.Piecewise((_v(a), c), (_v(b), True)))
    except RecursionError:  # sympy's Piecewise.eval can recurse without end on nested piecewise conditions
        return Value(sp.Piecewise((_v(a), c), (_v(b), True), evaluate=False))


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
                 pair_mode: Optional[str] = None):
        if not outputs and not reductions:
            raise EpilogueError(f"epilogue {name!r}: no outputs and no reductions")
        self.name = name
        self.fn = fn
        self.operands = tuple(operands)
        self.exprs = dict(outputs)
        self.red_specs = dict(reductions)
        self.outputs = tuple(k for k in outputs if k not in ("out", ODD_OUT))
        self.stores_out = "out" in outputs  # no "out": nothing M x N stored but the extra outputs
        self.reductions = tuple(Reduction(k, axis, op) for k, (axis, op, _) in reductions.items())
        keys = list(self.exprs) + list(self.red_specs)
        exprs = [self.exprs[k] for k in self.exprs] + [e for (_, _, e) in self.red_specs.values()]
        memo: dict = {}  # sin / cos of products: accurate angle reduction (evaluation only, not in the key)
        self._cse_repl, reduced = sp.cse([with_product_angles(e, memo) for e in exprs],
                                         symbols=sp.numbered_symbols("_t", real=True), optimizations=None)
        self._cse_out = dict(zip(keys, reduced))
        dag, self.symbols = _dag_key(exprs)  # symbols: the leaves visit/reference must provide
        # pairs: None, "half" (one value per pair: M x N/2 outputs) or "full" (two values per pair: M x N)
        # (explicit for derived epilogues whose math may not use the pair values, e.g. a rotation's backward)
        self.pair_mode = pair_mode
        if pair_mode or self.symbols & {ACC_EVEN, ACC_ODD}:
            self.pair_mode = "full" if ODD_OUT in outputs else "half"
            where = f"epilogue {name!r}"
            if ACC in self.symbols:
                raise EpilogueError(f"{where}: uses both coda.pairs(acc) and acc itself; use the pair values")
            if self.pair_mode == "full" and (self.outputs or not self.stores_out):
                raise EpilogueError(f"{where}: a 2 -> 2 pairs epilogue returns exactly two values")
        elif ODD_OUT in outputs:
            raise EpilogueError(f"epilogue {name!r}: a tuple of two outputs needs coda.pairs(acc)")
        self._key = ("coda.dsl", tuple((o.name, o.kind) for o in self.operands),
                     tuple(self.exprs), tuple((k, a, op) for k, (a, op, _) in self.red_specs.items()), dag,
                     self.pair_mode)
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

    @property
    def result_keys(self) -> list:
        """The results in order: main output (when stored), extra outputs, reductions."""
        return ["out"] * self.stores_out + [*self.outputs, *(r.name for r in self.reductions)]

    # -- kernel (CuTeDSL, trace time) -------------------------------------------------------------------------
    def visit(self, acc, env):
        """``acc``: the element's fp32 accumulator, or in a pairs epilogue the pair (even, odd); ``env.col`` is
        then the pair index j."""
        import cutlass
        from ._eval import CuteOps
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
        return self._evaluate(leaves, CuteOps())

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
            leaves[operand_symbol(o.name)] = _ref_operand(o, operands[o.name], acc)
        vals = self._evaluate(leaves, TorchOps(acc))
        out = {}
        for k in self.exprs:
            out[k] = torch.broadcast_to(vals[k], acc.shape)
        if self.pair_mode == "full":  # the two values of pair j at columns 2j, 2j+1
            out["out"] = torch.stack((out["out"], out.pop(ODD_OUT)), -1).reshape(full.shape)
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


def _ref_operand(o: Operand, v, acc):
    import torch
    if o.kind == "scalar":
        return torch.as_tensor(v, dtype=acc.dtype, device=acc.device).reshape(())
    t = v.to(device=acc.device, dtype=acc.dtype)
    if o.kind == "vec_m":
        return t.unsqueeze(-1)
    return t  # vec_n (N,) and tile (..., M, N) broadcast as they are


def trace(fn: Callable, name: Optional[str] = None) -> DslEpilogue:
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
    return DslEpilogue(name, tuple(operands), outputs, reductions, fn, pair_mode="half" if tr.used_pairs else None)


def _annotations(fn):
    import typing
    try:
        return typing.get_type_hints(fn)
    except Exception:
        return dict(getattr(fn, "__annotations__", {}))


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
            if isinstance(v, Reduced):
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


def epilogue(fn: Optional[Callable] = None, *, name: Optional[str] = None):
    """Decorator: ``@coda.epilogue`` over ``def f(acc, x: coda.VecN, ...)`` gives a fused-epilogue object for
    ``coda.gemm(a, b, epilogue=f, x=...)``, ``coda.reference.gemm`` and ``coda.ops.linear``."""
    if fn is None:
        return lambda f: trace(f, name)
    return trace(fn, name)
