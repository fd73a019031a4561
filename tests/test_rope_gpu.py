"""RoPE fused on a Hopper GPU: the rope epilogue and its backward (rotation by -theta) in CODA's kernel vs float64 with
the 2x rule and NaN-poisoned outputs (tests/test_dsl_gpu.py's helper), the in-kernel angle reduction at every
position up to 131072 (exact accumulator, fp32 output), and coda.ops.linear_rope forward + backward vs float64
autograd of a Hugging Face style rotate_half implementation, 2x rule against the same computation in bf16 / fp16
(tests/rope_ref.py): ragged M, a fused QKV with V unrotated, partial rotary, Llama-3-8B dims."""
import pytest
import torch

import coda
import coda.ops
from coda.autodiff import backward_epilogue, grad_name
from coda.dsl import ODD_OUT
from coda.epilogues.rope import rope
from rope_ref import check_against_fp64
from test_dsl_gpu import PAIR_CFGS, _check_fused

pytestmark = pytest.mark.gpu
DEV = "cuda"
MAX_POS = 131072


def _positions(*shape, gen):
    pos = torch.randint(0, MAX_POS, shape, generator=gen, dtype=torch.int64)
    pos.view(-1)[-1] = MAX_POS - 1
    return pos.double()


@pytest.mark.parametrize("cfg", PAIR_CFGS, ids=lambda c: c.name)
def test_rope_epilogue_fused(cfg):
    """Forward and backward epilogues vs float64 (out poisoned with NaN), positions up to 131072."""
    bwd = backward_epilogue(rope, ("out",), ())
    g = torch.Generator().manual_seed(0)
    for (M, N, K), L in (((333, 528, 264), None), ((1000, 1040, 512), None), ((200, 272, 128), 2)):
        lead = (L,) if L else ()
        ops = {"pos": _positions(*lead, M, gen=g), "freq": coda.ops.rope_freqs(16, N // 16).double()}
        _check_fused(rope, M, N, K, ops, cfg=cfg, L=L)
        grads = {grad_name("out"): torch.randn(*lead, M, N // 2, generator=g, dtype=torch.float64),
                 grad_name(ODD_OUT): torch.randn(*lead, M, N // 2, generator=g, dtype=torch.float64)}
        _check_fused(bwd, M, N, K, {**ops, **grads}, cfg=cfg, L=L)


def test_kernel_angles_at_every_position():
    """acc = (1, 0) per pair exactly (one-hot rows), fp32 output: the kernel writes (cos theta, sin theta) for every
    position 0..131072 and Llama's 64 frequencies; max error vs float64, beside torch's fp32 product."""
    M, N, K = MAX_POS + 1, 128, 8
    a = torch.zeros(M, K, device=DEV, dtype=torch.bfloat16)
    a[:, 0] = 1
    b = torch.zeros(N, K, device=DEV, dtype=torch.bfloat16)
    b[0::2, 0] = 1
    pos = torch.arange(M, device=DEV, dtype=torch.float32)
    freq = coda.ops.rope_freqs(128, 1, device=DEV)
    out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.float32)
    coda.gemm(a, b, epilogue=rope, out=out, pos=pos, freq=freq)
    theta = pos.double()[:, None] * freq.double()
    err = max((out[:, 0::2].double() - theta.cos()).abs().max().item(),
              (out[:, 1::2].double() - theta.sin()).abs().max().item())
    naive = pos[:, None] * freq
    err_naive = (naive.sin().double() - theta.sin()).abs().max().item()
    print(f"max |error| of the kernel's cos/sin at positions <= {MAX_POS}: {err:.2e} (torch fp32 product: "
          f"{err_naive:.2e})")
    assert err < 1e-6, err
    assert err_naive > 1e-3


def test_backward_rotation_k0_gemm():
    """The backward's dacc = R(-theta) dy as CODA's kernel runs it inside linear_rope (a K = 0 GEMM: only the
    epilogue), fp32 output poisoned with NaN, vs float64."""
    bwd = backward_epilogue(rope, ("out",), ())
    g = torch.Generator().manual_seed(1)
    M, N = 1000, 1040
    pos = _positions(M, gen=g).to(DEV)
    freq = coda.ops.rope_freqs(16, N // 16, device=DEV)
    ge, go = (torch.randn(M, N // 2, generator=g).to(DEV, torch.bfloat16) for _ in range(2))
    x = torch.zeros(M, 8, device=DEV, dtype=torch.bfloat16)
    w = torch.zeros(N, 8, device=DEV, dtype=torch.bfloat16)
    out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.float32)
    coda.gemm(x[:, :0], w[:, :0], epilogue=bwd, out=out, pos=pos.float(), freq=freq,
              **{grad_name("out"): ge, grad_name(ODD_OUT): go})
    th = pos[:, None] * freq.double()
    c, s, ge, go = th.cos(), th.sin(), ge.double(), go.double()
    want = torch.stack((ge * c + go * s, -ge * s + go * c), -1).reshape(M, N)
    assert not out.isnan().any()
    assert (out.double() - want).abs().max().item() < 1e-6 * want.abs().max().item() + 1e-6


@pytest.mark.parametrize("lead,K,hd,heads,rot_heads,rot_dim", [
    ((333,), 264, 128, 4, None, None),  # ragged M, head_dim 128
    ((4, 250), 520, 64, 6, 4, None),  # batched; fused q (2) + k (2) + v (2), v unrotated
    ((999,), 264, 32, 5, 3, 16),  # partial rotary; M = 999: the dW product falls back to torch.matmul
])
def test_linear_rope_fwd_bwd(lead, K, hd, heads, rot_heads, rot_dim):
    check_against_fp64(lead, K, hd, heads, rot_heads, rot_dim, device=DEV)


def test_fp16():
    check_against_fp64((1000,), 520, 64, 6, 4, device=DEV, dtype=torch.float16)


def test_llama3_8b_qkv():
    """2048 tokens, H = 4096, head_dim 128, 32 query + 8 key + 8 value heads (W_qkv 6144 x 4096), rope_theta 5e5,
    V unrotated, positions up to 131072."""
    check_against_fp64((2048,), 4096, 128, 48, 40, device=DEV, base=500000.0)


def test_torch_compile_fullgraph_cuda():
    torch._dynamo.reset()
    x = torch.randn(1000, 520, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(768, 520, device=DEV, dtype=torch.bfloat16) / 520 ** 0.5).requires_grad_()
    pos = torch.randint(0, MAX_POS, (1000,), device=DEV)
    freqs = coda.ops.rope_freqs(64, 12, rotary_heads=8, device=DEV)

    def f(x, w):
        return coda.ops.linear_rope(x, w, pos, freqs).float().square().sum()

    got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(x, w), (x, w))
    want = torch.autograd.grad(f(x, w), (x, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
