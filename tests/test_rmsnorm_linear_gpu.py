"""coda.ops.rmsnorm_linear fused on a Hopper GPU (forward GEMM with the r epilogue, dX GEMM with the RMSNorm backward
epilogue on an MN-major weight view, dW GEMM on transposed views) vs float64 autograd of the unfused module, with
the 2x rule against plain torch bf16 (tests/rmsnorm_linear_ref.py)."""
import pytest
import torch

import coda.ops
from rmsnorm_linear_ref import check_against_fp64

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("lead,K,N", [((1000,), 520, 776), ((4, 250), 520, 776), ((2, 200), 520, 776),
                                      ((3, 100), 520, 776)])
def test_ragged_fwd_bwd(lead, K, N, residual):
    """M = 1000 > N: gamma folded into the weight; M = 400, 300 <= N: x * gamma from the K = 0 pre-pass (M = 300:
    the dW product on torch.matmul)."""
    check_against_fp64(lead, K, N, residual=residual, device=DEV)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("lead,K,N", [((1000,), 264, 776), ((2, 1024), 1024, 4096)])
def test_split_backward(lead, K, N, residual):
    """N > 2.5 K: c from the dX GEMM (rmsnorm_dgrad_split, acc in fp32) and a K = 0 finishing pass; no row_dot."""
    check_against_fp64(lead, K, N, residual=residual, device=DEV)


@pytest.mark.parametrize("residual", [False, True])
def test_llama_dims(residual):
    """M = 8192 tokens, K = N = 4096 (a Llama-7B-sized projection)."""
    check_against_fp64((8192,), 4096, 4096, residual=residual, device=DEV)


def test_fp16_bf16_gamma():
    check_against_fp64((1000,), 520, 776, residual=True, device=DEV, dtype=torch.float16,
                       gamma_dtype=torch.bfloat16)


def test_unaligned_rows_dw_fallback():
    """M = 999 (not a multiple of 8): the dW product falls back to torch.matmul (ops/_common.backward_gemm)."""
    check_against_fp64((999,), 520, 776, residual=True, device=DEV)


def test_torch_compile_fullgraph_cuda():
    torch._dynamo.reset()
    x = torch.randn(1000, 520, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    g = torch.rand(520, device=DEV, requires_grad=True)
    w = (torch.randn(776, 520, device=DEV, dtype=torch.bfloat16) / 520 ** 0.5).requires_grad_()

    def f(x, g, w):
        return coda.ops.rmsnorm_linear(x, g, w).float().square().sum()

    got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(x, g, w), (x, g, w))
    want = torch.autograd.grad(f(x, g, w), (x, g, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
