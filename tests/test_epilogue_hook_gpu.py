"""The GEMM's epilogue hook on the H100: operands of every kind, an extra tile output, row and column reductions."""
import math

import pytest
import torch

import coda
from coda.config import GemmConfig
from coda.kernels.epilogue import Epilogue, Operand, Reduction

pytestmark = pytest.mark.gpu


class Everything(Epilogue):
    """pre = s*acc + bias[col]; y = pre*rs[row] + res; outputs y, pre; reductions over y."""
    name = "test_everything"
    operands = (Operand("bias", "vec_n"), Operand("rs", "vec_m"), Operand("res", "tile"), Operand("s", "scalar"))
    outputs = ("pre",)
    reductions = (Reduction("ss", "n", "sum"), Reduction("cs", "m", "sum"), Reduction("mx", "n", "max"))

    def visit(self, acc, env):
        pre = acc * env["s"] + env["bias"]
        y = pre * env["rs"] + env["res"]
        return {"out": y, "pre": pre, "ss": y * y, "cs": y, "mx": y}

    def reference(self, acc, bias, rs, res, s):
        pre = acc * s + bias
        y = pre * rs.unsqueeze(-1) + res
        return {"out": y, "pre": pre, "ss": (y * y).sum(-1), "cs": y.sum(-2), "mx": y.amax(-1)}


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


CONFIGS = [GemmConfig(), GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=1),
           GemmConfig(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2), GemmConfig(tile_m=64, tile_n=256,
                                                                                     pingpong=True, cluster_m=1)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("L", [None, 2])
def test_everything(cfg, L):
    M, N, K = 333, 520, 264  # ragged: partial tiles in M and N
    lead = (L,) if L else ()
    dev, dt = "cuda", torch.bfloat16
    a = torch.randn(*lead, M, K, device=dev, dtype=dt)
    b = torch.randn(*lead, N, K, device=dev, dtype=dt)
    ops = dict(bias=torch.randn(N, device=dev), rs=torch.rand(*lead, M, device=dev) + 0.5,
               res=torch.randn(*lead, M, N, device=dev, dtype=dt), s=0.37)
    out = torch.full((*lead, M, N), math.nan, device=dev, dtype=dt)
    got = coda.gemm(a, b, epilogue=Everything(), out=out, config=cfg, **ops)
    assert not torch.isnan(got["out"]).any() and not torch.isnan(got["pre"]).any()
    acc64 = torch.matmul(a.double(), b.double().transpose(-1, -2))
    ref = Everything().reference(acc64, ops["bias"].double(), ops["rs"].double(), ops["res"].double(), ops["s"])
    # torch in the same dtype: bf16 GEMM output, then the same math in fp32
    accbf = torch.matmul(a, b.transpose(-1, -2)).float()
    theirs = Everything().reference(accbf, ops["bias"], ops["rs"], ops["res"].float(), ops["s"])
    theirs["out"], theirs["pre"] = theirs["out"].to(dt), theirs["pre"].to(dt)
    for k in ("out", "pre", "ss", "cs", "mx"):
        assert got[k].shape == ref[k].shape, (k, got[k].shape, ref[k].shape)
        assert rel(got[k], ref[k]) <= 2 * rel(theirs[k], ref[k]) + 1e-6, (k, rel(got[k], ref[k]),
                                                                           rel(theirs[k], ref[k]))


def test_deterministic():
    a = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(776, 512, device="cuda", dtype=torch.bfloat16)
    ops = dict(bias=torch.randn(776, device="cuda"), rs=torch.rand(1000, device="cuda"),
               res=torch.randn(1000, 776, device="cuda", dtype=torch.bfloat16), s=1.5)
    r1 = coda.gemm(a, b, epilogue=Everything(), **ops)
    r2 = coda.gemm(a, b, epilogue=Everything(), **ops)
    for k in r1:
        assert torch.equal(r1[k], r2[k]), k
