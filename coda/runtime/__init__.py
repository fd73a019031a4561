"""The runtime layer under ``coda.gemm`` and below the autotuner (docs/DESIGN.md, "Layers"): what a kernel *is* and
where compiled kernels and measured facts are kept.

- :mod:`coda.runtime.keys`: kernel identity (arch, config, epilogue semantic key, dtypes, argument signature,
  versions, a hash of the kernel sources), tuning keys and shape buckets, the device description;
- :mod:`coda.runtime.store`: the on-disk JSON stores (atomic writes, ownership and permission checks, damaged files
  rebuilt with a warning);
- :mod:`coda.runtime.compile_cache`: compiled kernels as objects on disk, loaded back without compiling, and the
  per-GPU hardware facts (max active clusters);
- :mod:`coda.runtime.select`: which config ``coda.gemm(config=None)`` runs (memory, the tuning store, a shipped
  config, the heuristic; the tuner only with ``CODA_AUTOTUNE=1``, through the hook ``set_tuner``), with
  :mod:`coda.runtime.rules` (what a valid config is, for an epilogue and a problem) and
  :mod:`coda.runtime.shipped` (the per-GPU tuned-config files and their lookup).

``coda.autotune`` searches configs and calls down into these; nothing here imports ``coda.autotune``, ``coda.ops``
or ``coda.epilogues`` (tests/test_package.py); the default tuner is the package root's ``coda._tune_on_miss``.
Importing this package imports neither torch nor cutlass.
"""
