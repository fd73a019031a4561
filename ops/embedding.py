"""``coda.ops.embedding``: ``F.embedding`` whose backward, under ``coda.optim.AdamW``, updates the weight in place
(``coda.kernels.embedding_adamw``) instead of forming its V x H gradient.

Forward: torch's lookup (``F.embedding``). Backward: when this is an eager backward and a ``coda.optim.AdamW``
registered the weight for in-backward updates (a 16-bit contiguous CUDA matrix on a Hopper GPU with H a multiple of
8, or any CPU weight: the reference path), one pass sums each row's token gradients and applies the AdamW step to
every row (the weight gets no ``.grad``, as the other in-backward weights); otherwise the gradient is torch's
(``embedding_dense_backward``), for any optimizer, for a tied weight (its gradient has two parts) and for weights
the kernel does not take. ``padding_idx`` as torch's: its row gets no gradient (under the update: a zero one, so it
still decays as torch's AdamW decays it). Under torch.compile the backward op's in-place twin (``ops._builder``;
the graph carries the weight's ``coda.optim`` slot) does the same update.

Measured (H100, llama-1b step, docs/NOTES.md session 33): the embedding's backward + update kernels 1.26 ms a step
instead of 3.02 (zero fill, sort, two scatters, torch's fused AdamW); the step as one CUDA graph 130.3 / 130.6 ms vs
132.9 / 132.7 (two alternated rounds on one machine).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from coda import _device
from coda.kernels.embedding_adamw import VEC, embedding_adamw
from coda.optim import in_backward_operands

from ._builder import backward_op, forward_op
from ._common import IN_DTYPES, call, check_tensors, update_args

__all__ = ["embedding"]


def embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: Optional[int] = None) -> torch.Tensor:
    """``F.embedding(ids, weight, padding_idx)`` (the module docstring: its backward under ``coda.optim``).
    ``ids``: an integer tensor of any shape with values in [0, V); ``weight``: (V, H). Returns ids.shape + (H,)."""
    check_tensors("embedding", [("ids", ids), ("weight", weight)])
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"embedding: ids must be int64 or int32, got {ids.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"embedding: weight must be 2-D (V, H), got shape {tuple(weight.shape)}")
    if ids.device != weight.device:
        raise ValueError(f"embedding: ids is on {ids.device} but weight is on {weight.device}")
    V = weight.shape[0]
    if padding_idx is not None:
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, int) or not -V <= padding_idx < V:
            raise ValueError(f"embedding: padding_idx must be an int in [-{V}, {V}) or None, got {padding_idx!r}")
        padding_idx %= V
    # under torch.compile the weight coda.optim holds is updated by the backward op's in-place twin
    return call("embedding", weight, ids, padding_idx, *update_args(weight, when=torch.is_grad_enabled()))


def _updates_in_place(weight: torch.Tensor) -> bool:
    """Whether the kernel (or on the CPU the reference) can take ``weight``'s update (before asking coda.optim,
    whose answer commits to it)."""
    if weight.device.type == "cpu":
        return True
    return (weight.dtype in IN_DTYPES and weight.is_contiguous() and weight.shape[1] % VEC == 0
            and weight.data_ptr() % 16 == 0 and _device.is_hopper(weight.device))


def _fake_backward(dy, ids, weight, padding_idx, need_w):
    return (weight.new_empty(weight.shape) if need_w else weight.new_empty(0),)


@backward_op("embedding_backward", fake=_fake_backward, updates=("weight",), update_grads=(0,))
def _backward(dy: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, padding_idx: Optional[int],
              need_w: bool) -> tuple[torch.Tensor]:
    """(dW,): the weight's gradient, or an empty tensor (not needed, or updated in place by coda.optim)."""
    if not need_w:
        return (weight.new_empty(0),)
    H = weight.shape[1]
    dy2, ids1 = dy.reshape(-1, H), ids.reshape(-1)
    ops = in_backward_operands(weight) if _updates_in_place(weight) else None
    if ops is not None:
        from coda.epilogues.adamw import HYPER
        hyper = torch.cat([ops[name].reshape(1) for name in HYPER])
        if weight.dtype == torch.float64:
            hyper = hyper.double()
        embedding_adamw(dy2.to(weight.dtype), ids1, ops["p"], ops["m"], ops["v"], hyper, padding_idx)
        return (weight.new_empty(0),)
    return (torch.ops.aten.embedding_dense_backward(dy2, ids1, weight.shape[0],
                                                    -1 if padding_idx is None else padding_idx, False),)


def _fake(weight, ids, padding_idx=None, slots=None, token=None):
    return weight.new_empty(*ids.shape, weight.shape[1])


@forward_op("embedding", fake=_fake, backward="embedding_backward", grads=1,
            saved=lambda inputs, out: (inputs[1], inputs[0]), extra=lambda inputs: (inputs[2],),
            slots=3)
def _embedding_op(weight: torch.Tensor, ids: torch.Tensor, padding_idx: Optional[int] = None,
                  slots: Optional[list[int]] = None, token: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ids.shape + (H,): the rows of ``weight``. ``slots``, ``token``: ``coda.optim.compile_slots`` of the weight
    under torch.compile (the backward updates it in place), else None."""
    return F.embedding(ids, weight, padding_idx)
