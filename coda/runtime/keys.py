"""Cache keys: what identifies a tuning result and a compiled kernel, as stable strings.

- :func:`tune_key` (the result cache): GPU name + SM count, cutlass-dsl and CODA versions, dtypes, a shape bucket
  (M and L rounded up to a power of two, exact N and K) and the epilogue's semantic key.
- :func:`kernel_key` (the compiled-kernel cache): arch, max active clusters, config, epilogue semantic key, dtypes,
  the kernel's argument signature, the versions and a hash of CODA's kernel source.

The epilogue's semantic key is ``repr(epilogue.key())`` plus a fingerprint of the code of the epilogue's class
(bytecode, constants and global/attribute names of every method, and plain class / instance constants). Local
variable names, line numbers and file names are left out: renaming a variable keeps the key, changing the math
changes it. Nothing here imports cutlass; torch is imported only by :func:`device_info`.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
import sys
import types
from typing import Any, Optional

SCHEMA = 1  # bump when the meaning of a stored entry changes

_SIMPLE = (int, float, str, bool, type(None))


@functools.lru_cache(maxsize=None)
def cutlass_dsl_version() -> str:
    from importlib import metadata
    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        return "unknown"


def coda_version() -> str:
    import coda
    return coda.__version__


def dtype_name(dt: Any) -> str:
    """``torch.bfloat16`` / ``"bf16"`` / ``"bfloat16"`` -> ``"bfloat16"``."""
    s = str(dt).replace("torch.", "")
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16", "float": "float32"}.get(s, s)


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    name: str
    sm_count: int
    arch: str  # e.g. "sm_90a"

    @property
    def tag(self) -> str:
        return f"{self.name} ({self.sm_count} SMs, {self.arch})"


_devices: dict = {}


def device_info(device=None) -> DeviceInfo:
    """The CUDA device's identity (cached per device index); RuntimeError without a CUDA device."""
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    info = _devices.get(index)
    if info is None:
        p = torch.cuda.get_device_properties(index)
        major, minor = p.major, p.minor
        arch = f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
        info = _devices[index] = DeviceInfo(p.name, p.multi_processor_count, arch)
    return info


def pow2_bucket(x: int) -> int:
    """The smallest power of two >= x (0 stays 0)."""
    return 0 if x <= 0 else 1 << (int(x) - 1).bit_length()


def shape_bucket(M: int, N: int, K: int, L: int = 1) -> tuple:
    return (pow2_bucket(M), int(N), int(K), pow2_bucket(max(L, 1)))


# ---------------------------------------------------------------------------------------- epilogue semantic key
def _code_parts(code: types.CodeType, out: list) -> None:
    out.append(code.co_code)
    out.append(repr(code.co_names).encode())
    out.append(repr((code.co_argcount, code.co_kwonlyargcount, code.co_flags)).encode())
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code_parts(c, out)
        else:
            out.append(repr(c).encode())


def _value_parts(v: Any, out: list) -> bool:
    """Append a stable encoding of a plain constant (numbers, strings, tuples of them); False if not plain."""
    if isinstance(v, _SIMPLE):
        out.append(f"{type(v).__name__}:{v!r}".encode())
        return True
    if isinstance(v, (tuple, list, frozenset)) and all(isinstance(x, _SIMPLE) for x in v):
        out.append(f"{type(v).__name__}:{sorted(map(repr, v)) if isinstance(v, frozenset) else list(v)!r}".encode())
        return True
    return False


def _function_of(attr: Any) -> Optional[types.FunctionType]:
    if isinstance(attr, (staticmethod, classmethod)):
        attr = attr.__func__
    if isinstance(attr, property):
        attr = attr.fget
    return attr if isinstance(attr, types.FunctionType) else None


# instance attributes that name an epilogue rather than define it: ``op_name`` (coda.dsl) counts the programs made
# earlier in the process, so it differs between programs that build the same epilogue in another order
_NOT_CODE = frozenset({"op_name"})


def code_fingerprint(epi: Any) -> str:
    """sha256 over the code of every method of ``type(epi)`` (and its bases below :class:`Epilogue`), plain class
    attributes and plain instance attributes (except ``_NOT_CODE``). Excludes local names, line numbers and file
    names."""
    from coda.kernels.epilogue import Epilogue
    parts: list = [f"py{sys.version_info[0]}.{sys.version_info[1]}".encode()]
    for cls in type(epi).__mro__:
        if cls in (Epilogue, object):
            break
        parts.append(f"class:{cls.__module__}.{cls.__qualname__}".encode())
        for name in sorted(vars(cls)):
            if name.startswith("__") and name not in ("__init__", "__call__"):
                continue
            attr = vars(cls)[name]
            fn = _function_of(attr)
            if fn is not None:
                parts.append(f"def:{name}".encode())
                _code_parts(fn.__code__, parts)
                if fn.__defaults__:
                    for d in fn.__defaults__:
                        _value_parts(d, parts)
            else:
                sub: list = []
                if _value_parts(attr, sub):
                    parts.append(f"attr:{name}".encode())
                    parts.extend(sub)
    for name in sorted(getattr(epi, "__dict__", {})):
        if name in _NOT_CODE:
            continue
        sub = []
        if _value_parts(epi.__dict__[name], sub):
            parts.append(f"inst:{name}".encode())
            parts.extend(sub)
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


def epilogue_key(epi: Any) -> str:
    """The epilogue's semantic key as a stable string: ``repr(epi.key())`` + ``|code:`` + code fingerprint."""
    return f"{epi.key()!r}|code:{code_fingerprint(epi)[:32]}"


def _short(s: str, n: int = 20) -> str:
    return hashlib.sha256(s.encode()).hexdigest()[:n]


# ------------------------------------------------------------------------------------------------ result cache
def tune_key(dev: DeviceInfo, in_dtype: Any, out_dtype: Any, M: int, N: int, K: int, L: int, epi: Any) -> str:
    """Key of a tuning result: one entry per (GPU, versions, dtypes, shape bucket, epilogue)."""
    mb, n, k, lb = shape_bucket(M, N, K, L)
    return (f"{dev.name}|sm{dev.sm_count}|{dev.arch}|cutlass-dsl {cutlass_dsl_version()}|coda {coda_version()}"
            f"|{dtype_name(in_dtype)}->{dtype_name(out_dtype)}|M{mb}xN{n}xK{k}xL{lb}|epi {_short(epilogue_key(epi))}")


# ----------------------------------------------------------------------------------------------- kernel cache
# the code that emits a kernel's instructions: the kernels, their configs, the compile cache's host entry, and the
# lowering of an epilogue's math (``coda/dsl.py`` traces and simplifies it, ``coda/_eval.py`` emits it: before
# session 21 those two were missing, so a changed lowering kept serving the kernels compiled by the old one)
# (coda/dsl*.py: dsl.py, its sympy nodes dsl_nodes.py, the segment sums' dsl_segment.py)
_SOURCE_FILES = ("coda/kernels/*.py", "coda/config.py", "coda/runtime/compile_cache.py", "coda/dsl*.py",
                 "coda/_eval.py")


@functools.lru_cache(maxsize=None)
def kernel_source_hash(root: Optional[str] = None) -> str:
    """sha256 of the sources in :data:`_SOURCE_FILES` (under ``root``, default: the installed package's
    checkout): any edit there invalidates every cached compiled kernel."""
    if root is None:
        import coda
        root = pathlib.Path(coda.__file__).resolve().parent.parent
    base = pathlib.Path(root)
    files = sorted(p for pat in _SOURCE_FILES for p in base.glob(pat))
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def kernel_key(arch: str, max_clusters: int, cfg: Any, epi: Any, in_dtype: Any, out_dtype: Any,
               arg_sig: tuple, source_hash: Optional[str] = None) -> str:
    """sha256 hex naming one compiled kernel on disk."""
    parts = (f"schema {SCHEMA}", arch, f"clusters {max_clusters}", repr(dataclasses.astuple(cfg)),
             epilogue_key(epi), dtype_name(in_dtype), dtype_name(out_dtype), repr(arg_sig),
             f"cutlass-dsl {cutlass_dsl_version()}", f"coda {coda_version()}",
             source_hash if source_hash is not None else kernel_source_hash())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def named_kernel_key(name: str, arch: str, params: tuple, arg_sig: tuple, source_hash: Optional[str] = None) -> str:
    """sha256 hex naming one compiled kernel of a kernel with its own compile function (``coda.kernels.ce_grad``,
    ``coda.kernels.rope_grad``): its name, arch, compile-time parameters (dtypes by name), the cute types of its
    arguments (``coda.runtime.precompile.arg_signature``), the versions and the kernel sources' hash."""
    ps = tuple(dtype_name(p) if "dtype" in type(p).__name__ else p for p in params)
    parts = (f"schema {SCHEMA}", f"kernel {name}", arch, repr(ps), repr(arg_sig),
             f"cutlass-dsl {cutlass_dsl_version()}", f"coda {coda_version()}",
             source_hash if source_hash is not None else kernel_source_hash())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


# ------------------------------------------------------------------------------------------ stored entries
MAX_CLUSTERS_LIMIT = 1 << 16  # bound on a stored max-active-clusters count (an H100 answers at most 132)


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_num(v: Any) -> bool:
    return type(v) in (int, float) and v == v and abs(v) != float("inf")


def hardware_entry_problem(key: str, entry: dict) -> Optional[str]:
    """Why a stored hardware fact is unusable (the validator of ``compile_cache.hardware``); None if usable."""
    if set(entry) != {"max_active_clusters"}:
        return f"fields {sorted(entry)[:4]!r:.80} are not ['max_active_clusters']"
    n = entry["max_active_clusters"]
    if not _is_int(n) or not 1 <= n <= MAX_CLUSTERS_LIMIT:
        return f"max_active_clusters = {n!r:.40} is not an int in [1, {MAX_CLUSTERS_LIMIT}]"
    return None
