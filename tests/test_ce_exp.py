"""The fast cross entropy on stored exponentials (``coda.kernels.ce_exp``, ``CODA_CE_EXP=1``) on the CPU: the algebra
of its tables against float64 autograd, when the path is taken, the kernel-class hook, and both kernels compiled for
sm_90a (register-A WGMMAs, the dz store, no spills). On the GPU: tests/test_ce_exp_gpu.py."""
import pytest
import torch

from coda.epilogues.cross_entropy import ce_exp_dx, ce_exp_logits
from coda.ops import cross_entropy_fast as fast
from test_ce_grad import needs_cutlass


def _tables(z: torch.Tensor, seg: int = 256):
    """What the logits kernel produces from logits z (M x V): e = exp(z - m_t) and the (M x T) tables m_t, s_t of
    each 256-column tile t (the last one ragged)."""
    M, V = z.shape
    T = -(-V // seg)
    zp = torch.nn.functional.pad(z, (0, T * seg - V), value=-float("inf")).view(M, T, seg)
    mt = zp.amax(dim=2)
    e = torch.exp(zp - mt.unsqueeze(2))
    return e.view(M, T * seg)[:, :V], mt, e.sum(dim=2)


@pytest.mark.parametrize("M,V,zl,reduction", [(37, 1000, 0.0, "mean"), (64, 512, 1e-3, "sum"), (5, 256, 1e-2, "mean")])
def test_tables_give_the_cross_entropy_gradient(M, V, zl, reduction):
    """lse from the tables equals logsumexp; e s - g [v == t] equals d loss / d z of torch's cross entropy (+ z-loss,
    ignored rows, "mean" over valid rows), float64, ragged last tile."""
    g = torch.Generator().manual_seed(M + V)
    z = (torch.randn(M, V, generator=g, dtype=torch.float64) * 4).requires_grad_(True)
    t = torch.randint(0, V, (M,), generator=g)
    t[::7] = -100
    valid = t != -100
    lse_ref = torch.logsumexp(z, dim=1)
    loss = torch.nn.functional.cross_entropy(z, t, reduction=reduction) + zl * (
        lse_ref[valid] ** 2).sum() / (valid.sum() if reduction == "mean" else 1)
    loss.backward()
    e, mt, st = _tables(z.detach())
    scale = valid.double() / (valid.sum() if reduction == "mean" else 1)
    lse, s = fast.exp_tables(mt, st, scale, zl)
    assert torch.allclose(lse, lse_ref.detach(), rtol=0, atol=1e-12)
    tile = torch.arange(V) // 256
    dz = e * s[:, tile] - scale.unsqueeze(1) * (torch.arange(V) == t.unsqueeze(1))
    assert torch.allclose(dz, z.grad, rtol=1e-10, atol=1e-14)


def test_path_is_opt_in_and_bounded(monkeypatch):
    """Off without ``CODA_CE_EXP=1``; with it, only bf16 CUDA tensors, one chunk, V % 64 == 0, no label smoothing,
    soft-capping or vocabulary shards, dX needed (a CPU tensor never takes it)."""
    x = torch.zeros(16, 8, dtype=torch.bfloat16)
    assert not fast.exp_mode(x, 256, 16, 0.0, None, None, True)
    monkeypatch.setenv("CODA_CE_EXP", "1")
    assert not fast.exp_mode(x, 256, 16, 0.0, None, None, True)  # CPU

    class Cuda:  # the device / dtype checks without a GPU
        is_cuda, dtype, shape = True, torch.bfloat16, (16, 8)
    assert fast.exp_mode(Cuda, 256, 16, 0.0, None, None, True)
    for args in ((320 + 8, 16, 0.0, None, None, True), (256, 8, 0.0, None, None, True), (256, 16, 0.1, None, None, True),
                 (256, 16, 0.0, 30.0, None, True), (256, 16, 0.0, None, object(), True), (256, 16, 0.0, None, None, False)):
        assert not fast.exp_mode(Cuda, *args), args


def test_epilogues_name_their_kernels_and_have_no_reference():
    from coda.kernels.gemm_sm90 import GemmSm90, kernel_class
    from coda.kernels.ce_exp import LogitsExpSm90, SoftmaxGradDxSm90
    from coda.kernels.epilogue import Epilogue
    assert kernel_class(ce_exp_logits) is LogitsExpSm90 and kernel_class(ce_exp_dx) is SoftmaxGradDxSm90
    assert kernel_class(Epilogue()) is GemmSm90
    with pytest.raises(NotImplementedError, match="kernel only"):
        ce_exp_dx.reference(torch.zeros(2, 2))


@needs_cutlass
@pytest.mark.parametrize("which", ["logits", "dx"])
def test_kernels_compile_for_sm90a(which):
    from coda.check import compile_variant
    epi, cfg, majors = ((ce_exp_logits, fast.EXP_LOGITS, ("k", "k")) if which == "logits" else
                        (ce_exp_dx, fast.EXP_DX, ("k", "mn")))
    row = compile_variant(cfg, epi, majors=majors, count=("ex2.approx", "stmatrix", "st.global.v4", "fma.rn.bf16x2",
                                                           "shfl.sync"))
    assert row["ok"], row["error"]
    assert row["wgmma"] > 0 and row["spill_bytes"] == 0, row
    c = row["count"]
    if which == "logits":  # one ex2 per accumulator value, the quad shuffles of the row maximum and sum
        assert c["ex2.approx"] >= 128 and c["shfl.sync"] >= 8, c
    else:  # the bf16x2 multiply, the dz store (stmatrix over the stage, 16-byte global stores), no exponentials
        assert c["fma.rn.bf16x2"] > 0 and c["st.global.v4"] > 0 and c["ex2.approx"] == 0, c


@needs_cutlass
def test_kernels_reject_other_tiles():
    from coda.config import GemmConfig
    from coda.kernels.ce_exp import _check
    _check(GemmConfig())
    for cfg in (GemmConfig(tile_n=128), GemmConfig(pingpong=True, tile_m=64), GemmConfig(epi_wg=True)):
        with pytest.raises(ValueError, match="ce_exp"):
            _check(cfg)
