"""Shared by the linear_cross_entropy tests (CPU and GPU): torch's loss (+ z-loss) and a fwd + bwd runner."""
import torch
import torch.nn.functional as F


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def torch_loss(x, w, t, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None):
    """F.cross_entropy(x @ w.T, ...) + z_loss * logsumexp**2 on non-ignored rows, reduced like the loss; with
    ``softcap`` of the capped logits softcap * tanh(x @ w.T / softcap) (Gemma 2)."""
    logits = x @ w.T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits, t, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    if z_loss:
        valid = t != ignore_index
        zl = torch.where(valid, z_loss * torch.logsumexp(logits, -1) ** 2, 0)
        loss = loss + {"none": zl, "sum": zl.sum(), "mean": zl.sum() / valid.sum()}[reduction]
    return loss


def run(fn, x, w, t, up, **kw):
    """(loss, dx, dw) of fn(x, w, t, **kw) with upstream gradient ``up``."""
    xs, ws = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(xs, ws, t, **kw)
    (loss.double() * up).sum().backward()
    return loss.detach(), xs.grad, ws.grad

