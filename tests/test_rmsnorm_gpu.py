"""coda.ops.rmsnorm on a Hopper GPU (its three K = 0 passes) vs float64 autograd, 2x rule against plain torch
(tests/rmsnorm_ref.py): ragged row counts, the llama final norm's shape, fp16, bf16 gamma."""
import pytest
import torch

from rmsnorm_ref import check_against_fp64

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("lead,K", [((1000,), 520), ((3, 333), 2048), ((2, 4096), 2048), ((1,), 64)])
def test_against_fp64(lead, K):
    check_against_fp64(lead, K, device="cuda")


def test_fp16_bf16_gamma_and_scale():
    check_against_fp64((999,), 1024, device="cuda", dtype=torch.float16, gamma_dtype=torch.bfloat16)
    check_against_fp64((999,), 1024, device="cuda", scale=1e3)
