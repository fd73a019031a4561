"""RoPE (rotary position embedding) as a pairs epilogue of the QKV GEMM, used by ``coda.ops.linear_rope``
(issues 4 and 7; docs/DESIGN.md, "RoPE").

Layout: the accumulator columns (2j, 2j+1) are the pair (x_j, y_j) that RoPE rotates -- the interleaved (GPT-J /
Meta Llama) convention; one thread holds both (``coda.pairs``). The Hugging Face half-split convention
(``rotate_half``: dims i and i + d/2 of a head form a pair) becomes this one by permuting the W_q / W_k rows once
(:func:`permute_half_split`). The angle of pair j at row m is theta = pos_m * freq_j (``pos``: VecM, one position
per row; ``freq``: VecN with one value per pair, N/2 entries; ``freq = 0`` is the identity, for V columns).

Forward (R(theta) the 2 x 2 rotation)
    (x', y') = R(theta) (x, y) = (x cos(theta) - y sin(theta),  x sin(theta) + y cos(theta))

Backward (dx', dy' the incoming gradient; the derivative of a linear map is its transpose, R^T = R(-theta))
    (dx, dy) = R(-theta) (dx', dy') = (dx' cos(theta) + dy' sin(theta),  -dx' sin(theta) + dy' cos(theta))
It needs no accumulator: ``coda.autodiff`` derives it from the traced forward (tests/test_rope.py checks that it
is this rotation) and ``coda.ops.linear_rope`` runs it in a GEMM epilogue with nothing to multiply (K = 0).

z . dz is preserved: with z = (x, y) before and z' = R z after the rotation, dz = R^T dz', so
    z . dz = z^T R^T dz' = (R z)^T dz' = z' . dz'
per pair, hence per row: the RMSNorm backward's ZdZ_m = (1/D) sum_k z_mk dz_mk of the QKV GEMM is the same
computed before or after RoPE (e.g. from the attention's q, k, v and their gradients).

Angles are accurate at positions up to 131072 and beyond: ``coda.sin`` / ``coda.cos`` of a product form the
product and its reduction modulo 2 pi in extended precision (``coda._eval.reduce_angle``), then the SFU's
``sin.approx`` / ``cos.approx`` of the reduced angle (max |error| of cos / sin below 1e-6 at every position
0..131072, tests/test_rope_gpu.py); ``pos`` must hold integers below 2^24 (exact in fp32) and ``freq`` fp32 values.
"""
from __future__ import annotations

import math
from typing import Optional

import coda

__all__ = ["rope", "rope_rmsnorm", "rope_rmsnorm_bias", "rope_qknorm", "qknorm_operands", "norm_weight_pairs", "rope_freqs",
           "permute_half_split", "unpermute_half_split", "pairs_order", "half_split_order"]


def _rotate(x, y, pos, freq):
    """The pair (x, y) rotated by theta = pos * freq (traced math of the epilogues below)."""
    theta = pos * freq
    c, sn = coda.cos(theta), coda.sin(theta)
    return x * c - y * sn, x * sn + y * c


@coda.epilogue
def rope(acc, pos: coda.VecM, freq: coda.VecN):
    """Rotate each column pair (2j, 2j+1) of row m by theta = pos[m] * freq[j]."""
    x, y = coda.pairs(acc)
    return _rotate(x, y, pos, freq)


@coda.epilogue
def rope_rmsnorm(acc, r: coda.VecM, pos: coda.VecM, freq: coda.VecN):
    """:func:`rope` of the RMS-normed product: each pair scaled by the row's r = rsqrt(mean(h^2) + eps), then
    rotated (the input norm + QKV + RoPE of attention in one epilogue; the rotation commutes with the scale)."""
    x, y = coda.pairs(acc)
    return _rotate(x * r, y * r, pos, freq)


@coda.epilogue
def rope_rmsnorm_bias(acc, r: coda.VecM, pos: coda.VecM, freq: coda.VecN, b_even: coda.VecN, b_odd: coda.VecN):
    """:func:`rope_rmsnorm` with a bias added before the rotation (Qwen2's q/k/v biases): each pair (r x + b_even,
    r y + b_odd) rotated; ``b_even`` / ``b_odd`` (N/2,) the bias's values at columns 2j / 2j + 1."""
    x, y = coda.pairs(acc)
    return _rotate(x * r + b_even, y * r + b_odd, pos, freq)


_QKNORM = {}


def _check_head_dim(entry: str, head_dim) -> None:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"{entry}: head_dim must be a positive even int, got {head_dim!r}")


def _head_norm(x, y, head_dim: int, eps):
    """x, y (a pair's two values) times rsqrt(mean over the pair's head of x^2 + y^2 + eps): the head's RMSNorm
    without its weight, the sum of squares a ``coda.segment_sum`` over the head's head_dim / 2 pairs."""
    inv = coda.rsqrt(coda.segment_sum(x * x + y * y, head_dim // 2) / head_dim + eps)
    return x * inv, y * inv, inv


def rope_qknorm(head_dim: int, save_x: bool = False):
    """:func:`rope_rmsnorm` with Qwen3's QK-norm between the projection and the rotation, for heads of ``head_dim``:
    each q / k head's values x = r acc (its head_dim columns, i.e. head_dim / 2 pairs, one tile's) become
    x rsqrt(mean over the head of x^2 + eps) w -- a per-head RMSNorm, its sum of squares a ``coda.segment_sum`` --
    then rotate; v heads (``qk`` = 0) only get r. Operands (VecN, one value per column pair, as ``freq``; see
    :func:`qknorm_operands`): ``w_even`` / ``w_odd`` the norm weight of the pair's two dims (1 on v), ``qk`` 1 on q / k
    pairs and 0 on v; ``eps`` the norm's epsilon (Scalar). The weights are in the adjacent-pairs order
    (:func:`permute_half_split` of the q / k rows); the per-head sum does not depend on the order. One epilogue per
    head_dim (the group size is static).

    ``save_x=True``: for GEMMs of q or k heads only (no ``qk`` operand: every head is normed), the epilogue also
    writes x = r acc, the values before the norm (an extra M x N output "x", unrotated, adjacent-pairs order): what
    the backward (``coda.kernels.rope_grad``'s QK-norm) needs besides the output."""
    _check_head_dim("rope_qknorm", head_dim)
    key = (head_dim, bool(save_x))
    if key not in _QKNORM:
        if save_x:
            def rope_qknorm(acc, r: coda.VecM, pos: coda.VecM, freq: coda.VecN, w_even: coda.VecN,
                            w_odd: coda.VecN, eps: coda.Scalar):
                x, y = coda.pairs(acc)
                x, y = x * r, y * r
                xn, yn, _ = _head_norm(x, y, head_dim, eps)
                return {"out": _rotate(xn * w_even, yn * w_odd, pos, freq), "x": (x, y)}
        else:
            def rope_qknorm(acc, r: coda.VecM, pos: coda.VecM, freq: coda.VecN, w_even: coda.VecN,
                            w_odd: coda.VecN, qk: coda.VecN, eps: coda.Scalar):
                x, y = coda.pairs(acc)
                x, y = x * r, y * r
                _, _, inv = _head_norm(x, y, head_dim, eps)
                s = qk * inv + (1 - qk)  # (qk is exactly 0 or 1: v pairs keep x, y)
                return _rotate(x * s * w_even, y * s * w_odd, pos, freq)
        name = f"rope_qknorm_{head_dim}" + ("_x" if save_x else "")
        rope_qknorm.__name__ = rope_qknorm.__qualname__ = name
        _QKNORM[key] = coda.epilogue(rope_qknorm)
    return _QKNORM[key]


def norm_weight_pairs(weight, heads: int, rotary_dim: Optional[int] = None):
    """(even, odd): a per-head norm weight (head_dim,) in the model's half-split order, in the adjacent-pairs order
    (:func:`pairs_order`) repeated for ``heads`` heads and split into the pairs' two dims -- the ``w_even`` /
    ``w_odd`` VecN operands of :func:`rope_qknorm` for a block of q or k heads. float32 (float64 for a float64
    weight); device-side ops only (no index tensor is copied to the device)."""
    import torch
    w = pairs_order(weight.detach().to(torch.promote_types(weight.dtype, torch.float32)), rotary_dim).repeat(heads)
    return w[0::2].contiguous(), w[1::2].contiguous()


def qknorm_operands(q_weight, k_weight, head_dim: int, nq: int, nk: int, nv: int, rotary_dim: Optional[int] = None):
    """(w_even, w_odd, qk) of :func:`rope_qknorm` for a fused [W_q; W_k; W_v] projection of ``nq`` / ``nk`` / ``nv``
    heads: the q_norm / k_norm weights (:func:`norm_weight_pairs`), 1 on v; qk = 1 on q / k pairs."""
    import torch
    (qe, qo), (ke, ko) = norm_weight_pairs(q_weight, nq, rotary_dim), norm_weight_pairs(k_weight, nk, rotary_dim)
    ones = torch.ones(nv * head_dim // 2, device=q_weight.device, dtype=qe.dtype)
    qk = torch.cat((torch.ones((nq + nk) * head_dim // 2, device=q_weight.device, dtype=qe.dtype), torch.zeros_like(ones)))
    return torch.cat((qe, ke, ones)), torch.cat((qo, ko, ones)), qk


def rope_freqs(head_dim: int, n_heads: int, base: float = 10000.0, rotary_heads: Optional[int] = None,
               rotary_dim: Optional[int] = None, scaling=None, device=None):
    """The ``freq`` operand of :func:`rope` (fp32, one value per column pair: ``n_heads * head_dim / 2`` entries)
    for a projection whose N output columns are ``n_heads`` heads of ``head_dim``.

    Within a rotated head, pair i (columns 2i, 2i+1 after :func:`permute_half_split` of its weight rows) gets
    ``inv_freq[i] = 1 / base ** (2i / rotary_dim)``, computed in fp32 exactly as Hugging Face's rotary embedding
    does (a converted model sees the frequencies it was trained with); pairs past ``rotary_dim / 2`` (partial
    rotary, e.g. GPT-NeoX) get 0, the identity. Only the first ``rotary_heads`` heads (default: all) are rotated,
    the others get 0 too. Fused QKV weight [W_q; W_k; W_v] with H query and G key/value heads:
    ``rope_freqs(head_dim, H + 2 * G, rotary_heads=H + G)`` (V unrotated). ``scaling``: an optional function
    inv_freq -> scaled inv_freq (fp32 tensors of rotary_dim / 2; e.g. Llama-3.1 scaling as the model computes it).
    """
    import torch
    for name, v in (("head_dim", head_dim), ("n_heads", n_heads)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"rope_freqs: {name} must be a positive int, got {v!r}")
    if head_dim % 2:
        raise ValueError(f"rope_freqs: head_dim must be even, got {head_dim}")
    r = head_dim if rotary_dim is None else rotary_dim
    if isinstance(r, bool) or not isinstance(r, int) or r % 2 or not 0 < r <= head_dim:
        raise ValueError(f"rope_freqs: rotary_dim must be an even int in (0, head_dim={head_dim}], got {r!r}")
    h = n_heads if rotary_heads is None else rotary_heads
    if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= n_heads:
        raise ValueError(f"rope_freqs: rotary_heads must be an int in [0, n_heads={n_heads}], got {h!r}")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not (math.isfinite(base) and base > 0):
        raise ValueError(f"rope_freqs: base must be a positive finite number, got {base!r}")
    inv = 1.0 / (float(base) ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))  # HF's fp32 inv_freq
    if scaling is not None:
        inv = torch.as_tensor(scaling(inv), dtype=torch.float32)
        if inv.shape != (r // 2,):
            raise ValueError(f"rope_freqs: scaling must return {r // 2} frequencies, got shape {tuple(inv.shape)}")
    freqs = torch.zeros(n_heads, head_dim // 2, dtype=torch.float32)
    freqs[:h, :r // 2] = inv
    return freqs.flatten().to(device) if device is not None else freqs.flatten()


def pairs_order(t, rotary_dim: Optional[int] = None):
    """A head's values along dim 0 of ``t`` (head_dim, ...) from the half-split order (Hugging Face's) to the
    adjacent-pairs order of :func:`rope`: dims (i, i + r/2) -> (2i, 2i + 1), r = ``rotary_dim`` (default head_dim);
    dims past r keep their place. Reshapes only (differentiable, no index tensor)."""
    import torch
    r = t.shape[0] if rotary_dim is None else rotary_dim
    rot = t[:r].reshape(2, r // 2, *t.shape[1:]).transpose(0, 1).reshape(r, *t.shape[1:])
    return rot if r == t.shape[0] else torch.cat((rot, t[r:]))


def half_split_order(t, rotary_dim: Optional[int] = None):
    """The inverse of :func:`pairs_order`."""
    import torch
    r = t.shape[0] if rotary_dim is None else rotary_dim
    rot = t[:r].reshape(r // 2, 2, *t.shape[1:]).transpose(0, 1).reshape(r, *t.shape[1:])
    return rot if r == t.shape[0] else torch.cat((rot, t[r:]))


def _head_perm(head_dim: int, rotary_dim: Optional[int] = None):
    """Row order within one head (:func:`pairs_order` of the row indices): new row 2i = old row i, new row 2i+1 =
    old row i + r/2 (r = rotary_dim); rows past the rotary part keep their place."""
    import torch
    return pairs_order(torch.arange(head_dim), rotary_dim)


def _check_layout(entry, weight, head_dim, rotary_dim):
    import torch
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{entry}: weight must be a torch.Tensor, got {type(weight).__name__}")
    _check_head_dim(entry, head_dim)
    r = head_dim if rotary_dim is None else rotary_dim
    if isinstance(r, bool) or not isinstance(r, int) or r % 2 or not 0 < r <= head_dim:
        raise ValueError(f"{entry}: rotary_dim must be an even int in (0, head_dim={head_dim}], got {r!r}")
    if weight.dim() < 1 or weight.shape[0] % head_dim:
        raise ValueError(f"{entry}: weight must have a multiple of head_dim={head_dim} rows (whole heads), got "
                         f"shape {tuple(weight.shape)}")


def permute_half_split(weight, head_dim: int, rotary_dim: Optional[int] = None):
    """W_q or W_k rows (n_heads * head_dim, ...) in the half-split (Hugging Face ``rotate_half``) order -> the
    adjacent-pairs order of :func:`rope`: within each head, row i goes to 2i and row i + d/2 to 2i + 1 (d =
    ``rotary_dim``, default head_dim). A new tensor (a copy; differentiable); convert once, at load time.

    Why attention is unchanged: HF rotates the pairs (q_i, q_{i+d/2}) by theta_i; after the permutation P those
    pairs sit at (2i, 2i+1) and :func:`rope` rotates them by the same theta_i (freq of pair i = inv_freq[i], as
    :func:`rope_freqs` gives), so the rotated q and k come out as P q_HF and P k_HF. Scores only use
    q . k = (P q) . (P k) within a head (P is a permutation of that head's dims, P^T P = I), so attention
    weights and outputs are identical. V is not permuted (its rows feed the output projection, whose columns
    would otherwise have to follow), and neither is anything but W_q / W_k (and their biases)."""
    _check_layout("permute_half_split", weight, head_dim, rotary_dim)
    perm = _head_perm(head_dim, rotary_dim).to(weight.device)
    heads = weight.reshape(weight.shape[0] // head_dim, head_dim, *weight.shape[1:])
    return heads.index_select(1, perm).reshape(weight.shape)


def unpermute_half_split(weight, head_dim: int, rotary_dim: Optional[int] = None):
    """The inverse of :func:`permute_half_split` (adjacent pairs -> half-split rows), e.g. to save a checkpoint in
    the Hugging Face layout."""
    _check_layout("unpermute_half_split", weight, head_dim, rotary_dim)
    inv = _head_perm(head_dim, rotary_dim).argsort().to(weight.device)
    heads = weight.reshape(weight.shape[0] // head_dim, head_dim, *weight.shape[1:])
    return heads.index_select(1, inv).reshape(weight.shape)
