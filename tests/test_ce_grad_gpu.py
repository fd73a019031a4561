"""coda.kernels.ce_grad's CuTeDSL kernel on a Hopper GPU: against the float64 formula (errors at most twice torch's
error of the same expression in fp32 written back in bf16 / fp16, plus a small floor), ragged and Llama-3-sized
vocabularies, every option, NaN / inf rows, padding untouched, many rows, argument errors, the benchmark helper."""
import pytest
import torch

from coda.kernels import ce_grad
from coda.kernels.ce_grad import softmax_grad_, softmax_grad_reference_

pytestmark = pytest.mark.gpu

OPTIONS = [dict(), dict(label_smoothing=0.1), dict(z_loss=1e-3), dict(softcap=30.0),
           dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0)]
OPT_IDS = [",".join(f"{k}={v}" for k, v in o.items()) or "plain" for o in OPTIONS]


def expected64(z, lse, target, row_scale, label_smoothing=0.0, z_loss=0.0, softcap=None):
    R, V = z.shape
    z, lse, s = z.double(), lse.double().unsqueeze(1), row_scale.double().unsqueeze(1)
    onehot = (torch.arange(V, device=z.device).unsqueeze(0) == target.unsqueeze(1)).double()
    g = s * (torch.exp(z - lse) * (1 + 2 * z_loss * lse) - (1 - label_smoothing) * onehot - label_smoothing / V)
    if softcap is not None:
        g = g * (1 - (z / softcap) ** 2)
    return g


def make(R, V, ld, dtype, softcap=None, seed=0, pad_value=7.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(R, ld, device="cuda", generator=g) * 3
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    base = x.to(dtype)
    base[:, V:] = pad_value
    z = base[:, :V]
    lse = torch.logsumexp(z.float(), -1)
    target = torch.randint(0, V, (R,), device="cuda", generator=g)
    scale = torch.rand(R, device="cuda", generator=g) + 0.5
    scale[::5] = 0.0  # ignored rows
    target[::5] = -100
    return base, z, lse, target, scale


def _copy(z):
    """A copy of z with z's row stride (clone() of a padded view would be contiguous, ld = V)."""
    ld = z.stride(0) if z.shape[0] > 1 else z.shape[1]
    out = torch.empty(z.shape[0], max(ld, z.shape[1]), dtype=z.dtype, device=z.device)[:, :z.shape[1]]
    return out.copy_(z)


def compare(z_in, lse, target, scale, dtype, opts):
    """(kernel result, max |kernel - f64|, max |torch - f64|) for one input."""
    want = expected64(z_in, lse, target, scale, **opts)
    k, t = _copy(z_in), _copy(z_in)
    assert softmax_grad_(k, lse, target, scale, **opts) is k
    softmax_grad_reference_(t, lse, target, scale, **opts)
    torch.cuda.synchronize()
    assert torch.equal(torch.isnan(k), torch.isnan(want))
    fin = torch.isfinite(want)
    ek = (k.double()[fin] - want[fin]).abs().max().item() if fin.any() else 0.0
    et = (t.double()[fin] - want[fin]).abs().max().item() if fin.any() else 0.0
    return k, ek, et


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("opts", OPTIONS, ids=OPT_IDS)
@pytest.mark.parametrize("shape", [(37, 1003, 1008), (256, 128256, 128256), (64, 128251, 128256)],
                         ids=["ragged", "llama3", "llama3-5"])
def test_kernel_matches_float64(shape, dtype, opts):
    R, V, ld = shape
    base, z, lse, target, scale = make(R, V, ld, dtype, opts.get("softcap"))
    k, ek, et = compare(z, lse, target, scale, dtype, opts)
    floor = 1e-6 * scale.max().item()
    assert ek <= 2 * et + floor, (ek, et)
    assert torch.all(k[::5] == 0)  # ignored rows (finite logits): exactly 0
    # in place, and nothing beyond column V - 1 of a row written
    base2 = base.clone()
    softmax_grad_(z, lse, target, scale, **opts)
    assert torch.equal(z, k)
    assert torch.equal(base[:, V:], base2[:, V:]) and torch.all(base[:, V:] == 7.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_nan_inf_rows(dtype, z_loss):
    base, z, lse, target, scale = make(8, 1003, 1008, dtype)
    scale.fill_(1.0)
    z[0, 3] = float("nan")      # that element only
    z[0, 1001] = float("nan")   # in the straddling chunk (element-wise path)
    lse[1] = float("nan")       # the whole row
    lse[2] = float("inf")       # 0 * inf (or 1 + 0 * inf): NaN row, as in torch
    z[3, 5] = float("inf")      # exp(inf) = inf
    z[4, 0] = float("nan")
    scale[4] = 0.0              # ignored row keeps its NaN (0 * NaN)
    lse[5] = -float("inf")
    k, t = _copy(z), _copy(z)
    softmax_grad_(k, lse, target, scale, z_loss=z_loss)
    softmax_grad_reference_(t, lse, target, scale, z_loss=z_loss)
    torch.cuda.synchronize()
    assert torch.equal(torch.isnan(k), torch.isnan(t))
    assert torch.equal(torch.isinf(k), torch.isinf(t)) and torch.equal(k[torch.isinf(t)], t[torch.isinf(t)])
    assert torch.isnan(k[0]).sum() == 2 and torch.isnan(k[1]).all() and torch.isnan(k[2]).all()
    assert torch.isnan(k[4, 0]) and torch.all(k[4, 1:] == 0)
    fin = torch.isfinite(t)
    assert (k.float()[fin] - t.float()[fin]).abs().max() <= 2e-2


def test_targets_out_of_range_match_nothing():
    base, z, lse, target, scale = make(4, 1003, 1008, torch.bfloat16)
    scale.fill_(1.0)
    target[0], target[1], target[2], target[3] = 1003, 2 ** 32 + 7, -1, 1002
    k, ek, et = compare(z, lse, target, scale, torch.bfloat16, dict(label_smoothing=0.1))
    assert ek <= 2 * et + 1e-6
    assert k[1, 7] > -0.5 and k[3, 1002] < -0.5


def test_many_rows_grid_loop():
    """More rows than the grid's y extent (65535): the row loop."""
    base, z, lse, target, scale = make(70001, 24, 24, torch.bfloat16)
    k, ek, et = compare(z, lse, target, scale, torch.bfloat16, dict(label_smoothing=0.1, z_loss=1e-4))
    assert ek <= 2 * et + 1e-6


@pytest.mark.parametrize("V", [1, 7, 8, 9, 8191, 8192, 8193, 16385])
def test_column_edges(V):
    ld = -(-V // 8) * 8
    base, z, lse, target, scale = make(3, V, ld, torch.bfloat16)
    k, ek, et = compare(z, lse, target, scale, torch.bfloat16, dict(label_smoothing=0.1))
    assert ek <= 2 * et + 1e-6
    assert torch.all(base[:, V:] == 7.0)


def test_single_row_any_stride():
    z = torch.randn(1, 1003, device="cuda").to(torch.bfloat16)  # contiguous: stride 1003 (only one row)
    lse = torch.logsumexp(z.float(), -1)
    t, s = torch.tensor([4], device="cuda"), torch.ones(1, device="cuda")
    k, ek, et = compare(z, lse, t, s, torch.bfloat16, {})
    assert ek <= 2 * et + 1e-6


def test_side_stream():
    base, z, lse, target, scale = make(16, 4096, 4096, torch.bfloat16)
    want = z.clone()
    softmax_grad_reference_(want, lse, target, scale)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        softmax_grad_(z, lse, target, scale)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert (z.float() - want.float()).abs().max() <= 1e-2


def test_compiled_once_per_variant():
    base, z, lse, target, scale = make(4, 1003, 1008, torch.bfloat16)
    softmax_grad_(_copy(z), lse, target, scale, label_smoothing=0.05)
    n = len(ce_grad._compiled)
    base2, z2, lse2, t2, s2 = make(9, 5000, 5000, torch.bfloat16)
    softmax_grad_(z2, lse2, t2, s2, label_smoothing=0.05)
    assert len(ce_grad._compiled) == n


def test_cuda_argument_errors():
    lse, t, s = torch.zeros(4, device="cuda"), torch.zeros(4, dtype=torch.int64, device="cuda"), torch.ones(4, device="cuda")
    with pytest.raises(ValueError, match="^z: expected a row stride"):
        softmax_grad_(torch.zeros(4, 1003, dtype=torch.bfloat16, device="cuda"), lse, t, s)
    buf = torch.zeros(4 * 1008 + 8, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="^z: expected 16-byte aligned"):
        softmax_grad_(buf[1:1 + 4 * 1008].view(4, 1008), lse, t, s)
    with pytest.raises(ValueError, match="^lse: expected a tensor on"):
        softmax_grad_(torch.zeros(4, 16, dtype=torch.bfloat16, device="cuda"), lse.cpu(), t, s)
    with pytest.raises(TypeError, match="^target:"):
        softmax_grad_(torch.zeros(4, 16, dtype=torch.bfloat16, device="cuda"), lse, t.int(), s)


def test_bench_helper_runs():
    res = ce_grad.bench(R=64, V=4096, iters=3)
    assert res["gbps"] > 0 and res["copy_gbps"] > 0
