"""Transformer ops built on coda.gemm with fused epilogues (installed as ``coda.ops``)."""
from .linear import linear

__all__ = ["linear"]
