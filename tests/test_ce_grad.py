"""coda.kernels.ce_grad on the CPU: the torch reference against a float64 formula (options, ignored rows, NaN / inf),
argument errors, and the CuTeDSL kernel's sm_90a compile (128-bit accesses, no spills; skipped without cutlass)."""
import pytest
import torch

from coda.kernels import ce_grad
from coda.kernels.ce_grad import check_args, softmax_grad_, softmax_grad_reference_

OPTIONS = [dict(), dict(label_smoothing=0.1), dict(z_loss=1e-3), dict(softcap=30.0),
           dict(label_smoothing=0.2, z_loss=1e-4, softcap=15.0)]


def expected64(z, lse, target, row_scale, label_smoothing=0.0, z_loss=0.0, softcap=None):
    """The gradient in float64 (the ground truth)."""
    R, V = z.shape
    z, lse, s = z.double(), lse.double().unsqueeze(1), row_scale.double().unsqueeze(1)
    onehot = (torch.arange(V).unsqueeze(0) == target.unsqueeze(1)).double()
    g = s * (torch.exp(z - lse) * (1 + 2 * z_loss * lse) - (1 - label_smoothing) * onehot - label_smoothing / V)
    if softcap is not None:
        g = g * (1 - (z / softcap) ** 2)
    return g


def make(R=12, V=203, dtype=torch.bfloat16, softcap=None, seed=0, ld=None):
    g = torch.Generator().manual_seed(seed)
    ld = ld or V
    x = torch.randn(R, ld, generator=g) * 3
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    z = x.to(dtype)[:, :V]
    lse = torch.logsumexp(z.float(), -1)
    target = torch.randint(0, V, (R,), generator=g)
    row_scale = torch.rand(R, generator=g) + 0.5
    return z, lse, target, row_scale


def assert_matches(got, want, dtype):
    """got (in z's dtype) within one rounding of dtype of the float64 value (+ a floor for fp32 cancellation);
    NaN exactly where want is NaN, +-inf where want is."""
    got = got.double()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    fin = torch.isfinite(want)
    assert torch.equal(got[~fin & ~torch.isnan(want)], want[~fin & ~torch.isnan(want)])
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    err = (got[fin] - want[fin]).abs()
    bound = want[fin].abs() * ulp * 1.01 + 1e-6
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_reference_matches_float64(dtype, opts):
    z, lse, target, s = make(dtype=dtype, softcap=opts.get("softcap"))
    want = expected64(z, lse, target, s, **opts)
    out = softmax_grad_reference_(z, lse, target, s, **opts)
    assert out is z
    assert_matches(z, want, dtype)


def test_reference_padded_rows_untouched():
    z, lse, target, s = make(R=5, V=203, ld=208)
    base = z._base if z._base is not None else z
    pad = base[:, 203:].clone()
    want = expected64(z, lse, target, s, label_smoothing=0.1)
    softmax_grad_reference_(z, lse, target, s, label_smoothing=0.1)
    assert_matches(z, want, torch.bfloat16)
    assert torch.equal(base[:, 203:], pad)


def test_ignored_rows_and_out_of_range_targets():
    z, lse, target, s = make(R=6, V=50)
    s[1], target[1] = 0.0, -100          # ignored row: exactly 0
    target[2] = 50                        # out of range: no column matches
    target[3] = 2 ** 32 + 7               # would match column 7 if truncated to 32 bits
    want = expected64(z, lse, target, s, label_smoothing=0.1, z_loss=1e-3)
    softmax_grad_reference_(z, lse, target, s, label_smoothing=0.1, z_loss=1e-3)
    assert torch.all(z[1] == 0)
    assert torch.all(z[2] > -0.5) and torch.all(z[3] > -0.5)
    assert_matches(z, want, torch.bfloat16)


@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_nan_and_inf_follow_the_torch_expression(z_loss):
    z, lse, target, s = make(R=6, V=40)
    z[0, 3] = float("nan")        # one NaN element: that element only
    lse[1] = float("nan")         # NaN lse: the whole row
    lse[2] = float("inf")         # +inf lse: p = 0 but (1 + 2 zl lse) = inf (or 1 + 0 * inf = NaN): NaN row
    z[3, 5] = float("inf")        # p = inf: +inf (row scale > 0) at that element
    s[4] = 0.0                    # ignored row with a NaN: still NaN there (0 * NaN)
    z[4, 0] = float("nan")
    lse[5] = -float("inf")        # exp(z + inf) = inf everywhere
    want = expected64(z, lse, target, s, z_loss=z_loss)
    ref = z.clone()
    softmax_grad_reference_(ref, lse, target, s, z_loss=z_loss)
    assert_matches(ref, want, torch.bfloat16)
    assert torch.isnan(ref[0, 3]) and torch.isnan(ref[0]).sum() == 1
    assert torch.isnan(ref[1]).all() and torch.isnan(ref[2]).all()
    assert ref[3, 5] == float("inf")
    assert torch.isnan(ref[4, 0]) and (ref[4, 1:] == 0).all()


def test_softmax_grad_on_cpu_is_the_reference():
    z, lse, target, s = make(R=4, V=33)
    z2 = z.clone()
    out = softmax_grad_(z, lse, target, s, label_smoothing=0.1, z_loss=1e-4, softcap=30.0)
    assert out is z
    softmax_grad_reference_(z2, lse, target, s, label_smoothing=0.1, z_loss=1e-4, softcap=30.0)
    assert torch.equal(z, z2)


def test_empty():
    z = torch.empty(0, 16, dtype=torch.bfloat16)
    e = torch.empty(0)
    assert softmax_grad_(z, e, torch.empty(0, dtype=torch.int64), e) is z


# ---------------------------------------------------------------------------------------------------------------
# argument errors


def args(R=4, V=16, **kw):
    a = dict(z=torch.zeros(R, V, dtype=torch.bfloat16), lse=torch.zeros(R), target=torch.zeros(R, dtype=torch.int64),
             row_scale=torch.ones(R))
    a.update(kw)
    return a


@pytest.mark.parametrize("bad, exc, name", [
    (dict(z=torch.zeros(4, 16, dtype=torch.int32)), TypeError, "z"),
    (dict(z=[[0.0]]), TypeError, "z"),
    (dict(z=torch.zeros(4, 16, 2, dtype=torch.bfloat16)), ValueError, "z"),
    (dict(lse=torch.zeros(4, dtype=torch.float64)), TypeError, "lse"),
    (dict(lse=torch.zeros(5)), ValueError, "lse"),
    (dict(target=torch.zeros(4, dtype=torch.int32)), TypeError, "target"),
    (dict(target=torch.zeros(4, 1, dtype=torch.int64)), ValueError, "target"),
    (dict(row_scale=torch.ones(4, dtype=torch.bfloat16)), TypeError, "row_scale"),
    (dict(row_scale=torch.ones(3)), ValueError, "row_scale"),
    (dict(row_scale=torch.ones(4, device="meta")), ValueError, "row_scale"),
])
def test_argument_errors(bad, exc, name):
    with pytest.raises(exc, match=rf"^{name}:"):
        softmax_grad_(**args(**bad))


def test_float32_only_on_the_reference_path():
    """float32 / float64 logits run on the reference path (CPU; the library's fp32 / fp64 reference), never on the
    kernel."""
    a = args(z=torch.randn(4, 16))
    want = softmax_grad_reference_(**{**a, "z": a["z"].double()}).float()
    assert torch.allclose(softmax_grad_(**a), want, atol=1e-6)
    from coda.kernels.ce_grad import check_args
    with pytest.raises(TypeError, match="^z:"):
        check_args(**args(z=torch.zeros(4, 16)), kernel=True)


@pytest.mark.parametrize("opts, exc, name", [
    (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
    (dict(label_smoothing="0.1"), TypeError, "label_smoothing"),
    (dict(z_loss=float("nan")), ValueError, "z_loss"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap="30"), TypeError, "softcap"),
])
def test_option_errors(opts, exc, name):
    with pytest.raises(exc, match=rf"^{name}:"):
        softmax_grad_(**args(), **opts)


def test_requires_grad_is_refused():
    a = args()
    a["z"].requires_grad_()
    with pytest.raises(ValueError, match="^z:"):
        softmax_grad_(**a)


def test_kernel_layout_checks():
    """What the CUDA path checks before compiling or launching (here on CPU tensors, kernel=True)."""
    a = args(V=1003)  # contiguous: ld = 1003, not a multiple of 8
    with pytest.raises(ValueError, match=r"^z: expected a row stride"):
        check_args(**a, kernel=True)
    buf = torch.zeros(4 * 1008 + 8, dtype=torch.bfloat16)
    z = buf[1:1 + 4 * 1008].view(4, 1008)[:, :1003]  # 2-byte offset: not 16-byte aligned
    with pytest.raises(ValueError, match=r"^z: expected 16-byte aligned"):
        check_args(**args(V=1003, z=z), kernel=True)
    with pytest.raises(ValueError, match=r"^z: expected a contiguous last dim"):
        check_args(**args(z=torch.zeros(16, 4, dtype=torch.bfloat16).t()), kernel=True)
    z = torch.zeros(4, 1008, dtype=torch.bfloat16)[:, :1003]
    assert check_args(**args(V=1003, z=z), kernel=True) == (0.0, 0.0, None)


def test_kernel_view_single_row():
    z = torch.zeros(1, 1003, dtype=torch.bfloat16)
    v = ce_grad._kernel_view(z)
    assert v.stride() == (1008, 1) and v.data_ptr() == z.data_ptr()


# ---------------------------------------------------------------------------------------------------------------
# the kernel compiles for sm_90a on this machine (no GPU): 128-bit loads / stores, no local memory, no spills


def _cutlass():
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
        return True
    except Exception:
        return False


needs_cutlass = pytest.mark.skipif(not _cutlass(), reason="nvidia-cutlass-dsl not importable")


def sm90a_ptx(compile_kernel, *params) -> tuple:
    """(PTX text, ``ptxas -v`` output or None) of a kernel module's ``compile_kernel(*params)`` for sm_90a (the row
    kernels' compile tests: rope_grad, embedding_adamw)."""
    import os
    import tempfile

    from coda.kernels.ce_grad import _ptxas_v
    with tempfile.TemporaryDirectory() as d:
        compile_kernel(*params, options=f"--gpu-arch=sm_90a --keep-ptx --dump-dir={d}")
        ptx = next(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".ptx"))
        return open(ptx).read(), _ptxas_v(ptx, "sm_90a")


@needs_cutlass
@pytest.mark.parametrize("variant", [(torch.bfloat16, 0.0, 0.0, None), (torch.float16, 0.1, 1e-4, 30.0)],
                         ids=["bf16-plain", "fp16-all-options"])
def test_compiles_for_sm90a(variant):
    row, = ce_grad.check("sm_90a", [variant])
    assert row["ld_v4"] >= ce_grad.UNROLL and row["st_v4"] >= ce_grad.UNROLL, row
    assert row["ex2"] > 0 and row["local"] == 0, row
    assert row["spill_bytes"] == 0 and row["stack"] == 0, row
    assert row["registers"] <= 128, row


@needs_cutlass
def test_compiles_through_from_dlpack_and_marshals():
    """The launch path's arguments (from_dlpack views, a Float32, a stream) compile and marshal into 6 pointers."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass.cute.runtime import from_dlpack
    z = torch.zeros(37, 1008, dtype=torch.bfloat16)[:, :1003]
    mz = from_dlpack(ce_grad._kernel_view(z), assumed_align=16).mark_layout_dynamic(leading_dim=1)
    vecs = [from_dlpack(t).mark_layout_dynamic(leading_dim=0)
            for t in (torch.zeros(37), torch.zeros(37, dtype=torch.int64), torch.zeros(37))]
    a = [mz, *vecs, cutlass.Float32(0.1 / 1003), cuda.CUstream(0)]
    fn = ce_grad.compile_kernel(torch.bfloat16, 0.1, 0.0, None, fake=False, args=a, options="--gpu-arch=sm_90a")
    exe, _keep = fn.generate_execution_args(*a)
    assert len(exe) == 6
