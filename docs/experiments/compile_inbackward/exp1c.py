import torch, importlib, io, contextlib
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    import exp1b
torch._dynamo.reset()
from torch._inductor.utils import run_and_get_code
model = exp1b.MLP("tensor"); fn = torch.compile(model, fullgraph=True)
x = torch.randn(8, 32)
def go():
    fn(x).backward()
_, codes = run_and_get_code(go)
for i, c in enumerate(codes):
    lines = [l for l in c.splitlines() if ("study." in l or "clone" in l or "copy_" in l or "empty_strided_cpu((32, 32)" in l)]
    print(f"--- compiled module {i}:"); print("\n".join(lines))
