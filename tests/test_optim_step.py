"""coda.optim.AdamW.step(): large 16-bit matrices (the input embedding) updated by the AdamW epilogue's K = 0 pass
over their stored gradient (``kernel_step``), everything else by torch's step (CPU: the reference path of the pass;
the kernel in tests/test_optim_gpu.py). Against float64 AdamW: the 2x rule of torch's own bf16 step."""
import pytest
import torch

import coda.optim
from coda.optim import KERNEL_STEP_MIN
from test_optim import _torch_adamw

BF = torch.bfloat16
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(KERNEL_STEP_MIN // 512, 512, generator=g).to(BF)  # the pass
    small, vec = torch.randn(64, 64, generator=g).to(BF), torch.randn(512, generator=g).to(BF)  # torch's step
    ragged = torch.randn(KERNEL_STEP_MIN // 500 + 1, 500, generator=g).to(BF)  # rows not a multiple of 8: torch
    return [torch.nn.Parameter(t) for t in (big, small, vec, ragged)]


def _run(opt_cls, steps=3, **kw):
    params = _params()
    opt = opt_cls(params, **HP, **kw)
    g = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(steps):
        gs = [torch.randn(p.shape, generator=g).to(BF) for p in params]
        for p, gr in zip(params, gs):
            p.grad = gr.clone()
        opt.step()
        grads.append(gs)
    return params, opt, grads


def _err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def test_large_matrices_take_the_pass_others_torch(monkeypatch):
    seen = []
    real = coda.optim.AdamW._kernel_updates

    def spy(self):
        out = real(self)
        seen.append([tuple(p.shape) for p in out])
        return out
    monkeypatch.setattr(coda.optim.AdamW, "_kernel_updates", spy)
    ours, opt, grads = _run(coda.optim.AdamW, kernel_step=True)
    theirs, topt, _ = _run(torch.optim.AdamW)
    assert seen == [[tuple(ours[0].shape)]] * 3
    for i in (1, 2, 3):  # torch's step, bit for bit
        assert torch.equal(ours[i], theirs[i]), i
    # the pass: float64 AdamW from the same start on the same gradients; ours within 2x torch's bf16 error
    p0 = _params()[0]
    p, m, v = p0.double(), torch.zeros(p0.shape, dtype=torch.float64), torch.zeros(p0.shape, dtype=torch.float64)
    for t, gs in enumerate(grads, 1):
        p, m, v = _torch_adamw(gs[0].double(), p, m, v, t=t, lr=HP["lr"], b1=0.9, b2=0.95, eps=1e-8, wd=0.1)
    for got, want, name in ((ours[0], p, "p"), (opt.state[ours[0]]["exp_avg"], m, "m"),
                            (opt.state[ours[0]]["exp_avg_sq"], v, "v")):
        torch_got = {"p": theirs[0], "m": topt.state[theirs[0]]["exp_avg"], "v": topt.state[theirs[0]]["exp_avg_sq"]}
        assert _err(got, want) <= 2 * _err(torch_got[name], want) + 1e-6, name
    # one state, torch's layout; the gradient stays readable
    assert opt.state_dict()["state"].keys() == topt.state_dict()["state"].keys()
    assert float(opt.state[ours[0]]["step"]) == 3.0 and ours[0].grad is not None


@pytest.mark.parametrize("kw", [dict(kernel_step=False), {}], ids=["off", "default"])
def test_kernel_step_false_is_torch_adamw(kw):
    ours, _, _ = _run(coda.optim.AdamW, **kw)
    theirs, _, _ = _run(torch.optim.AdamW)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_closure_and_float32_moments_take_torch_step():
    params = _params()
    opt = coda.optim.AdamW(params, **HP)
    for p in params:
        p.grad = torch.randn(p.shape).to(BF)
    opt.step(lambda: torch.tensor(0.0))  # a closure recomputes gradients: torch's step for all
    assert opt._on_kernel(params[0], opt.param_groups[0])
    opt.state[params[0]]["exp_avg"] = opt.state[params[0]]["exp_avg"].float()  # e.g. loaded from elsewhere
    assert not opt._on_kernel(params[0], opt.param_groups[0])


class _Sub(torch.Tensor):  # stands for a DTensor shard (FSDP2): not a plain tensor
    pass


def test_tensor_subclasses_take_torch_step():
    p = torch.nn.Parameter(torch.randn(KERNEL_STEP_MIN // 512, 512).to(BF))
    opt = coda.optim.AdamW([p], **HP)
    p.grad = torch.randn(p.shape).to(BF)
    assert opt._on_kernel(p, opt.param_groups[0])
    p.grad = p.grad.as_subclass(_Sub)
    assert not opt._on_kernel(p, opt.param_groups[0])
    q = torch.nn.Parameter(torch.randn(KERNEL_STEP_MIN // 512, 512).to(BF).as_subclass(_Sub))
    q.grad = torch.randn(q.shape).to(BF)
    assert not opt._on_kernel(q, opt.param_groups[0])


def test_bad_flag():
    with pytest.raises(TypeError, match="kernel_step must be True or False"):
        coda.optim.AdamW([torch.nn.Parameter(torch.randn(2, 2))], kernel_step=1)
