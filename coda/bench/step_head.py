"""The LM head's share of a training step (issue 28): the final norm + LM head + loss, forward and backward, timed
alone on the step's shapes in each mode of :mod:`coda.bench.step` (``--head-reps``; the report's "LM head ms").

The stock modes run what the model's forward runs from the last hidden state (``examples/llama_model.py`` and Hugging
Face's loss alike: logits upcast to fp32, mean cross entropy over the shifted labels), under ``torch.compile`` in the
``+compile`` modes (the head alone, so inductor fuses the loss kernels as in the whole step); the fused modes run
``coda.fuse``'s head (the deferred norm, then ``LMHeadCrossEntropy`` on the same labels; under compile a custom op, so
the same kernels as eager). Included on both sides: the gradients of the hidden state, the LM head weight and the
norm weight, and the update of those two weights (the optimizer's step; with ``--optimizer coda-adamw`` the fused
eager modes update the LM head weight inside the backward instead), so each side carries the same work.
"""
from __future__ import annotations


def head_loss(model, fused: bool, ids):
    """loss(h) from the last hidden state h (B, T, H), as the model's forward computes it."""
    import torch
    import torch.nn.functional as F
    norm, head = model.model.norm, model.lm_head
    if fused:
        shift = F.pad(ids, (0, 1), value=head.ignore_index)[..., 1:]
        return lambda h: head(norm(h), shift)
    shift = F.pad(ids, (0, 1), value=-100)[..., 1:].flatten()
    return lambda h: F.cross_entropy(head(norm(h)).flatten(0, -2).to(torch.float32), shift, ignore_index=-100)


def head_ms(model, opt, mode: str, ids, reps: int, warmup: int = 2):
    """ms per pass of the head: ``reps`` passes of forward + backward + ``opt.step()`` (the update of the LM head
    and norm weights: in the fused eager modes coda.optim's update inside the backward, elsewhere the optimizer's
    step) queued back to back between two CUDA events, after ``warmup`` passes (the first compiles), so the host's
    launch time overlaps the GPU's work as in the step."""
    import torch
    f = head_loss(model, mode.startswith("fused"), ids)
    if "+compile" in mode:
        f = torch.compile(f)
    w = model.lm_head.weight
    h = torch.randn(*ids.shape, w.shape[1], device=w.device, dtype=w.dtype, requires_grad=True)

    def one():
        f(h).backward()
        h.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(warmup):
        one()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        one()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / reps
