"""RMSNorm -> Linear as GEMM epilogues (issue 4; the algebra is in docs/DESIGN.md), used by
``coda.ops.rmsnorm_linear``.

Notation (one row m of M tokens; K the model width, N the linear's output width):
    h (M, K) the residual stream, gamma (K,) the norm weight, W (N, K) the linear weight (``nn.Linear`` layout),
    r_m = (sum_k h_mk^2 / K + eps)^(-1/2), xhat = diag(r) h, n = xhat * gamma (the RMSNorm output),
    y = n W^T (the op's output), dy its incoming gradient.

Forward (:data:`rmsnorm_scale`)
    y = diag(r) ((h * gamma) W^T) = diag(r) (h W'^T) with W' = W diag(gamma): the row scale commutes with the right
    matmul and gamma goes to whichever GEMM operand is cheaper to scale: the weight (:data:`fold_gamma`, N x K) or
    the activation (:data:`scale_sumsq`, M x K, which also gives r's sum of squares in the same pass). The
    normalised activation diag(r) h diag(gamma) is never written; acc = (h * gamma) W^T and the epilogue applies
    y = acc * r (r a VecM operand).

Backward, dX GEMM (:data:`rmsnorm_dgrad`, :data:`rmsnorm_dgrad_residual`)
    The GEMM is acc = dy W (= dn, the gradient of the norm output; W unfolded, passed as ``weight.t()``, an
    MN-major view). With dxhat = acc * gamma, the RMSNorm backward is
        dh = r (dxhat - xhat (1/K) sum_k dxhat_k xhat_k).
    Because y is linear in n, sum_k dxhat_k xhat_k = sum_k dn_k n_k = sum_n dy_n y_n, so with the per-row
        c_m = (1/K) sum_n dy_mn y_mn            (a VecM operand: :data:`row_dot`, one pass over dy and y)
    the epilogue is
        dh = r (acc gamma - h r c)          (+ dres, the gradient arriving on the residual stream, a TileMN)
    and, in the same pass,
        dgamma = reduce_m(acc * h * r)      (dgamma_k = sum_m dn_mk xhat_mk: per-column partials, no atomics)
        normed = h * r * gamma              (an extra M x K output: n, the operand of the dW GEMM)
    so dW = dy^T n is a plain GEMM of transposed views (``dy.t()``, ``normed.t()``).

    Wide linears (N > 2.5 K, e.g. the Llama gate/up projection): c also equals (r / K) sum_k h_k (acc gamma)_k, a
    row sum over the dX GEMM's own tile, so the pass over dy and y (4 N bytes per row) is traded for an fp32 M x K
    round trip (~10 K bytes per row): :data:`rmsnorm_dgrad_split` writes acc and the per-row partials of
    s = sum_k h acc gamma (c = r s / K); a K = 0 pass of :data:`rmsnorm_dgrad_finish` forms dh = r (acc gamma -
    h r c) (+ dres), normed and dgamma from it. The output y then need not be saved for the backward at all.

    This is the formulation of docs/DESIGN.md (dgrad on the unfolded W, gamma a VecN of the dX GEMM). The alternative
    with the folded W' (acc' = dy W' = dxhat; dW = (dy^T xhat) diag(gamma), dgamma_k = sum_n W_nk (dy^T xhat)_nk)
    gives the same values (tests/test_rmsnorm_linear.py checks both with sympy) but needs W' in the backward and
    W as an N x K TileMN operand of the dW GEMM, i.e. more memory traffic.
"""
import coda

__all__ = ["rmsnorm_scale", "rmsnorm_dgrad", "rmsnorm_dgrad_residual", "rmsnorm_dgrad_split", "rmsnorm_dgrad_finish",
           "rmsnorm_dgrad_finish_residual", "row_dot", "fold_gamma", "scale_sumsq"]


@coda.epilogue
def rmsnorm_scale(acc, r: coda.VecM):
    """Forward: y = acc * r with acc = h W'^T (W' = W diag(gamma)), r = rsqrt(mean(h^2) + eps) per row."""
    return acc * r


def _dgrad(acc, gamma, h, r, c):
    xhat = h * r
    return {"out": r * (acc * gamma - xhat * c), "normed": xhat * gamma, "dgamma": coda.reduce_m(acc * xhat)}


@coda.epilogue
def rmsnorm_dgrad(acc, gamma: coda.VecN, h: coda.TileMN, r: coda.VecM, c: coda.VecM):
    """dX GEMM (acc = dy W): dh = r (acc gamma - h r c), normed = h r gamma (for dW = dy^T normed),
    dgamma = sum_m acc h r; c = (1/K) sum_n dy y per row."""
    return _dgrad(acc, gamma, h, r, c)


@coda.epilogue
def rmsnorm_dgrad_residual(acc, gamma: coda.VecN, h: coda.TileMN, r: coda.VecM, c: coda.VecM, dres: coda.TileMN):
    """:data:`rmsnorm_dgrad` plus the gradient arriving on the residual stream: dh = r (acc gamma - h r c) + dres."""
    res = _dgrad(acc, gamma, h, r, c)
    res["out"] = res["out"] + dres
    return res


@coda.epilogue
def rmsnorm_dgrad_split(acc, gamma: coda.VecN, h: coda.TileMN):
    """dX GEMM of the split backward: acc = dy W itself (stored fp32) and the per-row partials of
    s = sum_k h acc gamma (c = r s / K: no pass over dy and y)."""
    return {"out": acc, "s": coda.reduce_n(h * acc * gamma)}


@coda.epilogue
def rmsnorm_dgrad_finish(acc, t: coda.TileMN, h: coda.TileMN, r: coda.VecM, c: coda.VecM, gamma: coda.VecN):
    """The split backward's K = 0 pass (t = dy W from :data:`rmsnorm_dgrad_split`; the accumulator is not used):
    dh = r (t gamma - h r c), normed = h r gamma (the dW GEMM's operand), dgamma = sum_m t h r."""
    return _dgrad(t, gamma, h, r, c)


@coda.epilogue
def rmsnorm_dgrad_finish_residual(acc, t: coda.TileMN, h: coda.TileMN, r: coda.VecM, c: coda.VecM,
                                  gamma: coda.VecN, dres: coda.TileMN):
    """:data:`rmsnorm_dgrad_finish` plus the gradient arriving on the residual stream (+ dres)."""
    res = _dgrad(t, gamma, h, r, c)
    res["out"] = res["out"] + dres
    return res


@coda.epilogue
def row_dot(acc, dy: coda.TileMN, y: coda.TileMN):
    """sum_n dy y per row (fp32): c of the backward, before the dX GEMM needs it. The accumulator is not used: it
    runs as a K = 0 GEMM (CODA's kernel doing only the epilogue: one pass over dy and y, per-tile row partials)."""
    return {"dot": coda.reduce_n(dy * y)}


@coda.epilogue
def fold_gamma(acc, w: coda.TileMN, gamma: coda.VecN):
    """W' = W diag(gamma): the forward's folded weight (N x K, gamma per column), the product in fp32 rounded once.
    The accumulator is not used: a K = 0 GEMM (one read and one write of W, by TMA)."""
    return w * gamma


@coda.epilogue
def scale_sumsq(acc, h: coda.TileMN, gamma: coda.VecN):
    """The forward's activation-side pre-pass: h * gamma (M x K, the GEMM's A operand, rounded once) and the
    per-row sum of squares sum_k h^2 (fp32; r = rsqrt(ss / K + eps)), one read of h. A K = 0 GEMM like
    :data:`fold_gamma`."""
    return {"out": h * gamma, "ss": coda.reduce_n(h * h)}
