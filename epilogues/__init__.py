"""Epilogues of CODA's GEMM (installed as ``coda.epilogues``)."""
