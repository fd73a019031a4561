"""``coda.ops.rmsnorm_linear_rope``: attention's input RMSNorm + the fused QKV projection + RoPE as one GEMM.

    h (M, K), r = rsqrt(mean(h^2, -1) + eps), W' = W * gamma (gamma folded into the weight, as ``rmsnorm_linear``)
    y = RoPE(diag(r) (h W'^T))          each column pair (2j, 2j+1) of row m rotated by pos[m] * freq[j]

W is [W_q; W_k; W_v] with the q and k rows in the adjacent-pairs order (``permute_half_split``), ``freq`` 0 on the
v columns (``rope_freqs(d, Hq + 2 Hkv, rotary_heads=Hq + Hkv)``). The epilogue ``rope_rmsnorm`` scales and rotates
the accumulator tile; the normed activation and the unrotated q, k are never written.

Backward (dy, the gradient of y; ``rmsnorm_linear``'s algebra on the gradient before RoPE):
1. dacc = R(-theta) dy: one K = 0 launch of the kernel with the backward of ``rope`` as its epilogue;
2. c = (1/K) sum_n dy y per row from the rotated dy and the saved rotated y (the rotation keeps each pair's dot
   product): the epilogue ``row_dot`` as a K = 0 launch;
3. dX GEMM acc = dacc W with the epilogue ``rmsnorm_dgrad``: dh, the normed activation and dgamma partials;
4. dW = dacc^T n.
Saved: h, gamma, W, r, y (alive anyway: attention's q, k, v are views of it), positions and freqs.
"""
from __future__ import annotations

import torch
from torch import Tensor

from coda.epilogues.rope import rope_rmsnorm

from coda.epilogues.rmsnorm import rmsnorm_dgrad, row_dot

from ._builder import backward_op, forward_op
from ._common import call, check_inputs, check_last_dim_contiguous, epilogue_pass, gemm_for, weight_grad
from .rmsnorm_linear import check_eps, check_norm_weight, normed_operands
from .rope import unrotate

__all__ = ["rmsnorm_linear_rope"]

ENTRY = "coda.ops.rmsnorm_linear_rope"


@forward_op("rmsnorm_linear_rope", backward="rmsnorm_linear_rope_backward", grads=3,
            fake=lambda x, norm_weight, weight, positions, freqs, eps: (
                x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape[0], dtype=torch.float32)),
            # (h, norm_weight, weight, r, y, positions, freqs), then need_weight only
            saved=lambda i, out: (*i[:3], out[1], out[0], *i[3:5]), arrange=lambda extra, needs: (needs[2],))
def _op(x: Tensor, norm_weight: Tensor, weight: Tensor, positions: Tensor, freqs: Tensor,
        eps: float) -> tuple[Tensor, Tensor]:
    """x (M, K), weight (N, K), positions (M,) fp32, freqs (N/2,) fp32 -> y (M, N), r (M,) fp32."""
    gemm = gemm_for(x.device, ENTRY)
    a, b, r = normed_operands(x, norm_weight, weight, eps, gemm)
    y = gemm(a, b, epilogue=rope_rmsnorm, r=r, pos=positions, freq=freqs)
    return y, r


def _fake_backward(dy, h, norm_weight, weight, r, y, positions, freqs, need_weight):
    dw = weight.new_empty(weight.shape) if need_weight else weight.new_empty(0)
    return h.new_empty(h.shape), norm_weight.new_empty(norm_weight.shape), dw


@backward_op("rmsnorm_linear_rope_backward", fake=_fake_backward)
def _backward_op(dy: Tensor, h: Tensor, norm_weight: Tensor, weight: Tensor, r: Tensor, y: Tensor,
                 positions: Tensor, freqs: Tensor, need_weight: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dh, dgamma, dW; empty unless need_weight). c = (1/K) sum_n dy y comes from the rotated dy and y (the
    rotation preserves each pair's dot product), the dX GEMM from the unrotated gradient."""
    gemm = gemm_for(dy.device, ENTRY)
    K = h.shape[1]
    if h.shape[0] == 0:  # no rows: nothing to launch, the gradients are zero
        dw = torch.zeros_like(weight) if need_weight else weight.new_empty(0)
        return torch.zeros_like(h), torch.zeros_like(norm_weight), dw
    dy = dy.to(h.dtype).contiguous()
    dacc = unrotate(gemm, dy, positions, freqs)
    c = epilogue_pass(gemm, h, *dy.shape, epilogue=row_dot, dy=dy, y=y)["dot"] / K
    res = gemm(dacc, weight.t(), epilogue=rmsnorm_dgrad, out_dtype=h.dtype, gamma=norm_weight, h=h, r=r, c=c)
    dw = weight_grad(dacc, res["normed"], weight, ENTRY) if need_weight else weight.new_empty(0)
    return res["out"], res["dgamma"].to(norm_weight.dtype), dw


def rmsnorm_linear_rope(x: Tensor, norm_weight: Tensor, weight: Tensor, positions: Tensor, freqs: Tensor,
                        eps: float = 1e-6) -> Tensor:
    """``RoPE(RMSNorm(x) @ weight.T)`` in one fused GEMM, autograd included (see the module docstring).

    x (..., K) bfloat16/float16; norm_weight (K,); weight (N, K) of x's dtype with q/k rows in the adjacent-pairs
    order; positions: x.shape[:-1] (or broadcastable), integer positions below 2^24 (not checked here: the module
    that calls this builds them); freqs (N/2,) float32. N, K multiples of 8. Returns (..., N) in x's dtype."""
    check_inputs(ENTRY, x, weight)
    check_eps(ENTRY, eps)
    K, N = x.shape[-1], weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"{ENTRY}: weight must be (N, {K}) for x (..., {K}), got {tuple(weight.shape)}")
    if not (norm_weight.dtype == torch.float64 and x.device.type == "cpu"):  # float64: the CPU reference path
        check_norm_weight(ENTRY, norm_weight, K)
    if N % 2 or tuple(freqs.shape) != (N // 2,) or freqs.dtype != torch.float32:
        raise ValueError(f"{ENTRY}: freqs must be float32 of shape ({N // 2},) (one per column pair), got "
                         f"{freqs.dtype} {tuple(freqs.shape)}")
    check_last_dim_contiguous(ENTRY, (("x", x), ("weight", weight)))
    pos = torch.broadcast_to(positions, x.shape[:-1]).reshape(-1).to(torch.float32)
    y, _ = call("rmsnorm_linear_rope", x.reshape(-1, K), norm_weight, weight, pos, freqs, float(eps))
    return y.reshape(*x.shape[:-1], N)
