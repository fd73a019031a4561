"""Validation of stored tuning results (the store's ``validate`` hook): a stored config must be one the search
space (:mod:`coda.autotune.space`) could have produced, and the result's fields of the right types and ranges.
Moved here from the runtime's ``keys`` (issue 27): the runtime stores and keys entries, the autotuner knows what
a valid config is."""
from __future__ import annotations

from typing import Any, Optional

from coda.runtime.keys import _is_int, _is_num

from . import space


def config_problem(d: Any) -> Optional[str]:
    """Why the stored config ``d`` (``space.config_to_dict`` of a GemmConfig) is unusable: unknown or missing
    fields, a wrong type (``{"tile_n": None}``, ``swizzle: 1.5``, ``pingpong: 1``) or a value outside the tuning
    space. None if every field is one the space could have produced."""
    if not isinstance(d, dict):
        return f"config is {type(d).__name__}, not an object"
    choices = {"tile_m": space.TILE_M, "tile_n": space.TILE_N, "cluster_m": (1, 2), "cluster_n": (1, 2),
               "pingpong": (False, True), "raster": space.RASTERS, "swizzle": range(1, 65),
               "stages": (None, *range(2, 17)), "epi_n": (16, 32, 64), "sched": space.SCHEDS}
    types_ = {"pingpong": (bool,), "raster": (str,), "sched": (str,), "stages": (int, type(None))}
    extra = sorted(set(d) - set(choices))
    if extra:
        return f"config has unknown field {extra[0][:40]!r}"
    for name, allowed in choices.items():
        if name not in d:
            if name == "sched":  # "sched" came later: an entry stored without it is a static-schedule config
                continue
            return f"config lacks {name!r}"
        v = d[name]
        if type(v) not in types_.get(name, (int,)) or v not in allowed:
            shown = f"{allowed.start}..{allowed.stop - 1}" if isinstance(allowed, range) else list(allowed)
            return f"config field {name!r} = {v!r:.40} is not one of {shown}"
    return None


_RESULT_FIELDS = {"name": (str,), "default": (str,), "level": (str,), "ms": ("num", type(None)),
                  "default_ms": ("num", type(None)), "tuning_s": ("num",), "time": ("num",), "tried": (int,)}


def result_entry_problem(key: str, entry: dict) -> Optional[str]:
    """Why a stored tuning result is unusable (the validator of ``coda.autotune.store``); None if usable."""
    why = config_problem(entry.get("config"))
    if why is not None:
        return why
    for name, kinds in _RESULT_FIELDS.items():
        if name in entry:
            v = entry[name]
            ok = any((_is_num(v) and v >= 0) if k == "num" else type(v) is k for k in kinds)
            if not ok:
                return f"field {name!r} = {v!r:.40} has the wrong type or range"
    shape = entry.get("shape", [0, 0, 0, None])
    if not (isinstance(shape, list) and len(shape) == 4
            and all((_is_int(x) and 0 <= x < 1 << 40) or (i == 3 and x is None) for i, x in enumerate(shape))):
        return f"field 'shape' = {shape!r:.60} is not [M, N, K, L]"
    return None
