import torch, sys
from torch import Tensor

LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.999, 1e-8, 0.01

def adamw_inplace(p, m, v, g):
    # simplified AdamW (no bias correction), all in place
    m.mul_(B1).add_(g, alpha=1 - B1)
    v.mul_(B2).addcmul_(g, g, value=1 - B2)
    p.mul_(1 - LR * WD).addcdiv_(m, v.sqrt().add_(EPS), value=-LR)

# ---- the in-place update op (mutates p, m, v) ----
@torch.library.custom_op("study::dw_update_", mutates_args=("p", "m", "v"))
def dw_update_(p: Tensor, m: Tensor, v: Tensor, x: Tensor, dy: Tensor) -> None:
    g = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])   # dW = dy^T x
    adamw_inplace(p, m, v, g)

@dw_update_.register_fake
def _(p, m, v, x, dy):
    return None

# ---- variant (i)/(iii): m, v are extra non-differentiable forward inputs ----
@torch.library.custom_op("study::linear", mutates_args=())
def linear(x: Tensor, w: Tensor, m: Tensor, v: Tensor) -> Tensor:
    return x @ w.t()

@linear.register_fake
def _(x, w, m, v):
    return x.new_empty(*x.shape[:-1], w.shape[0])

def _setup(ctx, inputs, output):
    x, w, m, v = inputs
    ctx.save_for_backward(x, w, m, v)

def _bwd(ctx, dy):
    x, w, m, v = ctx.saved_tensors
    dx = dy @ w          # uses the OLD weight, computed before the update
    torch.ops.study.dw_update_(w, m, v, x, dy)
    return dx, None, None, None

linear.register_autograd(_bwd, setup_context=_setup)

# ---- variant (ii): m, v looked up from a global registry inside backward ----
REG = {}
@torch.library.custom_op("study::linear_reg", mutates_args=())
def linear_reg(x: Tensor, w: Tensor, key: str) -> Tensor:
    return x @ w.t()

@linear_reg.register_fake
def _(x, w, key):
    return x.new_empty(*x.shape[:-1], w.shape[0])

def _setup2(ctx, inputs, output):
    x, w, key = inputs
    ctx.save_for_backward(x, w)
    ctx.key = key

def _bwd2(ctx, dy):
    x, w = ctx.saved_tensors
    m, v = REG[ctx.key]
    dx = dy @ w
    torch.ops.study.dw_update_(w, m, v, x, dy)
    return dx, None, None

linear_reg.register_autograd(_bwd2, setup_context=_setup2)

class Model(torch.nn.Module):
    def __init__(self, variant, D=16, name="l0"):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(D, D) * 0.1)
        self.variant, self.name = variant, name
        if variant == "buffers":
            self.register_buffer("m", torch.zeros(D, D))
            self.register_buffer("v", torch.zeros(D, D))
        elif variant in ("inputs", "global"):
            REG[name] = (torch.zeros(D, D), torch.zeros(D, D))
    def forward(self, x):
        if self.variant == "buffers":
            y = torch.ops.study.linear(x, self.w, self.m, self.v)
        elif self.variant == "inputs":
            m, v = REG[self.name]
            y = torch.ops.study.linear(x, self.w, m, v)
        else:
            y = torch.ops.study.linear_reg(x, self.w, self.name)
        return torch.relu(y).sum()

def mv(model):
    if model.variant == "buffers":
        return model.m, model.v
    return REG[model.name]

def reference(steps, D=16):
    """pure-eager reference: explicit autograd.grad + adamw_inplace"""
    torch.manual_seed(0)
    w = (torch.randn(D, D) * 0.1).requires_grad_()
    m, v = torch.zeros(D, D), torch.zeros(D, D)
    ws = []
    for s in range(steps):
        x = torch.randn(4, D, generator=torch.Generator().manual_seed(s))
        loss = torch.relu(x @ w.t()).sum()
        g, = torch.autograd.grad(loss, w)
        with torch.no_grad():
            adamw_inplace(w, m, v, g)
        ws.append(w.detach().clone())
    return ws, m, v


class Fused(torch.nn.Module):
    """Two ops on row slices of one fused Parameter [Wa; Wb] (e.g. fused QKV), their moments sliced alike."""
    def __init__(self, op, D=16):
        super().__init__(); torch.manual_seed(0)
        self.op = op
        self.W = torch.nn.Parameter(torch.randn(2*D, D)*0.1)
        self.m = torch.zeros(2*D, D); self.v = torch.zeros(2*D, D); self.D = D
    def forward(self, x):
        D = self.D
        a = self.op(x, self.W[:D], self.m[:D], self.v[:D])
        b = self.op(x, self.W[D:], self.m[D:], self.v[D:])
        return (torch.tanh(a) * b).sum()
