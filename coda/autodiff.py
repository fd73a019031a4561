"""The backward of a traced epilogue, derived with sympy.

For a forward epilogue with outputs ``O_k = e_k(acc, p)`` (main and extra M x N outputs) and reductions
``R_r = reduce(e_r)``, and upstream gradients ``g_k`` (M x N) and ``g_r`` (one per row or column), the gradient of
the loss with respect to any per-element quantity ``z`` (the accumulator or an operand's value at the element) is

    G(z) = sum_k g_k * de_k/dz + sum_r w_r * de_r/dz,      w_r = g_r                      (sum)
                                                            w_r = g_r * t_r                (max)
                                                            w_r = g_r * exp(e_r - R_r)     (logsumexp)

where t_r = [e_r == R_r] / #(e_r == R_r) in the row: exact ties split the gradient, as torch's amax does; a TileMN
operand ``tie_<r>`` computed from the fp32 values the forward compared (:func:`tie_epilogue`, :func:`tie_shares`).

The backward epilogue runs on the recomputed accumulator (a second GEMM of the same x and W) and produces:
``out`` = dacc = G(acc) (then dX = dacc W and dW = dacc^T X), and per operand ``p``: TileMN -> G(p) as an extra
M x N output, VecN -> reduce_m(G(p)), VecM -> reduce_n(G(p)), Scalar -> reduce_n(G(p)) (summed on the host).
All of these come from one reverse sweep over the expression DAG (:func:`_gradients`: every adjoint formed once,
shared by the gradients of dacc and of the operands); common subexpressions are then evaluated once.

Pairs epilogues (``coda.pairs``): dacc is a 2 -> 2 pairs epilogue (G(acc_2j), G(acc_2j+1): M x N); a TileMN
operand holds one value per pair, so its gradient G(p) is M x N/2 -- a "half" pairs epilogue of the same terms
(:func:`pair_tile_grad_epilogue`), run as a second launch (the kernel stores either half- or full-width tiles).

``save_preact`` (:func:`with_preact`): the forward stores the pre-activation as an extra output ``_preact`` (M x N),
or for a half-mode pairs epilogue as two, ``_preact_even`` / ``_preact_odd`` (the pairs' two accumulator values,
M x N/2 each); the backward programs then run on it (torch ops) instead of a recomputed accumulator. A 2 -> 2 pairs
epilogue stores exactly its two values per pair (no extra outputs): ValueError.
"""
from __future__ import annotations

import sympy as sp

from .dsl import (ACC, ACC_EVEN, ACC_ODD, ODD_OUT, DslEpilogue, Operand, Piecewise, odd_key, operand_symbol,
                  rebuild)
from .dsl_segment import SegmentSum

GRAD, VALUE, TIE, DGRAD = "grad_", "value_", "tie_", "d_"
RESERVED_PREFIXES = (GRAD, VALUE, TIE)  # operand names of the backward programs (refused at decoration: coda.dsl)


def grad_name(output: str) -> str:
    """The operand name of the upstream gradient of forward output / reduction ``output``."""
    return GRAD + output


def value_name(reduction: str) -> str:
    """The operand name of a logsumexp reduction's forward result (needed by its backward)."""
    return VALUE + reduction


def tie_name(reduction: str) -> str:
    """The operand name of a max reduction's tie shares (a TileMN operand: :func:`tie_shares`)."""
    return TIE + reduction


def derived(src: DslEpilogue, name: str, operands, outputs: dict, reductions: dict, **kw) -> DslEpilogue:
    """A program derived from ``src`` (its backward, ties, pre-activation forms): it keeps ``src``'s compile-time
    arithmetic options (``fastmath``)."""
    return DslEpilogue(name, operands, outputs, reductions, fastmath=src.fastmath, **kw)


def tie_epilogue(epi: DslEpilogue, names: tuple) -> DslEpilogue:
    """The values that the max reductions ``names`` of ``epi`` compare, as M x N outputs (the first as ``out``,
    the others under their names; one value per pair in a pairs epilogue): run on the accumulator in fp32, their
    :func:`tie_shares` are the max reductions' operands ``tie_<name>`` in the backward programs."""
    outputs = {("out" if i == 0 else k): epi.red_specs[k][2] for i, k in enumerate(names)}
    return derived(epi, f"{epi.name}_ties", epi.operands, outputs, {}, pair_mode="half" if epi.pair_mode else None)


def tie_shares(values):
    """Each element's share of its row's max-reduction gradient, as torch's ``amax`` backward splits it: 1 / (the
    number of elements equal to the row's max) at those elements (exact ties only), 0 elsewhere (NaN in a row
    with a NaN max, as torch's)."""
    import torch
    values = values.to(torch.promote_types(values.dtype, torch.float32))
    if values.shape[-1] == 0:
        return values
    hit = (values == values.amax(-1, keepdim=True)).to(values.dtype)
    return hit / hit.sum(-1, keepdim=True)


def _sum(terms):
    """The sum of ``terms`` without sympy's rewrites (structural zeros -- terms that do not depend on the variable
    -- left out, as autograd adds nothing for them)."""
    terms = [t for t in terms if t is not sp.S.Zero]
    if not terms:
        return sp.S.Zero
    return terms[0] if len(terms) == 1 else sp.Add(*terms, evaluate=False)


def _prod(factors):
    """The product of ``factors`` without sympy's rewrites (exact factors of 1 left out)."""
    factors = [f for f in factors if f is not sp.S.One]
    if not factors:
        return sp.S.One
    return factors[0] if len(factors) == 1 else sp.Mul(*factors, evaluate=False)


def _select(c1, v1, c2, v2):
    """v1 where c1, else v2 where c2, else 1 (coda.dsl.Piecewise: the conditions as given, also when they compare
    a coda.where value, e.g. the derivative of minimum(acc, where(...)))."""
    return Piecewise((v1, c1), (v2, c2), (sp.S.One, sp.true))


def derivative(expr: sp.Expr, z: sp.Symbol) -> sp.Expr:
    """d expr / dz by the chain rule over the expression DAG, each distinct subexpression differentiated once.

    ``sympy.diff`` walks the expression as a tree: an epilogue that reuses a value (``gelu(gelu(x))`` uses its
    argument three times) grows exponentially with nesting (6 nested gelus: 130 s). Here every node's local
    derivative comes from sympy on a shallow copy whose arguments that depend on ``z`` are real dummies (so its
    rules, e.g. d|u| = sign(u) du, apply), then is combined with the memoised derivatives of the arguments. Nothing
    is simplified (the traced math is unevaluated, coda.dsl._node): the derivative computes what autograd computes
    for the expression as written, NaN and inf included (d(sqrt(x) sqrt(x)) is NaN at x < 0, not 2). Conditions of
    ``Piecewise`` (comparisons) are piecewise constant: derivative 0 almost everywhere."""
    memo: dict = {}

    def d(e):
        r = memo.get(e)
        if r is not None:
            return r
        if e == z:
            r = sp.S.One
        elif not e.args or isinstance(e, (sp.core.relational.Relational, sp.logic.boolalg.Boolean)):
            r = sp.S.Zero
        elif isinstance(e, sp.Add):
            r = _sum([d(a) for a in e.args])
        elif isinstance(e, SegmentSum):  # sums over other elements: no elementwise derivative (reverse mode only)
            if d(e.args[0]) is not sp.S.Zero:
                raise ValueError("coda.where: a branch that depends on the differentiated value through "
                                 "coda.segment_sum has no elementwise derivative; write the branch without the "
                                 "segment sum or move the segment sum out of the where")
            r = sp.S.Zero
        elif isinstance(e, sp.Piecewise):
            pieces = [(d(v), c) for v, c in e.args]
            r = (sp.S.Zero if all(dv is sp.S.Zero for dv, _ in pieces)
                 else Piecewise(*pieces))
        else:
            dargs = [d(a) for a in e.args]
            if all(da is sp.S.Zero for da in dargs):
                r = sp.S.Zero
            elif isinstance(e, sp.Mul):
                r = _sum([_prod([*e.args[:i], da, *e.args[i + 1:]]) for i, da in enumerate(dargs)
                          if da is not sp.S.Zero])
            else:
                live = [da is not sp.S.Zero for da in dargs]
                r = _sum([_prod([f, da]) for (_, f), da in zip(_local_partials(e, live),
                                                             [da for da in dargs if da is not sp.S.Zero])])
        memo[e] = r
        return r

    return d(expr)


def _gradient_terms(epi: DslEpilogue, grads: tuple) -> tuple[list, list]:
    """What every backward program of ``epi`` shares: the operands it reads (the forward's, then the upstream
    gradients of ``grads`` and the forward values of max / logsumexp reductions) and the terms ``(w, e)`` of
    ``G(z) = sum w * de/dz`` (see the module docstring)."""
    for o in epi.operands:
        if o.name.startswith(RESERVED_PREFIXES):
            raise ValueError(f"epilogue {epi.name!r}: operand names starting with {', '.join(RESERVED_PREFIXES)} "
                             "are reserved for the backward")
    ops = list(epi.operands)
    terms = []  # (weight expression, forward expression)
    for k in grads:
        if k in epi.exprs:
            g = operand_symbol(grad_name(k))
            ops.append(Operand(grad_name(k), "tile"))
            terms.append((g, epi.exprs[k]))
            if epi.pair_mode == "full":
                # a 2 -> 2 pairs output: the upstream gradient arrives as two per-pair tiles (columns 2j and 2j+1)
                ops.append(Operand(grad_name(odd_key(k)), "tile"))
                terms.append((operand_symbol(grad_name(odd_key(k))), epi.exprs[odd_key(k)]))
        elif k in epi.red_specs:
            axis, op, e = epi.red_specs[k]
            g = operand_symbol(grad_name(k))
            ops.append(Operand(grad_name(k), "vec_m" if axis == "n" else "vec_n"))
            if op == "sum":
                w = g
            elif op == "max":
                # exact ties split the gradient (torch's amax): the shares come with the call (tie_shares of the
                # values the forward compared, tie_epilogue), not from a test on recomputed, maybe rounded values
                ops.append(Operand(tie_name(k), "tile"))
                w = _prod([g, operand_symbol(tie_name(k))])
            else:
                val = operand_symbol(value_name(k))
                ops.append(Operand(value_name(k), "vec_m"))
                diff = sp.Add(e, sp.Mul(sp.S.NegativeOne, val, evaluate=False), evaluate=False)
                w = _prod([g, sp.exp(diff, evaluate=False)])
            terms.append((w, e))
        else:
            raise ValueError(f"epilogue {epi.name!r} has no output or reduction {k!r}")
    return ops, terms


def _local_partials(e, dargs: list) -> list:
    """(argument, d e / d argument) of the arguments of ``e`` flagged in ``dargs`` (those that depend on a variable),
    by the rules :func:`derivative` applies (the product rule, maximum / minimum with ties split, sympy's derivative
    of any other function on real dummies)."""
    args = e.args
    if isinstance(e, sp.Add):
        return [(a, sp.S.One) for a, da in zip(args, dargs) if da]
    if isinstance(e, sp.Mul):
        return [(a, _prod([*args[:i], *args[i + 1:]])) for i, (a, da) in enumerate(zip(args, dargs)) if da]
    if isinstance(e, (sp.Max, sp.Min)) and len(args) == 2:
        # torch.maximum / minimum: a tie splits the gradient; the other side gets none; NaN passes it
        a, b = args
        big = sp.Gt if isinstance(e, sp.Max) else sp.Lt
        return [(x, _select(big(y, x, evaluate=False), sp.S.Zero, sp.Eq(x, y, evaluate=False), sp.S.Half))
                for x, y, da in ((a, b, dargs[0]), (b, a, dargs[1])) if da]
    # arguments that do not depend on a variable stay as they are when they are numbers (d(x ** 2) = 2 x, not
    # 2 x ** 2 / x), else become dummies too (sympy need not compare log(0.0) with a dummy)
    dummies = [a if not da and not a.args else sp.Dummy(real=True) for a, da in zip(args, dargs)]
    shallow = e.func(*dummies)
    back = {u: a for u, a in zip(dummies, args) if u is not a}
    return [(a, rebuild(sp.diff(shallow, u), back)) for a, u, da in zip(args, dummies, dargs) if da]


def _gradients(terms: list, zs) -> dict:
    """G(z) = sum_t w_t * de_t/dz for every z of ``zs`` (symbols), in one reverse sweep over the DAG of the e_t.

    Reverse mode, as autograd runs it: each node's adjoint (the sum of what its users pass down) is formed once and
    shared by every gradient below it, so the gradients of several variables (dacc and an operand's, e.g. the
    SwiGLU backward's dg, du and d_r) reuse each other's products instead of repeating the chain per variable
    (:func:`derivative`'s forward mode). A ``Piecewise`` (``coda.where``) is differentiated in forward mode
    (:func:`derivative`: the derivative of the taken piece only), so its semantics, NaN included, are unchanged."""
    zs = tuple(zs)
    targets = set(zs)
    dep: dict = {}

    def depends(e) -> bool:
        r = dep.get(e)
        if r is None:
            if e in targets:
                r = True
            elif not e.args or isinstance(e, (sp.core.relational.Relational, sp.logic.boolalg.Boolean)):
                r = False
            elif isinstance(e, sp.Piecewise):
                r = any(depends(v) for v, _ in e.args)
            else:
                r = any([depends(a) for a in e.args])
            dep[e] = r
        return r

    order, seen = [], set()  # the dependent nodes, arguments before their users

    def visit(e) -> None:
        if e in seen or not depends(e):
            return
        seen.add(e)
        if e not in targets and not isinstance(e, sp.Piecewise):
            for a in e.args:
                visit(a)
        order.append(e)

    contrib: dict = {}
    for w, e in terms:
        visit(e)
        if depends(e):
            contrib.setdefault(e, []).append(w)
    for e in reversed(order):
        parts = contrib.get(e)
        if not parts or e in targets:
            continue
        bar = _sum(parts)
        if isinstance(e, SegmentSum):  # every element of a group reads the sum: the argument's adjoint is summed too
            contrib.setdefault(e.args[0], []).append(SegmentSum(bar, e.args[1]))
            continue
        if isinstance(e, sp.Piecewise):
            for z in zs:
                dz = derivative(e, z)
                if dz is not sp.S.Zero:
                    contrib.setdefault(z, []).append(_prod([bar, dz]))
            continue
        for a, f in _local_partials(e, [depends(a) for a in e.args]):
            contrib.setdefault(a, []).append(_prod([bar, f]))
    return {z: _sum(contrib.get(z, [])) for z in zs}


def _operand_kinds(epi: DslEpilogue, needs: tuple) -> dict:
    kinds = {o.name: o.kind for o in epi.operands}
    for name in needs:
        if name not in kinds:
            raise ValueError(f"epilogue {epi.name!r} has no operand {name!r}")
    return kinds


def pair_tile_operands(epi: DslEpilogue, needs: tuple) -> tuple:
    """The operands of ``needs`` whose gradient comes from :func:`pair_tile_grad_epilogue` (TileMN operands of a
    pairs epilogue); the others come from :func:`backward_epilogue`."""
    kinds = _operand_kinds(epi, needs)
    return tuple(n for n in needs if epi.pair_mode and kinds[n] == "tile")


def backward_epilogue(epi: DslEpilogue, grads: tuple, needs: tuple) -> DslEpilogue:
    """The backward epilogue of ``epi``.

    ``grads``: names of the forward outputs / reductions that have an upstream gradient (others are zero);
    ``needs``: names of the operands whose gradient is wanted. Output keys: ``out`` (dacc) and ``d_<operand>``.
    The TileMN operands of a pairs epilogue are not among them (:func:`pair_tile_grad_epilogue`)."""
    ops, terms = _gradient_terms(epi, grads)
    kinds = _operand_kinds(epi, needs)
    # pairs: dacc is a 2 -> 2 pairs epilogue over the recomputed pairs; upstream gradients are per-pair tiles
    # (one per pair, or two -- even and odd columns -- for a 2 -> 2 forward); operand values and their gradients
    # are per pair too (VecN of N/2: reduce_m per pair; VecM / Scalar: reduce_n over the pairs of a row)
    accs = (ACC_EVEN, ACC_ODD) if epi.pair_mode else (ACC,)
    grads_of = _gradients(terms, accs + tuple(operand_symbol(n) for n in needs if kinds[n] != "tile"
                                             or not epi.pair_mode))
    outputs = {"out": grads_of[ACC_EVEN], ODD_OUT: grads_of[ACC_ODD]} if epi.pair_mode else {"out": grads_of[ACC]}
    reductions = {}
    for name in needs:
        kind = kinds[name]
        if kind == "tile" and epi.pair_mode:
            # an M x N/2 gradient next to the M x N dacc would need half- and full-width stores in one kernel
            raise NotImplementedError(f"epilogue {epi.name!r}: the gradient of TileMN operand {name!r} of a pairs "
                                      "epilogue (one value per pair, M x N/2) cannot come out of the M x N dacc "
                                      "kernel; it is a second, half-mode epilogue: pair_tile_grad_epilogue")
        gz = grads_of[operand_symbol(name)]
        if kind == "tile":
            outputs[DGRAD + name] = gz
        elif kind == "vec_n":
            reductions[DGRAD + name] = ("m", "sum", gz)
        else:  # vec_m, scalar (the scalar's per-row sums are added up on the host)
            reductions[DGRAD + name] = ("n", "sum", gz)
    return derived(epi, f"{epi.name}_bwd", tuple(ops), outputs, reductions,
                   pair_mode="full" if epi.pair_mode else None)


def pair_tile_grad_epilogue(epi: DslEpilogue, grads: tuple, needs: tuple) -> DslEpilogue:
    """The gradients of TileMN operands ``needs`` of the pairs epilogue ``epi``: a "half" pairs epilogue (one
    value per pair, M x N/2 outputs) over the same accumulator pairs and operands as :func:`backward_epilogue`'s.

    ``G(p)`` of a per-pair operand ``p`` sums, over the pair's forward values (one, or two for a 2 -> 2 forward)
    and the pair's reduction contributions, the upstream weight times the derivative: one value per pair, i.e.
    exactly a half-mode output. The first operand's gradient is the main output ``out``, the others are extra
    outputs ``d_<operand>`` (one launch for all of them). It is a second launch next to the dacc kernel (which
    writes M x N and cannot also write half-width tiles): in ``coda.ops.linear`` one more GEMM recomputes the
    accumulator for it, unless the gradients do not depend on the accumulator."""
    if not epi.pair_mode:
        raise ValueError(f"epilogue {epi.name!r} is not a pairs epilogue; its TileMN gradients are outputs of "
                         "backward_epilogue")
    kinds = _operand_kinds(epi, needs)
    if not needs or any(kinds[n] != "tile" for n in needs):
        raise ValueError(f"epilogue {epi.name!r}: pair_tile_grad_epilogue takes TileMN operands, got {needs!r}")
    ops, terms = _gradient_terms(epi, grads)
    grads_of = _gradients(terms, tuple(operand_symbol(n) for n in needs))
    outputs = {("out" if i == 0 else DGRAD + n): grads_of[operand_symbol(n)] for i, n in enumerate(needs)}
    return derived(epi, f"{epi.name}_bwd_tiles", tuple(ops), outputs, {}, pair_mode="half")


PREACT = "_preact"
PREACT_PAIRS = ("_preact_even", "_preact_odd")


def preact_keys(epi: DslEpilogue) -> tuple:
    """The extra outputs of :func:`with_preact` ``(epi)`` that hold the pre-activation: ``("_preact",)`` (M x N), or
    for a half-mode pairs epilogue ``("_preact_even", "_preact_odd")`` (the pairs' two accumulator values, M x N/2
    each: columns 0::2 and 1::2 of the pre-activation)."""
    if epi.pair_mode == "full":
        raise ValueError(f"epilogue {epi.name!r}: a 2 -> 2 pairs epilogue cannot save its pre-activation (the kernel "
                         "stores exactly its two values per pair, no extra outputs); use save_preact=False (the "
                         "backward recomputes the accumulator pairs)")
    return PREACT_PAIRS if epi.pair_mode == "half" else (PREACT,)


_preact_cache: dict = {}


def with_preact(epi: DslEpilogue) -> DslEpilogue:
    """``epi`` plus extra outputs holding the accumulator (saved for the backward; see :func:`preact_keys`): one,
    ``_preact`` = acc, or for a half-mode pairs epilogue (whose outputs are M x N/2) two, ``_preact_even`` /
    ``_preact_odd`` = the pair's accumulator values. A 2 -> 2 pairs epilogue has no extra outputs: ValueError.
    Cached per epilogue (building one runs sympy; forwards ask for it on every call)."""
    prog = _preact_cache.get(epi.key())
    if prog is None:
        prog = _preact_cache.setdefault(epi.key(), _with_preact(epi))
    return prog


def _with_preact(epi: DslEpilogue) -> DslEpilogue:
    keys = preact_keys(epi)
    for k in keys:
        if k in epi.exprs or k in epi.red_specs:
            raise ValueError(f"epilogue {epi.name!r}: the output name {k!r} is reserved for save_preact")
    outputs = dict(epi.exprs)
    outputs.update(zip(keys, (ACC_EVEN, ACC_ODD) if epi.pair_mode else (ACC,)))
    return derived(epi, epi.name + "_preact", epi.operands, outputs, dict(epi.red_specs), pair_mode=epi.pair_mode)


def on_preact(bwd: DslEpilogue, epi: DslEpilogue) -> DslEpilogue:
    """A backward program ``bwd`` of ``epi`` evaluated on the pre-activation that ``with_preact(epi)`` saved,
    instead of a recomputed accumulator: acc (or a pairs epilogue's two values) become TileMN operands named
    :func:`preact_keys` ``(epi)`` (M x N, or one value per pair: M x N/2). The program no longer reads the
    accumulator, so it runs as a K = 0 GEMM: CODA's kernel doing only the epilogue, one pass over memory."""
    keys = PREACT_PAIRS if epi.pair_mode else (PREACT,)  # (a 2 -> 2 forward cannot save them, but could be given)
    sub = {s: operand_symbol(k) for s, k in zip((ACC_EVEN, ACC_ODD) if epi.pair_mode else (ACC,), keys)}
    memo: dict = {}
    outputs = {k: rebuild(e, sub, memo) for k, e in bwd.exprs.items()}
    reductions = {k: (axis, op, rebuild(e, sub, memo)) for k, (axis, op, e) in bwd.red_specs.items()}
    ops = tuple(bwd.operands) + tuple(Operand(k, "tile") for k in keys)
    return derived(bwd, f"{bwd.name}_on_preact", ops, outputs, reductions, pair_mode=bwd.pair_mode)


def on_acc(prog: DslEpilogue, name: str) -> DslEpilogue:
    """A pairs backward program on the saved pre-activation (``on_preact``; it reads no accumulator) fused into the
    GEMM that forms its TileMN operand ``name``: that operand becomes the accumulator, and the program runs as a
    1 -> 2 (``expand``) epilogue: element j of the accumulator (one value per pair of the forward) gives the two
    values of pair j, stored at columns 2j, 2j + 1. E.g. the SwiGLU backward inside da = dy W_down: da is never
    written, dacc comes out of that GEMM (its other operands, the saved g and u, are read by the epilogue)."""
    if prog.pair_mode != "full" or prog.symbols & {ACC, ACC_EVEN, ACC_ODD}:
        raise ValueError(f"on_acc: {prog.name!r} is not a 2 -> 2 program that reads no accumulator")
    if name not in {o.name for o in prog.operands if o.kind == "tile"}:
        raise ValueError(f"on_acc: {prog.name!r} has no TileMN operand {name!r}")
    sub = {operand_symbol(name): ACC}
    memo: dict = {}
    outputs = {k: rebuild(e, sub, memo) for k, e in prog.exprs.items()}
    reductions = {k: (axis, op, rebuild(e, sub, memo)) for k, (axis, op, e) in prog.red_specs.items()}
    ops = tuple(o for o in prog.operands if o.name != name)
    return derived(prog, f"{prog.name}_on_acc", ops, outputs, reductions, expand=True)
