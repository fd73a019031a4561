"""The GEMM's epilogue hook on the H100: operands of every kind, an extra tile output, row and column reductions."""
import math
import sys

import pytest
import torch

import coda
from coda.config import GemmConfig
from coda.kernels.epilogue import Epilogue, Operand, Reduction
from hook_epilogues import Everything

pytestmark = pytest.mark.gpu


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


CONFIGS = [GemmConfig(), GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=1),
           GemmConfig(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2), GemmConfig(tile_m=64, tile_n=256,
                                                                                     pingpong=True, cluster_m=1)]


class NoReductions(Everything):
    name = "test_no_reductions"
    reductions = ()


class NoOperands(Epilogue):
    name = "test_no_operands"
    reductions = Everything.reductions

    def visit(self, acc, env):
        return {"out": acc, "ss": acc * acc, "cs": acc, "mx": acc}


class ReductionsAndExtraOutput(NoOperands):
    name = "test_reductions_extra_output"
    outputs = ("pre",)

    def visit(self, acc, env):
        return dict(super().visit(acc, env), pre=acc * 0.5)


def test_operands_and_extra_output_leave_inputs_alone():
    M, N, K = 333, 520, 264
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    res0 = res.clone()
    got = coda.gemm(a, b, epilogue=NoReductions(), bias=torch.randn(N, device="cuda"),
                    rs=torch.rand(M, device="cuda"), res=res, s=0.5)
    torch.cuda.synchronize()
    assert torch.equal(res, res0), "the kernel wrote into an operand"


@pytest.mark.parametrize("extra", [False, True])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_three_reductions(cfg, extra):
    M, N, K = 333, 520, 264
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    got = coda.gemm(a, b, epilogue=ReductionsAndExtraOutput() if extra else NoOperands(), config=cfg)
    acc = a.double() @ b.double().T
    if extra:
        torch.testing.assert_close(got["pre"].double(), (acc * 0.5), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got["ss"].double(), (acc * acc).sum(-1), rtol=1e-3, atol=1e-2)
    torch.testing.assert_close(got["cs"].double(), acc.sum(0), rtol=1e-3, atol=1e-2)
    torch.testing.assert_close(got["mx"].double(), acc.amax(-1), rtol=1e-3, atol=1e-2)


class OperandsAndReductions(Everything):
    name = "test_operands_reductions"
    outputs = ()

    def visit(self, acc, env):
        r = super().visit(acc, env)
        r.pop("pre")
        return r

    def reference(self, *args):
        r = super().reference(*args)
        r.pop("pre")
        return r


@pytest.mark.parametrize("epi", [OperandsAndReductions(), Everything()],
                         ids=lambda e: e.name)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("L", [None, 2])
def test_everything(cfg, L, epi):
    M, N, K = 333, 520, 264  # ragged: partial tiles in M and N
    lead = (L,) if L else ()
    dev, dt = "cuda", torch.bfloat16
    a = torch.randn(*lead, M, K, device=dev, dtype=dt)
    b = torch.randn(*lead, N, K, device=dev, dtype=dt)
    ops = dict(bias=torch.randn(N, device=dev), rs=torch.rand(*lead, M, device=dev) + 0.5,
               res=torch.randn(*lead, M, N, device=dev, dtype=dt), s=0.37)
    out = torch.full((*lead, M, N), math.nan, device=dev, dtype=dt)
    got = coda.gemm(a, b, epilogue=epi, out=out, config=cfg, **ops)
    assert not any(torch.isnan(got[k]).any() for k in ("out", "pre") if k in got)
    acc64 = torch.matmul(a.double(), b.double().transpose(-1, -2))
    ref = epi.reference(acc64, ops["bias"].double(), ops["rs"].double(), ops["res"].double(), ops["s"])
    # torch in the same dtype: bf16 GEMM output, then the same math in fp32
    accbf = torch.matmul(a, b.transpose(-1, -2)).float()
    theirs = epi.reference(accbf, ops["bias"], ops["rs"], ops["res"].float(), ops["s"])
    for k in ("out", "pre"):
        if k in theirs:
            theirs[k] = theirs[k].to(dt)
    for k in ref:
        assert got[k].shape == ref[k].shape, (k, got[k].shape, ref[k].shape)
        assert rel(got[k], ref[k]) <= 2 * rel(theirs[k], ref[k]) + 1e-6, (k, rel(got[k], ref[k]),
                                                                           rel(theirs[k], ref[k]))


@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=lambda c: c.name)
def test_deterministic(cfg):
    a = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(776, 512, device="cuda", dtype=torch.bfloat16)
    r1 = coda.gemm(a, b, epilogue=One("rowsum"), config=cfg)
    r2 = coda.gemm(a, b, epilogue=One("rowsum"), config=cfg)
    for k in r1:
        assert torch.equal(r1[k], r2[k]), k


class One(Epilogue):
    """A single feature of the hook at a time, so a failure names the feature."""

    def __init__(self, what):
        self.what = what
        self.name = f"one_{what}"
        kind = {"bias": "vec_n", "rowscale": "vec_m", "residual": "tile", "scalar": "scalar"}.get(what)
        self.operands = (Operand("x", kind),) if kind else ()
        self.reductions = {"rowsum": (Reduction("r", "n", "sum"),), "colsum": (Reduction("r", "m", "sum"),),
                           "rowmax": (Reduction("r", "n", "max"),)}.get(what, ())
        self.outputs = ("extra",) if what == "extra" else ()

    def key(self):
        return super().key() + (self.what,)

    def visit(self, acc, env):
        w = self.what
        if w == "coords":
            return {"out": acc + env.row.to(type(acc)) * 0.001 + env.col.to(type(acc)) * 0.01}
        if w in ("bias", "rowscale", "residual", "scalar"):
            return {"out": acc * env["x"] if w in ("rowscale", "scalar") else acc + env["x"]}
        if w == "extra":
            return {"out": acc, "extra": acc * 2.0}
        return {"out": acc, "r": acc}

    def reference(self, acc, x=None):
        w = self.what
        M, N = acc.shape[-2:]
        if w == "coords":
            r = torch.arange(M, device=acc.device, dtype=acc.dtype).unsqueeze(-1)
            c = torch.arange(N, device=acc.device, dtype=acc.dtype)
            return {"out": acc + r * 0.001 + c * 0.01}
        if w == "bias" or w == "residual":
            return {"out": acc + x}
        if w == "rowscale":
            return {"out": acc * x.unsqueeze(-1)}
        if w == "scalar":
            return {"out": acc * x}
        if w == "extra":
            return {"out": acc, "extra": acc * 2}
        red = {"rowsum": lambda t: t.sum(-1), "colsum": lambda t: t.sum(-2), "rowmax": lambda t: t.amax(-1)}[w]
        return {"out": acc, "r": red(acc)}


@pytest.mark.parametrize("what", ["coords", "bias", "rowscale", "residual", "scalar", "extra", "rowsum", "colsum",
                                  "rowmax"])
@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=lambda c: c.name)
def test_one_feature(what, cfg):
    M, N, K = 333, 520, 264
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    x = {"bias": lambda: torch.randn(N, device="cuda"), "rowscale": lambda: torch.rand(M, device="cuda") + 0.5,
         "residual": lambda: torch.randn(M, N, device="cuda", dtype=torch.bfloat16), "scalar": lambda: 0.37}
    ops = {"x": x[what]()} if what in x else {}
    got = coda.gemm(a, b, epilogue=One(what), config=cfg, **ops)
    got = got if isinstance(got, dict) else {"out": got}
    acc64 = a.double() @ b.double().T
    ref = One(what).reference(acc64, **{k: (v.double() if torch.is_tensor(v) else v) for k, v in ops.items()})
    for k in ref:
        err = (got[k].double() - ref[k]).abs()
        tol = 0.02 * ref[k].abs() + 0.05
        bad = (err > tol).nonzero()
        assert len(bad) == 0, f"{k}: {len(bad)} bad of {err.numel()}, first {bad[:4].tolist()}: got " \
                              f"{got[k][tuple(bad[0])].item():.4f} ref {ref[k][tuple(bad[0])].item():.4f}"


GUARD = 1 << 14


@pytest.mark.parametrize("whole", [False, True], ids=["ragged", "whole_tiles"])
@pytest.mark.parametrize("cfg", CONFIGS + [GemmConfig(cluster_m=1, cluster_n=2, raster="n")], ids=lambda c: c.name)
def test_partials_stay_in_bounds(cfg, whole, monkeypatch):
    """Every partial entry is written and nothing outside the partial buffers is: the scheduler pads the tile grid
    (cluster shape, swizzle groups), and padded tiles must not store partials. Guard zones of NaN around each
    buffer catch stray writes. ``whole``: M and N are 3 tiles each (the kernel drops the reductions' masks, the
    clusters still pad the grid); the finished reductions against float64."""
    G = sys.modules["coda.gemm"]
    bufs = []

    def guarded(shape, device):
        n = math.prod(shape)
        big = torch.full((2 * GUARD + n,), math.nan, dtype=torch.float32, device=device)
        bufs.append((big, n, shape))
        return big[GUARD:GUARD + n].view(shape)

    monkeypatch.setattr(G, "_new_partial", guarded)
    M, N, K = 333, 520, 264  # 3 x 3 tiles of 128 x 256: padded to 4 M-tiles by 2x1 clusters, to 8 N-tiles by swizzle
    if whole:
        M, N = 3 * cfg.tile_m, 3 * cfg.tile_n
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    got = coda.gemm(a, b, epilogue=NoOperands(), config=cfg)
    torch.cuda.synchronize()
    acc = a.double() @ b.double().T
    for k, want in (("ss", (acc * acc).sum(1)), ("cs", acc.sum(0)), ("mx", acc.amax(1))):
        assert rel(got[k].double(), want) < 1e-2, k
    assert len(bufs) == 3
    real_m = -(-M // cfg.tile_m) * cfg.warps_per_tile  # per-column buffers also have the padded M-tile's slots
    for big, n, shape in bufs:
        assert torch.isnan(big[:GUARD]).all() and torch.isnan(big[GUARD + n:]).all(), "write outside a partial buffer"
        real = big[GUARD:GUARD + n].view(shape)
        if shape[-1] == N:  # per column: (L, slots, N)
            real = real[:, :real_m]
        assert not torch.isnan(real).any(), "partial entry never written"


@pytest.mark.parametrize("tf32", [False, True])
@pytest.mark.parametrize("shape", [(1, 512, 2048), (1, 17, 300), (1, 16, 1), (2, 64, 40), (1, 15, 8)])
def test_finish_sum_in_fp32(shape, tf32, monkeypatch):
    """finish_reduction's sum (a matrix-vector product for >= 16 tiles of one batch) is fp32 arithmetic whatever
    torch's TF32 setting, matches float64, and is bitwise repeatable; under CUDA-graph capture it works from the
    ones vector made before the capture."""
    from coda.kernels import epilogue as ep
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", tf32)
    p = torch.randn(*shape, device="cuda") * 100 + 1  # a large common part: TF32's 10-bit mantissa would show
    ref = p.double().sum(dim=1)
    got = ep.finish_reduction(p, "sum")
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    assert torch.equal(got, ep.finish_reduction(p, "sum"))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ep.finish_reduction(p, "sum")
    p.copy_(torch.randn_like(p))
    g.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out.double(), p.double().sum(dim=1), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("shape", [(1, 501, 2816), (1, 16, 3), (1, 15, 40), (2, 33, 7), (1, 600, 4096)])
def test_finish_logsumexp(shape):
    """finish_reduction's logsumexp (in place over the partials) vs float64, with a row of -inf partials (-inf), a +inf one (+inf) and a NaN one (NaN), as torch.logsumexp."""
    from coda.kernels.epilogue import finish_reduction
    p = torch.randn(*shape, device="cuda") * 30
    p[0, :, 0] = -float("inf")
    if shape[2] > 2:
        p[0, 1, 1] = float("inf")
        p[0, -1, 2] = float("nan")
    ref = p.double().logsumexp(dim=1)
    got = finish_reduction(p.clone(), "logsumexp")
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert torch.equal(torch.isnan(got), torch.isnan(ref)) and torch.equal(torch.isinf(got), torch.isinf(ref))
    fin = torch.isfinite(ref)
    if fin.any():
        assert (got.double()[fin] - ref[fin]).abs().max().item() < 1e-5 * ref[fin].abs().max().item() + 1e-6
