"""Variant (i) with backend='aot_eager' (no inductor reinplacing) -> is it still correct, and are there clones?"""
import torch
from common import *
ref_ws, _, _ = reference(3)
model = Model("inputs", name="l_ae"); fn = torch.compile(model, backend="aot_eager", fullgraph=True)
from torch._dynamo.testing import AotEagerAndRecordGraphs
for s in range(3):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(s)).requires_grad_()
    fn(x).backward()
print("aot_eager: max|w-ref| =", (model.w.detach()-ref_ws[-1]).abs().max().item(), "w.grad None:", model.w.grad is None)
torch._dynamo.reset()
be = AotEagerAndRecordGraphs(); model = Model("inputs", name="l_ae2")
torch.compile(model, backend=be, fullgraph=True)(torch.randn(4, 16)).backward()
print(be.bw_graphs[0].print_readable(print_output=False).split("\n", 1)[1][:0] or "")
print("\n".join(l.strip()[:160] for l in be.bw_graphs[0].code.splitlines() if "auto_functionalized" in l or "copy_" in l))
