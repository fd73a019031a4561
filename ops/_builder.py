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

from typing import Callable, Optional, Union

from ._common import call, custom_op, grad_of, register_autograd


def backward_op(name: str, *, fake: Callable, eager=None):
    """Decorator: ``fn`` as the custom op ``coda::<name>`` (a backward: no autograd of its own) with ``fake``;
    ``eager``: as ``ops._common.custom_op``'s."""
    def wrap(fn):
        op = custom_op(name, eager=eager)(fn)
        op.register_fake(fake)
        return op
    return wrap


def forward_op(name: str, *, fake: Callable, backward: Union[str, Callable], saved: Callable, grads: int = 0,
               extra: Optional[Callable] = None, arrange: Optional[Callable] = None,
               outputs: Union[int, Callable] = 1, eager=None):
    """Decorator: ``fn`` as the custom op ``coda::<name>`` with ``fake`` and autograd through ``backward``: the
    backward op's name, or the autograd backward function itself (module docstring). ``saved(inputs, output)``:
    the tensors (or None) to save; ``extra(inputs)``: non-tensor values the backward needs (default none; kept as
    ``ctx.coda_extra``); ``arrange(extra, needs)``: the backward op's arguments after the saved tensors (default
    ``(*extra, *needs)``); ``outputs``: how many leading outputs are differentiable (an int, or a function of the
    inputs); ``eager``: as ``ops._common.custom_op``'s."""
    def wrap(fn):
        op = custom_op(name, eager=eager)(fn)
        op.register_fake(fake)

        def setup_context(ctx, inputs, output):
            ctx.set_materialize_grads(False)  # saved outputs get no gradient: no zero tensors of their size
            if isinstance(output, (tuple, list)):
                ctx.mark_non_differentiable(*output[outputs(inputs) if callable(outputs) else outputs:])
            ctx.coda_extra = tuple(extra(inputs)) if extra is not None else ()
            ctx.save_for_backward(*saved(inputs, output))

        def autograd_backward(ctx, dy, *_):
            n_in = len(ctx.needs_input_grad)
            needs = tuple(ctx.needs_input_grad[:grads])
            if dy is None or not any(needs):
                return (None,) * n_in
            rest = arrange(ctx.coda_extra, needs) if arrange is not None else (*ctx.coda_extra, *needs)
            out = call(backward, dy, *ctx.saved_tensors, *rest, ctx=ctx)
            # an empty gradient: not needed, or a weight updated in its dW GEMM (coda.optim): no gradient
            return tuple(grad_of(g) if need else None for g, need in zip(out, needs)) + (None,) * (n_in - grads)

        register_autograd(name, backward if callable(backward) else autograd_backward, setup_context)
        return op
    return wrap
