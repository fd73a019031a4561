"""Timing candidates on the GPU and picking the best (needs a Hopper GPU; imported lazily).

For one problem (the caller's ``a``, ``b``, epilogue and operands):

- candidates: :func:`coda.autotune.space.candidates` (quick level: tile / schedule / cluster / raster; ``level=
  "full"`` then refines the best 3 over swizzle, stages and epilogue sub-tile), the heuristic default first;
  ``level="near"``: the default's one-knob neighbours (:func:`coda.autotune.space.neighbours`, ~10), then the
  knobs that beat the default by more than 1 % combined into one more config;
- each candidate is run once (compiling it, or loading it from the compile cache), its result checked against
  ``coda.reference.gemm`` (relative error <= ``CHECK_TOL`` per output, same non-finite pattern: a config that
  computes garbage is rejected, with the reason), then timed with ``triton.testing.do_bench`` (median; an
  event-timed equivalent if triton is missing) over rotating copies of ``a``/``b`` so every launch reads them
  L2-cold (the caller's tensors are only read; copies are added until 4x the L2 size is covered, within 1/4 of
  the free memory);
- the fastest few and the default are timed again, interleaved (:func:`runoff`); the default stays unless the
  winner beats it by more than 1 %;
- when tuning has taken more than 1 s, progress is shown: a tqdm bar (configs tried, best so far) if tqdm is
  importable, else a line per config on stderr.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

from coda.config import GemmConfig

from . import space
from .keys import device_info, dtype_name

CHECK_TOL = 2e-2
WARMUP_MS, REP_MS = 25, 100


@dataclasses.dataclass
class Row:
    config: GemmConfig
    ms: Optional[float] = None
    status: str = "ok"
    first_call_s: float = 0.0


@dataclasses.dataclass
class TuneResult:
    best: GemmConfig
    best_ms: Optional[float]
    default: GemmConfig
    default_ms: Optional[float]
    rows: list
    pruned: list
    seconds: float
    flop: int
    level: str

    def entry(self, prob, epi: Any = None) -> dict:
        """What the result cache stores for this problem. With ``epi``, also the problem as the kernel sees it
        and the epilogue's identity (what ``python -m coda.autotune --ship-from`` needs to ship the result)."""
        e = {"config": space.config_to_dict(self.best), "name": self.best.name, "ms": self.best_ms,
             "default": self.default.name, "default_ms": self.default_ms, "tried": len(self.rows),
             "shape": [prob.M, prob.N, prob.K, prob.L], "tuning_s": round(self.seconds, 2),
             "level": self.level, "time": time.time()}
        if epi is not None:
            from . import _kernel_view, ship
            M, L = _kernel_view(prob)
            e["problem"] = {"M": M, "N": prob.N, "K": prob.K, "L": L, "in_dtype": dtype_name(prob.in_dtype),
                            "out_dtype": dtype_name(prob.out_dtype), "a_major": prob.a_major,
                            "b_major": prob.b_major}
            e["epilogue"] = {"name": epi.name, "id": ship.epilogue_id(epi), "ref": ship.epilogue_ref(epi)}
        return e

    def table(self) -> str:
        lines = [f"{'#':>3} {'config':34s} {'ms':>9s} {'TFLOP/s':>8s} {'vs default':>10s}  status"]
        ok = sorted((r for r in self.rows if r.ms is not None), key=lambda r: r.ms)
        bad = [r for r in self.rows if r.ms is None]
        for i, r in enumerate(ok + bad):
            ms = f"{r.ms:9.4f}" if r.ms is not None else f"{'-':>9s}"
            tf = f"{self.flop / r.ms / 1e9:8.1f}" if r.ms else f"{'-':>8s}"
            rel = f"{self.default_ms / r.ms:9.3f}x" if r.ms and self.default_ms else f"{'-':>10s}"
            mark = " (default)" if r.config == self.default else ""
            lines.append(f"{i + 1:3d} {r.config.name + '_e' + str(r.config.epi_n):34s} {ms} {tf} {rel}  "
                         f"{r.status}{mark}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------- timing
def _event_bench(fn: Callable, warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS) -> float:
    """do_bench's method without triton: flush L2 (zero a 256 MB buffer) before each rep, CUDA-event time, median."""
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(5):
        flush.zero_()
        fn()
    e.record()
    torch.cuda.synchronize()
    est = max(s.elapsed_time(e) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    n = max(1, int(rep_ms / est))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(x.elapsed_time(y) for x, y in zip(starts, ends))
    return times[len(times) // 2]


def bench(fn: Callable, rep_ms: float = REP_MS) -> float:
    """Median milliseconds of ``fn`` (``triton.testing.do_bench`` if available)."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return _event_bench(fn, rep_ms=rep_ms)
    return do_bench(fn, warmup=WARMUP_MS, rep=rep_ms, return_mode="median")


def rotating_copies(t: torch.Tensor, n: int) -> list:
    """``t`` itself plus ``n - 1`` copies with the same shape and strides at other addresses."""
    out = [t]
    for _ in range(n - 1):
        c = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        c.copy_(t)
        out.append(c)
    return out


def n_buffers(bytes_in: int, l2_bytes: int, free_bytes: int, max_n: int = 8) -> int:
    """How many input sets make every launch L2-cold: enough to span 4x the L2, within 1/4 of the free memory."""
    if bytes_in <= 0:
        return 1
    want = min(max_n, max(1, math.ceil(4 * l2_bytes / bytes_in)))
    afford = 1 + int(free_bytes // 4 // bytes_in)
    return max(1, min(want, afford))


# ---------------------------------------------------------------------------------------------------- checking
def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    fin = torch.isfinite(ref)
    if not torch.equal(fin, torch.isfinite(x)):
        return math.inf
    x, ref = torch.where(fin, x, 0), torch.where(fin, ref, 0)
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item() if ref.numel() else 0.0


def check_result(got: Any, ref: Any) -> Optional[str]:
    """None if ``got`` matches the reference within CHECK_TOL (every output), else the reason."""
    gd = got if isinstance(got, dict) else {"out": got}
    rd = ref if isinstance(ref, dict) else {"out": ref}
    for k, r in rd.items():
        if k not in gd:
            return f"wrong result: output {k!r} missing"
        e = _rel_err(gd[k], r)
        if not e <= CHECK_TOL:
            return f"wrong result: {k} rel err {e:.3g} > {CHECK_TOL}"
    return None


def input_std(K: int) -> float:
    """The standard deviation of random ``a`` and ``b`` for tuning: K^-1/4, so that the accumulator's entries are
    ~N(0, 1), as a trained layer's are. With unit entries they would be ~N(0, K), and an epilogue such as the cross
    entropy's exp-stored forward (exp of the logit) overflows there for every config ("no config could be timed",
    session 51)."""
    return max(K, 1) ** -0.25


def random_operands(epi: Any, L: Optional[int], M: int, N: int, out_dtype: torch.dtype) -> dict:
    """Operands of the declared kinds for tuning on random inputs (vec_m / vec_n fp32, tile in the out dtype)."""
    lead = (L,) if L else ()
    ops = {}
    for o in epi.operands:
        if o.kind == "scalar":
            ops[o.name] = 0.5
        elif o.kind == "vec_n":
            ops[o.name] = torch.randn(N, device="cuda")
        elif o.kind == "vec_m":
            ops[o.name] = torch.rand(*lead, M, device="cuda") + 0.5
        else:
            ops[o.name] = torch.randn(*lead, M, N, device="cuda", dtype=out_dtype)
    return ops


# ------------------------------------------------------------------------------------------------------ progress
class Progress:
    """Silent for the first ``after_s`` seconds; then a tqdm bar if importable, else plain lines on stderr."""

    def __init__(self, total: int, desc: str, after_s: float = 1.0, stream=None, unit: str = "cfg"):
        self.total, self.desc, self.after_s, self.unit = total, desc, after_s, unit
        self.t0 = time.perf_counter()
        self.bar = None
        self.plain = False
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr

    def update(self, best: str) -> None:
        self.done += 1
        if self.bar is None and not self.plain and time.perf_counter() - self.t0 > self.after_s:
            try:
                from tqdm.auto import tqdm
                self.bar = tqdm(total=self.total, initial=self.done - 1, desc=self.desc, unit=self.unit,
                                file=self.stream, leave=False)
            except ImportError:
                self.plain = True
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"best {best}")
        elif self.plain:
            what = "configs, best so far" if self.unit == "cfg" else f"{self.unit}s;"
            print(f"{self.desc}: {self.done}/{self.total} {what} {best}", file=self.stream, flush=True)

    def grow(self, n: int) -> None:
        """``n`` more steps than announced (a later round of candidates)."""
        self.total += n
        if self.bar is not None:
            self.bar.total = self.total

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------------------------------------- tune
RUNOFF_TOP, RUNOFF_ROUNDS, RUNOFF_MARGIN = 4, 3, 0.01


def runoff(rows: list, default: GemmConfig, time_cfg: Callable, top: int = RUNOFF_TOP,
           rounds: int = RUNOFF_ROUNDS, margin: float = RUNOFF_MARGIN) -> Optional[Row]:
    """The winner among the timed ``rows``, robust to the GPU's run-to-run noise (clocks move by several per cent
    between measurements, more than the gap between good configs): the ``top`` fastest rows and the default are
    timed again ``rounds`` times, interleaved, and each row's ``ms`` becomes the median of all its timings. The
    default is kept unless the best beats it by more than ``margin`` (a tuned config must beat the heuristic by
    more than the noise). None if no row was timed."""
    ok = [r for r in rows if r.ms is not None]
    if not ok:
        return None
    finalists = sorted(ok, key=lambda r: r.ms)[:top]
    d_row = next((r for r in ok if r.config == default), None)
    if d_row is not None and d_row not in finalists:
        finalists.append(d_row)
    if len(finalists) > 1:
        times = {id(r): [r.ms] for r in finalists}
        for _ in range(rounds):
            for r in finalists:
                times[id(r)].append(time_cfg(r.config))
        for r in finalists:
            r.ms = statistics.median(times[id(r)])
    best = min(finalists, key=lambda r: r.ms)
    if d_row is not None and best is not d_row and d_row.ms <= best.ms * (1 + margin):
        return d_row
    return best


def tune(a: torch.Tensor, b: torch.Tensor, epi: Any = None, out_dtype: Optional[torch.dtype] = None,
         operands: Optional[dict] = None, level: str = "quick", rep_ms: float = REP_MS, check: bool = True,
         progress: bool = True) -> TuneResult:
    """Time every candidate config for ``epi(a @ b.T)`` and return the best (see the module docstring)."""
    import coda
    import coda.reference
    from coda import _device
    from coda._device import require_hopper
    from coda._validate import check_gemm_args
    from coda.kernels.epilogue import check_epilogue, out_flags
    if level not in ("quick", "full", "near"):
        raise ValueError(f"level must be 'quick', 'full' or 'near', got {level!r}")
    t_start = time.perf_counter()
    operands = dict(operands or {})
    epi = check_epilogue(epi)
    # the output's width as the epilogue writes it (N/2 for a pairs epilogue, 2N for a 1 -> 2 one): before session
    # 21 the tuner allocated N columns, so every config of such an epilogue failed ("no config could be timed")
    prob = check_gemm_args(a, b, out_dtype=out_dtype, **out_flags(epi))
    require_hopper(prob.device, "coda.autotune")
    from . import _kernel_view, heuristic
    M, L = _kernel_view(prob)
    default = heuristic(prob)
    cands, pruned = space.candidates(epi, prob.in_dtype, prob.out_dtype, M, prob.N, L,
                                     "near" if level == "near" else "quick", [default])
    # few tiles, long K: the in-kernel split-K variants too (space.split_candidates)
    cands += [c for c in space.split_candidates(epi, prob.in_dtype, prob.out_dtype, M, prob.N, prob.K, L,
                                                _device.sm_count(prob.device), level) if c not in cands]
    if default in cands:
        cands.remove(default)
        cands.insert(0, default)

    props = torch.cuda.get_device_properties(prob.device)
    free, _ = torch.cuda.mem_get_info(prob.device)
    nbuf = n_buffers(a.nbytes + (0 if b.data_ptr() == a.data_ptr() else b.nbytes), props.L2_cache_size, free)
    As, Bs = rotating_copies(a, nbuf), rotating_copies(b, nbuf)
    out = torch.empty(prob.out_shape, dtype=prob.out_dtype, device=a.device) if epi.stores_out else None
    out_numel = math.prod(prob.out_shape)
    ref_bytes = 4 * (a.numel() + b.numel() + out_numel * (2 + len(epi.outputs)))
    unchecked = check and ref_bytes > free // 4
    check = check and not unchecked  # the fp32 reference would not fit comfortably next to the caller's data
    ref = coda.reference.gemm(a, b, epilogue=None if epi.is_identity else epi, out_dtype=prob.out_dtype,
                              **operands) if check else None
    if isinstance(ref, dict) and not (epi.outputs or epi.reductions):
        ref = ref["out"]
    it = [0]

    def rot():
        it[0] = (it[0] + 1) % nbuf
        return As[it[0]], Bs[it[0]]

    def time_cfg(cfg):
        return bench(lambda: coda.gemm(*rot(), epilogue=epi, out=out, config=cfg, **operands), rep_ms)

    rows: list = []
    bar = Progress(len(cands), f"coda.autotune {prob.M}x{prob.N}x{prob.K} {device_info(prob.device).name}") \
        if progress else None

    def run(cfgs):
        for cfg in cfgs:
            row = Row(cfg)
            try:
                t0 = time.perf_counter()
                got = coda.gemm(As[0], Bs[0], epilogue=epi, out=out, config=cfg, **operands)
                torch.cuda.synchronize()
                row.first_call_s = time.perf_counter() - t0
                bad = check_result(got, ref) if check else None
                if bad:
                    row.status = bad
                else:
                    if unchecked:
                        row.status = "ok (unchecked: the fp32 reference would not fit in memory)"
                    row.ms = time_cfg(cfg)
            except Exception as e:  # reported in the table; a faulting kernel may still poison the context
                row.status = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            rows.append(row)
            if bar is not None:
                ok = [r for r in rows if r.ms is not None]
                best = min(ok, key=lambda r: r.ms) if ok else None
                bar.update(f"{best.config.name} {best.ms:.3f} ms" if best else "-")

    try:
        run(cands)
        if level == "full":
            top = [r.config for r in sorted((r for r in rows if r.ms is not None), key=lambda r: r.ms)[:3]]
            more, pruned2 = space.candidates(epi, prob.in_dtype, prob.out_dtype, M, prob.N, L, "refine", top)
            seen = {c for c, _ in pruned}
            pruned += [(c, r) for c, r in pruned2 if c not in seen]
            if bar is not None:
                bar.grow(len(more))
            run(more)
        elif level == "near":
            d_ms = next((r.ms for r in rows if r.config == default and r.ms is not None), None)
            better = [r.config for r in sorted((r for r in rows if r.ms is not None), key=lambda r: r.ms)
                      if d_ms is not None and r.ms < d_ms / (1 + RUNOFF_MARGIN)]
            combo = space.combine(default, better)
            if combo is not None and all(r.config != combo for r in rows):
                kept, bad = space.near_candidates(epi, prob.in_dtype, prob.out_dtype, M, prob.N, L, [combo])
                pruned += bad
                if bar is not None:
                    bar.grow(len(kept))
                run(kept)
    finally:
        if bar is not None:
            bar.close()
    best_row = runoff(rows, default, time_cfg)
    default_row = next((r for r in rows if r.config == default), None)
    return TuneResult(best=best_row.config if best_row else default, best_ms=best_row.ms if best_row else None,
                      default=default, default_ms=default_row.ms if default_row else None, rows=rows,
                      pruned=pruned, seconds=time.perf_counter() - t_start,
                      flop=2 * M * prob.N * prob.K * L, level=level)


def describe(result: TuneResult) -> str:
    d = f"{result.default_ms:.4f} ms" if result.default_ms else "n/a"
    b = f"{result.best_ms:.4f} ms" if result.best_ms else "n/a"
    return (f"best {result.best.name} ({b}), default {result.default.name} ({d}); {len(result.rows)} timed, "
            f"{len(result.pruned)} pruned, {result.seconds:.1f} s")


__all__ = ["tune", "bench", "TuneResult", "Row", "check_result", "n_buffers", "rotating_copies", "Progress",
           "random_operands", "describe", "dtype_name", "runoff"]
