"""coda.ops.linear_swiglu / linear_geglu vs the unfused gated MLP projection in float64 (the truth), with the 2x rule
against plain torch in the input dtype; shared by tests/test_gated.py (CPU) and tests/test_gated_gpu.py (Hopper)."""
import torch
import torch.nn.functional as F

import coda.ops

ACTS = {"swiglu": F.silu, "geglu_tanh": lambda g: F.gelu(g, approximate="tanh"),
        "geglu_none": lambda g: F.gelu(g, approximate="none")}


def unfused(kind, x, w_gate, w_up):
    """act(x @ w_gate.T) * (x @ w_up.T) with separate weights, in the leaves' dtype (what a plain model does)."""
    return ACTS[kind](x @ w_gate.T) * (x @ w_up.T)


def ours(kind, x, weight_gu, save_preact=True):
    if kind == "swiglu":
        return coda.ops.linear_swiglu(x, weight_gu, save_preact=save_preact)
    return coda.ops.linear_geglu(x, weight_gu, approximate=kind.split("_")[1], save_preact=save_preact)


def rel(a, ref):
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_against_fp64(kind, lead, H, I, *, device="cpu", dtype=torch.bfloat16, floor=1e-4, seed=0,
                       save_preact=True):
    """Forward and the gradients of x, w_gate, w_up (through ``interleave_gate_up``) vs float64 autograd of the
    unfused projection: error(ours) <= 2 * error(plain torch in ``dtype``) + floor, each measured against float64;
    the backward on the saved pre-activation or (``save_preact=False``) on a recomputed one."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    x, wg, wu = rnd(*lead, H), rnd(I, H, scale=H ** -0.5), rnd(I, H, scale=H ** -0.5)
    dy = rnd(*lead, I)

    def run(fn, fp64=False):
        leaves = [t.detach().to(torch.float64 if fp64 else dtype).requires_grad_() for t in (x, wg, wu)]
        y = fn(*leaves)
        grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
        return dict(zip(["y", "dx", "dw_gate", "dw_up"], [y, *grads]))

    got = run(lambda x_, g_, u_: ours(kind, x_, coda.ops.interleave_gate_up(g_, u_), save_preact))
    want = run(lambda *t: unfused(kind, *t), fp64=True)
    theirs = run(lambda *t: unfused(kind, *t))
    assert got["y"].shape == (*lead, I) and got["y"].dtype == dtype
    report = {}
    for k in want:
        e_ours, e_torch = rel(got[k], want[k]), rel(theirs[k], want[k])
        report[k] = (e_ours, e_torch)
        assert e_ours <= 2 * e_torch + floor, (kind, k, e_ours, e_torch)
    return report
