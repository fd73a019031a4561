"""``coda.ops.linear``: ``epilogue(x @ weight.T)`` as a torch.autograd op, forward and backward as GEMM + epilogue.

Forward: one fused GEMM (``coda.gemm``). Backward (the epilogue's derivative comes from sympy, see
``coda.autodiff``): one GEMM of the same x and W recomputes the accumulator and its epilogue forms dacc and every
operand gradient (VecN by per-column partials, VecM and Scalar by per-row partials, TileMN as an extra output); with
``save_preact=True`` the forward also writes the pre-activation and the backward evaluates the same derivative
program on it instead of recomputing the GEMM (trading M x N saved bytes for a GEMM): a K = 0 GEMM, i.e. CODA's
kernel running only the epilogue, with the pre-activation as TileMN operands (``coda.autodiff.on_preact``); a
derivative that does not depend on the accumulator (identity, residual add, operand scales) needs no recompute at all.
(A half-mode pairs epilogue saves the pre-activation as two M x N/2 extra outputs, the pairs' even and odd
accumulator values; a 2 -> 2 one cannot store extra outputs and does not support ``save_preact``.) Then
dX = dacc W and dW = dacc^T X are plain GEMMs of CODA's kernel on transposed views (``weight.t()``, ``dacc.t()``,
``x.t()``: MN-major operands, read by TMA without copies); shapes the kernel cannot align (N or M not a multiple
of 8) use ``torch.matmul`` for these two products (``ops/_common.backward_gemm``).

Pairs epilogues (``coda.pairs``): dacc is a 2 -> 2 pairs epilogue (M x N), with the VecN / VecM / Scalar operand
gradients as its reductions. A TileMN operand holds one value per pair, so its gradient is M x N/2, which that
kernel cannot store next to dacc: it comes from a second launch, a "half" pairs epilogue derived from the same terms
(``coda.autodiff.pair_tile_grad_epilogue``; the gradients of all TileMN operands in one launch, the first as the
main output, the others as extra outputs; fp32 or the operands' dtype). Cost, only when a TileMN operand of a pairs
epilogue requires grad: one more GEMM recomputing the accumulator (M x N x K, as the forward) plus an M x N/2 store
per TileMN gradient -- none when those gradients do not depend on the accumulator (then: elementwise torch ops) or
with ``save_preact=True`` (half mode: a K = 0 launch on the saved pre-activation, no recompute GEMM at all) --
and the dacc kernel is skipped when neither x, W nor another operand needs a gradient.

Registered as the ``torch.library`` custom ops ``coda::linear`` / ``coda::linear_backward`` (fake implementations,
autograd), so ``torch.compile(fullgraph=True)`` traces a call as one op; the epilogue program is passed by its
``op_name`` (set when the program is made, ``coda.dsl.by_op_name``), operands as a tensor list plus the
Python-number scalars.

Device: on a Hopper GPU the fused kernels run; on CPU tensors the same programs run through ``coda.reference.gemm``
(torch ops, fp32 math; float32 / float64 inputs too, in their own precision, so ``torch.autograd.gradcheck`` can
check a custom epilogue; autocast does not change it) -- the documented reference path, useful for tests and
debugging; other GPUs raise (``ops/_common.py``).
"""
from __future__ import annotations

import functools
import threading

import torch

from typing import List, Optional

from torch import Tensor

from coda.autodiff import (DGRAD, backward_epilogue, grad_name, on_preact, pair_tile_grad_epilogue,
                           pair_tile_operands, preact_keys, tie_epilogue, tie_name, tie_shares, value_name,
                           with_preact)
from coda.dsl import ACC, ACC_EVEN, ACC_ODD, DslEpilogue, by_op_name, odd_key, operand_symbol

from ._builder import backward_op, forward_op
from ._common import IN_DTYPES, call, check_inputs, epilogue_pass, gemm_for, grad_of, linear_grads

__all__ = ["linear"]  # also used across coda.ops: backward_of, evaluate, saved_preact (see their docstrings)
ENTRY = "coda.ops.linear"

_bwd_cache: dict = {}
_bwd_lock = threading.Lock()


def backward_of(epi: DslEpilogue, grads: tuple, needs: tuple, tiles: bool = False,
                 preact: bool = False, ties: bool = False) -> DslEpilogue:
    """The (cached) dacc backward epilogue, or with ``tiles`` the pairs TileMN-gradient one; with ``preact`` the
    same program reading the saved pre-activation (``coda.autodiff.on_preact``: a K = 0 GEMM's epilogue); with
    ``ties`` the values that the max reductions ``grads`` compare (``coda.autodiff.tie_epilogue``)."""
    key = (epi.key(), grads, needs, tiles, preact, ties)
    with _bwd_lock:
        prog = _bwd_cache.get(key)
    if prog is None:  # built outside the lock (sympy); a race builds the same program twice, harmlessly
        if ties:
            prog = tie_epilogue(epi, grads)
        else:
            prog = (pair_tile_grad_epilogue if tiles else backward_epilogue)(epi, grads, needs)
        if preact:
            prog = on_preact(prog, epi)
        with _bwd_lock:
            prog = _bwd_cache.setdefault(key, prog)
    return prog


# ------------------------------------------------------------------------- forward / backward (2-D), two entries
# torch.compile: the torch.library custom ops coda::linear / coda::linear_backward (fake implementations, autograd),
# which it traces as single ops instead of tracing into the kernels. Eager: ops._common.call runs the same
# functions through an autograd.Function (no dispatcher host time). The epilogue travels by name
# (DslEpilogue.op_name), operands as a tensor list plus (names, values) of the Python-number scalars; names are
# comma-separated.
def _backward_impl(grads, x2, weight, epilogue, save_preact, names, tensors, scalar_names, scalar_values, saved,
                   needs, fresh: bool = False) -> list:
    """[dX, dW, d(tensors)...] for the upstream ``grads`` (one per result, None where none); ``saved``: the
    forward's max / logsumexp results, then the pre-activation parts; ``needs``: [x, weight, *tensors]; None where
    not needed. ``fresh`` (the custom op): every result a new contiguous tensor (a custom op's outputs may not
    alias its inputs or each other; e.g. dacc = the upstream gradient is copied), empty ones where not needed."""
    epi = by_op_name(epilogue)
    names = _split(names)
    scalars = dict(zip(_split(scalar_names), scalar_values))
    value_names = [r.name for r in epi.reductions if r.op != "sum"]
    maxes = tuple(r.name for r in epi.reductions if r.op == "max")
    vals = dict(zip(value_names, saved))
    preact = saved_preact(epi, *saved[len(value_names):]) if save_preact else None
    keys = epi.result_keys
    present = tuple(k for k, g in zip(keys, grads) if g is not None)
    need_x, need_w = needs[0], needs[1]
    needed = tuple(n for n, need in zip(names, needs[2:]) if need)
    res, dx, dw = {}, None, None
    if present:
        # TileMN operands of a pairs epilogue: M x N/2 gradients, a second (half-mode) launch; the rest with dacc
        tile_needs = pair_tile_operands(epi, needed)
        main_needs = tuple(n for n in needed if n not in tile_needs)
        ops = dict(zip(names, tensors), **scalars)
        for k, g in zip(keys, grads):
            if g is None:
                continue
            if epi.pair_mode == "full" and k not in epi.red_specs:  # 2 -> 2 pairs: even / odd columns, two tiles
                ops[grad_name(k)] = g[..., 0::2].contiguous()
                ops[grad_name(odd_key(k))] = g[..., 1::2].contiguous()
            else:
                ops[grad_name(k)] = g.contiguous()
            if k in vals and k not in maxes:
                ops[value_name(k)] = vals[k]
        if any(grad_name(k) in ops for k in maxes):  # max reductions: each element's share of the gradient
            ops.update(_tie_operands(epi, tuple(k for k in maxes if grad_name(k) in ops), x2, weight,
                                     {o.name: ops[o.name] for o in epi.operands}))
        if preact is not None and any(value_name(k) in ops for k in vals):
            # max / logsumexp results of the rounded pre-activation, so that ties still match
            parts = list(preact.values())  # pairs: even / odd columns interleaved back into M x N
            full = parts[0] if len(parts) == 1 else torch.stack(parts, -1).flatten(-2)
            fwd = epi.reference(full.to(torch.promote_types(full.dtype, torch.float32)),
                                **dict(zip(names, tensors), **scalars))
            ops.update({value_name(k): fwd[k] for k in vals if value_name(k) in ops})
        if need_x or need_w or main_needs:
            res = evaluate(epi, (present, main_needs, False), x2, weight, ops, preact, x2.dtype)
            dx, dw = linear_grads(res["out"], x2, weight, need_x, need_w, ENTRY)
        if tile_needs:
            dtype = functools.reduce(torch.promote_types, (ops[n].dtype for n in tile_needs))
            tiles = evaluate(epi, (present, tile_needs, True), x2, weight, ops, preact, dtype)
            res.update({DGRAD + n: tiles["out" if i == 0 else DGRAD + n] for i, n in enumerate(tile_needs)})
    kinds = {o.name: o.kind for o in epi.operands}
    outs = [x2.new_zeros(x2.shape) if dx is None and need_x else dx, weight.new_zeros(weight.shape)
            if dw is None and need_w else dw]
    for n, t, need in zip(names, tensors, needs[2:]):
        d = res.get(DGRAD + n) if need else None
        if need and d is None:  # no upstream gradient reached the results
            d = torch.zeros_like(t)
        elif need:
            d = (d.sum().reshape(t.shape) if kinds[n] == "scalar" else d).to(t.dtype)
        outs.append(d)
    if not fresh:
        return outs
    taken = {t.untyped_storage().data_ptr() for t in (*[g for g in grads if g is not None], x2, weight, *tensors,
                                                     *saved) if t.numel()}
    fresh = []
    for o, like in zip(outs, (x2, weight, *tensors)):
        if o is None:
            fresh.append(like.new_empty(0))
            continue
        if o.numel() and o.untyped_storage().data_ptr() in taken:
            o = o.clone()
        o = o.contiguous()
        taken.add(o.untyped_storage().data_ptr())
        fresh.append(o)
    return fresh


def _backward_fake(grads, x2, weight, epilogue, save_preact, names, tensors, scalar_names, scalar_values, saved,
                   needs):
    return [like.new_empty(like.shape) if need else like.new_empty(0)
            for like, need in zip((x2, weight, *tensors), needs)]


@backward_op("linear_backward", fake=_backward_fake, eager=_backward_impl)
def _linear_backward_op(grads: List[Optional[Tensor]], x2: Tensor, weight: Tensor, epilogue: str, save_preact: bool,
                        names: str, tensors: List[Tensor], scalar_names: str, scalar_values: List[float],
                        saved: List[Tensor], needs: List[bool]) -> List[Tensor]:
    return _backward_impl(grads, x2, weight, epilogue, save_preact, names, tensors, scalar_names, scalar_values,
                          saved, needs, fresh=True)


def _split(names: str) -> list:
    return names.split(",") if names else []


def _saved(inputs, output):
    """x2, weight, the tensor operands, the forward's max / logsumexp results, then the pre-activation parts."""
    x2, weight, epilogue, _, _, tensors = inputs[:6]
    epi = by_op_name(epilogue)
    keys = epi.result_keys
    res = dict(zip(keys, output))
    return (x2, weight, *tensors, *(res[r.name] for r in epi.reductions if r.op != "sum"), *output[len(keys):])


def _extra(inputs):
    """(epilogue, save_preact, names, scalar_names, scalar_values, the number of tensor operands, of results, the
    inputs' requires_grad [x2, weight, *tensors])."""
    x2, weight, epilogue, save_preact, names, tensors, scalar_names, scalar_values = inputs[:8]
    return (epilogue, save_preact, names, scalar_names, list(scalar_values), len(tensors),
            len(by_op_name(epilogue).result_keys), [x2.requires_grad, weight.requires_grad,
                                                    *(t.requires_grad for t in tensors)])


def _backward(ctx, grads):
    """The autograd backward (through the coda::linear_backward op under torch.compile, so that traces see one
    op)."""
    epilogue, save_preact, names, scalar_names, scalar_values, n_tensors, n_keys, needs = ctx.coda_extra
    saved = [t.detach() for t in ctx.saved_tensors]  # the kernels take plain tensors (no autograd export)
    x2, weight, tensors = saved[0], saved[1], list(saved[2:2 + n_tensors])
    grads = [g if g is None else g.detach() for g in grads[:n_keys]]
    # the return mirrors the inputs' structure as torch.library flattens it: a list of numbers is one leaf, an
    # empty list a list
    no_scalars = None if scalar_values else []
    # one entry per argument as passed: torch.library's structure leaves out a defaulted out_dtype (its
    # needs_input_grad has the passed arguments' structure); the eager Function always passes all nine
    n_inputs = 9 if getattr(ctx, "coda_eager", False) else len(ctx.needs_input_grad)
    nothing = (None, None, None, None, None, [None] * n_tensors, None, no_scalars, None)[:n_inputs]
    if all(g is None for g in grads) or not any(needs):
        return nothing
    d = call("linear_backward", grads, x2, weight, epilogue, save_preact, names, tensors, scalar_names,
             scalar_values, list(saved[2 + n_tensors:]), needs, ctx=ctx)
    pick = [grad_of(t) if need else None for t, need in zip(d, needs)]  # empty 1-D: updated in backward
    return (pick[0], pick[1], None, None, None, pick[2:], None, no_scalars, None)[:n_inputs]


def _fake(x2, weight, epilogue, save_preact, names, tensors, scalar_names, scalar_values, out_dtype=None):
    epi = by_op_name(epilogue)
    M, N = x2.shape[0], weight.shape[0]
    cols = epi.out_cols(N)  # N/2 for a half-mode pairs epilogue
    axes = {r.name: r.axis for r in epi.reductions}
    dt = out_dtype or x2.dtype
    red = torch.promote_types(x2.dtype, torch.float32) if x2.dtype == torch.float64 else torch.float32
    outs = [x2.new_empty(M, cols, dtype=dt) for _ in range(epi.stores_out)]
    outs += [x2.new_empty(M, cols, dtype=dt) for _ in epi.outputs]
    outs += [x2.new_empty(M if axes[k] == "n" else cols, dtype=red) for k in axes]
    pre = (N // 2 if epi.pair_mode else N)
    return outs + [x2.new_empty(M, pre, dtype=dt) for _ in (preact_keys(epi) if save_preact else ())]


# results differentiable (their count: the epilogue's), the pre-activation parts not
@forward_op("linear", fake=_fake, backward=_backward, saved=_saved, extra=_extra,
            outputs=lambda inputs: len(by_op_name(inputs[2]).result_keys))
def _linear_op(x2: Tensor, weight: Tensor, epilogue: str, save_preact: bool, names: str,
               tensors: List[Tensor], scalar_names: str, scalar_values: List[float],
               out_dtype: Optional[torch.dtype] = None) -> List[Tensor]:
    """The epilogue's results (``result_keys`` order), then, with ``save_preact``, the pre-activation parts."""
    epi = by_op_name(epilogue)
    ops = dict(zip(_split(names), tensors), **dict(zip(_split(scalar_names), scalar_values)))
    res = gemm_for(x2.device, ENTRY)(x2, weight, epilogue=with_preact(epi) if save_preact else epi,
                                     out_dtype=out_dtype, **ops)
    res = res if isinstance(res, dict) else {"out": res}
    return [res[k] for k in (*epi.result_keys, *(preact_keys(epi) if save_preact else ()))]


def saved_preact(epi: DslEpilogue, *parts):
    """The saved pre-activation as ``evaluate`` takes it: {name: tensor} (one M x N tensor, or a pairs epilogue's
    even / odd columns, M x N/2 each), or None when nothing was saved (no parts, or empty ones)."""
    if not parts or parts[0] is None or not parts[0].numel():
        return None
    return dict(zip(preact_keys(epi), parts))


def _tie_operands(epi: DslEpilogue, maxes: tuple, x2, weight, fwd_ops: dict) -> dict:
    """The operands ``tie_<name>`` of the max reductions ``maxes``: each element's share of its row's gradient
    (exact ties split it, as torch's amax does), from the values the forward compared: the reduced expressions on
    the fp32 accumulator, recomputed by one GEMM (also with ``save_preact``, whose saved pre-activation is rounded
    to the output dtype: 1000 and 1000.03125 would tie in bf16)."""
    prog = backward_of(epi, maxes, (), ties=True)
    dt = torch.promote_types(x2.dtype, torch.float32)
    res = gemm_for(x2.device, ENTRY)(x2, weight, epilogue=prog, out_dtype=dt, **fwd_ops)
    res = res if isinstance(res, dict) else {"out": res}
    return {tie_name(k): tie_shares(res["out" if i == 0 else k]) for i, k in enumerate(maxes)}


def evaluate(epi: DslEpilogue, which: tuple, x2, weight, ops: dict, preact, out_dtype) -> dict:
    """The results of the backward program ``backward_of(epi, *which)`` (dacc and operand gradients, or a pairs
    epilogue's TileMN gradients), ``out`` cast to ``out_dtype``: computed on a recomputed accumulator (one GEMM of
    x and W), on the saved pre-activation ``preact`` (a dict of its tensors; the same program as a K = 0 GEMM:
    one memory pass of CODA's kernel), or -- when they do not depend on the accumulator -- elementwise (torch ops;
    nothing at all when ``out`` is one of the tile operands, e.g. dacc = the upstream gradient)."""
    bwd = backward_of(epi, *which)
    if not bwd.symbols & {ACC, ACC_EVEN, ACC_ODD} and not bwd.reductions:
        tiles = {operand_symbol(o.name): o.name for o in bwd.operands if o.kind == "tile"}
        if set(bwd.exprs) == {"out"} and bwd.exprs["out"] in tiles:
            return {"out": ops[tiles[bwd.exprs["out"]]].to(out_dtype)}
        acc_dtype = torch.promote_types(x2.dtype, torch.float32)  # float64 on the CPU reference path: gradcheck
        acc0 = torch.zeros((), dtype=acc_dtype, device=x2.device).expand(x2.shape[0], weight.shape[0])
        res = bwd.reference(acc0, **ops)
    elif preact is None:
        res = gemm_for(x2.device, "coda.ops.linear")(x2, weight, epilogue=bwd, out_dtype=out_dtype, **ops)
    else:
        res = epilogue_pass(gemm_for(x2.device, "coda.ops.linear"), x2, x2.shape[0], weight.shape[0],
                            epilogue=backward_of(epi, *which, preact=True), out_dtype=out_dtype, **ops, **preact)
    res = dict(res) if isinstance(res, dict) else {"out": res}
    res["out"] = res["out"].to(out_dtype)
    return res


def linear(x: torch.Tensor, weight: torch.Tensor, *, epilogue=None, save_preact: bool = False,
           out_dtype: Optional[torch.dtype] = None, **operands):
    """``epilogue(x @ weight.T)`` with autograd; ``x`` (..., K), ``weight`` (N, K) like ``F.linear``.

    Operands follow the epilogue's declared kinds, with x's leading dims: VecM (...,), TileMN (..., N), VecN (N,),
    Scalar (a number, or a 1-element tensor that gets a gradient). Returns the main output (..., N), or a dict of
    the main output, extra outputs (..., N) and reductions ((...,) for reduce_n, (N,) for reduce_m). For a pairs
    epilogue (``coda.pairs``) TileMN / VecN operands and half-mode outputs have N/2 columns.

    ``save_preact=True``: the forward kernel also stores the pre-activation (no second GEMM) and the backward
    evaluates dacc and the operand gradients on it (a K = 0 launch: one memory pass) instead of recomputing the
    accumulator with a GEMM (M x N saved bytes, in the output dtype, for an M x N x K GEMM). A half-mode pairs
    epilogue saves it as two extra M x N/2 outputs, the pairs' even and odd accumulator values (interleaved back for
    the backward). A 2 -> 2 pairs epilogue cannot carry extra outputs in the kernel: ``save_preact=True`` is a
    ValueError there.

    ``out_dtype``: the dtype of the main and extra outputs (and of the saved pre-activation): bfloat16, float16 or
    float32, default x's dtype; reductions are float32. dtypes: x and weight both bfloat16 or both float16; on CPU
    tensors (the reference path, ``coda.reference``) both float32 or both float64 too, computed in their own
    precision (float64 math for float64, any floating ``out_dtype``; epilogue operands may be float64), so that
    ``torch.autograd.gradcheck`` can check a custom epilogue's derived backward. Errors name the arguments as
    passed here (``x``, ``weight``, ``out_dtype``, the operands)."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"linear: x and weight must be torch tensors, got {type(x).__name__} and "
                        f"{type(weight).__name__}")
    if x.dim() < 1 or weight.dim() != 2:
        raise ValueError(f"linear: x must be (..., K) and weight (N, K); got x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x has K={x.shape[-1]} but weight has K={weight.shape[1]} (weight is (N, K))")
    if not isinstance(save_preact, bool):
        raise TypeError(f"linear: save_preact must be True or False, got {save_preact!r}")
    check_inputs("linear", x, weight)
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"linear: out_dtype must be a torch.dtype or None, got {out_dtype!r}")
    if epilogue is None:
        epilogue = _identity()
    if not isinstance(epilogue, DslEpilogue):
        raise TypeError("linear: epilogue must be made with @coda.epilogue (its backward is derived from the "
                        f"traced math), got {type(epilogue).__name__}")
    if save_preact and epilogue.pair_mode == "full":
        raise ValueError(f"linear: save_preact=True is not supported for the 2 -> 2 pairs epilogue {epilogue.name!r}: "
                         "the kernel stores exactly its two values per pair and cannot carry the extra outputs that "
                         "would save the pre-activation; use save_preact=False (the backward recomputes the "
                         "accumulator pairs with one more GEMM)")
    lead, K, N = x.shape[:-1], x.shape[-1], weight.shape[0]
    M = 1
    for d in lead:
        M *= d
    x2 = x.reshape(M, K)
    kinds = {o.name: o.kind for o in epilogue.operands}
    tile_n = epilogue.operand_cols(N)  # TileMN operands of a pairs epilogue hold one value per pair
    flat = {}
    for n, v in operands.items():
        kind = kinds.get(n)
        if isinstance(v, torch.Tensor) and kind == "vec_m" and tuple(v.shape) == tuple(lead):
            v = v.reshape(M)
        elif isinstance(v, torch.Tensor) and kind == "tile" and tuple(v.shape) == (*lead, tile_n):
            v = v.reshape(M, tile_n)
        elif isinstance(v, torch.Tensor) and kind == "scalar":
            v = v.reshape(1)
        flat[n] = v
    # the same checks as coda.gemm, before anything runs (names, shapes, dtypes, devices); under torch.compile the
    # op's own coda.gemm call makes them when it runs (they read data pointers, which a trace does not have)
    if not torch.compiler.is_compiling():
        _check_gemm(x2, weight, out_dtype, epilogue)
        epilogue.check_operands(_checkable(flat), None, M, N, x.device)
    names = tuple(n for n, v in flat.items() if isinstance(v, torch.Tensor))
    scalars = {n: v for n, v in flat.items() if not isinstance(v, torch.Tensor)}
    outs = call("linear", x2, weight, epilogue.op_name, save_preact, ",".join(names), [flat[n] for n in names],
                ",".join(scalars), [float(v) for v in scalars.values()], out_dtype)
    keys = epilogue.result_keys
    axes = {r.name: r.axis for r in epilogue.reductions}
    res = {}
    for k, t in zip(keys, outs):
        if k in axes:
            res[k] = t.reshape(*lead) if axes[k] == "n" else t
        else:
            res[k] = t.reshape(*lead, epilogue.out_cols(N))  # N/2 columns for a pairs epilogue
    return res["out"] if keys == ["out"] else res  # (an epilogue of reductions only: a dict of them)


_RENAME = (("a/b: ", "x/weight: "), ("a: ", "x: "), ("b: ", "weight: "), ("b.shape[-2]", "weight.shape[0]"))


def _check_gemm(x2: Tensor, weight: Tensor, out_dtype, epilogue: DslEpilogue) -> None:
    """``coda.gemm``'s checks of the forward call (alignment, layout, ``out_dtype``), their messages naming
    ``linear``'s arguments (``x``, ``weight``) instead of ``coda.gemm``'s (``a``, ``b``). Float32 / float64 inputs
    (the CPU reference path) have no layout rules; their ``out_dtype`` is any floating dtype."""
    from coda._validate import check_gemm_args
    from coda.kernels.epilogue import out_flags
    if x2.dtype not in IN_DTYPES:
        if out_dtype is not None and not out_dtype.is_floating_point:
            raise TypeError(f"linear: out_dtype: expected a floating dtype, got {out_dtype}")
        return
    try:
        check_gemm_args(x2, weight, out_dtype=out_dtype, **out_flags(epilogue))
    except (TypeError, ValueError) as e:
        msg = str(e)
        for old, new in _RENAME[:3]:
            if msg.startswith(old):
                msg = new + msg[len(old):]
                break
        raise type(e)("linear: " + msg.replace(*_RENAME[3])) from None


def _checkable(flat: dict) -> dict:
    """The operands as ``check_operands`` reads them: float64 ones (the CPU reference path) as float32 copies."""
    return {n: v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.float64 else v for n, v in flat.items()}


@functools.lru_cache(maxsize=None)
def _identity() -> DslEpilogue:
    from coda.dsl import trace
    return trace(lambda acc: acc, "identity")
