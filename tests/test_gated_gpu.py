"""coda.ops.linear_swiglu / linear_geglu fused on a Hopper GPU (forward GEMM with the pairs epilogue, storing the
pre-activation or not; the 2 -> 2 pairs program that writes dacc, as a K = 0 launch on the saved pre-activation or
in a recompute GEMM; dX / dW GEMMs on transposed views) vs float64 autograd of the unfused
projection, with the 2x rule against plain torch bf16 (tests/gated_ref.py)."""
import pytest
import torch

import coda.ops
from gated_ref import check_against_fp64

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("kind", ["swiglu", "geglu_tanh", "geglu_none"])
@pytest.mark.parametrize("lead,H,I", [((1000,), 520, 776), ((4, 250), 520, 776), ((999,), 264, 136)])
@pytest.mark.parametrize("save_preact", [True, False])
def test_ragged_fwd_bwd(kind, lead, H, I, save_preact):
    """M = 1000 / 999 (999: the dW product falls back to torch.matmul), H and I not multiples of any tile."""
    check_against_fp64(kind, lead, H, I, device=DEV, save_preact=save_preact)


def test_fp16():
    check_against_fp64("swiglu", (1000,), 520, 776, device=DEV, dtype=torch.float16)


@pytest.mark.parametrize("kind", ["swiglu", "geglu_tanh"])
@pytest.mark.parametrize("save_preact", [True, False])
def test_llama3_8b_dims(kind, save_preact):
    """M = 2048 tokens, H = 4096, I = 14336 (Llama-3-8B's MLP: weight_gu is 28672 x 4096)."""
    check_against_fp64(kind, (2048,), 4096, 14336, device=DEV, save_preact=save_preact)


def test_torch_compile_fullgraph_cuda():
    torch._dynamo.reset()
    x = torch.randn(1000, 520, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(1552, 520, device=DEV, dtype=torch.bfloat16) / 520 ** 0.5).requires_grad_()

    def f(x, w):
        return coda.ops.linear_swiglu(x, w).float().square().sum()

    got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(x, w), (x, w))
    want = torch.autograd.grad(f(x, w), (x, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
