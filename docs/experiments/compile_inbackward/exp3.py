"""Variant (i) (in-backward update inside the custom op's backward) under compiled autograd,
and with dynamo's trace_autograd_ops (tracing loss.backward() into the graph). argv[1]: ca | trace_bw"""
import sys, torch, torch._dynamo
from common import *
mode = sys.argv[1]
if mode == "ca": torch._dynamo.config.compiled_autograd = True
else: torch._dynamo.config.trace_autograd_ops = True
ref_ws, ref_m, _ = reference(3)
model = Model("inputs", name="l_ca"); fn = torch.compile(model)
@torch.compile
def train_step(x):
    loss = fn(x); loss.backward(); return loss
torch._dynamo.utils.counters.clear()
try:
    for s in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(s)).requires_grad_()
        train_step(x)
        print(f"[{mode}] step {s}: w.grad None={model.w.grad is None} x.grad ok={x.grad is not None} max|w-ref|={(model.w.detach()-ref_ws[s]).abs().max():.2e}")
    print("m matches ref:", torch.allclose(REG['l_ca'][0], ref_m))
    print("stats:", dict(torch._dynamo.utils.counters["stats"]), "compiled_autograd:", dict(torch._dynamo.utils.counters["compiled_autograd"]))
    print("graph_breaks:", {k.splitlines()[0]: v for k, v in torch._dynamo.utils.counters["graph_break"].items()})
except Exception as ex:
    import traceback; traceback.print_exc(limit=2); print("ERROR:", type(ex).__name__, str(ex)[:1500])
