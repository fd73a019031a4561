"""Transformer ops built on coda.gemm with fused epilogues (installed as ``coda.ops``)."""
from .cross_entropy import linear_cross_entropy
from .linear import linear
from .rmsnorm_linear import rmsnorm_linear

__all__ = ["linear_cross_entropy", "linear", "rmsnorm_linear"]
