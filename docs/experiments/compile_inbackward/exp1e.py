"""Fused-param slices: keep w/m/v on ctx as attributes (no save_for_backward version check)."""
import torch
from torch import Tensor
from common import *
@torch.library.custom_op("study::linear_attr", mutates_args=())
def linear_attr(x: Tensor, w: Tensor, m: Tensor, v: Tensor) -> Tensor: return x @ w.t()
@linear_attr.register_fake
def _(x, w, m, v): return x.new_empty(*x.shape[:-1], w.shape[0])
def _setup(ctx, inputs, output):
    x, w, m, v = inputs
    ctx.save_for_backward(x)          # x: normal saved tensor
    ctx.wmv = (w, m, v)               # w/m/v: plain attributes -> no version-counter check
def _bwd(ctx, dy):
    x, = ctx.saved_tensors; w, m, v = ctx.wmv
    dx = dy @ w
    torch.ops.study.dw_update_(w, m, v, x, dy)
    return dx, None, None, None
linear_attr.register_autograd(_bwd, setup_context=_setup)

def run(compiled):
    torch._dynamo.reset()
    mod = Fused(torch.ops.study.linear_attr); fn = torch.compile(mod, fullgraph=True) if compiled else mod
    for s in range(3):
        fn(torch.randn(4, 16, generator=torch.Generator().manual_seed(s)).requires_grad_()).backward()
    return mod
e = run(False); print("eager fused-view with ctx attrs: OK")
try:
    c = run(True)
    print("compiled fused-view: max|eager-compiled| W=%.2e m=%.2e v=%.2e W.grad None=%s" % (
        (e.W-c.W).abs().max(), (e.m-c.m).abs().max(), (e.v-c.v).abs().max(), c.W.grad is None))
except Exception as ex: print("compiled ERROR:", type(ex).__name__, str(ex)[:1500])
from torch._inductor.utils import run_and_get_code
torch._dynamo.reset(); mod = Fused(torch.ops.study.linear_attr); fn = torch.compile(mod, fullgraph=True)
_, codes = run_and_get_code(lambda: fn(torch.randn(4, 16)).backward())
print("\n".join(l.strip() for l in codes[-1].splitlines() if "study." in l or "clone" in l or "copy_" in l or "(32, 16)" in l))
