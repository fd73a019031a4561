"""Row-scale + column-bias epilogues (hook classes), shared by the quickstart, ``coda.bench`` and
``coda.bench.launch``: y = acc * scale[row] + bias[col], optionally with the per-row sum of y^2 (what an RMSNorm
consumer needs)."""
from coda.kernels.epilogue import Epilogue, Operand, Reduction


class ScaleBias(Epilogue):
    """y = acc * scale[row] + bias[col]."""
    name = "scale_bias"
    operands = (Operand("scale", "vec_m"), Operand("bias", "vec_n"))

    def visit(self, acc, env):
        return {"out": acc * env["scale"] + env["bias"]}

    def reference(self, acc, scale, bias):
        return {"out": acc * scale.unsqueeze(-1) + bias}


class ScaleBiasSumsq(ScaleBias):
    """y = acc * scale[row] + bias[col] and the per-row sum of y^2."""
    name = "scale_bias_sumsq"
    reductions = (Reduction("sumsq", "n", "sum"),)

    def visit(self, acc, env):
        y = super().visit(acc, env)["out"]
        return {"out": y, "sumsq": y * y}

    def reference(self, acc, scale, bias):
        y = super().reference(acc, scale, bias)["out"]
        return {"out": y, "sumsq": (y * y).sum(-1)}
