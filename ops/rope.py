"""``coda.ops.linear_rope``: a projection followed by RoPE (rotary position embedding) as one GEMM + epilogue -- the
QKV projection of attention with q and k rotated, no separate rotary kernel and no M x N round trip.

    y = linear_rope(x, weight, positions, freqs),  z = x @ weight.T:
    (y[m, 2j], y[m, 2j+1]) = R(positions[m] * freqs[j]) (z[m, 2j], z[m, 2j+1])

with R(theta) the 2 x 2 rotation (``coda/epilogues/rope.py`` has the algebra). Column pairs (2j, 2j+1) are rotated:
the interleaved convention. For Hugging Face / Llama checkpoints (half-split ``rotate_half``), permute the W_q / W_k
rows once with ``coda.ops.permute_half_split`` (attention scores are unchanged, see its docstring) and build
``freqs`` with ``coda.ops.rope_freqs`` (0 for V and other unrotated columns).

Forward: one GEMM x W^T whose epilogue rotates each pair by theta = pos * freq, with the angle formed and reduced
modulo 2 pi in extended precision (``coda._eval.reduce_angle``: accurate to a few 1e-7 rad at position 131072, where
an fp32 product ``pos * freq`` is off by up to 4e-3 rad). Output (..., N) in x's dtype.

Backward: the derivative is the rotation by -theta (``coda.autodiff`` derives it from the traced forward; the
cached backward epilogue of ``ops.linear``). It needs no accumulator, so it runs as the epilogue of a GEMM with
nothing to multiply (K = 0: ``coda.gemm`` gives the kernel one all-zero K tile), reading the upstream gradient as
even / odd per-pair tiles: dacc (M x N, x's dtype) in one launch of CODA's kernel with the same accurate angles.
Then dX = dacc W and dW = dacc^T X on CODA's kernel with transposed views (``ops/_common.backward_gemm``). Saved:
x, the weight, positions and freqs. ``positions`` and ``freqs`` get no gradient (one that requires grad is an
error). Because the rotation preserves dot products, z . dz of the GEMM output equals y . dy of the rotated
output: the RMSNorm backward's ZdZ can be formed from the post-RoPE tensors.

torch integration: custom ops ``torch.ops.coda.linear_rope`` (2-D x, positions (M,) fp32) and
``coda::linear_rope_backward`` with fake impls and autograd, so ``torch.compile(fullgraph=True)`` keeps them as
opaque nodes and ``torch.library.opcheck`` passes.

Device: on a Hopper GPU the fused kernels run; on CPU the same epilogue programs run through ``coda.reference.gemm``
(torch ops; the reference forms the angle in float64); other GPUs raise (``ops/_common.py``).
"""
from __future__ import annotations

import math
from typing import Union

import torch
from torch import Tensor

from coda.autodiff import grad_name
from coda.dsl import ODD_OUT
from coda.epilogues.rope import permute_half_split, rope, rope_freqs, unpermute_half_split

from ._builder import backward_op, forward_op
from ._common import call, check_last_dim_contiguous, check_tensors, epilogue_pass, gemm_for, linear_grads
from .linear import backward_of

__all__ = ["linear_rope", "rope_freqs", "permute_half_split", "unpermute_half_split"]

ENTRY = "coda.ops.linear_rope"
_IN_DTYPES = (torch.bfloat16, torch.float16)
_POS_DTYPES = (torch.float32, torch.int32, torch.int64)
_ALIGN = 8  # 16-byte rows of 16-bit elements
_MAX_POS = 2 ** 24  # integers below this are exact in fp32


# ------------------------------------------------------------------------------------------------ checks
def _check(x, weight, positions, freqs) -> None:
    """Every argument rule but the positions' values (:func:`_check_positions`), before anything is computed;
    each message names the argument."""
    check_tensors("linear_rope", (("x", x), ("weight", weight), ("positions", positions), ("freqs", freqs)))
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"linear_rope: x must be bfloat16 or float16, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise TypeError(f"linear_rope: weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if positions.dtype not in _POS_DTYPES:
        raise TypeError(f"linear_rope: positions must be int64, int32 or float32 (integer positions below 2^24), "
                        f"got {positions.dtype}")
    if freqs.dtype != torch.float32:
        raise TypeError(f"linear_rope: freqs must be float32 (one frequency per column pair), got {freqs.dtype}")
    if x.dim() < 1:
        raise ValueError("linear_rope: x must be (..., K), got a 0-d tensor")
    K = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"linear_rope: weight must be (N, K) with K={K} (x's last dim), got {tuple(weight.shape)}")
    for name, t in (("weight", weight), ("positions", positions), ("freqs", freqs)):
        if t.device != x.device:
            raise ValueError(f"linear_rope: {name} is on {t.device} but x is on {x.device}")
    N = weight.shape[0]
    if N % 2:
        raise ValueError(f"linear_rope: weight has N={N} rows; RoPE rotates column pairs (2j, 2j+1), so N must be "
                         "even")
    if N % _ALIGN:
        raise ValueError(f"linear_rope: weight has N={N} rows; N must be a multiple of {_ALIGN} (the kernel writes "
                         "16-byte rows of the (..., N) output)")
    if K % _ALIGN:
        raise ValueError(f"linear_rope: x: K = x.shape[-1] = {K} must be a multiple of {_ALIGN} (the kernel reads "
                         "16-byte rows)")
    lead = tuple(x.shape[:-1])
    try:
        torch.broadcast_shapes(tuple(positions.shape), lead)
        ok = len(positions.shape) <= len(lead) and torch.broadcast_shapes(tuple(positions.shape), lead) == lead
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"linear_rope: positions must have shape {lead} (x.shape[:-1]: one position per row of x) "
                         f"or broadcast to it, got {tuple(positions.shape)}")
    if tuple(freqs.shape) != (N // 2,):
        raise ValueError(f"linear_rope: freqs must have shape ({N // 2},) (one frequency per column pair: N/2 with "
                         f"N={N}; see coda.ops.rope_freqs), got {tuple(freqs.shape)}")
    for name, t in (("positions", positions), ("freqs", freqs)):
        if t.requires_grad:
            raise ValueError(f"linear_rope: {name} requires grad, but linear_rope computes no gradient for it; pass "
                             f"{name}.detach()")
    check_last_dim_contiguous("linear_rope", (("x", x), ("weight", weight), ("freqs", freqs)))


_CHECKS = {True: "sync", "async": "async", False: "off"}


def _check_positions(positions: Tensor, check) -> None:
    """``positions`` must hold integers in [0, 2^24) (exact in fp32; the angle reduction relies on it):
    ``check_positions`` True reads the values (a device sync on a GPU) and raises a ValueError naming the argument;
    "async" asserts on the device instead (no sync; a bad value fails the CUDA context at the next synchronizing
    call; on CPU tensors it is the True check, which costs no sync there; under torch.compile both are the device
    assert, a RuntimeError on CPU);
    False skips it."""
    if not (isinstance(check, bool) or check == "async"):
        raise TypeError(f"linear_rope: check_positions must be True, False or \"async\", got {check!r}")
    mode = _CHECKS[check]
    if mode == "off" or not positions.numel():
        return
    p = positions
    bad = (p < 0) | (p >= _MAX_POS)
    if p.is_floating_point():
        bad = bad | (p != torch.floor(p))  # NaN too (NaN != NaN)
    msg = (f"linear_rope: positions must be integers in [0, 2^24) = [0, {_MAX_POS}) (exact in float32), got a "
           "value outside")
    if (mode == "async" and p.device.type != "cpu") or torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), msg)
        return
    if bool(bad.any()):
        first = p.reshape(-1)[bad.reshape(-1)][0].item()
        raise ValueError(f"{msg}: {first!r}" + (" (not an integer)" if math.isfinite(first) and first % 1 else ""))


# ------------------------------------------------------------------------------------------------ custom ops (2-D)
@forward_op("linear_rope", fake=lambda x, weight, positions, freqs: x.new_empty(x.shape[0], weight.shape[0]),
            backward="linear_rope_backward", grads=2, saved=lambda inputs, out: inputs)
def _rope_op(x: Tensor, weight: Tensor, positions: Tensor, freqs: Tensor) -> Tensor:
    """RoPE(x @ weight.T) for x (M, K), weight (N, K), positions (M,) fp32, freqs (N/2,) fp32; (M, N)."""
    return gemm_for(x.device, ENTRY)(x, weight, epilogue=rope, pos=positions, freq=freqs)


def unrotate(gemm, dy: Tensor, positions: Tensor, freqs: Tensor) -> Tensor:
    """R(-theta) dy per column pair (M, N), in dy's dtype: the gradient before RoPE. The backward of ``rope`` (a 2 -> 2
    pairs epilogue without acc, reading dy as even / odd tiles) on a K = 0 GEMM: CODA's kernel running only the
    epilogue."""
    bwd = backward_of(rope, ("out",), ())
    # the even and odd columns as two M x N/2 tiles. H100, 8192 x 3072 (bench.kzero.unrotate_sweep): the K = 0 pass
    # (angles per element, one CTA per SM) is most of the 0.19 ms, a clone of dy 0.04; one deinterleaving copy
    # instead of these two measured 1 % faster (session 20): not worth its alignment bookkeeping
    grads = {grad_name("out"): dy[:, 0::2].contiguous(), grad_name(ODD_OUT): dy[:, 1::2].contiguous()}
    return epilogue_pass(gemm, dy, dy.shape[0], dy.shape[1], epilogue=bwd, out_dtype=dy.dtype, pos=positions,
                         freq=freqs, **grads)


@backward_op("linear_rope_backward", fake=lambda dy, x, weight, positions, freqs, need_x, need_w: (
    torch.empty_like(x) if need_x else x.new_empty(0), torch.empty_like(weight) if need_w else weight.new_empty(0)))
def _backward_op(dy: Tensor, x: Tensor, weight: Tensor, positions: Tensor, freqs: Tensor, need_x: bool,
                 need_w: bool) -> tuple[Tensor, Tensor]:
    """(dx (M, K), dweight (N, K)) for the upstream dy (M, N); a gradient not needed comes back empty."""
    gemm = gemm_for(x.device, ENTRY)
    dx, dw = x.new_empty(0), weight.new_empty(0)
    if x.shape[0] == 0:  # no rows: nothing to launch, the gradients are zero
        return (torch.zeros_like(x) if need_x else dx), (torch.zeros_like(weight) if need_w else dw)
    dacc = unrotate(gemm, dy.to(x.dtype), positions, freqs)
    gx, gw = linear_grads(dacc, x, weight, need_x, need_w, ENTRY)
    return (dx if gx is None else gx), (dw if gw is None else gw)


# ------------------------------------------------------------------------------------------------ public entry
def linear_rope(x: Tensor, weight: Tensor, positions: Tensor, freqs: Tensor, *,
                check_positions: Union[bool, str] = True) -> Tensor:
    """``x @ weight.T`` with each column pair (2j, 2j+1) of row m rotated by ``positions[m] * freqs[j]``, in one
    fused GEMM, autograd included (see the module docstring).

    ``x``: (..., K), bfloat16 or float16; ``weight``: (N, K) of x's dtype (W_q / W_k rows in the adjacent-pairs
    order: ``permute_half_split`` converts Hugging Face weights once); ``positions``: x.shape[:-1] (or broadcastable
    to it, e.g. (S,) for x (B, S, K)), int64 / int32 / float32 integer positions below 2^24 (converted to fp32,
    exact); ``freqs``: (N/2,) float32, one frequency per pair (``rope_freqs``; 0 = not rotated). N and K multiples
    of 8. Returns (..., N) in x's dtype. Positions and frequencies get no gradient.

    ``check_positions``: True (default: the values are read -- one device sync on a GPU -- and a non-integer,
    negative or >= 2^24 position is a ValueError naming ``positions``), "async" (a device-side assert, no sync) or
    False (no check; such a position then gives a wrong angle)."""
    _check(x, weight, positions, freqs)
    _check_positions(positions, check_positions)
    lead, K = x.shape[:-1], x.shape[-1]
    M = math.prod(lead)
    pos = torch.broadcast_to(positions, lead).reshape(M).to(torch.float32).contiguous()
    y = call("linear_rope", x.reshape(M, K), weight, pos, freqs)
    return y.reshape(*lead, weight.shape[0])
