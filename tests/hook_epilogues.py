"""Hook and DSL epilogues shared by the test files (with their float64 torch models where tests need one)."""
import torch

import coda
from coda.kernels.epilogue import Epilogue, Operand, Reduction


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


@coda.epilogue
def rotate(acc, c: coda.TileMN, s: coda.TileMN):
    """A 2 -> 2 pairs epilogue: each column pair rotated by the angle whose cos / sin are c / s (per pair)."""
    x, y = coda.pairs(acc)
    return x * c - y * s, x * s + y * c


@coda.epilogue
def scaled_swiglu_stats(acc, s: coda.VecN, r: coda.VecM):
    """SwiGLU with a per-pair scale and a per-row scale, plus per-row and per-pair statistics."""
    g, u = coda.pairs(acc)
    y = coda.silu(g) * u * s * r
    return {"out": y, "ss": coda.reduce_n(y * y, "sum"), "mx": coda.reduce_n(g, "max"),
            "cs": coda.reduce_m(u * s, "sum"), "lse": coda.reduce_n(g * r, "logsumexp")}


@coda.epilogue
def gated_tiles(acc, p: coda.TileMN, q: coda.TileMN, s: coda.VecN, r: coda.VecM):
    """Half-mode pairs epilogue with two per-pair TileMN operands next to VecN / VecM ones, an extra output and
    reductions (sum, logsumexp per row; sum per pair column)."""
    g, u = coda.pairs(acc)
    y = coda.silu(g * p) * u * s + q * r
    return {"out": y, "gate": coda.sigmoid(g + q), "ss": coda.reduce_n(y * y),
            "lse": coda.reduce_n(u * p, "logsumexp"), "cs": coda.reduce_m(g * q)}


def gated_tiles64(h, p, q, s, r):
    """:func:`gated_tiles` in torch over the accumulator h (autograd-able, any dtype)."""
    g, u = h[..., 0::2], h[..., 1::2]
    y = torch.nn.functional.silu(g * p) * u * s + q * r.unsqueeze(-1)
    return {"out": y, "gate": torch.sigmoid(g + q), "ss": (y * y).sum(-1), "lse": torch.logsumexp(u * p, -1),
            "cs": (g * q).flatten(0, -2).sum(0)}  # per pair column, over every row (of every batch)


def rotate64(h, c, s):
    """:func:`rotate` in torch over the accumulator h."""
    a, b = h[..., 0::2], h[..., 1::2]
    return {"out": torch.stack((a * c - b * s, a * s + b * c), -1).reshape(h.shape)}


def stats_epilogue():
    """The README's reductions example (a VecM operand, per-row sum and logsumexp, a per-column sum)."""
    @coda.epilogue
    def stats(acc, r: coda.VecM):
        y = acc * r
        return {"out": y, "ss": coda.reduce_n(y * y), "lse": coda.reduce_n(y, "logsumexp"), "cs": coda.reduce_m(y)}
    return stats
