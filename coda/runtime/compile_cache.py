"""Compiled GEMM kernels on disk: ``<cache dir>/kernels/<key>.o``, loaded back in a new process without compiling.

What CuTeDSL 4.8.1 offers (see docs/NOTES.md, "Compile cache"):

- its own file cache (``CUTE_DSL_CACHE_DIR``, ``CUTE_DSL_DISABLE_FILE_CACHING``) stores MLIR bytecode keyed by the
  traced module's hash, but ``cute.compile`` always passes ``no_cache=True`` (``base_dsl/compiler.py``,
  ``CompileCallable._compile``), so it never applies to the kernels ``coda.gemm`` compiles;
- ``JitCompiledFunction.dump_to_object(prefix)`` (what ``export_to_c`` writes as ``.o``) returns an ELF object with
  the host launch function and the cubin, and ``cutlass.runtime.load_module(path)[prefix]`` loads it back as a
  callable ``JitCompiledFunction`` (JITLink, no compiler involved). That is the cache used here.

Export needs every host argument annotated with a type the C-header generator knows (``GemmSm90.__call__`` leaves
``stream`` unannotated), so kernels are compiled through :func:`host_entry`, a thin ``@cute.jit`` wrapper with
annotated parameters that calls ``GemmSm90.__call__`` (inlined at trace time; same kernel).

Keys (:func:`coda.autotune.keys.kernel_key`) cover arch, max active clusters, config, epilogue semantic key,
dtypes, argument signature, cutlass-dsl / CODA versions and a hash of ``coda/kernels/*.py``, ``coda/config.py`` and
this file. ``CODA_COMPILE_CACHE=0`` turns the disk cache off. This module imports cutlass; import it lazily.

Integrity and safety: each object ``<key>.o`` has its sha256 beside it in ``<key>.sha256`` (written first); an
object whose bytes do not match (flipped bits, a truncated write, no checksum) is not loaded: one warning, it is
recompiled and rewritten. The cache dir (and ``kernels/``) must be a directory owned by the current user and not
writable by group or others (:func:`coda.autotune.store.dir_problem`), since a planted object would be linked into
every process; otherwise, and when writing fails (read-only dir, ``CODA_CACHE_DIR`` naming a file, ...), kernels
are compiled in memory with one warning per dir. Nothing here raises on a bad cache.
"""
import ctypes
import hashlib
import os
import pathlib
import threading
import warnings
from typing import Any, Optional

from .keys import cutlass_dsl_version, hardware_entry_problem, kernel_key
from .store import (CacheFileWarning, ResultStore, atomic_write_bytes, cache_dir, dir_problem, usable_dir,
                    warn_unwritable)

KERNEL_DIR = "kernels"
_modules: dict = {}  # path -> ExternalBinaryModule (keeps the JIT engines alive)
_runtime_loaded = False
_lock = threading.Lock()
_Entry = None
hardware = ResultStore(name="hardware.json", validate=hardware_entry_problem)  # per-GPU facts that cost a compile


def enabled() -> bool:
    return os.environ.get("CODA_COMPILE_CACHE", "1") != "0"


def kernel_dir() -> pathlib.Path:
    return cache_dir() / KERNEL_DIR


def kernel_path(key: str) -> pathlib.Path:
    return kernel_dir() / f"{key[:40]}.o"


def checksum_path(key: str) -> pathlib.Path:
    """Where the sha256 (hex) of ``kernel_path(key)``'s bytes is stored."""
    return kernel_dir() / f"{key[:40]}.sha256"


def _usable() -> bool:
    """The cache dir and its ``kernels/`` may hold objects (else one warning per dir; compile in memory)."""
    return usable_dir(cache_dir()) and usable_dir(kernel_dir(), group=cache_dir())


def prefix_of(key: str) -> str:
    return f"coda_{key[:24]}"


def host_entry(op: Any, max_clusters: int):
    """``op`` (a ``GemmSm90``) behind a host function whose parameters are all annotated (exportable)."""
    global _Entry
    if _Entry is None:
        from typing import Optional as Opt

        import cuda.bindings.driver as cuda
        import cutlass.cute as cute

        class HostEntry:
            def __init__(self, op, max_clusters):
                self.op, self.max_clusters = op, max_clusters

            @cute.jit
            def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mD: cute.Tensor, stream: cuda.CUstream,
                         x0: Opt[cute.Tensor] = None, x1: Opt[cute.Tensor] = None, x2: Opt[cute.Tensor] = None, x3: Opt[cute.Tensor] = None, x4: Opt[cute.Tensor] = None, x5: Opt[cute.Tensor] = None, x6: Opt[cute.Tensor] = None, x7: Opt[cute.Tensor] = None, x8: Opt[cute.Tensor] = None, x9: Opt[cute.Tensor] = None, x10: Opt[cute.Tensor] = None, x11: Opt[cute.Tensor] = None, x12: Opt[cute.Tensor] = None, x13: Opt[cute.Tensor] = None, x14: Opt[cute.Tensor] = None, x15: Opt[cute.Tensor] = None, x16: Opt[cute.Tensor] = None, x17: Opt[cute.Tensor] = None, x18: Opt[cute.Tensor] = None, x19: Opt[cute.Tensor] = None):
                self.op(mA, mB, mD, self.max_clusters, stream, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, x16, x17, x18, x19)

        _Entry = HostEntry
    return _Entry(op, max_clusters)


def _load_runtime_global() -> None:
    """``dump_to_object`` links against the DSL runtime's CUDA shims (``_cudaLaunchKernelEx``, ...), which must be
    globally visible in the process (they are not on a CPU-only machine until loaded like this)."""
    global _runtime_loaded
    if _runtime_loaded:
        return
    from cutlass.runtime import find_runtime_libraries
    for path in find_runtime_libraries(enable_tvm_ffi=False):
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    _runtime_loaded = True


def _drop(key: str) -> None:
    for p in (kernel_path(key), checksum_path(key)):
        try:
            p.unlink()
        except OSError:
            pass


def _verified(key: str) -> Optional[str]:
    """Why the stored object of ``key`` must not be loaded (None: its bytes match the stored sha256). Raises
    ``FileNotFoundError`` if there is no object."""
    path = kernel_path(key)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as e:
        return f"unreadable: {type(e).__name__}"
    try:
        want = checksum_path(key).read_bytes().decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return "no readable checksum beside it"
    got = hashlib.sha256(data).hexdigest()
    if want != got:
        return f"checksum mismatch: sha256 {got[:16]}..., expected {want[:16]!r:.20}..."
    return None


def load(key: str) -> Optional[Any]:
    """The compiled function stored under ``key``, or None: missing, in a refused cache dir, or damaged (checksum
    mismatch, unloadable: one warning, the files are removed and the kernel is recompiled)."""
    if not _usable():
        return None
    path = kernel_path(key)
    with _lock:
        mod = _modules.get(str(path))
    try:
        if mod is None:
            try:
                why = _verified(key)
            except FileNotFoundError:
                return None
            if why is not None:
                raise DamagedObject(why)
            import cutlass.runtime as crt
            with _lock:
                mod = _modules.get(str(path))
                if mod is None:
                    mod = _modules[str(path)] = crt.load_module(str(path))
        return mod[prefix_of(key)]
    except Exception as e:  # a truncated / flipped / foreign / incompatible object: recompile and overwrite it
        warnings.warn(f"coda.autotune: ignoring unloadable compiled kernel {path} ({type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200] if str(e) else ''}); it will be recompiled", CacheFileWarning,
                      stacklevel=2)
        with _lock:
            _modules.pop(str(path), None)
        _drop(key)
        return None


class DamagedObject(Exception):
    """A stored object failed its checksum."""


def save(key: str, fn: Any) -> bool:
    """Write ``fn`` (a compiled function) under ``key`` with its checksum; False (with a warning) if it cannot be
    exported or written (then it stays in memory only)."""
    if not _usable():
        return False
    try:
        _load_runtime_global()
        data = fn.dump_to_object(prefix_of(key))
    except Exception as e:
        warnings.warn(f"coda.autotune: could not store the compiled kernel ({type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200] if str(e) else ''}); it stays in memory only",
                      CacheFileWarning, stacklevel=2)
        return False
    try:  # the checksum first: a reader that sees the new object also sees its checksum
        atomic_write_bytes(checksum_path(key), hashlib.sha256(data).hexdigest().encode() + b"\n")
        atomic_write_bytes(kernel_path(key), data)
    except OSError as e:
        warn_unwritable(cache_dir(), e)
        return False
    return True


def compile_kernel(cfg: Any, epi: Any, in_dtype: Any, out_dtype: Any, arg_sig: tuple, args: list,
                   max_clusters: int, arch: str, options: Optional[str] = None):
    """Load or compile the kernel for ``(cfg, epi, dtypes, arg_sig)``; ``args`` = ``[mA, mB, mD, stream, *xs]``.

    Returns ``(fn, how)`` with ``how`` in ``{"disk", "compiled"}``."""
    key = kernel_key(arch, max_clusters, cfg, epi, in_dtype, out_dtype, arg_sig) if enabled() else None

    def build():
        import cutlass.cute as cute

        from coda.kernels.gemm_sm90 import GemmSm90
        kw = {"options": options} if options else {}
        flags = dict((x[0], x[1]) for x in arg_sig if isinstance(x[0], str) and len(x) == 2)
        kernel = GemmSm90(cfg, epi, tile_aligned=flags.get("tile_aligned"), even=flags.get("even", (False, False)))
        return cute.compile(host_entry(kernel, max_clusters), *args, **kw)
    return cached(key, build)


def cached(key: Optional[str], build) -> tuple:
    """``(fn, how)``: the function stored under ``key`` (``how`` = ``"disk"``), else ``build()`` saved under ``key``
    (``"compiled"``); ``key`` None: built, not stored (the cache is off)."""
    if key is not None:
        from .precompile import wait_inflight
        wait_inflight(key)  # a background precompile's worker is compiling it: load its object, not a second build
        fn = load(key)
        if fn is not None:
            return fn, "disk"
    fn = build()
    if key is not None:
        save(key, fn)
    return fn, "compiled"


def stored(key: str) -> bool:
    """Whether an object whose bytes match its checksum is stored under ``key`` (in a usable cache dir); nothing is
    loaded (what ``coda.runtime.precompile`` skips)."""
    if not enabled() or not _usable():
        return False
    try:
        return _verified(key) is None
    except FileNotFoundError:
        return False


def max_active_clusters(dev: Any, cluster_size: int, compute) -> int:
    """``cutlass.utils.HardwareInfo().get_max_active_clusters(cluster_size)`` remembered on disk per GPU: the DSL
    answers it by compiling and loading a dummy kernel (``HardwareInfo._get_device_function``), a cost every new
    process would otherwise pay on its first call. A stored count must be an int in [1, SM count] (the dummy kernel
    takes a whole SM's shared memory); anything else is recomputed. Never raises on a bad or unwritable cache."""
    if not enabled():
        return compute()
    key = f"{dev.name}|sm{dev.sm_count}|{dev.arch}|cutlass-dsl {cutlass_dsl_version()}|cluster {cluster_size}"
    entry = hardware.get(key)
    n = entry.get("max_active_clusters") if entry else None
    if type(n) is int and 1 <= n <= max(int(dev.sm_count), 1):
        return n
    n = int(compute())
    hardware.put(key, {"max_active_clusters": n})  # kept in memory (one warning) if it cannot be written
    return n


def clear() -> int:
    """Remove every stored kernel of the current cache dir (objects and checksums); returns how many objects were
    removed. A refused cache dir is left alone; an unwritable one warns once. Never raises ``OSError``."""
    n = 0
    d = kernel_dir()
    if dir_problem(cache_dir()) is None and dir_problem(d) is None:
        try:
            if d.is_dir():
                for p in list(d.glob("*.o")) + list(d.glob("*.sha256")):
                    try:
                        p.unlink()
                        n += p.suffix == ".o"
                    except FileNotFoundError:
                        pass
        except OSError as e:
            warn_unwritable(cache_dir(), e)
    with _lock:
        _modules.clear()
    hardware.clear()
    return n
