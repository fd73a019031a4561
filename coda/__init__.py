"""CODA: transformer ops as Hopper (sm_90) GEMMs with fused epilogues, written in CuTeDSL.

``import coda`` is cheap: it imports neither torch nor cutlass and compiles nothing. The public names below are
resolved on first use:

- :func:`coda.gemm` -- ``a @ b.T`` (``F.linear`` semantics) on a Hopper GPU, with an optional fused epilogue;
- :class:`coda.GemmConfig` -- the kernel's compile-time knobs;
- :mod:`coda.reference` -- the torch reference (any device), with the same argument checks as :func:`coda.gemm`;
- :func:`coda.precompile` -- a dry run of one training step that compiles every kernel it needs ahead, in
  parallel worker processes, into the disk cache (the first real step then compiles nothing);
- :mod:`coda.ops`, :mod:`coda.nn`, :mod:`coda.autotune`, :func:`coda.fuse` -- the subpackages, imported on first
  attribute access (``import coda; coda.ops.linear(...)`` works).
"""
from __future__ import annotations

import importlib
import sys
import types

__version__ = "0.1.0"

# public name -> (module, attribute); attribute None means the module itself.
_LAZY = {
    "gemm": ("coda.gemm", "gemm"),
    "GemmConfig": ("coda.config", "GemmConfig"),
    "reference": ("coda.reference", None),
    "nn": ("coda.nn", None),
    "ops": ("coda.ops", None),
    "autotune": ("coda.autotune", None),
    "optim": ("coda.optim", None),
    "fuse": ("coda.fuse", "fuse"),
    "unfuse": ("coda.fuse", "unfuse"),
    "stock_grads": ("coda.fuse", "stock_grads"),
    "precompile": ("coda.dry_run", "precompile"),
}
# the epilogue DSL: @coda.epilogue, operand kinds, math on traced values (coda/dsl.py)
_DSL = ["epilogue", "VecM", "VecN", "Scalar", "TileMN", "EpilogueError", "row", "col", "reduce_n", "reduce_m", "exp",
        "exp2", "log", "log2", "sqrt", "rsqrt", "sigmoid", "tanh", "sin", "cos", "silu", "gelu", "relu", "abs",
        "minimum", "maximum", "where", "cast", "pairs"]
_LAZY.update({n: ("coda.dsl", n) for n in _DSL})
_LAZY["segment_sum"] = ("coda.dsl_segment", "segment_sum")  # a segmented row reduction (coda/dsl_segment.py)

__all__ = ["__version__", *_LAZY]


def _tune_on_miss(a, b, epi, out_dtype, operands):
    """The tuner ``coda.runtime.select`` runs on a miss with ``CODA_AUTOTUNE=1`` (the package root wires the layers:
    the runtime below never imports the autotuner above it; ``coda.runtime.select.set_tuner`` replaces this)."""
    from coda.runtime.precompile import paused
    with paused():  # in a dry run (coda.precompile) the tuner still times real launches
        return importlib.import_module("coda.autotune.tuner").tune(a, b, epi, out_dtype, operands)


def _resolve(name: str):
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attr is None else getattr(module, attr)


def __getattr__(name: str):
    if name in _LAZY:
        value = _resolve(name)
        if name != "gemm":  # coda.gemm is served by the property below, never cached in the module dict
            globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


class _CodaModule(types.ModuleType):
    """``coda.gemm`` is both a submodule and the function it defines.

    Importing the submodule ``coda.gemm`` makes the import system set the attribute ``coda.gemm`` to the module,
    which would shadow the function. This data descriptor wins over the module dict: ``coda.gemm`` is always the
    function, and the import system's assignment of the submodule is ignored (it stays in ``sys.modules``).
    """

    @property
    def gemm(self):
        return _resolve("gemm")

    @gemm.setter
    def gemm(self, value):
        if isinstance(value, types.ModuleType) and value.__name__ == "coda.gemm":
            return
        raise AttributeError("coda.gemm cannot be reassigned")


sys.modules[__name__].__class__ = _CodaModule
