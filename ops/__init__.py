"""Transformer ops built on coda.gemm with fused epilogues (installed as ``coda.ops``)."""
from .cross_entropy import linear_cross_entropy
from .gated import deinterleave_gate_up, interleave_gate_up, linear_geglu, linear_swiglu
from .linear import linear
from .mlp import mlp, rmsnorm_swiglu
from .rmsnorm_linear import rmsnorm_linear

__all__ = ["linear_cross_entropy", "linear_swiglu", "linear_geglu", "interleave_gate_up", "deinterleave_gate_up",
           "linear", "mlp", "rmsnorm_linear", "rmsnorm_swiglu"]
