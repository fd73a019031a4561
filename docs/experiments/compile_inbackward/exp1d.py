"""Variant (i) where the op's weight is a *view* (row slice) of a bigger fused Parameter (e.g. fused QKV)."""
import torch
from common import *
def run(compiled):
    mod = Fused(torch.ops.study.linear); fn = torch.compile(mod, fullgraph=True) if compiled else mod
    for s in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(s)).requires_grad_()
        fn(x).backward()
    return mod
class Split(torch.nn.Module):   # eager reference: two separate params (eager on the fused view version fails, see report)
    def __init__(self, D=16):
        super().__init__(); torch.manual_seed(0); W = torch.randn(2*D, D)*0.1
        self.a = torch.nn.Parameter(W[:D].clone()); self.b = torch.nn.Parameter(W[D:].clone())
        self.st = [torch.zeros(D, D) for _ in range(4)]
    def forward(self, x):
        a = torch.ops.study.linear(x, self.a, self.st[0], self.st[1]); b = torch.ops.study.linear(x, self.b, self.st[2], self.st[3])
        return (torch.tanh(a) * b).sum()
try: run(False); print("eager fused-view: OK")
except Exception as ex: print("eager fused-view ERROR:", str(ex)[:300])
e = Split()
for s in range(3): e(torch.randn(4, 16, generator=torch.Generator().manual_seed(s)).requires_grad_()).backward()
e.W = torch.cat([e.a, e.b]).detach(); e.m = torch.cat([e.st[0], e.st[2]])
try:
    c = run(True)
    print("view-of-fused-param: max|eager-compiled| W=%.2e m=%.2e, W.grad None=%s" % (
        (e.W-c.W).abs().max(), (e.m-c.m).abs().max(), c.W.grad is None))
except Exception as ex:
    print("ERROR:", type(ex).__name__, str(ex)[:1500])
from torch._inductor.utils import run_and_get_code
torch._dynamo.reset()
mod = Fused(torch.ops.study.linear); fn = torch.compile(mod, fullgraph=True)
_, codes = run_and_get_code(lambda: fn(torch.randn(4, 16)).backward())
print("\n".join(l for l in codes[-1].splitlines() if "study." in l or "clone" in l or "copy_" in l or "empty_strided_cpu((32, 16)" in l or "reinterpret" in l))
