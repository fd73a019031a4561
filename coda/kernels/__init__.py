"""CODA's CuTeDSL kernels: the Hopper GEMM and its epilogue hook."""
