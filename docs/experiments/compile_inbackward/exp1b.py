"""Variant (i) deeper checks: explain/graph breaks, recompiles with lr float vs tensor,
create_graph=True, multi-layer correctness, compiled train step incl. backward."""
import sys, torch, torch._dynamo, traceback
from torch import Tensor
from common import *

# op carrying a hyper-parameter (lr) into the backward: as python float vs 0-d tensor
@torch.library.custom_op("study::upd_lr_", mutates_args=("p", "m", "v"))
def upd_lr_(p: Tensor, m: Tensor, v: Tensor, x: Tensor, dy: Tensor, lr: float) -> None:
    g = dy.t() @ x; m.mul_(B1).add_(g, alpha=1-B1); v.mul_(B2).addcmul_(g, g, value=1-B2)
    p.addcdiv_(m, v.sqrt().add_(EPS), value=-lr)
@upd_lr_.register_fake
def _(p, m, v, x, dy, lr): return None
@torch.library.custom_op("study::upd_lrt_", mutates_args=("p", "m", "v"))
def upd_lrt_(p: Tensor, m: Tensor, v: Tensor, x: Tensor, dy: Tensor, lr: Tensor) -> None:
    g = dy.t() @ x; m.mul_(B1).add_(g, alpha=1-B1); v.mul_(B2).addcmul_(g, g, value=1-B2)
    p.addcdiv_(m, v.sqrt().add_(EPS), value=-lr.item())   # .item() is fine inside an opaque op
@upd_lrt_.register_fake
def _(p, m, v, x, dy, lr): return None

@torch.library.custom_op("study::lin_f", mutates_args=())
def lin_f(x: Tensor, w: Tensor, m: Tensor, v: Tensor, lr: float) -> Tensor: return x @ w.t()
@lin_f.register_fake
def _(x, w, m, v, lr): return x.new_empty(x.shape[0], w.shape[0])
def _s(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4]); ctx.lr = inputs[4]
def _b(ctx, dy):
    x, w, m, v = ctx.saved_tensors; dx = dy @ w
    torch.ops.study.upd_lr_(w, m, v, x, dy, ctx.lr); return dx, None, None, None, None
lin_f.register_autograd(_b, setup_context=_s)

@torch.library.custom_op("study::lin_t", mutates_args=())
def lin_t(x: Tensor, w: Tensor, m: Tensor, v: Tensor, lr: Tensor) -> Tensor: return x @ w.t()
@lin_t.register_fake
def _(x, w, m, v, lr): return x.new_empty(x.shape[0], w.shape[0])
def _s2(ctx, inputs, output): ctx.save_for_backward(*inputs)
def _b2(ctx, dy):
    x, w, m, v, lr = ctx.saved_tensors; dx = dy @ w
    torch.ops.study.upd_lrt_(w, m, v, x, dy, lr); return dx, None, None, None, None
lin_t.register_autograd(_b2, setup_context=_s2)

class MLP(torch.nn.Module):
    def __init__(self, kind, D=32, L=3):
        super().__init__(); torch.manual_seed(0); self.kind = kind
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(D, D)*0.1) for _ in range(L)])
        self.ms = [torch.zeros(D, D) for _ in range(L)]; self.vs = [torch.zeros(D, D) for _ in range(L)]
        self.lr = 1e-2; self.lr_t = torch.tensor(1e-2)
    def forward(self, x):
        for w, m, v in zip(self.ws, self.ms, self.vs):
            if self.kind == "float": x = torch.ops.study.lin_f(x, w, m, v, self.lr)
            elif self.kind == "tensor": x = torch.ops.study.lin_t(x, w, m, v, self.lr_t)
            else: x = torch.ops.study.linear(x, w, m, v)
            x = torch.tanh(x)
        return x.square().sum()

def run(kind, compiled, steps=4, create_graph=False):
    model = MLP(kind); fn = torch.compile(model, fullgraph=True) if compiled else model
    for s in range(steps):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(s))
        fn(x).backward(create_graph=create_graph)
        model.lr *= 0.9; model.lr_t.mul_(0.9)     # lr schedule
        assert all(w.grad is None for w in model.ws)
    return [w.detach().clone() for w in model.ws]

torch._dynamo.reset()
print("== explain (variant i, 3 layers)")
ex = torch._dynamo.explain(MLP("plain"))(torch.randn(8, 32))
print(f"graph_count={ex.graph_count} graph_break_count={ex.graph_break_count} break_reasons={ex.break_reasons}")

for kind in ("plain", "float", "tensor"):
    torch._dynamo.reset(); torch._dynamo.utils.counters.clear()
    e = run(kind, False); c = run(kind, True)
    err = max((a-b).abs().max().item() for a, b in zip(e, c))
    print(f"== {kind}: max|eager-compiled| over 3 weights after 4 steps = {err:.2e}; "
          f"stats={dict(torch._dynamo.utils.counters['stats'])}")

print("== create_graph=True")
torch._dynamo.reset()
try: run("plain", True, steps=1, create_graph=True); print("no error")
except Exception as ex: print("ERROR:", type(ex).__name__, ex)

print("== compile a whole train step containing loss.backward()")
torch._dynamo.reset(); torch._dynamo.utils.counters.clear()
model = MLP("plain")
@torch.compile
def step(x):
    loss = model(x); loss.backward(); return loss
for s in range(3):
    step(torch.randn(8, 32, generator=torch.Generator().manual_seed(s)))
ref = run("plain", False, steps=3)
print("max|eager-compiled_step|=%.2e" % max((a-b).abs().max().item() for a, b in zip(ref, model.ws)),
      "graph_breaks:", dict(torch._dynamo.utils.counters["graph_break"]),
      "stats:", dict(torch._dynamo.utils.counters["stats"]))
