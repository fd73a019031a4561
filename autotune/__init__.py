"""Autotuning of GemmConfig for CODA's GEMM (installed as ``coda.autotune``)."""
