"""The sympy nodes and the unevaluated construction of ``coda.dsl``'s traced math (moved out of coda/dsl.py
unchanged): the functions CODA adds (``Sigmoid``, the casts, the evaluation-only ``ProductAngle``), the memoised
DAG walk (``rebuild``, ``with_product_angles``) and the never-evaluated ``Piecewise``. ``coda.dsl`` re-exports
every name."""
from __future__ import annotations

from typing import Optional

import sympy as sp


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


def _factors(e) -> list:
    """The factors of a (nested, unevaluated) product: ``(p * f) * 2`` -> [p, f, 2]."""
    return [f for a in e.args for f in (_factors(a) if isinstance(a, sp.Mul) else [a])]


def with_product_angles(e, memo: dict):
    """``e`` with every ``sin(a*b*...)`` / ``cos(a*b*...)`` (a product argument that is not a number) written as
    ``sin(ProductAngle(a, b, ...))``. A memoised walk over the DAG (sympy's ``replace`` walks the tree, exponential
    for reused values); expressions without such a node come back as the same object."""
    def node(e, args):
        if isinstance(e, (sp.sin, sp.cos)) and isinstance(args[0], sp.Mul) and not args[0].is_number:
            return e.func(ProductAngle(*_factors(args[0])), evaluate=False)
        return None
    return _walk(e, memo, node)


def _walk(e, memo: dict, node, mapping: Optional[dict] = None):
    """Rebuild ``e`` bottom-up over its DAG, each subexpression once (``memo``): ``mapping`` replaces a node
    outright; ``node(e, new_args)`` may return a replacement; otherwise ``e`` stays the same object when its
    arguments did, else it is remade unevaluated."""
    r = mapping.get(e) if mapping else None
    if r is None:
        r = memo.get(e)
    if r is not None:
        return r
    if not e.args:
        r = e
    else:
        args = tuple(_walk(a, memo, node, mapping) for a in e.args)
        r = node(e, args) if node is not None else None
        if r is None:
            r = e if args == e.args else _remake(e.func, args)
    memo[e] = r
    return r


class CastBF16(_Cast):
    dtype = "bfloat16"


class CastF16(_Cast):
    dtype = "float16"


# ------------------------------------------------------------------------------------ unevaluated construction
# The traced math is built with sympy's automatic evaluation off: its rewrites are not IEEE-safe (acc - acc -> 0,
# acc / acc -> 1, acc * 0 -> 0, Eq(acc, acc) -> True, ~(acc > 0) -> acc <= 0, sqrt(acc)**2 -> acc,
# exp(log(acc)) -> acc change what NaN and inf give). The expressions are evaluated as written (coda/_eval.py);
# sympy only differentiates them (coda/autodiff.py, also without evaluation). The two arguments of a commutative
# binary operation are put in a canonical order (a + b and b + a: one semantic key; exact in IEEE arithmetic).
def _canon(a, b):
    return (a, b) if sp.default_sort_key(a) <= sp.default_sort_key(b) else (b, a)


def _node(func, *args):
    """``func(*args)`` unevaluated (two-argument commutative operations in canonical order)."""
    if len(args) == 2 and func in (sp.Add, sp.Mul, sp.Max, sp.Min, sp.And, sp.Or):
        args = _canon(*args)
    return func(*args, evaluate=False)


def _add(a, b): return _node(sp.Add, a, b)
def _mul(a, b): return _node(sp.Mul, a, b)
def _neg(a): return sp.Mul(sp.S.NegativeOne, a, evaluate=False)
def _div(a, b): return sp.Mul(a, sp.Pow(b, sp.S.NegativeOne, evaluate=False), evaluate=False)


def rebuild(e, mapping: dict, memo: Optional[dict] = None):
    """``e`` with the subexpressions in ``mapping`` replaced, rebuilt without evaluation (``xreplace`` would
    re-evaluate, and with it apply the rewrites above); a memoised walk over the DAG."""
    return _walk(e, {} if memo is None else memo, None, mapping)


def _remake(func, args):
    func = _UNEVALUATED.get(func, func)
    return func(*args) if func in (Piecewise, ExprCondPair) else func(*args, evaluate=False)


class ExprCondPair(sp.functions.elementary.piecewise.ExprCondPair):
    """A ``(value, condition)`` piece of :class:`Piecewise`, as given. sympy's, even unevaluated, folds a condition
    that contains a Piecewise (``acc > where(...)``) into an ITE: that fails (``KeyError: 'pop from an empty set'``
    for ``0 > acc**2``, no free symbol) or changes what is compared. Named as sympy's (semantic keys, sort order)."""

    def __new__(cls, expr, cond):
        cond = sp.true if cond is True else sp.false if cond is False else cond
        if not isinstance(cond, sp.logic.boolalg.Boolean):
            raise TypeError(f"a Piecewise condition must be a Boolean, not {type(cond).__name__}")
        return sp.Tuple.__new__(cls, sp.sympify(expr), cond)


class Piecewise(sp.Piecewise):
    """sympy's ``Piecewise`` never evaluated (``coda.where``, derivatives), of :class:`ExprCondPair` pieces: only
    pieces after a literally True condition or with a literally False one are dropped (neither changes a value).
    ``isinstance(e, sympy.Piecewise)`` holds; named as sympy's (semantic keys, sort order)."""

    def __new__(cls, *args, evaluate=None):  # (evaluate: accepted, ignored)
        pairs = []
        for pair in (ExprCondPair(*ec) for ec in args):
            if pair.cond is not sp.false:
                pairs.append(pair)
            if pair.cond is sp.true:
                break
        if not pairs:
            raise TypeError("a Piecewise needs a piece whose condition is not False")
        return pairs[0].expr if len(pairs) == 1 and pairs[0].cond is sp.true else sp.Basic.__new__(cls, *pairs)


_UNEVALUATED = {sp.Piecewise: Piecewise, sp.functions.elementary.piecewise.ExprCondPair: ExprCondPair}
