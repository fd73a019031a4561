"""A small Llama-style causal LM in plain torch (no CODA): the stock model that ``coda.fuse`` rewrites.

Same structure and names as Hugging Face's ``LlamaForCausalLM`` (``model.embed_tokens``, ``model.layers[i]`` with
``input_layernorm``, ``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``,
``model.norm``, ``lm_head``), so its state dict is a Llama checkpoint and ``coda.fuse`` treats both alike.
Attention: RoPE (rotate-half) + ``F.scaled_dot_product_attention`` (causal), grouped-query heads.
``LlamaForCausalLM.forward(input_ids, labels=None)`` returns the logits, or with labels the mean next-token loss
(labels shifted inside, ignore_index -100, as Hugging Face's).
Optional config flags give the Qwen variants: ``attention_bias`` (Qwen2: biases on q_proj, k_proj, v_proj),
``qk_norm`` (Qwen3: ``self_attn.q_norm`` / ``k_norm``, an RMSNorm over each head of q and k before RoPE) and
``head_dim`` (default hidden_size // num_attention_heads); with their defaults the model is the Llama one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    head_dim: Optional[int] = None  # None: hidden_size // num_attention_heads
    attention_bias: bool = False  # Qwen2: biases on q_proj, k_proj, v_proj (not o_proj)
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k (q_norm, k_norm) before RoPE


def _head_dim(cfg: LlamaConfig) -> int:
    return cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = _head_dim(cfg)
        h, d, b = cfg.hidden_size, self.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=b)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=b)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=b)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        if cfg.qk_norm:  # Qwen3 (created only then: the Llama model's parameters and their order stay as they are)
            self.q_norm = LlamaRMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        if hasattr(self, "q_norm"):  # per head, before the transpose and RoPE (Hugging Face's Qwen3Attention)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        d = _head_dim(cfg)
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)
        dt = torch.promote_types(x.dtype, torch.float32)  # fp32 angles (Hugging Face's), fp64 in a float64 model
        pos = torch.arange(input_ids.shape[-1], device=input_ids.device, dtype=dt)
        freqs = torch.outer(pos, self.inv_freq.to(dt))
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, input_ids, labels=None):
        logits = self.lm_head(self.model(input_ids))
        if labels is None:
            return logits
        shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
        logits = logits.flatten(0, -2)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 (Hugging Face's upcast); fp64 stays
        return F.cross_entropy(logits, shift.flatten(), ignore_index=-100)
