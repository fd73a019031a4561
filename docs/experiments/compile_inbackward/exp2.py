"""Optimizer-in-backward via p.register_post_accumulate_grad_hook (torchtune style) under torch.compile.
argv[1]: eager | compile | compile_ca (compiled_autograd=True) ; argv[2]: py | op (update via plain torch ops or a mutating custom op)"""
import sys, torch, torch._dynamo
from torch import Tensor
from common import adamw_inplace, reference
mode, upd = sys.argv[1], sys.argv[2]

@torch.library.custom_op("study::adamw_", mutates_args=("p", "m", "v"))
def adamw_(p: Tensor, m: Tensor, v: Tensor, g: Tensor) -> None: adamw_inplace(p, m, v, g)
@adamw_.register_fake
def _(p, m, v, g): return None

class Model(torch.nn.Module):
    def __init__(self, D=16):
        super().__init__(); torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(D, D) * 0.1)
    def forward(self, x): return torch.relu(x @ self.w.t()).sum()

model = Model(); state = {model.w: (torch.zeros(16, 16), torch.zeros(16, 16))}
calls = {"n": torch.zeros((), dtype=torch.int64)}  # tensor counter: a python int would be guarded on -> recompile every step under compiled autograd
def hook(p):
    calls["n"].add_(1)
    m, v = state[p]
    with torch.no_grad():
        if upd == "py": adamw_inplace(p, m, v, p.grad)
        else: torch.ops.study.adamw_(p, m, v, p.grad)
    p.grad = None                                  # free the gradient right away
model.w.register_post_accumulate_grad_hook(hook)

if mode == "compile_ca":
    torch._dynamo.config.compiled_autograd = True
fn = model if mode == "eager" else torch.compile(model, fullgraph=True)
ref_ws, ref_m, _ = reference(3)
@torch.compile   # compiled autograd captures the backward when .backward() runs inside a compiled region
def train_step(x):
    loss = fn(x); loss.backward(); return loss
torch._dynamo.utils.counters.clear()
try:
    for s in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(s))
        if mode == "compile_ca":
            train_step(x)
        else:
            fn(x).backward()
        print(f"[{mode}/{upd}] step {s}: hook calls={int(calls['n'])} w.grad is None={model.w.grad is None} "
              f"max|w-ref|={(model.w.detach()-ref_ws[s]).abs().max():.2e}")
    print("stats:", dict(torch._dynamo.utils.counters["stats"]), "compiled_autograd:", dict(torch._dynamo.utils.counters["compiled_autograd"]))
    print("graph_breaks:", {k.splitlines()[0]: v for k, v in torch._dynamo.utils.counters["graph_break"].items()})
    print("m matches ref:", torch.allclose(state[model.w][0], ref_m))
except Exception as ex:
    import traceback; traceback.print_exc(limit=2); print("ERROR:", type(ex).__name__, str(ex)[:1500])
