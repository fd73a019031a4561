"""Tuning every GEMM of a model's training step: ``python -m coda.autotune --model PRESET --batch B --seq T``
(``--prefill``: of its inference forward instead).

1. :func:`record_model_step`: one fused training step (forward with the loss, backward) of a preset of
   ``coda.bench.step`` (``PRESETS``, ``build_model``) on the GPU, under a :class:`Recorder`: every problem
   (shape, dtypes, layouts, epilogue and its operands' shapes) that ``coda.gemm(config=None)`` served is collected,
   without tuning (the default chain: store, shipped, heuristic), whatever ``CODA_AUTOTUNE`` says.
2. :func:`tune_recorded`: each recorded problem is tuned on random inputs of the recorded shapes, strides and
   dtypes (``coda.autotune.tuner.tune``), behind one progress bar (tqdm if installed, else a line per problem on
   stderr), and stored in the tuning store; problems the store already has are skipped unless ``retune``.
"""
from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
import time
from typing import Any, Callable, Optional


@dataclasses.dataclass
class Recorded:
    """One problem as ``coda.gemm`` saw it; the tensors' metadata only (no tensor is kept alive)."""
    prob: Any  # coda._validate.GemmProblem
    epi: Any
    a: tuple  # (shape, stride, dtype)
    b: tuple
    operands: dict  # name -> ("tensor", shape, stride, dtype) | ("scalar", value)
    source: str  # what served it: "tuned" (the store), "shipped", "heuristic"
    config: Any  # the GemmConfig it was served
    calls: int = 1

    @property
    def label(self) -> str:
        p = self.prob
        lead = f"{p.L}x" if p.L else ""
        return f"{lead}{p.M}x{p.N}x{p.K} {self.epi.name}"


def _meta(t: Any) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.dtype)


class Recorder:
    """Collects every (problem, epilogue) ``coda.autotune.select_config`` serves while active (a context manager);
    while any recorder is active nothing is tuned. ``problems``: one :class:`Recorded` per distinct problem, in
    the order first seen."""

    def __init__(self):
        self._by_key: dict = {}
        self._lock = threading.Lock()

    @property
    def problems(self) -> list:
        return list(self._by_key.values())

    def add(self, prob, epi, cfg, source, a, b, operands) -> None:
        ops = {}
        for k, v in (operands or {}).items():
            ops[k] = ("tensor", *_meta(v)) if hasattr(v, "stride") else ("scalar", v)
        key = (prob.L, prob.M, prob.N, prob.K, str(prob.in_dtype), str(prob.out_dtype), prob.a_major, prob.b_major,
               prob.b_broadcast, repr(epi.key()), tuple((k, o[0], o[1] if o[0] == "tensor" else None)
                                                          for k, o in sorted(ops.items())))
        with self._lock:
            hit = self._by_key.get(key)
            if hit is not None:
                hit.calls += 1
                return
            self._by_key[key] = Recorded(prob, epi, _meta(a) if hasattr(a, "stride") else None,
                                         _meta(b) if hasattr(b, "stride") else None, ops, source, cfg)

    def __enter__(self) -> "Recorder":
        from . import _recorders, _usage_lock
        with _usage_lock:
            _recorders.append(self)
        return self

    def __exit__(self, *exc) -> None:
        from . import _recorders, _usage_lock
        with _usage_lock:
            if self in _recorders:
                _recorders.remove(self)


def record_model_step(preset: str, batch: int, seq: int, dtype: str = "bfloat16", seed: int = 0,
                      optimizer: str = "adamw", compile: bool = False, prefill: bool = False) -> list:
    """The problems one fused training step of ``preset`` runs (forward + loss + backward), recorded on the GPU.
    ``prefill``: instead, one forward of ``batch`` prompts of ``seq`` tokens under ``torch.no_grad()`` and without
    labels (inference: the fused ops' epilogues save no pre-activation and the LM head is the stock one; no
    optimizer).
    ``optimizer="coda-adamw"``: under ``coda.optim.AdamW`` (weights updated in the backward), whose step runs other
    problems (the cross entropy keeps its logits' gradient for the backward: one chunk of all rows, not chunks of
    ``cross_entropy.MEMORY_BUDGET``); ``"adamw"``: no optimizer in the step (torch's AdamW runs no GEMM).
    ``compile``: the step of ``torch.compile(model)`` (the step report's ``fused+compile`` mode), whose operands
    inductor may lay out otherwise than the eager step's: other problems (majors, strides) for the same shapes."""
    import torch

    import coda
    from coda.bench.step import PRESETS, build_model, make_batches
    if preset not in PRESETS:
        raise ValueError(f"unknown model {preset!r}; one of {sorted(PRESETS)}")
    if optimizer not in ("adamw", "coda-adamw"):
        raise ValueError(f"optimizer must be 'adamw' or 'coda-adamw', got {optimizer!r}")
    cfg = PRESETS[preset]
    torch.manual_seed(seed)
    model, _ = build_model(cfg, seq)
    model = model.to("cuda", getattr(torch, dtype))
    coda.fuse(model)
    opt = None
    if optimizer == "coda-adamw" and not prefill:
        import coda.optim
        opt = coda.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    ids = make_batches(cfg["vocab"], batch, seq, 1, seed + 1)[0].to("cuda")
    importlib.import_module("coda.gemm").clear_plans()  # a launch plan skips the config choice: start without any
    step = torch.compile(model) if compile else model
    with Recorder() as rec:
        if prefill:
            with torch.no_grad():
                loss = step(ids)
        else:
            loss = step(ids, labels=ids)
            loss = loss.loss if hasattr(loss, "loss") else loss
            loss.backward()
        torch.cuda.synchronize()
    del model, step, ids, loss, opt
    torch.cuda.empty_cache()
    return rec.problems


def _random_like(meta: tuple, device, fill: str, std: float = 1.0):
    import torch
    shape, stride, dtype = meta
    t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    if fill == "positive":
        t.uniform_(0.5, 1.5)
    else:
        t.normal_(0.0, std)
    return t


def inputs_for(rec: Recorded, device=None) -> tuple:
    """Random ``a``, ``b`` and operands with the recorded shapes, strides and dtypes (a VecM operand in
    [0.5, 1.5), as ``tuner.random_operands`` makes it; scalars as recorded); ``a`` and ``b`` with
    ``tuner.input_std(K)``."""
    from .tuner import input_std
    device = device if device is not None else rec.prob.device
    std = input_std(rec.prob.K)
    a, b = _random_like(rec.a, device, "normal", std), _random_like(rec.b, device, "normal", std)
    kinds = {o.name: o.kind for o in rec.epi.operands}
    ops = {}
    for k, o in rec.operands.items():
        if o[0] == "scalar":
            v = o[1]
            ops[k] = v if isinstance(v, (int, float)) else 0.5
        else:
            ops[k] = _random_like(o[1:], device, "positive" if kinds.get(k) == "vec_m" else "normal")
    return a, b, ops


def tune_recorded(problems: list, level: str = "quick", retune: bool = False, desc: str = "coda.autotune",
                  stream=None, tune_fn: Optional[Callable] = None) -> list:
    """Tune each recorded problem (skipping those the store has, unless ``retune``) behind one progress bar and
    store the winners. Returns one row per problem: (Recorded, TuneResult or None, status)."""
    import coda.autotune as at

    from . import tuner
    tune_fn = tune_fn or tuner.tune
    todo, rows = [], []
    for r in problems:
        if not retune and at._config_of(at.store.get(at.key_for(r.prob, r.epi)), r.epi, r.prob) is not None:
            rows.append((r, None, "in the store already"))
        else:
            todo.append(r)
    bar = tuner.Progress(len(todo), desc, after_s=0.0, stream=stream, unit="shape")
    t0 = time.perf_counter()
    try:
        for r in todo:
            try:
                a, b, ops = inputs_for(r)
                res = tune_fn(a, b, r.epi, r.prob.out_dtype, ops, level=level, progress=False)
                del a, b, ops
                if res.best_ms is not None:
                    at._remember(r.prob, r.epi, res)
                    status = f"{res.best.name} ({res.best_ms:.3f} ms; heuristic {res.default.name})"
                else:  # why, as the first candidate (the heuristic's config) failed
                    why = next((row.status for row in res.rows if row.status != "ok"), "")
                    status = "no config could be timed" + (f" ({why[:160]})" if why else "")
                rows.append((r, res, status))
            except Exception as e:  # one problem failing must not lose the others' results
                res, status = None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                rows.append((r, None, status))
            bar.update(f"{r.label}: {status}")
    finally:
        bar.close()
    if todo:
        print(f"{desc}: tuned {len(todo)} shapes in {time.perf_counter() - t0:.0f} s", file=stream or sys.stderr)
    return rows
