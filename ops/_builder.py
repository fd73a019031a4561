"""One way to declare a named op's torch integration (issue 27): the forward custom op with its fake, the backward
custom op with its fake, and the autograd glue between them (what is saved, which inputs get gradients, what the
backward is called with), for torch.compile (opaque nodes), ``torch.library.opcheck`` and the eager
autograd.Function path of ``ops._common.call`` alike.

    @backward_op("linear_gated_backward", fake=_backward_fake)
    def _backward(dy, x, weight_gu, g, u, kind, need_x, need_w): ...

    @forward_op("linear_swiglu", fake=_fake, backward="linear_gated_backward", grads=2,
                saved=lambda inputs, out: (inputs[0], inputs[1], *out[1:]),
                extra=lambda inputs: ("swiglu",))
    def _swiglu(x, weight_gu, save_preact): ...

Conventions (those of the ops built here): the forward returns the result, or a tuple (or list) whose first
``outputs`` entries are differentiable and whose other entries are saved-for-backward outputs (marked
non-differentiable); gradients are not materialised (an output that got none has None). With a backward op
(``backward`` its name; one differentiable output): the first ``grads`` inputs are the differentiable ones; the
backward op is called as ``backward(dy, *saved, *arrange(extra, needs))`` (default: the extra values, then the
``grads`` needs flags) and returns one gradient per differentiable input (an empty tensor where not needed);
``dy`` None: no gradient flows. An op whose backward is not that one call (several differentiable outputs,
gradients mapped onto its inputs its own way, or formed in the forward: ``linear``, ``rmsnorm_linear``, the cross
entropy's fast mode) passes its autograd backward itself, ``backward(ctx, *output_grads)``, reading
``ctx.saved_tensors`` and ``ctx.coda_extra``; the builder still generates the custom op, fake, context and eager
entry."""
from __future__ import annotations

import inspect
import typing
from typing import Callable, List, Optional, Union

import torch

from coda import optim

from ._common import call, custom_op, grad_of, register_autograd


def backward_op(name: str, *, fake: Callable, eager=None, updates: tuple = (), update_grads: tuple = ()):
    """Decorator: ``fn`` as the custom op ``coda::<name>`` (a backward: no autograd of its own) with ``fake``;
    ``eager``: as ``ops._common.custom_op``'s. ``updates``: the names of the weight arguments that ``coda.optim``
    may update in place and ``update_grads`` the positions of their gradients among the results: then a second op,
    ``coda::<name>_update``, takes two more arguments, ``slots`` and ``token`` (``coda.optim.compile_slots``) --
    what a torch.compile graph runs for an in-backward update (:func:`_update_op`)."""
    def wrap(fn):
        op = custom_op(name, eager=eager)(fn)
        op.register_fake(fake)
        if updates:
            _update_op(name, fn, fake, updates, update_grads)
        return op
    return wrap


def _update_op(name: str, fn: Callable, fake: Callable, updates: tuple, update_grads: tuple):
    """``coda::<name>_update(*args, slots, token)``: the backward op ``fn`` run under ``coda.optim.slot_updates``
    (the weights named in ``updates`` updated in their dW GEMMs' epilogues by the optimizer of their slot), their
    gradients returned empty; a weight no live optimizer took gets its gradient in ``.grad`` instead
    (``coda.optim.accumulate_grad``). The op declares only ``token`` mutated: that keeps it in the graph (its
    gradients may have no user) and in order; the weights are written as the eager backward writes them, outside
    what the graph tracks (AOTAutograd rejects a backward that mutates a leaf requiring grad: torch 2.11), which is
    safe because nothing in the backward reads a weight after its update (dX runs first, inside the op)."""
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn)
    params = [p.replace(annotation=hints[p.name]) for p in sig.parameters.values()]
    at = [list(sig.parameters).index(u) for u in updates]
    n_args = len(params)

    def split(args):
        return args[:n_args], args[n_args]  # (the backward's arguments, slots); the token is last

    def run(*args):
        args, slots = split(args)
        with optim.slot_updates([args[i] for i in at], slots):
            out = list(fn(*args))
        for i, slot in zip(update_grads, slots):
            if slot >= 0 and out[i].numel():  # not taken in place: the gradient goes to .grad
                optim.accumulate_grad(slot, out[i])
                out[i] = out[i].new_empty(0)
        return tuple(out) if len(out) > 1 else out[0]

    def fake_run(*args):
        args, slots = split(args)
        out = list(fake(*args))
        for i, slot in zip(update_grads, slots):
            if slot >= 0:
                out[i] = out[i].new_empty(0)
        return tuple(out) if len(out) > 1 else out[0]

    slots = inspect.Parameter("slots", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=List[int])
    token = inspect.Parameter("token", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.Tensor)
    ret = hints["return"] if len(typing.get_args(hints["return"])) > 1 else torch.Tensor
    for f in (run, fake_run):
        # a lone result as a Tensor: a one-tuple's schema (and a Tensor[]) does not functionalize under torch.compile
        f.__signature__ = sig.replace(parameters=[*params, slots, token], return_annotation=ret)
        f.__name__ = f.__qualname__ = f"{name}_update"
    op = custom_op(f"{name}_update", mutates_args=("token",))(run)
    op.register_fake(fake_run)
    return op


def backward_call(ctx, name: str, *args) -> tuple:
    """``ops._common.call`` of the backward op ``name`` from an autograd backward: its in-place update twin when the
    forward carried ``coda.optim`` slots (``ctx.coda_slots``, under torch.compile), else the op itself."""
    if not getattr(ctx, "coda_slots", None):
        return call(name, *args, ctx=ctx)
    out = call(f"{name}_update", *args, ctx.coda_slots, ctx.coda_token, ctx=ctx)
    return (out,) if isinstance(out, torch.Tensor) else out


def forward_op(name: str, *, fake: Callable, backward: Union[str, Callable], saved: Callable, grads: int = 0,
               extra: Optional[Callable] = None, arrange: Optional[Callable] = None,
               outputs: Union[int, Callable] = 1, eager=None, slots: Optional[int] = None):
    """Decorator: ``fn`` as the custom op ``coda::<name>`` with ``fake`` and autograd through ``backward``: the
    backward op's name, or the autograd backward function itself (module docstring). ``saved(inputs, output)``:
    the tensors (or None) to save; ``extra(inputs)``: non-tensor values the backward needs (default none; kept as
    ``ctx.coda_extra``); ``arrange(extra, needs)``: the backward op's arguments after the saved tensors (default
    ``(*extra, *needs)``); ``outputs``: how many leading outputs are differentiable (an int, or a function of the
    inputs); ``eager``: as ``ops._common.custom_op``'s; ``slots``: the position of the op's optional ``slots``
    argument, followed by ``token`` (``ops._common.update_args``), when the backward op has an ``_update`` twin
    (:func:`backward_op`'s ``updates``), which the backward then calls with them."""
    def wrap(fn):
        op = custom_op(name, eager=eager)(fn)
        op.register_fake(fake)

        def setup_context(ctx, inputs, output):
            ctx.set_materialize_grads(False)  # saved outputs get no gradient: no zero tensors of their size
            if isinstance(output, (tuple, list)):
                ctx.mark_non_differentiable(*output[outputs(inputs) if callable(outputs) else outputs:])
            ctx.coda_extra = tuple(extra(inputs)) if extra is not None else ()
            carried = slots is not None and len(inputs) > slots + 1 and inputs[slots]
            ctx.coda_slots, ctx.coda_token = (inputs[slots], inputs[slots + 1]) if carried else ([], None)
            ctx.save_for_backward(*saved(inputs, output))

        def autograd_backward(ctx, dy, *_):
            n_in = len(ctx.needs_input_grad)
            needs = tuple(ctx.needs_input_grad[:grads])
            if dy is None or not any(needs):
                return (None,) * n_in
            rest = arrange(ctx.coda_extra, needs) if arrange is not None else (*ctx.coda_extra, *needs)
            out = backward_call(ctx, backward, dy, *ctx.saved_tensors, *rest)
            # an empty gradient: not needed, or a weight updated in its dW GEMM (coda.optim): no gradient
            return tuple(grad_of(g) if need else None for g, need in zip(out, needs)) + (None,) * (n_in - grads)

        register_autograd(name, backward if callable(backward) else autograd_backward, setup_context)
        return op
    return wrap
