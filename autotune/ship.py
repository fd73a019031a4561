"""Building the shipped tuned-config files (one JSON file per GPU model in ``coda/autotune/shipped/``, package
data): entries from tuning tables or a user's tuning store, validated, with their provenance. The file format, the
choice of file and of entry (nearest shape bucket) and the lookup are :mod:`coda.runtime.shipped`'s (re-exported
here). Nothing here imports torch or cutlass, except :func:`epilogue_ref` / :func:`resolve_ref` (the library's
epilogues).
"""
from __future__ import annotations

import datetime
import hashlib
import importlib
import json
import pathlib
import re
import subprocess
from typing import Any, Iterable, Optional

# the read side (files, validation, lookup) is the runtime's (coda.runtime.shipped, issue 27); re-exported here
from coda.runtime.rules import config_problem
from coda.runtime.shipped import (LAYOUTS, MAX_M_RATIO, SHIP_SCHEMA, SHIPPED_DIR, _load, doc_problems,  # noqa: F401
                                  entry_key, entry_problem, epilogue_id, files_for, load, lookup, nearest,
                                  shipped_entries)

from .keys import dtype_name

MARGIN = 0.01  # a tuned config ships only if it re-measured > 1 % faster than the default (tuner.RUNOFF_MARGIN)


# ------------------------------------------------------------------------------------------------- identities


def _library_epilogues() -> Iterable[tuple]:
    """(``module:attr``, epilogue or Epilogue subclass) for everything ``coda.epilogues``' modules define."""
    import pkgutil

    import coda.epilogues as lib
    from coda.kernels.epilogue import Epilogue
    for info in pkgutil.iter_modules(lib.__path__):
        try:
            mod = importlib.import_module(f"{lib.__name__}.{info.name}")
        except Exception:  # an optional dependency missing: its epilogues cannot be shipped
            continue
        for attr, v in vars(mod).items():
            if isinstance(v, Epilogue) or (isinstance(v, type) and issubclass(v, Epilogue) and v is not Epilogue
                                           and v.__module__ == mod.__name__):
                yield f"{mod.__name__}:{attr}", v


def epilogue_ref(epi: Any) -> Optional[str]:
    """``"identity"``, or the ``module:attribute`` of ``coda.epilogues`` that gives an epilogue of the same
    :func:`epilogue_id` (an instance, or a class built without arguments); None if the library has none."""
    if epi.is_identity:
        return "identity"
    want = epilogue_id(epi)
    for ref, v in _library_epilogues():
        try:
            e = v() if isinstance(v, type) else v
            if epilogue_id(e) == want:
                return ref
        except Exception:
            continue
    return None


def resolve_ref(ref: str) -> Any:
    """The epilogue a ``ref`` names (``"identity"`` or ``module:attribute``; a class is instantiated)."""
    from coda.kernels.epilogue import IDENTITY, Epilogue
    if ref == "identity":
        return IDENTITY
    mod, attr = ref.split(":", 1)
    v = getattr(importlib.import_module(mod), attr)
    return v() if isinstance(v, type) and issubclass(v, Epilogue) else v


def resolve_name(name: str) -> Optional[str]:
    """The ref of the library epilogue called ``name`` (attribute or ``.name``), or None."""
    if name in ("identity", "none", ""):
        return "identity"
    for ref, v in _library_epilogues():
        if ref.split(":", 1)[1] == name or getattr(v, "name", None) == name:
            return ref
    return None


_NAME_RE = re.compile(r"^(\d+)x(\d+)_(pp|coop)_c(\d+)x(\d+)_r([mn])(\d+)(?:_s(\d+))?(_dyn)?$")


def config_from_name(name: str, epi_n: Optional[int] = None) -> Any:
    """The GemmConfig whose ``.name`` is ``name`` (the name leaves out ``epi_n``: the quick level's, 32, unless
    given)."""
    from coda.config import GemmConfig
    m = _NAME_RE.match(name)
    if not m:
        raise ValueError(f"not a GemmConfig name: {name!r}")
    tm, tn, sched, cm, cn, raster, sw, st, dyn = m.groups()
    return GemmConfig(tile_m=int(tm), tile_n=int(tn), cluster_m=int(cm), cluster_n=int(cn), pingpong=sched == "pp",
                      raster=raster, swizzle=int(sw), stages=int(st) if st else None,
                      epi_n=epi_n if epi_n is not None else GemmConfig.epi_n, sched="dynamic" if dyn else "static")


# ------------------------------------------------------------------------------------------------- the files


# ------------------------------------------------------------------------------------------- building a file
def _git_date(path: pathlib.Path) -> Optional[str]:
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%cs %h", "--", path.name], cwd=path.parent,
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _file_source(path: pathlib.Path, rows: int, note: str = "") -> dict:
    raw = path.read_bytes()
    git = _git_date(path)
    date = git.split()[0] if git else datetime.date.fromtimestamp(path.stat().st_mtime).isoformat()
    src = {"file": _display(path), "sha256": hashlib.sha256(raw).hexdigest()[:16], "date": date, "rows": rows}
    if git and len(git.split()) > 1:
        src["commit"] = git.split()[1]
    if note:
        src["note"] = note
    return src


def _display(path: pathlib.Path) -> str:
    path = path.resolve()
    for parent in path.parents:
        if (parent / ".git").exists():
            return str(path.relative_to(parent))
    return str(path)


def make_entry(cfg: Any, M: int, N: int, K: int, L: int, in_dtype: str, out_dtype: str, a_major: str,
               b_major: str, epi_name: str, epi_id: str, ref: Optional[str], source: str, **timing) -> tuple:
    from .space import config_to_dict
    e = {"problem": {"M": M, "N": N, "K": K, "L": L, "in_dtype": in_dtype, "out_dtype": out_dtype,
                     "a_major": a_major, "b_major": b_major},
         "epilogue": {"name": epi_name, "id": epi_id, "ref": ref}, "config": config_to_dict(cfg), "name": cfg.name,
         "source": source, **{k: v for k, v in timing.items() if v is not None}}
    return entry_key(in_dtype, out_dtype, a_major, b_major, M, N, K, L, epi_id), e


def from_table_rows(rows: list, source: str, in_dtype: str = "bfloat16", out_dtype: Optional[str] = None) -> tuple:
    """Entries from the rows of ``docs/tune_h100/tuned_table.py`` (``epilogue``, ``shape`` [M, N, K], ``default``,
    ``tuned``, ``default_ms``, ``tuned_ms``: the tuner's pick and the heuristic default, re-timed interleaved).
    The shipped config is the tuner's pick if it re-measured more than :data:`MARGIN` faster than the default,
    else the default of then (an entry equal to its own default is used only while today's heuristic still picks
    it: see ``coda.autotune.select_config``). Returns (entries, skipped rows with the reason)."""
    out_dtype = out_dtype or in_dtype
    entries, skipped = {}, []
    for i, r in enumerate(rows):
        name = r.get("epilogue", "identity")
        ref = resolve_name(name)
        if ref is None:
            skipped.append({"row": i, "epilogue": name, "shape": r.get("shape"),
                            "why": "epilogue not defined in the library (coda.epilogues): cannot be identified"})
            continue
        epi = resolve_ref(ref)
        M, N, K = (int(x) for x in r["shape"][:3])
        tuned, default = config_from_name(r["tuned"]), config_from_name(r["default"])
        t_ms, d_ms = r.get("tuned_ms"), r.get("default_ms")
        better = tuned != default and t_ms is not None and d_ms is not None and t_ms < d_ms * (1 - MARGIN)
        cfg = tuned if better else default
        k, e = make_entry(cfg, M, N, K, 1, dtype_name(in_dtype), dtype_name(out_dtype), "k", "k", epi.name,
                          epilogue_id(epi), ref, f"{source} row {i}", ms=t_ms if better else d_ms,
                          default=default.name, default_ms=d_ms, tuner_pick=tuned.name, tuner_pick_ms=t_ms,
                          candidates=r.get("candidates"))
        entries[k] = e
    return entries, skipped


_STORE_KEY = re.compile(r"^(?P<gpu>[^|]+)\|sm(?P<sms>\d+)\|(?P<arch>[^|]+)\|cutlass-dsl (?P<dsl>[^|]+)\|coda [^|]+"
                        r"\|(?P<din>\w+)->(?P<dout>\w+)\|M(?P<M>\d+)xN(?P<N>\d+)xK(?P<K>\d+)xL(?P<L>\d+)\|epi \w+$")


def parse_store_key(key: str) -> Optional[dict]:
    m = _STORE_KEY.match(key)
    return m.groupdict() if m else None


def from_store(entries_in: dict, source: str) -> tuple:
    """Entries from a tuning store (``autotune.json``: ``{"schema", "entries"}``). Only entries that record their
    problem (``problem``) and epilogue (``epilogue``; written by this version's tuner) can be shipped. Returns
    (entries by GPU (name, sm_count, arch, cutlass-dsl), skipped keys with the reason)."""
    from .space import config_from_dict
    by_gpu: dict = {}
    skipped = []
    for key, s in entries_in.items():
        k = parse_store_key(key)
        p, ep = (s.get("problem"), s.get("epilogue")) if isinstance(s, dict) else (None, None)
        if k is None or not isinstance(p, dict) or not isinstance(ep, dict) or config_problem(s.get("config")):
            skipped.append({"key": key[:160], "why": "not a tuning result that records its problem and epilogue"})
            continue
        if s.get("ms") is None:
            skipped.append({"key": key[:160], "why": "no config was timed"})
            continue
        cfg = config_from_dict(s["config"])
        ek, e = make_entry(cfg, p["M"], p["N"], p["K"], p["L"], p["in_dtype"], p["out_dtype"], p["a_major"],
                           p["b_major"], ep["name"], ep["id"], ep.get("ref"), f"{source} {key[:24]}...",
                           ms=s.get("ms"), default=s.get("default"), default_ms=s.get("default_ms"),
                           tuning_s=s.get("tuning_s"), level=s.get("level"))
        why = entry_problem(ek, e)
        if why:
            skipped.append({"key": key[:160], "why": why})
            continue
        gpu = (k["gpu"], int(k["sms"]), k["arch"], k["dsl"])
        by_gpu.setdefault(gpu, {})[ek] = e
    return by_gpu, skipped


def build_doc(gpu: tuple, entries: dict, sources: list, skipped: list, note: str = "") -> dict:
    name, sms, arch, dsl = gpu
    prov = {"gpu": f"{name} ({sms} SMs, {arch})", "cutlass_dsl": dsl,
            "converted": datetime.date.today().isoformat(),
            "converter": "python -m coda.autotune --ship-from FILE [...] (coda/autotune/ship.py)",
            "sources": sources, "skipped": skipped}
    if note:
        prov["note"] = note
    return {"schema": SHIP_SCHEMA, "gpu": {"name": name, "sm_count": sms, "arch": arch}, "cutlass_dsl": dsl,
            "provenance": prov, "entries": dict(sorted(entries.items()))}


def file_name(gpu_name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100_sxm.json``; otherwise the name, lower case, as a file name."""
    known = {"NVIDIA H100 80GB HBM3": "h100_sxm", "NVIDIA H200": "h200", "NVIDIA H100 PCIe": "h100_pcie",
             "NVIDIA H100 NVL": "h100_nvl", "NVIDIA GH200 480GB": "gh200"}
    stem = known.get(gpu_name) or re.sub(r"[^a-z0-9]+", "_", gpu_name.lower().replace("nvidia", "")).strip("_")
    return f"{stem}.json"


def ship_from(paths: list, gpu: Optional[tuple] = None, out_dir: Optional[pathlib.Path] = None,
              in_dtype: str = "bfloat16", out_dtype: Optional[str] = None, note: str = "",
              merge: bool = True, drop: Optional[dict] = None) -> list:
    """Convert tuning results into shipped files: tuner-table rows (a JSON list; ``gpu`` = (name, sm_count, arch,
    cutlass-dsl version) must be given, the rows do not record it) and tuning stores (``{"schema", "entries"}``;
    the GPU comes from each key). Merges into an existing file of the same GPU (``merge``). ``drop``: {entry key:
    why} -- measured entries not to ship (e.g. a config that spills), recorded in the provenance's ``skipped``
    with ``"dropped": true``; a merge keeps the existing file's drops, so that converting a file's sources again
    with its recorded drops gives the same file. Returns the paths written."""
    out_dir = pathlib.Path(out_dir or SHIPPED_DIR)
    drop = dict(drop or {})
    groups: dict = {}  # gpu -> (entries, sources, skipped)
    for p in map(pathlib.Path, paths):
        data = json.loads(p.read_text())
        if isinstance(data, list):
            if gpu is None:
                raise ValueError(f"{p}: tuner-table rows do not name the GPU; give --gpu NAME --sm-count N "
                                 "--cutlass-dsl VERSION")
            entries, skipped = from_table_rows(data, _display(p), in_dtype, out_dtype)
            g = groups.setdefault(tuple(gpu), ({}, [], []))
            g[0].update(entries)
            g[1].append(_file_source(p, len(data), "tuned_table.py rows: coda.autotune.tuner.tune (quick level), "
                                     "then the pick and the default re-timed interleaved"))
            g[2].extend(skipped)
        elif isinstance(data, dict) and isinstance(data.get("entries"), dict):
            by_gpu, skipped = from_store(data["entries"], _display(p))
            for key, entries in by_gpu.items():
                g = groups.setdefault(key, ({}, [], []))
                g[0].update(entries)
                g[1].append(_file_source(p, len(entries), "a coda.autotune tuning store"))
                g[2].extend(skipped)
            if not by_gpu:
                raise ValueError(f"{p}: no shippable entry ({len(skipped)} skipped; first: "
                                 f"{skipped[0]['why'] if skipped else 'empty'})")
        else:
            raise ValueError(f"{p}: neither tuner-table rows (a list) nor a tuning store ({{'entries': ...}})")
    written = []
    for g, (entries, sources, skipped) in groups.items():
        path = out_dir / file_name(g[0])
        if merge and path.exists():
            old = json.loads(path.read_text())
            if not doc_problems(old) and old["cutlass_dsl"] == g[3] and old["gpu"]["name"] == g[0]:
                entries = {**old["entries"], **entries}
                sources = [s for s in old["provenance"]["sources"] if s["file"] not in {x["file"] for x in sources}] \
                    + sources
                kept = old["provenance"].get("skipped", []) + skipped
                skipped = [json.loads(x) for x in dict.fromkeys(json.dumps(y, sort_keys=True) for y in kept)]
        drops = {**{x["key"]: x["why"] for x in skipped if x.get("dropped")}, **drop}
        entries = {k: v for k, v in entries.items() if k not in drops}
        skipped = [x for x in skipped if not x.get("dropped")] + [{"key": k, "why": w, "dropped": True}
                                                                  for k, w in drops.items()]
        doc = build_doc(g, entries, sources, skipped, note)
        problems = doc_problems(doc)
        if problems:
            raise ValueError(f"{path}: the converted file is not valid: {problems[:3]}")
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        written.append(path)
    _load.cache_clear()
    return written
