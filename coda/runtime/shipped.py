"""Shipped tuned configs, the read side (moved from ``coda.autotune.ship``, issue 27: ``coda.runtime.select`` looks
entries up; building a file stays in ``coda.autotune.ship``): one JSON file per GPU model in
``coda/autotune/shipped/`` (package data of ``coda.autotune``, located without importing it).

A file::

    {"schema": 1, "gpu": {"name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "arch": "sm_90a"},
     "cutlass_dsl": "4.8.1", "provenance": {...}, "entries": {key: entry}}

An entry is one tuning result: ``problem`` (M, N, K, L as the kernel sees them -- a weight shared by every batch
folds L into M, as in the tuning store --, dtypes, operand layouts ``a_major`` / ``b_major``), ``epilogue``
(``name``, ``id`` = sha256 of ``repr(epilogue.key())`` -- the epilogue's declared structure and, for
``@coda.epilogue`` functions, its traced math; not the code fingerprint of the store's keys, which depends on the
Python version --, and ``ref``, an importable ``module:attribute`` when the library defines it), ``config``, the
timings (``ms``, ``default``, ``default_ms``) and ``source``. The key is :func:`entry_key` of those fields.

Which file: the one whose ``gpu.name`` and ``gpu.sm_count`` are this GPU's, made with this cutlass-dsl version;
a file of another patch release of the same major.minor is used when no exact one exists (a config is a set of
compile-time knobs; ``tests/test_first_use_tuning.py`` compiles every shipped entry with the installed DSL).

Which entry (the nearest shape bucket): same dtypes, layouts, N, K, L bucket (power of two) and epilogue id; among
those, the M nearest in log distance (``|log2 M - log2 M_entry|``; a tie goes to the larger M), and only within
:data:`MAX_M_RATIO` of it (farther, a tile choice made for other wave counts is no better than the heuristic).

Nothing here imports torch or cutlass.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import math
import os
import pathlib
from typing import Any, Optional

from .keys import DeviceInfo, cutlass_dsl_version, dtype_name, pow2_bucket
from .rules import config_problem


def _shipped_dir() -> pathlib.Path:
    """``shipped/`` of the ``coda.autotune`` package (found by its import spec: the package is not imported)."""
    spec = importlib.util.find_spec("coda.autotune")
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / "shipped"


SHIP_SCHEMA = 1
SHIPPED_DIR = _shipped_dir()
MAX_M_RATIO = 4  # an entry serves M within a factor of 4 of its own
LAYOUTS = ("k", "mn")


def epilogue_id(epi: Any) -> str:
    """Stable identity of an epilogue's structure and math: sha256 of ``repr(epi.key())`` (16 hex digits)."""
    return hashlib.sha256(repr(epi.key()).encode()).hexdigest()[:16]


def entry_key(in_dtype: Any, out_dtype: Any, a_major: str, b_major: str, M: int, N: int, K: int, L: int,
              epi_id: str) -> str:
    return (f"{dtype_name(in_dtype)}->{dtype_name(out_dtype)}|{a_major},{b_major}|M{int(M)}xN{int(N)}xK{int(K)}"
            f"xL{int(L)}|epi {epi_id}")


def _minor(v: str) -> str:
    return ".".join(str(v).split(".")[:2])


def doc_problems(doc: Any) -> list:
    """Why a shipped file's content is unusable (empty: usable). Checks the schema, the GPU and version fields, the
    provenance, and every entry (fields, types, layouts, config, key = :func:`entry_key` of the fields)."""
    if not isinstance(doc, dict):
        return ["not an object"]
    out = []
    if doc.get("schema") != SHIP_SCHEMA:
        out.append(f"schema {doc.get('schema')!r}, expected {SHIP_SCHEMA}")
    gpu = doc.get("gpu")
    if not (isinstance(gpu, dict) and isinstance(gpu.get("name"), str) and type(gpu.get("sm_count")) is int
            and isinstance(gpu.get("arch"), str)):
        out.append("gpu must be {name: str, sm_count: int, arch: str}")
    if not isinstance(doc.get("cutlass_dsl"), str):
        out.append("cutlass_dsl must be a version string")
    prov = doc.get("provenance")
    if not (isinstance(prov, dict) and isinstance(prov.get("sources"), list) and prov["sources"]
            and all(isinstance(s, dict) and {"file", "date"} <= set(s) for s in prov["sources"])
            and isinstance(prov.get("gpu"), str) and isinstance(prov.get("converted"), str)):
        out.append("provenance must give gpu, converted and sources [{file, date, ...}]")
    entries = doc.get("entries")
    if not isinstance(entries, dict):
        return out + ["entries must be an object"]
    for k, e in entries.items():
        why = entry_problem(k, e)
        if why:
            out.append(f"entry {k[:100]!r}: {why}")
    return out


def entry_problem(key: str, e: Any) -> Optional[str]:
    if not isinstance(e, dict):
        return "not an object"
    p, ep = e.get("problem"), e.get("epilogue")
    if not isinstance(p, dict) or not all(type(p.get(f)) is int and p[f] >= (0 if f == "K" else 1) for f in "MNKL"):
        return "problem must have positive ints M, N, L and an int K >= 0 (0: an epilogue-only pass)"
    if p.get("a_major") not in LAYOUTS or p.get("b_major") not in LAYOUTS:
        return f"problem layouts must be in {LAYOUTS}"
    if not all(isinstance(p.get(f), str) for f in ("in_dtype", "out_dtype")):
        return "problem dtypes must be strings"
    if not (isinstance(ep, dict) and isinstance(ep.get("name"), str) and isinstance(ep.get("id"), str)
            and (ep.get("ref") is None or isinstance(ep.get("ref"), str))):
        return "epilogue must be {name, id, ref}"
    why = config_problem(e.get("config"))
    if why:
        return why
    if not isinstance(e.get("source"), str):
        return "source must name where the result comes from"
    want = entry_key(p["in_dtype"], p["out_dtype"], p["a_major"], p["b_major"], p["M"], p["N"], p["K"], p["L"],
                     ep["id"])
    return None if key == want else f"key does not match the fields (expected {want!r})"


@functools.lru_cache(maxsize=32)
def _load(path: str, mtime_ns: int) -> Optional[dict]:
    try:
        doc = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return None
    if doc_problems(doc):
        return None
    index: dict = {}
    for e in doc["entries"].values():
        p = e["problem"]
        group = (p["in_dtype"], p["out_dtype"], p["a_major"], p["b_major"], p["N"], p["K"], pow2_bucket(p["L"]),
                 e["epilogue"]["id"])
        index.setdefault(group, []).append(e)
    return {"doc": doc, "index": index}


def load(path: Any) -> Optional[dict]:
    """The validated file (``{"doc", "index"}``), cached per modification time; None if missing or unusable."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _load(str(path), st.st_mtime_ns)


def files_for(dev: DeviceInfo, version: Optional[str] = None, directory: Optional[pathlib.Path] = None) -> list:
    """The usable shipped files (paths) for ``dev`` and the cutlass-dsl ``version``: exact version first."""
    version = version or cutlass_dsl_version()
    found = []
    for path in sorted(pathlib.Path(directory or SHIPPED_DIR).glob("*.json")):
        data = load(path)
        if data is None:
            continue
        doc = data["doc"]
        if doc["gpu"]["name"] != dev.name or doc["gpu"]["sm_count"] != dev.sm_count:
            continue
        if doc["cutlass_dsl"] == version:
            found.insert(0, path)
        elif _minor(doc["cutlass_dsl"]) == _minor(version):
            found.append(path)
    return found


def nearest(entries: list, M: int) -> Optional[dict]:
    """The entry of M nearest in log distance (a tie: the larger M), within MAX_M_RATIO; None if none is."""
    best, best_d = None, None
    for e in entries:
        me = e["problem"]["M"]
        d = abs(math.log2(max(M, 1)) - math.log2(me))
        if d > math.log2(MAX_M_RATIO) + 1e-9:
            continue
        if best is None or d < best_d - 1e-12 or (abs(d - best_d) <= 1e-12 and me > best["problem"]["M"]):
            best, best_d = e, d
    return best


def lookup(dev: DeviceInfo, in_dtype: Any, out_dtype: Any, a_major: str, b_major: str, M: int, N: int, K: int,
           L: int, epi_id: str, directory: Optional[pathlib.Path] = None) -> Optional[tuple]:
    """(entry, path) of the shipped entry for this problem (nearest shape bucket), or None."""
    group = (dtype_name(in_dtype), dtype_name(out_dtype), a_major, b_major, int(N), int(K), pow2_bucket(max(L, 1)),
             epi_id)
    for path in files_for(dev, directory=directory):
        e = nearest(load(path)["index"].get(group, []), M)
        if e is not None:
            return e, path
    return None


def shipped_entries(dev: Optional[DeviceInfo] = None, directory: Optional[pathlib.Path] = None) -> list:
    """(path, doc) of every usable shipped file (for ``dev`` only, if given)."""
    out = []
    for path in sorted(pathlib.Path(directory or SHIPPED_DIR).glob("*.json")):
        data = load(path)
        if data is None:
            continue
        if dev is None or path in files_for(dev, directory=directory):
            out.append((path, data["doc"]))
    return out
