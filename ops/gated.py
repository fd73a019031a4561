"""``coda.ops.linear_swiglu`` / ``coda.ops.linear_geglu``: the gate/up projection of a gated MLP and its activation
as one GEMM + epilogue; the forward writes the (M, I) result and (``save_preact=True``, the default) the M x 2I
gate/up pre-activation for the backward.

    linear_swiglu(x, weight_gu) == F.silu(x @ w_gate.T) * (x @ w_up.T)                      (..., I)
    linear_geglu(x, weight_gu)  == F.gelu(x @ w_gate.T, approximate="tanh") * (x @ w_up.T)   ("none": erf GELU)

with ``weight_gu = interleave_gate_up(w_gate, w_up)``: (2I, H), row 2j = w_gate[j], row 2j+1 = w_up[j]. The
interleaving is a one-time conversion of the weights (at load time; ``deinterleave_gate_up`` converts back, e.g.
to save a checkpoint in the usual layout); it puts gate_j and up_j in adjacent accumulator columns, which one
thread of the kernel holds (``coda.pairs``). The algebra is in ``coda/epilogues/gated.py``.

Forward: one GEMM x W_gu^T with the epilogue ``swiglu`` / ``geglu`` / ``geglu_erf``: (M, I) out, x's dtype; with
``save_preact`` also the pairs' accumulator values g, u (two M x I extra outputs, x's dtype).
Backward (the same programs as ``coda.ops.linear(x, weight_gu, epilogue=swiglu, save_preact=...)``: the backward
epilogue is the sympy derivative of the forward, cached by ``ops.linear``): the 2 -> 2 pairs program writes dacc =
(dg, du) interleaved (M x 2I, x's dtype), on the saved g, u as a K = 0 launch (CODA's kernel running only the
epilogue: one pass over memory) or, with ``save_preact=False``, in a GEMM that recomputes them; then dX = dacc W_gu
and dW_gu = dacc^T X on CODA's kernel with transposed views (``ops/_common.backward_gemm``; ``torch.matmul`` where M
is not a multiple of 8). Saved: x, the weight and (save_preact) g, u. Double backward is not supported.

Shapes: H % 8 == 0 and I % 8 == 0 (2I % 16 == 0): the kernel reads and writes 16-byte rows, and the output has
I columns. Anything else raises ValueError naming the argument, before any compute.

torch integration: custom ops ``torch.ops.coda.linear_swiglu`` / ``coda::linear_geglu`` (2-D x; return (a, g, u),
g and u empty without save_preact; fake impls;
autograd through the custom op ``coda::linear_gated_backward``), so ``torch.compile(fullgraph=True)`` keeps them
as opaque nodes and ``torch.library.opcheck`` passes.

Device: on a Hopper GPU the fused kernels run; on CPU the same epilogue programs run through
``coda.reference.gemm`` (torch ops, fp32 math); other GPUs raise (``ops/_common.py``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from coda.autodiff import grad_name, preact_keys, with_preact
from coda.epilogues.gated import geglu, geglu_erf, swiglu

from ._builder import backward_op, forward_op
from ._common import call, check_last_dim_contiguous, check_tensors, gemm_for, linear_grads, save_preact_for
from .linear import evaluate, saved_preact

__all__ = ["linear_swiglu", "linear_geglu", "interleave_gate_up", "deinterleave_gate_up"]

_IN_DTYPES = (torch.bfloat16, torch.float16)
_ALIGN = 8  # 16-byte rows of 16-bit elements
_EPILOGUES = {"swiglu": swiglu, "geglu_tanh": geglu, "geglu_none": geglu_erf}


# ------------------------------------------------------------------------------------------------ weight layout
def interleave_gate_up(w_gate: Tensor, w_up: Tensor) -> Tensor:
    """``weight_gu`` for ``linear_swiglu`` / ``linear_geglu``: rows interleaved, ``weight_gu[2j] = w_gate[j]``,
    ``weight_gu[2j + 1] = w_up[j]``. ``w_gate``, ``w_up``: (I, H) (``nn.Linear`` weights; any equal shapes work,
    interleaved along dim 0, e.g. biases). A new contiguous tensor (a copy; differentiable). Convert once, when the
    weights are loaded, and train / run on ``weight_gu``."""
    for name, t in (("w_gate", w_gate), ("w_up", w_up)):
        if not isinstance(t, Tensor):
            raise TypeError(f"interleave_gate_up: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 1:
            raise ValueError(f"interleave_gate_up: {name} must have at least one dim, got a 0-d tensor")
    if w_gate.shape != w_up.shape:
        raise ValueError(f"interleave_gate_up: w_gate and w_up must have the same shape, got "
                         f"{tuple(w_gate.shape)} and {tuple(w_up.shape)}")
    if w_gate.dtype != w_up.dtype:
        raise TypeError(f"interleave_gate_up: w_up must have w_gate's dtype {w_gate.dtype}, got {w_up.dtype}")
    if w_gate.device != w_up.device:
        raise ValueError(f"interleave_gate_up: w_up is on {w_up.device} but w_gate is on {w_gate.device}")
    return torch.stack((w_gate, w_up), 1).flatten(0, 1)


def deinterleave_gate_up(weight_gu: Tensor) -> tuple[Tensor, Tensor]:
    """``(w_gate, w_up)`` from an interleaved ``weight_gu`` (2I, ...): the inverse of :func:`interleave_gate_up`.
    Returns views of ``weight_gu`` (rows 0::2 and 1::2, no copy; ``.contiguous()`` them to save compactly)."""
    if not isinstance(weight_gu, Tensor):
        raise TypeError(f"deinterleave_gate_up: weight_gu must be a torch.Tensor, got {type(weight_gu).__name__}")
    if weight_gu.dim() < 1 or weight_gu.shape[0] % 2:
        raise ValueError(f"deinterleave_gate_up: weight_gu must have an even first dim (2I rows: gate, up, gate, "
                         f"...), got shape {tuple(weight_gu.shape)}")
    return weight_gu[0::2], weight_gu[1::2]


# ------------------------------------------------------------------------------------------------ checks
def check_x_weight_gu(entry: str, x, weight_gu) -> None:
    """Every rule on ``x`` and ``weight_gu`` (gate and up rows interleaved), before anything is computed; each
    message names the argument (``entry``: the public op's name). Also used by ``ops/mlp.py``."""
    check_tensors(entry, (("x", x), ("weight_gu", weight_gu)))
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"{entry}: x must be bfloat16 or float16, got {x.dtype}")
    if weight_gu.dtype != x.dtype:
        raise TypeError(f"{entry}: weight_gu must have x's dtype {x.dtype}, got {weight_gu.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{entry}: x must be (..., H), got a 0-d tensor")
    H = x.shape[-1]
    if weight_gu.dim() != 2 or weight_gu.shape[1] != H:
        raise ValueError(f"{entry}: weight_gu must be (2I, H) with H={H} (x's last dim), got "
                         f"{tuple(weight_gu.shape)}")
    if weight_gu.device != x.device:
        raise ValueError(f"{entry}: weight_gu is on {weight_gu.device} but x is on {x.device}")
    N = weight_gu.shape[0]
    if N % (2 * _ALIGN):
        raise ValueError(f"{entry}: weight_gu has {N} rows; it must be 2I interleaved rows (gate, up, ...; see "
                         f"coda.ops.interleave_gate_up) with I % {_ALIGN} == 0, i.e. 2I % {2 * _ALIGN} == 0 (the "
                         "kernel writes 16-byte rows of the (..., I) output)")
    if H % _ALIGN:
        raise ValueError(f"{entry}: x: H = x.shape[-1] = {H} must be a multiple of {_ALIGN} (the kernel reads "
                         "16-byte rows)")
    check_last_dim_contiguous(entry, (("x", x), ("weight_gu", weight_gu)))


# ------------------------------------------------------------------------------------------------ custom ops (2-D)
def _entry(kind: str) -> str:
    return "coda.ops.linear_swiglu" if kind == "swiglu" else "coda.ops.linear_geglu"


def fake_preact(x: Tensor, weight_gu: Tensor, save_preact: bool) -> tuple[Tensor, Tensor]:
    """Fake (meta) g, u of :func:`forward_preact`: M x I each, or empty without ``save_preact``."""
    shape = (x.shape[0], weight_gu.shape[0] // 2) if save_preact else (0,)
    return x.new_empty(shape), x.new_empty(shape)


def _fake(x, weight_gu, *args):
    return (x.new_empty(x.shape[0], weight_gu.shape[0] // 2), *fake_preact(x, weight_gu, args[-1]))


def forward_preact(gemm, x: Tensor, weight_gu: Tensor, epi, save_preact: bool, **ops):
    """(a, g, u): the GEMM x W_gu^T with the half-mode pairs epilogue ``epi``; with ``save_preact`` it also stores
    the pre-activation g, u (the pairs' accumulator values, M x I each; empty tensors otherwise)."""
    if not save_preact:
        return gemm(x, weight_gu, epilogue=epi, **ops), x.new_empty(0), x.new_empty(0)
    res = gemm(x, weight_gu, epilogue=with_preact(epi), **ops)
    return (res["out"], *(res[k] for k in preact_keys(epi)))


def _saved(inputs, output):
    return (inputs[0], inputs[1], *output[1:])  # x, weight_gu, g, u


@backward_op("linear_gated_backward", fake=lambda dy, x, weight_gu, g, u, kind, need_x, need_w: (
    torch.empty_like(x) if need_x else x.new_empty(0),
    torch.empty_like(weight_gu) if need_w else weight_gu.new_empty(0)))
def _backward_op(dy: Tensor, x: Tensor, weight_gu: Tensor, g: Optional[Tensor], u: Optional[Tensor], kind: str,
                 need_x: bool, need_w: bool) -> tuple[Tensor, Tensor]:
    """(dx (M, H), dweight_gu (2I, H)) for the upstream dy (M, I) of the ``kind`` ("swiglu", "geglu_tanh",
    "geglu_none") op; g, u the saved pre-activation (None: recomputed); a gradient not needed comes back as an
    empty tensor."""
    entry = _entry(kind)
    gemm_for(x.device, entry)  # a GPU that is not Hopper raises here, before anything runs
    dx, dw = x.new_empty(0), weight_gu.new_empty(0)
    if x.shape[0] == 0:  # no rows: nothing to launch, the gradients are zero
        return (torch.zeros_like(x) if need_x else dx), (torch.zeros_like(weight_gu) if need_w else dw)
    # the 2 -> 2 pairs program (dg, du) as ops.linear runs it: on the saved g, u (a K = 0 launch) or recomputed
    epi = _EPILOGUES[kind]
    dacc = evaluate(epi, (("out",), (), False), x, weight_gu, {grad_name("out"): dy.contiguous()},
                    saved_preact(epi, g, u), x.dtype)["out"]
    gx, gw = linear_grads(dacc, x, weight_gu, need_x, need_w, entry)
    return (dx if gx is None else gx), (dw if gw is None else gw)


@forward_op("linear_swiglu", fake=_fake, backward="linear_gated_backward", grads=2, saved=_saved,
            extra=lambda inputs: ("swiglu",))
def _swiglu_op(x: Tensor, weight_gu: Tensor, save_preact: bool) -> tuple[Tensor, Tensor, Tensor]:
    """silu(g) u for x (M, H), weight_gu (2I, H) interleaved: (M, I), and (save_preact) g, u (M, I)."""
    return forward_preact(gemm_for(x.device, _entry("swiglu")), x, weight_gu, swiglu, save_preact)


@forward_op("linear_geglu", fake=_fake, backward="linear_gated_backward", grads=2, saved=_saved,
            extra=lambda inputs: ("geglu_" + inputs[2],))
def _geglu_op(x: Tensor, weight_gu: Tensor, approximate: str, save_preact: bool) -> tuple[Tensor, Tensor, Tensor]:
    """gelu(g) u (``approximate``: "tanh" or "none") for x (M, H), weight_gu (2I, H) interleaved: (M, I), and
    (save_preact) g, u (M, I)."""
    return forward_preact(gemm_for(x.device, _entry("geglu")), x, weight_gu, _EPILOGUES["geglu_" + approximate],
                          save_preact)


# ------------------------------------------------------------------------------------------------ public entries
def _apply(op: str, x: Tensor, weight_gu: Tensor, *args, save_preact) -> Tensor:
    """The public entry ``op`` (also the custom op's name): checks, then the op on 2-D x."""
    check_x_weight_gu(op, x, weight_gu)
    save = save_preact_for(op, save_preact, x, weight_gu)
    lead, H = x.shape[:-1], x.shape[-1]
    y = call(op, x.reshape(math.prod(lead), H), weight_gu, *args, save)[0]
    return y.reshape(*lead, weight_gu.shape[0] // 2)


def linear_swiglu(x: Tensor, weight_gu: Tensor, *, save_preact: bool = True) -> Tensor:
    """``silu(x @ w_gate.T) * (x @ w_up.T)`` in one fused GEMM, autograd included (see the module docstring).

    ``x``: (..., H), bfloat16 or float16; ``weight_gu``: (2I, H) of x's dtype, gate and up rows interleaved
    (:func:`interleave_gate_up`). H and I multiples of 8. Returns (..., I) in x's dtype. ``save_preact=True``
    (default) saves the gate/up pre-activation (M x 2I, like the GEMM output torch autograd saves) for the
    backward -- only when autograd records the call (grad mode on and x or weight_gu requiring grad); ``False``
    saves only x and the weight and recomputes it with one more GEMM."""
    return _apply("linear_swiglu", x, weight_gu, save_preact=save_preact)


def linear_geglu(x: Tensor, weight_gu: Tensor, approximate: str = "tanh", *, save_preact: bool = True) -> Tensor:
    """``gelu(x @ w_gate.T, approximate) * (x @ w_up.T)`` in one fused GEMM, autograd included.

    ``approximate``: "tanh" (default: GELU's tanh approximation, as in Gemma / T5 v1.1 / torch
    ``gelu(approximate="tanh")``) or "none" (the exact erf GELU, torch's default). Arguments and result as
    :func:`linear_swiglu`."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"linear_geglu: approximate must be 'tanh' or 'none', got {approximate!r}")
    return _apply("linear_geglu", x, weight_gu, approximate, save_preact=save_preact)
