"""The runtime layer under ``coda.gemm`` and below the autotuner (docs/DESIGN.md, "Layers"): what a kernel *is* and
where compiled kernels and measured facts are kept.

- :mod:`coda.runtime.keys`: kernel identity (arch, config, epilogue semantic key, dtypes, argument signature,
  versions, a hash of the kernel sources), tuning keys and shape buckets, the device description;
- :mod:`coda.runtime.store`: the on-disk JSON stores (atomic writes, ownership and permission checks, damaged files
  rebuilt with a warning);
- :mod:`coda.runtime.compile_cache`: compiled kernels as objects on disk, loaded back without compiling, and the
  per-GPU hardware facts (max active clusters).

``coda.autotune`` searches configs and calls down into these; nothing here imports ``coda.autotune``, ``coda.ops``
or ``coda.epilogues`` (tests/test_package.py). Importing this package imports neither torch nor cutlass.
"""
