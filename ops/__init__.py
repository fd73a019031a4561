"""Transformer ops built on coda.gemm with fused epilogues (installed as ``coda.ops``)."""
from .attention import linear_residual, rmsnorm_linear_rope, rmsnorm_linear_rope_qkv
from .attention_bias import rmsnorm_linear_rope_bias_qkv
from .attention_qknorm import rmsnorm_linear_rope_qknorm_qkv
from .cross_entropy import linear_cross_entropy
from .embedding import embedding
from .gated import deinterleave_gate_up, interleave_gate_up, linear_geglu, linear_swiglu
from .layernorm_linear import layernorm_linear
from .linear import linear
from .mlp import mlp, rmsnorm_swiglu
from .rmsnorm import rmsnorm
from .rmsnorm_linear import rmsnorm_linear
from .rope import linear_rope, permute_half_split, rope_freqs, unpermute_half_split

__all__ = ["linear_cross_entropy", "linear_swiglu", "linear_geglu", "interleave_gate_up", "deinterleave_gate_up",
           "linear", "mlp", "rmsnorm", "rmsnorm_linear", "rmsnorm_swiglu", "linear_rope", "rope_freqs",
           "permute_half_split", "unpermute_half_split", "rmsnorm_linear_rope", "rmsnorm_linear_rope_qkv",
           "rmsnorm_linear_rope_qknorm_qkv", "rmsnorm_linear_rope_bias_qkv", "linear_residual", "layernorm_linear",
           "embedding"]
