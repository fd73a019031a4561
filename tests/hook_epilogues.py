"""Hook and DSL epilogues shared by the test files."""
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
