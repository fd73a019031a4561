"""coda.ops.layernorm_linear (the worked example of docs/DESIGN.md section 7) on the CPU reference path: forward and
every gradient vs float64 torch (exact in float64; in bf16 within 2x torch's own bf16 error), the normalised
activation never saved, argument errors naming the argument."""
import pytest
import torch
import torch.nn.functional as F

import coda.ops


def _inputs(M=37, K=64, N=48, dtype=torch.bfloat16, seed=0, bias=True, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) + 0.1).to(device, dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(device, dtype)
    gamma = (1 + 0.3 * torch.randn(K, generator=g)).to(device, dtype)
    beta = (0.2 * torch.randn(K, generator=g)).to(device, dtype) if bias else None
    return [t.requires_grad_() if t is not None else None for t in (x, w, gamma, beta)]


def _stock(x, w, gamma, beta, eps=1e-5):
    return F.linear(F.layer_norm(x, (x.shape[-1],), gamma, beta, eps), w)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _run(fn, leaves, gy):
    y = fn(*leaves)
    live = [t for t in leaves if t is not None]
    return [y, *torch.autograd.grad(y, live, gy.to(y.dtype))]


def _check_2x_rule(M, K, N, bias, save_preact, device="cpu"):
    leaves = _inputs(M, K, N, bias=bias, device=device, seed=M + K)
    gy = torch.randn(M, N, generator=torch.Generator().manual_seed(5)).to(device)
    ours = _run(lambda *a: coda.ops.layernorm_linear(*a, save_preact=save_preact), leaves, gy)
    want = _run(_stock, [t.detach().double().requires_grad_() if t is not None else None for t in leaves], gy)
    theirs = _run(_stock, leaves, gy)
    for name, a, b, c in zip(("y", "dx", "dw", "dgamma", "dbeta"), ours, want, theirs):
        assert a.dtype == c.dtype and a.shape == c.shape, name
        assert _rel(a, b) <= 2 * _rel(c, b) + 1e-3, (name, _rel(a, b), _rel(c, b))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("save_preact", [False, True])
def test_matches_float64_and_the_2x_rule(bias, save_preact):
    _check_2x_rule(37, 64, 48, bias, save_preact)


@pytest.mark.gpu
@pytest.mark.parametrize("save_preact", [False, True])
@pytest.mark.parametrize("M,K,N", [(1000, 520, 776), (8192, 2048, 2048)])
def test_gpu_matches_float64_and_the_2x_rule(M, K, N, save_preact):
    """On the Hopper GPU (the fused GEMM, its derived backward): a ragged shape and a Llama-1B-sized projection."""
    _check_2x_rule(M, K, N, True, save_preact, device="cuda")


def test_exact_in_float64():
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in _inputs()]
    gy = torch.randn(37, 48, dtype=torch.float64)
    ours, want = _run(coda.ops.layernorm_linear, leaves, gy), _run(_stock, leaves, gy)
    for a, b in zip(ours, want):
        assert _rel(a, b) < 1e-12


def test_normalised_activation_never_saved():
    x, w, gamma, beta = _inputs()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        coda.ops.layernorm_linear(x, w, gamma, beta)
    big = [t for t in saved if t.numel() >= x.numel() and t.data_ptr() != x.data_ptr()
           and tuple(t.shape) == tuple(x.shape)]
    assert not big, [tuple(t.shape) for t in big]


def test_argument_errors_name_the_argument():
    x, w, gamma, beta = _inputs()
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        coda.ops.layernorm_linear(x, w, gamma[:-1], beta)
    with pytest.raises(ValueError, match="norm_bias must have shape"):
        coda.ops.layernorm_linear(x, w, gamma, beta[:8])
    with pytest.raises(ValueError, match="eps must be a positive number"):
        coda.ops.layernorm_linear(x, w, gamma, beta, eps=0.0)
    with pytest.raises(TypeError, match="norm_weight must be a torch.Tensor"):
        coda.ops.layernorm_linear(x, w, [1.0] * 64, beta)
    with pytest.raises(ValueError, match="weight must be"):
        coda.ops.layernorm_linear(x, w[:, :32], gamma, beta)
