import sys, traceback, torch, torch._dynamo
from common import *
variant = sys.argv[1]          # inputs | global | buffers
mode = sys.argv[2]             # eager | compile
STEPS = 3
ref_ws, ref_m, ref_v = reference(STEPS)
model = Model(variant, name=f"{variant}_{mode}")
fn = model if mode == "eager" else torch.compile(model, fullgraph=True)
torch._dynamo.utils.counters.clear()
try:
    for s in range(STEPS):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(s)).requires_grad_()
        loss = fn(x)
        loss.backward()
        m, v = mv(model)
        print(f"[{variant}/{mode}] step {s}: w.grad is None={model.w.grad is None}, "
              f"x.grad ok={x.grad is not None}, max|w-ref|={(model.w.detach()-ref_ws[s]).abs().max():.2e}, "
              f"max|w-w0_ref|={(model.w.detach()-(ref_ws[s-1] if s else ref_ws[0])).abs().max():.2e}, "
              f"|m-ref| ok={torch.allclose(m, ref_m) if s==STEPS-1 else '-'}")
    print("frames compiled:", dict(torch._dynamo.utils.counters["stats"]))
    print("graph_breaks:", dict(torch._dynamo.utils.counters["graph_break"]))
    print("RESULT: OK" if (model.w.detach()-ref_ws[-1]).abs().max() < 1e-5 else "RESULT: MISMATCH")
except Exception as e:
    traceback.print_exc(limit=3)
    print("RESULT: ERROR", type(e).__name__, str(e)[:2000])
