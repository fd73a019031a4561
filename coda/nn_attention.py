"""``coda.nn.FusedAttention``: a Llama-style attention block whose input RMSNorm, QKV projection and RoPE are one GEMM.

    y = RoPE(RMSNorm(x) [W_q; W_k; W_v]^T)          ``coda.ops.rmsnorm_linear_rope_qkv`` (one GEMM + epilogue)
    o = scaled_dot_product_attention(q, k, v, causal, enable_gqa)   q, k, v: strided views of y (no copies)
    out = o_proj(o)

Drop-in for ``LlamaAttention`` (``examples/llama_model.py``: ``forward(x, cos, sin)``; Hugging Face:
``forward(hidden_states, position_embeddings, attention_mask, ...)`` returning ``(out, None)``) inside a decoder
layer whose ``input_layernorm`` became a :class:`coda.nn.DeferredRMSNorm` (identity; its weight is gamma here).
RoPE uses the model's own ``inv_freq`` (fp32; angles formed in extended precision by the epilogue) and positions
``position_ids`` when the caller passes them, else 0..T-1 (the stock models' cos/sin arguments are not read).
W_q / W_k rows are kept in the adjacent-pairs order (``permute_half_split``: attention scores are unchanged); the
state dict is the stock one (``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight``, ``o_proj.weight``).
Grouped-query heads go to SDPA as they are (``enable_gqa``), never repeated.

QK-norm (Qwen3: ``q_norm`` / ``k_norm``, an RMSNorm over each head of q and k before RoPE): the head norms run in
the QKV GEMMs' epilogues between the input norm's scale and the rotation, their backward in the un-rotation pass
(``coda.ops.rmsnorm_linear_rope_qknorm_qkv``; heads of a multiple of 8 dividing 256, one epsilon for both norms,
no q/k/v biases). q/k/v biases (Qwen2): ``bias_qkv`` (the three biases in ``weight_qkv``'s row order, q / k in
the adjacent-pairs order) is added in the same epilogues before the rotation, its gradient formed in the
un-rotation pass (``coda.ops.rmsnorm_linear_rope_bias_qkv``; no QK-norm, q / k / v widths multiples of 8); the
state dict keeps the stock ``q_proj.bias`` / ``k_proj.bias`` / ``v_proj.bias``. Otherwise (both, or sizes these
ops refuse) the block runs ``coda.ops.rmsnorm_linear`` (input norm + QKV in one GEMM), then the biases, the head
norms (the stock modules, weights permuted like the W_q / W_k rows) and RoPE on the column pairs in torch.
"""
from __future__ import annotations

import inspect
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import coda.nn as _nn
from coda import ops
from coda.epilogues.rope import permute_half_split, unpermute_half_split
from coda.ops.attention_qknorm import supported as qknorm_supported
from coda.nn import (_FUSED_DTYPES, INDUCTOR_UNDER_COMPILE, DeferredRMSNorm, _cast, _compute_dtype, _NormConsumer,
                     norm_eps, rms_norm)

__all__ = ["FusedAttention", "attention_fusable"]


def attention_fusable(attn: nn.Module) -> Optional[str]:
    """Why ``attn`` can't become a :class:`FusedAttention` (None: it can)."""
    lins = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if not all(isinstance(lin, nn.Linear) for lin in lins):
        return "needs nn.Linear q_proj, k_proj, v_proj, o_proj"
    if lins[3].bias is not None:
        return "an o_proj bias is not supported yet"
    if len({lin.bias is None for lin in lins[:3]}) > 1:
        return "biases on some of q_proj, k_proj, v_proj only are not supported"
    d = _head_dim(attn)
    if d is None or d % 2:
        return "needs an even head_dim"
    if any(lin.weight.shape[0] % 8 or lin.weight.shape[1] % 8 for lin in lins):
        return "sizes must be multiples of 8"
    qk = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
    if any(m is not None for m in qk) and not all(_head_rms_norm(m, d) for m in qk):
        return "QK-norm other than an RMSNorm over head_dim on both q and k is not supported"
    cfg = getattr(attn, "config", None)
    # Qwen2 / Qwen3 set attn.sliding_window per layer (None on full-attention layers); Mistral only in its config
    window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(cfg, "sliding_window", None)
    impl = getattr(cfg, "_attn_implementation", None)
    if window is not None and window < getattr(cfg, "max_position_embeddings", float("inf")) and \
            impl not in WINDOW_IN_MASK:
        return (f"sliding-window attention (window {window}) with attn_implementation {impl!r} is not supported "
                f"(with {' or '.join(map(repr, WINDOW_IN_MASK))} it is: the window comes in the attention mask)")
    return None


# Hugging Face attention implementations whose decoder layers hand the attention a mask that already holds the
# sliding window (None where the window cannot matter: the plain causal SDPA is then the same); FusedAttention passes
# the mask to SDPA as it is (transformers 5.24: a bool (B, 1, T, T) mask under "sdpa", an additive one under "eager")
WINDOW_IN_MASK = ("sdpa", "eager")


def _head_rms_norm(m, d: int) -> bool:
    """Whether ``m`` is a per-head RMSNorm (Qwen3's ``q_norm`` / ``k_norm``: a ``*RMSNorm`` with a (d,) weight)."""
    w = getattr(m, "weight", None)
    return (type(m).__name__.endswith("RMSNorm") and isinstance(w, torch.Tensor) and tuple(w.shape) == (d,)
            and norm_eps(m) is not None)


def _rotate_pairs(z: Tensor, pos: Tensor, freqs: Tensor, dtype: torch.dtype) -> Tensor:
    """RoPE on adjacent column pairs (2j, 2j+1) of z (..., T, n) by pos_t * freqs_j, angles in fp32 (fp64 for an
    fp64 model), cos / sin rounded to ``dtype`` (the hidden states', as the stock model's): the stock math in
    CODA's pair order (what the fused epilogue computes)."""
    dt = torch.promote_types(dtype, torch.float32)
    ang = pos.to(dt).unsqueeze(-1) * freqs.to(dt)
    c, s = ang.cos().to(dtype), ang.sin().to(dtype)
    a, b = z[..., 0::2], z[..., 1::2]
    return torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)


def _head_dim(attn) -> Optional[int]:
    d = getattr(attn, "head_dim", None)
    if d is None:
        cfg = getattr(attn, "config", None)
        if cfg is not None:
            d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return d


class FusedAttention(_NormConsumer):
    """See the module docstring. Parameters: ``weight_qkv`` ((Hq + 2 Hkv) d, H), ``o_proj`` (the stock module,
    shared), the norm (a shared :class:`DeferredRMSNorm`); buffer ``freqs`` (one frequency per column pair).

    ``inductor_under_compile`` (class attribute; default False, see ``coda.nn.INDUCTOR_UNDER_COMPILE``): True leaves
    the norm, QKV GEMM and RoPE to inductor under ``torch.compile`` (the stock math on the same weights, GQA by
    repeat as in the stock model). The fused block is faster there now: llama-1b on an H200 (session 43, one
    machine), fused + compile 122.9 ms a step with it fused, 124.0 left to inductor, first step 28 s against 53
    (stock + compile 129.5). Before ``ops._common.inductor_fallbacks`` (session 42) the first compiled step of the
    fused block grew faster than quadratically with the layer count on torch 2.11 (no first step of llama-1b within
    ~480 s), and in session 22 (H100) inductor's path had measured 140.1 ms against 142.8.
    """

    inductor_under_compile = "attention" in INDUCTOR_UNDER_COMPILE
    # add the block's input x to the output (the decoder layer's first residual add; coda.fuse sets it with the
    # layer's patched forward): in eager, o_proj's epilogue adds it and its gradient joins dx in the QKV op's dX
    # epilogue (H100 llama-1b: two bf16 add kernels a layer, ~0.065 ms)
    add_residual = False
    # q, k, v from the QKV op apart (their gradients un-rotated in one pass, coda.kernels.rope_grad) or as one output
    # split in torch (False: the backward cats them, copies and un-rotates in four passes; python -m
    # coda.bench.layer times both)
    qkv_apart = True
    # eager grouped-query heads: SDPA's enable_gqa (False) or k, v repeated per query head first (True);
    # python -m coda.bench.layer times both
    gqa_by_repeat = False
    # with add_residual: o_proj's epilogue also writes h * gamma of the next RMSNorm (the fused MLP's weight, which
    # coda.fuse's layer forward passes as ``next_norm_weight``) and h's rows' sums of squares, which the MLP's
    # gate/up GEMM takes instead of its scale_sumsq pass (appended to the layer forward's ``next_norm_out`` list,
    # which hands them to the MLP call, eager and under torch.compile; else coda.nn.recall_normed). CODA_O_NORM_CHAIN=0
    # turns it off (H100 llama-1b, session 32: fused + graph 129.4 / 129.0 ms with it vs 129.3 / 129.8 without).
    emit_next_norm = os.environ.get("CODA_O_NORM_CHAIN", "1") == "1"

    def __init__(self, hidden_size: int, n_heads: int, n_kv_heads: int, head_dim: int, inv_freq: Tensor,
                 eps: float = 1e-6, *, norm=None, hf_signature: bool = False, device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.n_heads, self.n_kv, self.head_dim = hidden_size, n_heads, n_kv_heads, head_dim
        self.hf_signature, self.layer_idx = hf_signature, None
        n = (n_heads + 2 * n_kv_heads) * head_dim
        self.weight_qkv = nn.Parameter(torch.empty(n, hidden_size, device=device, dtype=dtype))
        self.o_proj = nn.Linear(n_heads * head_dim, hidden_size, bias=False, device=device, dtype=dtype)
        freqs = torch.zeros(n_heads + 2 * n_kv_heads, head_dim // 2, dtype=torch.float32)
        freqs[:n_heads + n_kv_heads] = inv_freq.detach().float().cpu()
        self.register_buffer("freqs", freqs.flatten().to(inv_freq.device), persistent=False)
        self._set_norm(norm, hidden_size, eps, device, dtype)
        self.q_norm = self.k_norm = None  # per-head RMSNorms on q and k before RoPE (Qwen3), the stock modules
        self.register_parameter("bias_qkv", None)  # q/k/v biases (Qwen2), weight_qkv's row order

    @classmethod
    def from_stock(cls, attn: nn.Module, inv_freq: Tensor, norm: DeferredRMSNorm) -> "FusedAttention":
        why = attention_fusable(attn)
        if why:
            raise ValueError(f"FusedAttention.from_stock: {why}")
        d = _head_dim(attn)
        q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
        hf = "position_embeddings" in inspect.signature(attn.forward).parameters
        out = cls(q.shape[1], q.shape[0] // d, k.shape[0] // d, d, inv_freq, norm.variance_epsilon, norm=norm,
                  hf_signature=hf, device="meta", dtype=q.dtype)
        with torch.no_grad():
            w = torch.cat((permute_half_split(q, d), permute_half_split(k, d), v))
        out.weight_qkv = nn.Parameter(w, requires_grad=q.requires_grad)
        if attn.q_proj.bias is not None:  # Qwen2: the biases in weight_qkv's row order
            bq, bk, bv = attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias
            with torch.no_grad():
                b = torch.cat((permute_half_split(bq, d), permute_half_split(bk, d), bv))
            out.bias_qkv = nn.Parameter(b, requires_grad=bq.requires_grad)
        out.freqs = out.freqs.to(q.device)
        out.o_proj = attn.o_proj
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: shared, stock order (permuted when applied)
            out.q_norm, out.k_norm = attn.q_norm, attn.k_norm
        out.layer_idx = getattr(attn, "layer_idx", None)
        return out

    def qkv_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        """(W_q, W_k, W_v) in the stock (half-split) row order."""
        return _stock_qkv(self, self.weight_qkv)

    def qkv_biases(self) -> Optional[tuple[Tensor, Tensor, Tensor]]:
        """(b_q, b_k, b_v) in the stock order, or None (no q/k/v biases)."""
        return None if self.bias_qkv is None else _stock_qkv(self, self.bias_qkv)

    def forward(self, *args, **kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        mask = kwargs.get("attention_mask")
        B, T, _ = x.shape
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = torch.arange(T, device=x.device)
        dtype = _compute_dtype(x)
        fused = dtype in _FUSED_DTYPES and not (_nn.compiling() and self.inductor_under_compile)
        hq, hk, d = self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.head_dim
        one_gemm = fused and self.q_norm is None and self.bias_qkv is None  # norm + QKV + RoPE in the epilogue
        qk_gemm = fused and self._qknorm_in_gemm()  # ... and the head norms too (Qwen3)
        bias_gemm = (fused and self.q_norm is None and self.bias_qkv is not None and self.qkv_apart
                     and hq % 8 == 0 and hk % 8 == 0)  # ... or the q/k/v biases (Qwen2)
        if one_gemm and not self.qkv_apart:
            xr = ()
            q, k, v = torch.split(ops.rmsnorm_linear_rope(x.to(dtype), self.norm_weight, _cast(self.weight_qkv, dtype),
                                                          pos, self.freqs, self.eps), [hq, hk, hk], dim=-1)
        elif one_gemm or qk_gemm or bias_gemm:  # norm + QKV (+ head norms or biases) + RoPE: one GEMM (q, k, v
            # apart: three)
            res_in_op = self.add_residual and type(self.o_proj) is nn.Linear and self.o_proj.bias is None
            ss = kwargs.get("input_sumsq")  # r from the previous block's epilogue: coda.fuse's layer forward
            ss = (ss if ss is not None else _nn.recall_sumsq(x)) if x.dtype == dtype else None  # or the side table
            w = _cast(self.weight_qkv, dtype)
            if qk_gemm:
                q, k, v, *xr = ops.rmsnorm_linear_rope_qknorm_qkv(
                    x.to(dtype), self.norm_weight, w, self.q_norm.weight, self.k_norm.weight, pos, self.freqs,
                    self.eps, norm_eps(self.q_norm), (hq, hk), d, residual=res_in_op, sumsq=ss)
            elif bias_gemm:
                q, k, v, *xr = ops.rmsnorm_linear_rope_bias_qkv(x.to(dtype), self.norm_weight, w, self.bias_qkv,
                                                                pos, self.freqs, self.eps, (hq, hk),
                                                                residual=res_in_op, sumsq=ss)
            else:
                q, k, v, *xr = ops.rmsnorm_linear_rope_qkv(x.to(dtype), self.norm_weight, w, pos, self.freqs,
                                                           self.eps, (hq, hk), residual=res_in_op, sumsq=ss)
            # (q, k, v apart: their gradients go to the backward as they are, un-rotated in one pass with the
            # norm's row dots; a split's backward would first cat them into one buffer)
        else:  # norm + QKV (fused unless float32 / float64 or left to inductor under torch.compile, where it is the
            # stock math that inductor fuses around cuBLAS's GEMM), then Qwen2's biases, Qwen3's head norms (weights
            # in CODA's pair order) and RoPE on the column pairs in torch
            xr = ()
            if fused:
                z = ops.rmsnorm_linear(x.to(dtype), self.norm_weight, _cast(self.weight_qkv, dtype), self.eps)
                z = z if self.bias_qkv is None else z + self.bias_qkv.to(dtype)
            else:
                z = F.linear(rms_norm(x, self.norm_weight, self.eps), self.weight_qkv, self.bias_qkv)
            q, k, v = torch.split(z, [hq, hk, hk], dim=-1)
            if self.q_norm is not None:
                q, k = self._head_norm(q, self.q_norm), self._head_norm(k, self.k_norm)
            # q and k rotated (v's frequencies are 0: left as it is, not copied)
            q = _rotate_pairs(q, pos, self.freqs[:hq // 2], x.dtype)
            k = _rotate_pairs(k, pos, self.freqs[hq // 2:(hq + hk) // 2], x.dtype)
        q = q.reshape(B, T, self.n_heads, d).transpose(1, 2)
        k = k.reshape(B, T, self.n_kv, d).transpose(1, 2)
        v = v.reshape(B, T, self.n_kv, d).transpose(1, 2)
        cache = next((kwargs[n] for n in ("cache", "past_key_values", "past_key_value") if kwargs.get(n) is not None),
                     None)  # transformers 5.x: ``cache``; earlier: ``past_key_value(s)``
        if cache is not None:  # Hugging Face generation: keys and values of earlier positions come from the cache
            k, v = cache.update(k, v, self.layer_idx, {"cache_position": kwargs.get("cache_position")})
        tq, tk = q.shape[2], k.shape[2]
        if mask is None and 1 < tq < tk:  # a chunk after cached positions: causal, aligned bottom-right
            mask = torch.ones(tq, tk, dtype=torch.bool, device=x.device).tril(tk - tq)
        gqa = self.n_kv != self.n_heads
        if gqa and ((_nn.compiling() and not fused) or self.gqa_by_repeat):  # inductor's RoPE kernel (compile,
            # block left to inductor) writes the repeated heads, as for stock; else SDPA takes them as they are
            k, v = (t.repeat_interleave(self.n_heads // self.n_kv, dim=1) for t in (k, v))
            gqa = False
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and tq == tk and tq > 1,
                                           enable_gqa=gqa)
        o = o.transpose(1, 2).reshape(B, T, hq)
        if xr:  # x + o_proj(o) in one GEMM; its backward hands dx's residual part to the QKV op (no add kernels)
            gamma = kwargs.get("next_norm_weight") if self.emit_next_norm else None
            box = kwargs.get("next_norm_out")  # coda.fuse's layer forward: (h * gamma, sums) go to its MLP call
            if gamma is not None and tuple(gamma.shape) == (self.hidden_size,) and (box is not None
                                                                                   or not _nn.compiling()):
                out, hg, ss = ops.linear_residual(o, _cast(self.o_proj.weight, o.dtype), xr[0], norm_weight=gamma)
                if box is not None:
                    box.append((hg, ss))
                else:  # (eager only: keyed by the tensor object)
                    _nn.remember_sumsq(out, ss, hg, gamma)
            else:
                out = ops.linear_residual(o, _cast(self.o_proj.weight, o.dtype), xr[0])
        else:
            out = self.o_proj(o)
            out = x + out if self.add_residual else out
        return (out, None) if self.hf_signature else out

    def _qknorm_in_gemm(self) -> bool:
        """Whether the head norms run in the QKV GEMMs' epilogues and the backward's one pass
        (``ops.rmsnorm_linear_rope_qknorm_qkv``): QK-norm, no q/k/v biases, one epsilon for both norms, head sizes
        that pass (a multiple of 8 dividing 256)."""
        return (self.q_norm is not None and self.bias_qkv is None and self.qkv_apart
                and norm_eps(self.q_norm) == norm_eps(self.k_norm)
                and qknorm_supported(self.head_dim, self.n_heads * self.head_dim, self.n_kv * self.head_dim) is None)

    def _head_norm(self, t: Tensor, norm: nn.Module) -> Tensor:
        """``norm`` (a per-head RMSNorm, stock weight order) over each head of t (..., heads * d)."""
        d = self.head_dim
        w = permute_half_split(norm.weight, d)
        return rms_norm(t.unflatten(-1, (-1, d)), w, norm_eps(norm)).flatten(-2)

    def _to_stock(self, local):
        parts = {kind: _stock_qkv(self, local.pop(mine)) for mine, kind in (("weight_qkv", "weight"),
                                                                            ("bias_qkv", "bias")) if mine in local}
        out = {f"{n}_proj.{kind}": ts[i].contiguous() for i, n in enumerate("qkv") for kind, ts in parts.items()}
        return {**out, **local}  # the stock order: q_proj.weight, q_proj.bias, k_proj.weight, ...

    def _from_stock(self, local):
        d = self.head_dim
        for mine, kind in (("weight_qkv", "weight"), ("bias_qkv", "bias")):
            if all(f"{n}_proj.{kind}" in local for n in "qkv"):
                local[mine] = torch.cat((permute_half_split(local.pop(f"q_proj.{kind}"), d),
                                         permute_half_split(local.pop(f"k_proj.{kind}"), d),
                                         local.pop(f"v_proj.{kind}")))
        return local

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, heads={self.n_heads}, kv_heads={self.n_kv}, "
                f"head_dim={self.head_dim}, q/k rows in adjacent-pairs order"
                + (", q/k/v biases" if self.bias_qkv is not None else ""))


def _stock_qkv(attn, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``weight_qkv`` or ``bias_qkv`` of ``attn`` (rows in CODA's order) -> its q, k, v parts in the stock order
    (``attn``: anything with n_heads, n_kv, head_dim)."""
    hq, hk, d = attn.n_heads * attn.head_dim, attn.n_kv * attn.head_dim, attn.head_dim
    return unpermute_half_split(t[:hq], d), unpermute_half_split(t[hq:hq + hk], d), t[hq + hk:]


def find_inv_freq(model: nn.Module) -> Optional[Tensor]:
    """The model's RoPE ``inv_freq`` buffer (examples/llama_model.py: ``model.inv_freq``; Hugging Face:
    ``model.rotary_emb.inv_freq``), None if it has none or more than one, or a RoPE variant that scales cos/sin."""
    found = [(n, b) for n, b in model.named_buffers() if n.split(".")[-1] == "inv_freq"]
    if len(found) != 1:
        return None
    owner = model.get_submodule(found[0][0].rsplit(".", 1)[0]) if "." in found[0][0] else model
    if float(getattr(owner, "attention_scaling", 1.0)) != 1.0:
        return None
    return found[0][1]
