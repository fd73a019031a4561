"""Random epilogue programs (hypothesis) with two interpreters: traced by @coda.epilogue, and direct torch.

A program is a nested tuple over leaves ``acc``, operands, ``row``/``col`` and constants; ops are chosen so that
every program is finite on any input (divisions by 1 + x^2, logs of 1 + x^2, exp of -x^2, ...). sin / cos get
bounded arguments (|arg| <= 3: tanh inside), so float64 comparisons stay tight and no huge angle is ever reduced;
``sin_3tanh`` and ``sin_prod`` take products (the kernel's extended-precision angle path, constants merged in).
"""
from __future__ import annotations

import inspect
import math

import torch
from hypothesis import strategies as st

import coda

KINDS = {"vec_m": coda.VecM, "vec_n": coda.VecN, "scalar": coda.Scalar, "tile": coda.TileMN}
UNARY = ["neg", "sq", "cube", "exp_nsq", "log1p_sq", "sqrt1p_sq", "rsqrt1p_sq", "sigmoid", "tanh", "silu", "gelu",
         "gelu_erf", "relu", "abs", "recip1p_sq", "exp2_ntanh", "sin_3tanh", "cos_tanh"]
BINARY = ["add", "sub", "mul", "div1p_sq", "minimum", "maximum", "where_gt", "sin_prod"]
SEGMENT = ["segsum3"]  # coda.segment_sum over groups of 3 columns (pairs): specs(segment=True) only (no kernel yet)


def _unary(name, x, m):
    if name == "neg":
        return -x
    if name == "sq":
        return x * x
    if name == "cube":
        return x ** 3
    if name == "exp_nsq":
        return m.exp(-(x * x))
    if name == "log1p_sq":
        return m.log(1.0 + x * x)
    if name == "sqrt1p_sq":
        return m.sqrt(1.0 + x * x)
    if name == "rsqrt1p_sq":
        return m.rsqrt(1.0 + x * x)
    if name == "recip1p_sq":
        return 1.0 / (1.0 + x * x)
    if name == "exp2_ntanh":
        return m.exp2(m.tanh(x))
    if name == "sin_3tanh":
        return m.sin(3.0 * m.tanh(x))
    if name == "cos_tanh":
        return m.cos(m.tanh(x) + 0.5)
    if name == "gelu":
        return m.gelu(x)
    if name == "gelu_erf":
        return m.gelu_erf(x)
    if name == "segsum3":
        return m.segment_sum(x, 3)
    return getattr(m, name)(x)


def _binary(name, a, b, m):
    if name == "add":
        return a + b
    if name == "sub":
        return a - b
    if name == "mul":
        return a * b
    if name == "div1p_sq":
        return a / (1.0 + b * b)
    if name == "minimum":
        return m.minimum(a, b)
    if name == "maximum":
        return m.maximum(a, b)
    if name == "where_gt":
        return m.where(a > b, a * 0.5, b - a)
    if name == "sin_prod":
        return m.sin(2.0 * m.tanh(a) * m.tanh(b))
    raise ValueError(name)


def interpret(prog, env, m):
    kind = prog[0]
    if kind == "leaf":
        return env[prog[1]]
    if kind == "const":
        return m.const(prog[1])
    if kind == "u":
        return _unary(prog[1], interpret(prog[2], env, m), m)
    return _binary(prog[1], interpret(prog[2], env, m), interpret(prog[3], env, m), m)


class CodaMath:
    exp, exp2, log, sqrt, rsqrt = coda.exp, coda.exp2, coda.log, coda.sqrt, coda.rsqrt
    sigmoid, tanh, silu, relu, abs = coda.sigmoid, coda.tanh, coda.silu, coda.relu, coda.abs
    sin, cos = coda.sin, coda.cos
    minimum, maximum, where = coda.minimum, coda.maximum, coda.where
    const = staticmethod(lambda v: v)
    gelu = staticmethod(lambda x: coda.gelu(x, "tanh"))
    gelu_erf = staticmethod(lambda x: coda.gelu(x, "none"))
    segment_sum = staticmethod(lambda x, size: coda.segment_sum(x, size))


class TorchMath:
    exp, exp2, log, sqrt, rsqrt = torch.exp, torch.exp2, torch.log, torch.sqrt, torch.rsqrt
    sigmoid, tanh, abs = torch.sigmoid, torch.tanh, torch.abs
    sin, cos = torch.sin, torch.cos
    silu = staticmethod(torch.nn.functional.silu)
    relu = staticmethod(torch.relu)
    minimum, maximum, where = torch.minimum, torch.maximum, torch.where
    const = staticmethod(lambda v: torch.tensor(v, dtype=torch.float64))
    gelu = staticmethod(lambda x: torch.nn.functional.gelu(x, approximate="tanh"))
    gelu_erf = staticmethod(lambda x: torch.nn.functional.gelu(x, approximate="none"))
    grid = None  # the element grid (..., M, N) of the evaluation in progress (torch_eval): segment sums need N

    @staticmethod
    def segment_sum(x, size):
        """The sum over each row's aligned groups of ``size`` columns, broadcast back (written here, not coda's)."""
        *lead, n = TorchMath.grid
        x = torch.broadcast_to(x, TorchMath.grid)
        return torch.stack([x[..., j - j % size:j - j % size + size].sum(-1) for j in range(n)], -1)


def programs(leaves, depth=3, unary=tuple(UNARY)):
    """Programs of nesting depth <= ``depth`` (at most 2**depth leaves). Bounded depth, not only a bounded leaf
    count: chains of unary ops are free in leaves, and sympy's assumption queries on deeply nested tanh/gelu take
    exponential time (see README, Errors and limits)."""
    leaf = st.one_of(st.sampled_from([("leaf", n) for n in leaves]),
                     st.floats(-2, 2, allow_nan=False).map(lambda v: ("const", round(v, 3))))
    if depth == 0:
        return leaf
    sub = programs(leaves, depth - 1, unary)
    return st.one_of(leaf, st.tuples(st.just("u"), st.sampled_from(list(unary)), sub),
                     st.tuples(st.just("b"), st.sampled_from(BINARY), sub, sub))


@st.composite
def specs(draw, allow_row_col=True, segment=False):
    """(operand kinds, main program, extra outputs, reductions): the recipe of one random epilogue; ``segment``:
    with segment sums among the unary ops (evaluated by the reference only: the kernel has no lowering yet)."""
    unary = (*UNARY, *SEGMENT) if segment else tuple(UNARY)
    n_ops = draw(st.integers(0, 3))
    kinds = [draw(st.sampled_from(sorted(KINDS))) for _ in range(n_ops)]
    names = [f"p{i}" for i in range(n_ops)]
    # pairs: None, "half" (one value per column pair, coda.pairs) or "full" (a 2 -> 2 transform, two programs)
    pairs = draw(st.sampled_from([None, None, "half", "full"]))
    accs = ["g", "u"] if pairs else ["acc", "acc"]
    leaves = accs + names + (["row", "col"] if allow_row_col and draw(st.booleans()) else [])
    main = draw(programs(leaves, unary=unary))
    if pairs == "full":
        return dict(kinds=dict(zip(names, kinds)), main=main, extras={}, reds={}, pairs=pairs,
                    main_odd=draw(programs(leaves, unary=unary)))
    extras = {f"x{i}": draw(programs(leaves, unary=unary)) for i in range(draw(st.integers(0, 1)))}
    reds = {}
    for i in range(draw(st.integers(0, 2))):  # in a pairs epilogue: one value per pair reduced
        axis_op = draw(st.sampled_from([("n", "sum"), ("n", "max"), ("n", "logsumexp"), ("m", "sum")]))
        reds[f"r{i}"] = (*axis_op, draw(programs(leaves, unary=unary)))
    return dict(kinds=dict(zip(names, kinds)), main=main, extras=extras, reds=reds, pairs=pairs)


def make_epilogue(spec, name="gen"):
    """Trace the recipe with @coda.epilogue (the function is built with the declared annotations)."""
    kinds = spec["kinds"]

    def fn(acc, *ops):
        env = {**dict(zip(kinds, ops))}
        if spec.get("pairs"):
            env["g"], env["u"] = coda.pairs(acc)
        else:
            env["acc"] = acc
        if any(p[1] in ("row", "col") for p in _leaf_iter(spec)):
            env["row"], env["col"] = coda.row() * 0.01, coda.col() * 0.01
        if spec.get("pairs") == "full":
            return interpret(spec["main"], env, CodaMath), interpret(spec["main_odd"], env, CodaMath)
        out = {"out": interpret(spec["main"], env, CodaMath)}
        for k, p in spec["extras"].items():
            out[k] = interpret(p, env, CodaMath)
        for k, (axis, op, p) in spec["reds"].items():
            v = interpret(p, env, CodaMath)
            out[k] = coda.reduce_n(v, op) if axis == "n" else coda.reduce_m(v, op)
        return out

    params = [inspect.Parameter("acc", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=KINDS[k])
               for n, k in kinds.items()]
    fn.__signature__ = inspect.Signature(params)
    fn.__annotations__ = {n: KINDS[k] for n, k in kinds.items()}
    fn.__name__ = name
    return coda.epilogue(fn)


def segment_in_where(spec) -> bool:
    """Whether a segment sum lies under a where_gt (whose backward raises where the sum depends on the variable)."""
    def walk(p, under):
        if p[0] in ("leaf", "const"):
            return False
        if p[0] == "u" and p[1] in SEGMENT and under:
            return True
        inner = under or (p[0] == "b" and p[1] == "where_gt")
        return any(walk(q, inner) for q in p[2:])
    progs = [spec["main"], spec.get("main_odd"), *spec["extras"].values(), *(p for (_, _, p) in spec["reds"].values())]
    return any(walk(p, False) for p in progs if p is not None)


def _leaf_iter(spec):
    progs = [spec["main"], *spec["extras"].values(), *(p for (_, _, p) in spec["reds"].values())]
    if "main_odd" in spec:
        progs.append(spec["main_odd"])
    stack = list(progs)
    while stack:
        p = stack.pop()
        if p[0] == "leaf":
            yield p
        elif p[0] in ("u", "b"):
            stack.extend(p[2:])


def torch_eval(spec, acc, ops):
    """Direct torch evaluation of the recipe: acc (..., M, N), operands as coda.gemm takes them."""
    full = acc
    if spec.get("pairs"):  # one element per column pair: operands, row/col and outputs are per pair
        acc = full[..., 0::2]
        env = {"g": acc, "u": full[..., 1::2]}
    else:
        env = {"acc": acc}
    M, N = acc.shape[-2:]
    TorchMath.grid = acc.shape
    for n, k in spec["kinds"].items():
        v = ops[n]
        env[n] = (torch.as_tensor(v, dtype=acc.dtype) if k == "scalar" else
                  v.unsqueeze(-1) if k == "vec_m" else v)
    env["row"] = torch.arange(M, dtype=acc.dtype, device=acc.device).unsqueeze(-1) * 0.01
    env["col"] = torch.arange(N, dtype=acc.dtype, device=acc.device) * 0.01
    if spec.get("pairs") == "full":
        e0, e1 = (torch.broadcast_to(interpret(spec[k], env, TorchMath), acc.shape) for k in ("main", "main_odd"))
        return {"out": torch.stack((e0, e1), -1).reshape(full.shape)}
    out = {"out": interpret(spec["main"], env, TorchMath)}
    for k, p in spec["extras"].items():
        out[k] = interpret(p, env, TorchMath)
    for k, (axis, op, p) in spec["reds"].items():
        v = torch.broadcast_to(interpret(p, env, TorchMath), acc.shape)
        d = -1 if axis == "n" else -2
        out[k] = v.sum(d) if op == "sum" else v.amax(d) if op == "max" else torch.logsumexp(v, d)
    return {k: torch.broadcast_to(v, acc.shape) if k in ("out", *spec["extras"]) else v for k, v in out.items()}


def random_operands(spec, L, M, N, dtype=torch.float64, device="cpu", gen=None):
    """Operands for an accumulator of M x N (per column pair -- N/2 -- in a pairs epilogue)."""
    lead = (L,) if L else ()
    if spec.get("pairs"):
        N //= 2
    ops = {}
    for n, k in spec["kinds"].items():
        if k == "scalar":
            ops[n] = round(float(torch.rand((), generator=gen)) + 0.5, 4)
        elif k == "vec_n":
            ops[n] = torch.randn(N, generator=gen, dtype=dtype).to(device)
        elif k == "vec_m":
            ops[n] = torch.randn(*lead, M, generator=gen, dtype=dtype).to(device)
        else:
            ops[n] = torch.randn(*lead, M, N, generator=gen, dtype=dtype).to(device)
    return ops


__all__ = ["specs", "make_epilogue", "torch_eval", "random_operands", "segment_in_where", "math"]
