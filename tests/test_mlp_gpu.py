"""coda.ops.mlp / coda.ops.rmsnorm_swiglu fused on a Hopper GPU vs float64 autograd of the unfused formula, with the
2x rule against plain torch in the same dtype (tests/test_mlp.py's ``check_against_fp64``): forward (gate/up GEMM with
the rms_swiglu pairs epilogue, down GEMM with residual_add) and backward (da and dW_down GEMMs; the 2 -> 2 pairs epilogue that writes dacc and the per-row d_r, as a K = 0
launch on the saved pre-activation or in the recompute GEMM; the dX GEMM with the gamma + radial + residual epilogue
on the MN-major weight view; the dW' GEMM with the fold_grads epilogue), every gradient (x, norm_weight, w_gate_up, w_down). Our calls allocate their
outputs from NaN-poisoned memory, so an element a kernel never writes shows as a non-finite value."""
import pytest
import torch

import coda.ops
from test_mlp import check_against_fp64

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _poison():
    """Fill the caching allocator's free memory with NaN: NaN blocks of the small pool (allocations <= 1 MiB) and
    of the large one are made and released (they stay cached), so the next allocations are carved from NaN."""
    blocks = [torch.full((n,), float("nan"), device=DEV) for n in [1 << 16] * 64 + [1 << 22] * 4 + [1 << 24] * 2]
    del blocks


@pytest.mark.parametrize("down", [True, False], ids=["mlp", "rmsnorm_swiglu"])
@pytest.mark.parametrize("lead,H,I", [((3, 127), 200, 136), ((127,), 200, 136), ((1000,), 520, 776),
                                      ((4, 250), 520, 776)])
@pytest.mark.parametrize("save_preact", [True, False])
def test_ragged_fwd_bwd(lead, H, I, down, save_preact):
    """M = 381 / 127 (not multiples of 8: the dW products fall back to torch.matmul) and M = 1000 (CODA's dW GEMMs);
    H and I not multiples of any tile; the backward on the saved pre-activation (K = 0 launch) or recomputing it."""
    check_against_fp64(lead, H, I, down=down, device=DEV, poison=_poison, save_preact=save_preact)


@pytest.mark.parametrize("lead,H,I", [((3, 127), 200, 136), ((1000,), 520, 776), ((4096,), 2048, 8192)])
def test_without_residual(lead, H, I):
    """residual=False (what SwiGLUMLP runs in a fused Llama): the backward's dacc and d_r come out of the GEMM
    dy W_down (the 1 -> 2 epilogue on the saved g, u); ragged shapes and Llama-3.2-1B's (M = 4096)."""
    check_against_fp64(lead, H, I, device=DEV, poison=_poison, residual=False)


@pytest.mark.parametrize("M,H,I", [(1000, 520, 776), (381, 200, 136), (2048, 2048, 8192)])
def test_swiglu_backward_in_da_gemm(M, H, I):
    """The 1 -> 2 epilogue alone (coda.gemm): dy W_down with rms_swiglu's backward on the saved g, u as its epilogue
    equals the reference evaluation of the same program (fp32 math) on every element of dacc (M x 2I, interleaved)
    and d_r; outputs allocated from NaN-poisoned memory, M, I not multiples of the tile."""
    from coda.ops.mlp import dacc_on_da
    g = torch.Generator().manual_seed(1)
    rnd = lambda *s: torch.randn(*s, generator=g).to(DEV, torch.bfloat16)  # noqa: E731
    dy, wd, gp, up = rnd(M, H), rnd(H, I) * H ** -0.5, rnd(M, I), rnd(M, I)
    r = (0.5 + torch.rand(M, generator=g)).to(DEV)
    prog = dacc_on_da((("out",), ("r",), False))
    ops = dict(r=r, _preact_even=gp, _preact_odd=up)
    _poison()
    got = coda.gemm(dy, wd.t(), epilogue=prog, **ops)
    want = coda.reference.gemm(dy.cpu(), wd.t().cpu(), epilogue=prog, **{k: v.cpu() for k, v in ops.items()})
    assert got["out"].shape == (M, 2 * I) and set(got) == set(want)
    for k in want:
        assert torch.isfinite(got[k]).all(), f"{k}: unwritten elements"
        err = ((got[k].cpu().double() - want[k].double()).norm() / want[k].double().norm()).item()
        assert err < 5e-3, (k, err)


def test_fp16_bf16_gamma():
    check_against_fp64((3, 127), 200, 136, device=DEV, dtype=torch.float16, gamma_dtype=torch.bfloat16,
                       poison=_poison)


@pytest.mark.parametrize("save_preact", [True, False])
def test_llama3_8b_dims(save_preact):
    """M = 2048 tokens, H = 4096, I = 14336 (Llama-3-8B's MLP: w_gate_up is 28672 x 4096)."""
    check_against_fp64((2048,), 4096, 14336, device=DEV, poison=_poison, save_preact=save_preact)


def test_torch_compile_fullgraph_cuda():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(381, 200, generator=g).to(DEV, torch.bfloat16).requires_grad_()
    gamma = (1 + 0.1 * torch.randn(200, generator=g)).to(DEV).requires_grad_()
    wgu = (torch.randn(272, 200, generator=g) / 200 ** 0.5).to(DEV, torch.bfloat16).requires_grad_()
    wd = (torch.randn(200, 136, generator=g) / 136 ** 0.5).to(DEV, torch.bfloat16).requires_grad_()

    def f(*leaves):
        return coda.ops.mlp(*leaves).float().square().sum()

    got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(x, gamma, wgu, wd),
                              (x, gamma, wgu, wd))
    want = torch.autograd.grad(f(x, gamma, wgu, wd), (x, gamma, wgu, wd))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
