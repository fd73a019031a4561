"""AdamW in the epilogue of the GEMM that forms a weight's gradient (``coda.optim.AdamW``, ``in_backward``).

The dW GEMM's accumulator *is* the gradient g of one weight tile; instead of storing it (and the optimizer reading
it back) the epilogue reads the weight p and its moments m, v (TileMN operands), applies torch's fused AdamW update
in fp32 and writes p, m, v back in place (``out=p``; m, v are in-place outputs, ``Epilogue.inplace``):

    m' = b1 m + (1 - b1) g              v' = b2 v + (1 - b2) g^2
    p' = p (1 - lr wd) - step_size m' / (sqrt(v') c2 + eps)

with step_size = lr / (1 - b1^t) and c2 = 1 / sqrt(1 - b2^t) (torch's ``_fused_adamw_`` in the same order). The
hyper-parameters are run-time ``Scalar`` operands (device fp32, one launch per step for a whole parameter group:
``coda.optim``), so a learning-rate schedule compiles nothing. Per element the gradient is never rounded (torch's
is rounded to the parameter dtype first) and 12 bytes move instead of the 2-byte gradient store of the GEMM plus the
optimizer's 14-byte pass.

Four programs share :func:`update`: :func:`adamw` (a plain dW GEMM), :func:`adamw_fold` (the MLP's folded
gate/up weight, ``ops.mlp.fold_grads`` plus the update: g = acc gamma and dgamma's per-column partials over the
weight before its update), :func:`adamw_scaled` (a K = 0 pass over a gradient formed earlier, times a scalar: the
cross entropy's fast mode, whose dW exists before the backward knows grad_output) and :func:`adamw_times` (that
mode's dW GEMM when it waits for the backward: g = acc s). (g = (acc + t) s, for a dW GEMM over the last of several
chunks, spills 24 bytes in the epilogue warps on sm_90a: not used.)
"""
import coda
from coda import Scalar, TileMN

HYPER = ("b1", "b1c", "b2", "b2c", "c2", "eps", "step_size", "decay")  # the Scalar operands, in coda.optim's order


def update(g, p, m, v, b1, b1c, b2, b2c, c2, eps, step_size, decay) -> dict:
    """The outputs of one AdamW step of the weight ``p`` with gradient ``g`` (traced values)."""
    m2 = b1 * m + b1c * g
    v2 = b2 * v + b2c * g * g
    return {"out": p * decay - step_size * m2 / (coda.sqrt(v2) * c2 + eps), "m": m2, "v": v2}


@coda.epilogue(fastmath=True)
def adamw(acc, p: TileMN, m: TileMN, v: TileMN, b1: Scalar, b1c: Scalar, b2: Scalar, b2c: Scalar, c2: Scalar,
          eps: Scalar, step_size: Scalar, decay: Scalar):
    """dW = acc; the weight p and its moments m, v updated in place."""
    return update(acc, p, m, v, b1, b1c, b2, b2c, c2, eps, step_size, decay)


@coda.epilogue(fastmath=True)
def adamw_fold(acc, gamma: coda.VecN, p: TileMN, m: TileMN, v: TileMN, b1: Scalar, b1c: Scalar, b2: Scalar,
               b2c: Scalar, c2: Scalar, eps: Scalar, step_size: Scalar, decay: Scalar):
    """The folded weight's dW GEMM (acc = dW' = dacc^T h): dW = acc gamma updates p; dgamma = sum_n acc p."""
    res = update(acc * gamma, p, m, v, b1, b1c, b2, b2c, c2, eps, step_size, decay)
    res["dgamma"] = coda.reduce_m(acc * p)
    return res


@coda.epilogue(fastmath=True)
def adamw_scaled(acc, t: TileMN, s: Scalar, p: TileMN, m: TileMN, v: TileMN, b1: Scalar, b1c: Scalar, b2: Scalar,
                 b2c: Scalar, c2: Scalar, eps: Scalar, step_size: Scalar, decay: Scalar):
    """K = 0 pass: dW = t s (a gradient formed earlier, times the upstream scalar)."""
    return update(t * s, p, m, v, b1, b1c, b2, b2c, c2, eps, step_size, decay)


@coda.epilogue(fastmath=True)
def adamw_times(acc, s: Scalar, p: TileMN, m: TileMN, v: TileMN, b1: Scalar, b1c: Scalar, b2: Scalar, b2c: Scalar,
                c2: Scalar, eps: Scalar, step_size: Scalar, decay: Scalar):
    """dW = acc s (the upstream scalar s: the fast cross entropy's dW GEMM run in its backward)."""
    return update(acc * s, p, m, v, b1, b1c, b2, b2c, c2, eps, step_size, decay)

