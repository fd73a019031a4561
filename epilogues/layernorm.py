"""LayerNorm -> Linear as one GEMM epilogue (``coda.ops.layernorm_linear``; the worked example of docs/DESIGN.md,
section 7: a fused op from an epilogue and ``coda.ops.linear``).

    n = (x - mu) r gamma + beta,   mu, r = mean(x), rsqrt(var(x) + eps) per row,   y = n W^T.

With W' = W diag(gamma) (gamma folded into the weight), c_j = sum_k W'_jk and b_j = sum_k W_jk beta_k:

    y_ij = r_i (acc_ij - mu_i c_j) + b_j,   acc = x W'^T,

so the GEMM reads x itself and the normalised activation (M x K) is never written: the row statistics (mu, r:
VecM) and the weight's column terms (c, b: VecN) are epilogue operands. The backward is derived (``coda.autodiff``
through ``coda.ops.linear``): dacc = r dy, d_r = sum_j dy (acc - mu c), d_mu = -r sum_j dy c, dc_j = -sum_i dy r mu,
db_j = sum_i dy; torch autograd carries d_r, d_mu to x and dc, db to W, gamma, beta. Precision: acc - mu c
cancels when |mean(x)| is large against its spread (as E[x^2] - E[x]^2 would); pre-norm transformer activations are
near zero mean.
"""
import coda

__all__ = ["layernorm_scale"]


@coda.epilogue
def layernorm_scale(acc, r: coda.VecM, mu: coda.VecM, c: coda.VecN, shift: coda.VecN):
    """r (acc - mu c) + shift, shift = W beta (module docstring: b)."""
    return r * (acc - mu * c) + shift
