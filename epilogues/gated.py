"""Gated activations (SwiGLU, GeGLU) as pairs epilogues of the gate/up GEMM, used by ``coda.ops.linear_swiglu`` /
``coda.ops.linear_geglu`` (issue 4; docs/DESIGN.md).

Layout: the gate/up weight has its rows interleaved, row 2j = gate_j, row 2j+1 = up_j
(``coda.ops.interleave_gate_up``), so the accumulator columns (2j, 2j+1) are the pair (g_j, u_j), which one
thread holds (``coda.pairs``); the epilogue writes one value per pair: an M x N/2 output, N = 2I.

Forward (one output a per pair; act = silu or gelu)
    a = act(g) u

Backward (da the incoming gradient of a; the backward GEMM recomputes (g, u) and writes dacc, M x N, at 2j, 2j+1)
    dg = da u act'(g)        du = da act(g)
    silu'(g)      = s (1 + g (1 - s)),                         s = sigmoid(g)
    gelu_tanh'(g) = (1 + t)/2 + (g/2)(1 - t^2) k (1 + 3c g^2),  t = tanh(k (g + c g^3)), k = sqrt(2/pi), c = 0.044715
    gelu_erf'(g)  = Phi(g) + g phi(g),                         Phi(g) = (1 + erf(g/sqrt 2))/2, phi = Phi'
The backward epilogues are not written by hand: ``coda.autodiff`` differentiates the traced forward with sympy
(``backward_epilogue(swiglu, ("out",), ())``), and tests/test_gated.py checks that it equals the formulas above.
"""
import coda

__all__ = ["swiglu", "geglu", "geglu_erf"]


@coda.epilogue
def swiglu(acc):
    """SwiGLU (Llama, Mistral): a = silu(g) u = g sigmoid(g) u."""
    g, u = coda.pairs(acc)
    return coda.silu(g) * u


@coda.epilogue
def geglu(acc):
    """GeGLU with the tanh approximation of GELU (Gemma, T5 v1.1; torch ``gelu(approximate="tanh")``):
    a = (g/2)(1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) u."""
    g, u = coda.pairs(acc)
    return coda.gelu(g, approximate="tanh") * u


@coda.epilogue
def geglu_erf(acc):
    """GeGLU with the exact (erf) GELU (torch ``gelu(approximate="none")``, the default of ``F.gelu``):
    a = (g/2)(1 + erf(g/sqrt 2)) u."""
    g, u = coda.pairs(acc)
    return coda.gelu(g, approximate="none") * u
