"""coda.ops.linear_rope vs a Hugging Face style projection + ``rotate_half`` RoPE in float64 (the truth), with the 2x
rule against the same HF-style computation in the input dtype (fp32 angles pos * inv_freq, cos / sin cast to the
dtype, as ``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb`` do); shared by tests/test_rope.py (CPU) and
tests/test_rope_gpu.py (Hopper)."""
import torch

import coda.ops


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), -1)


def hf_rotary(q, positions, inv_freq, rotary_dim, fp64=False):
    """HF ``apply_rotary_pos_emb`` (partial rotary as GPT-NeoX) on q (..., heads, head_dim); positions (...,).
    The angles are an fp32 product (float64 for the truth), cos / sin are cast to q's dtype before the rotation."""
    adt = torch.float64 if fp64 else torch.float32
    f = positions.to(adt)[..., None] * inv_freq.to(adt)
    emb = torch.cat((f, f), -1)
    cos, sin = emb.cos().to(q.dtype).unsqueeze(-2), emb.sin().to(q.dtype).unsqueeze(-2)
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    return torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q_pass), -1)


def unfused(x, w_hf, positions, inv_freq, head_dim, rotary_heads, rotary_dim, fp64=False):
    """x @ w_hf.T with the first ``rotary_heads`` heads rotated HF-style (q and k), the rest (v) untouched."""
    heads = (x @ w_hf.T).unflatten(-1, (-1, head_dim))
    rot = hf_rotary(heads[..., :rotary_heads, :], positions, inv_freq, rotary_dim, fp64)
    return torch.cat((rot, heads[..., rotary_heads:, :]), -2).flatten(-2)


def ours(x, w_hf, positions, freqs, head_dim, rotary_heads, rotary_dim):
    """coda.ops.linear_rope on the HF weight with its rotated rows permuted once, the output put back in HF column
    order (permutations only: differentiable, no rounding)."""
    n = rotary_heads * head_dim
    w = torch.cat((coda.ops.permute_half_split(w_hf[:n], head_dim, rotary_dim), w_hf[n:]))
    y = coda.ops.linear_rope(x, w, positions, freqs)
    y_rot = coda.ops.unpermute_half_split(y[..., :n].movedim(-1, 0), head_dim, rotary_dim).movedim(0, -1)
    return torch.cat((y_rot, y[..., n:]), -1)


def rel(a, ref):
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_against_fp64(lead, K, head_dim, n_heads, rotary_heads=None, rotary_dim=None, *, max_pos=131072,
                       device="cpu", dtype=torch.bfloat16, floor=1e-4, seed=0, base=10000.0):
    """Forward, dx and dW vs float64 autograd of the HF-style computation: error(ours) <= 2 * error(HF-style in
    ``dtype``) + floor, each against float64. Positions are random in [0, max_pos) with max_pos - 1 included.
    Returns {name: (error ours, error torch)}."""
    rotary_heads = n_heads if rotary_heads is None else rotary_heads
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    g = torch.Generator(device="cpu").manual_seed(seed)
    N = n_heads * head_dim
    x = torch.randn(*lead, K, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(device=device, dtype=dtype)
    pos = torch.randint(0, max_pos, lead, generator=g)
    pos.view(-1)[-1] = max_pos - 1
    pos = pos.to(device)
    dy = torch.randn(*lead, N, generator=g).to(device=device, dtype=dtype)
    freqs = coda.ops.rope_freqs(head_dim, n_heads, base, rotary_heads=rotary_heads, rotary_dim=rotary_dim,
                                device=device)
    inv_freq = freqs[: rotary_dim // 2]  # HF's fp32 inv_freq (rope_freqs computes it as HF does)

    def run(fn, fp64=False):
        leaves = [t.detach().to(torch.float64 if fp64 else dtype).requires_grad_() for t in (x, w)]
        y = fn(*leaves)
        return dict(zip(["y", "dx", "dw"], [y, *torch.autograd.grad(y, leaves, dy.to(y.dtype))]))

    args = (head_dim, rotary_heads, rotary_dim)
    got = run(lambda x_, w_: ours(x_, w_, pos, freqs, *args))
    want = run(lambda x_, w_: unfused(x_, w_, pos, inv_freq, *args, fp64=True), fp64=True)
    theirs = run(lambda x_, w_: unfused(x_, w_, pos, inv_freq, *args))
    assert got["y"].shape == (*lead, N) and got["y"].dtype == dtype
    report = {}
    for k in want:
        e_ours, e_torch = rel(got[k], want[k]), rel(theirs[k], want[k])
        report[k] = (e_ours, e_torch)
        assert e_ours <= 2 * e_torch + floor, (k, e_ours, e_torch)
    return report
