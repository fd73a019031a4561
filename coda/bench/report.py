"""Rendering of ``python -m coda.bench`` reports: SoL arithmetic, ``report.md``, ``sol.png`` and ``roofline.png``.

Everything here works from the JSON report alone (no GPU, no CODA kernels): ``python -m coda.bench --from
report.json`` re-renders a saved report anywhere. Derived numbers (SoL time, TFLOP/s, GB/s, % SoL, ratio to cuBLAS)
are recomputed from the raw measurements (median ms, FLOPs, bytes, measured ceilings) by :func:`finalize`, so a
re-render never disagrees with the data it shows. matplotlib is imported only to draw the PNGs (extra ``bench``).
"""
from __future__ import annotations

import copy
import json
import math
import os
from typing import Optional

IMPLS = ("coda", "cublas", "eager", "compile")
IMPL_LABEL = {"coda": "CODA", "cublas": "cuBLAS GEMM", "eager": "torch eager", "compile": "torch.compile"}
IMPL_COLOR = {"coda": "#d62728", "cublas": "#7f7f7f", "eager": "#1f77b4", "compile": "#2ca02c"}
IMPL_MARKER = {"coda": "o", "cublas": "s", "eager": "^", "compile": "D"}
# an implementation whose output differs from the reference by more than this (relative Frobenius norm) is
# flagged in the report and never declared the winner
MISMATCH_REL_ERR = 0.05
PNG_DPI = 90
_CEIL_WHO = {"cublas": "cuBLAS", "coda": "CODA"}


# -- SoL arithmetic ---------------------------------------------------------------------------------------------------
def sol_ms(flops: float, nbytes: float, peak_tflops: float, bandwidth_gbps: float) -> float:
    """Speed-of-light time in ms: max(FLOPs / GEMM peak, bytes / memory bandwidth)."""
    return max(compute_ms(flops, peak_tflops), memory_ms(nbytes, bandwidth_gbps))


def compute_ms(flops: float, peak_tflops: float) -> float:
    return flops / (peak_tflops * 1e12) * 1e3


def memory_ms(nbytes: float, bandwidth_gbps: float) -> float:
    return nbytes / (bandwidth_gbps * 1e9) * 1e3


def bound(flops: float, nbytes: float, peak_tflops: float, bandwidth_gbps: float) -> str:
    return "compute" if compute_ms(flops, peak_tflops) >= memory_ms(nbytes, bandwidth_gbps) else "memory"


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def pct_sol(ms: float, sol: float) -> float:
    """Percentage of the speed of light reached by a measured time (100 = at the SoL)."""
    return 100.0 * sol / ms


def median(xs):
    s = sorted(xs)
    n = len(s)
    if n == 0:
        raise ValueError("median of nothing")
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def quantiles(xs, qs) -> tuple:
    """Linear-interpolated quantiles ``qs`` (0..1) of ``xs``."""
    s = sorted(xs)
    out = []
    for q in qs:
        p = q * (len(s) - 1)
        lo = int(math.floor(p))
        hi = min(lo + 1, len(s) - 1)
        out.append(s[lo] + (s[hi] - s[lo]) * (p - lo))
    return tuple(out)


def summarize_timings(quartiles: list) -> dict:
    """Repeated timer results [(q25, q50, q75) ms, ...] -> the time reported and its spread.

    ``ms`` is the median of the repeat medians; ``min_ms``/``max_ms`` bound the repeat medians (drift between
    repeats, e.g. clocks and temperature); ``iqr_ms`` is the median within-repeat interquartile range (launch noise).
    """
    meds = [float(q[1]) for q in quartiles]
    ms = median(meds)
    return dict(ms=ms, min_ms=min(meds), max_ms=max(meds), repeats_ms=meds,
                iqr_ms=median([float(q[2]) - float(q[0]) for q in quartiles]),
                spread_pct=100.0 * (max(meds) - min(meds)) / ms)


# -- derived numbers ----------------------------------------------------------------------------------------------
def complete_impls(case: dict) -> list:
    """Implementations that compute the whole op (the cuBLAS GEMM baseline does only when the op is a plain GEMM)."""
    return [k for k in case["impls"] if k != "cublas" or case.get("cublas_complete")]


def _ok(r: dict) -> bool:
    return "error" not in r and r.get("ms") is not None


def mismatched(r: dict) -> bool:
    """The result disagrees with the reference: flagged at measurement (non-finite values) or rel err too large."""
    e = r.get("rel_err")
    return bool(r.get("mismatch")) or (e is not None and not (e <= MISMATCH_REL_ERR))


def winner(case: dict) -> Optional[str]:
    """The fastest implementation that computes the whole op, ran, and agrees with the reference."""
    cands = [(case["impls"][k]["ms"], k) for k in complete_impls(case)
             if _ok(case["impls"][k]) and not mismatched(case["impls"][k])]
    return min(cands)[1] if cands else None


def paired_ratio(reps: Optional[list], base_reps: Optional[list]) -> Optional[float]:
    """The median over repeats of (this repeat's median / the baseline's median in the same repeat): the
    implementations run one after another within each repeat, so what drifts between repeats (clock, temperature)
    cancels in each quotient. None without repeat medians for both, or when their counts differ."""
    if not reps or not base_reps or len(reps) != len(base_reps) or min(base_reps) <= 0:
        return None
    return median([a / b for a, b in zip(reps, base_reps)])


def finalize(report: dict) -> dict:
    """A copy of ``report`` with every derived number (re)computed from the raw measurements."""
    rep = copy.deepcopy(report)
    ceil = rep["ceilings"]
    peak, bw = ceil["gemm"]["peak_tflops"], ceil["bandwidth"]["gbps"]
    for case in rep["results"]:
        case["sol_ms"] = sol_ms(case["flops"], case["bytes"], peak, bw)
        case["bound"] = bound(case["flops"], case["bytes"], peak, bw)
        case["intensity"] = case["flops"] / case["bytes"]
        base = case["impls"].get("cublas")
        base_ms = base["ms"] if base and _ok(base) else None
        for r in case["impls"].values():
            if not _ok(r):
                continue
            r["tflops"] = tflops(case["flops"], r["ms"])
            r["gbps"] = gbps(case["bytes"], r["ms"])
            r["pct_sol"] = pct_sol(r["ms"], case["sol_ms"])
            r["vs_cublas"] = r["ms"] / base_ms if base_ms else None
            r["vs_cublas_paired"] = paired_ratio(r.get("repeats_ms"), base.get("repeats_ms")) if base_ms else None
        case["winner"] = winner(case)
    return rep


# -- formatting ---------------------------------------------------------------------------------------------------
def shape_label(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def case_label(case: dict) -> str:
    return f"{case['op']} {case['mode']} {'x'.join(str(v) for v in case['shape'].values())}"


def _f(x, fmt="{:.3f}", none="-"):
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _gb(nbytes):
    return _f(None if nbytes is None else nbytes / 1e9, "{:.3f}")


def _meta_line(meta: dict) -> str:
    commit = meta.get("commit") or "unknown"
    if commit != "unknown":
        commit = commit[:10] + (" (uncommitted changes)" if meta.get("dirty") else "")
    runs = meta.get("runs") or []
    if len({r.get("commit") for r in runs}) > 1:
        commit += f"; {len(runs)} runs appended, commits " + ", ".join(
            dict.fromkeys((r.get("commit") or "?")[:10] + ("+" if r.get("dirty") else "") for r in runs))
    parts = [meta.get("device", "unknown device"), f"driver {meta.get('driver') or '?'}",
             f"CUDA {meta.get('cuda') or '?'}", f"torch {meta.get('torch') or '?'}",
             f"triton {meta.get('triton') or '-'}", f"nvidia-cutlass-dsl {meta.get('cutlass_dsl') or '?'}",
             f"CODA {meta.get('coda') or '?'}", f"commit {commit}", meta.get("dtype", "?"), meta.get("date", "")]
    return " · ".join(p for p in parts if p)


def render_markdown(report: dict, images: tuple = ("sol.png", "roofline.png")) -> str:
    rep = finalize(report)
    meta, ceil = rep.get("meta", {}), rep["ceilings"]
    peak, bw = ceil["gemm"]["peak_tflops"], ceil["bandwidth"]["gbps"]
    L = ["# CODA speed-of-light report", "", _meta_line(meta), ""]
    timing = meta.get("timing", {})
    if timing:
        L += [f"Timing: {timing.get('timer', '?')}; each number is the median of {timing.get('repeats', '?')} "
              f"repeats (each: {timing.get('warmup_ms', '?')} ms warm-up, {timing.get('rep_ms', '?')} ms of "
              "timed runs), implementations interleaved within each repeat. Spread = (max - min) / median of "
              "the repeat medians. Inputs: " + ("rotated over several fresh copies (`--l2-cold`)."
                                                if timing.get("l2_cold") else "one set per op and shape.")
              + f" torch.compile mode: {timing.get('compile_mode', 'default')}.", ""]
    g = ceil["gemm"]
    L += ["## Ceilings (measured first)", "", "| ceiling | measured with | ms | spread | value |", "|---|---|---|---|---|"]
    gshape = "x".join(str(v) for v in g["shape"])
    for k in ("cublas", "coda"):
        r = g["impls"].get(k)
        if r is None:
            continue
        what = {"cublas": "torch.mm", "coda": "coda.gemm"}[k]
        who = _CEIL_WHO[k]
        if _ok(r):
            L.append(f"| GEMM peak, {who} | {what} {gshape} | {_f(r['ms'])} | {_f(r['spread_pct'], '{:.1f}')} % "
                     f"| {tflops(g['flops'], r['ms']):.0f} TFLOP/s |")
        else:
            L.append(f"| GEMM peak, {who} | {what} {gshape} | - | - | failed: {_cell(r['error'])} |")
    L.append(f"| **GEMM peak used** | best of the above ({_CEIL_WHO.get(g.get('peak_source'), '?')}) | | | "
             f"**{peak:.0f} TFLOP/s** |")
    b = ceil["bandwidth"]
    L.append(f"| **memory bandwidth** | device-to-device copy of {b['bytes'] / 2 / 2**30:.1f} GiB (read + write) | "
             f"{_f(b['ms'])} | {_f(b.get('spread_pct'), '{:.1f}')} % | **{bw:.0f} GB/s** |")
    L += ["", f"Ridge point: {peak * 1e3 / bw:.0f} FLOP/byte. SoL time = max(FLOPs / GEMM peak, bytes / bandwidth); "
          "FLOPs = matmul FLOPs (2·M·N·K per GEMM; forward+backward = 3x: forward, data and weight gradients); "
          "bytes = each input read once and each output written once (forward+backward adds the output gradient "
          "read and the input gradients written). % SoL = SoL time / measured time.", ""]

    L += ["## Summary", "", "| op | shape | SoL ms | bound | winner | CODA ms | CODA % SoL | CODA / cuBLAS GEMM "
          "| paired | eager / CODA | compile / CODA |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in rep["results"]:
        co = c["impls"].get("coda", {})
        w = c["winner"]

        def over(k):
            r = c["impls"].get(k)
            return r["ms"] / co["ms"] if r and _ok(r) and _ok(co) else None
        coda_ms = _f(co.get("ms")) if _ok(co) else ("failed" if "error" in co else "-")
        if _ok(co) and mismatched(co):
            coda_ms += " (MISMATCH)"
        L.append(f"| {c['op']} {c['mode']} | {shape_label(c['shape'])} | {_f(c['sol_ms'])} | {c['bound']} | "
                 f"{IMPL_LABEL.get(w, '-') if w else '-'} | {coda_ms} | {_f(co.get('pct_sol'), '{:.1f}')} | "
                 f"{_f(co.get('vs_cublas'))} | {_f(co.get('vs_cublas_paired'))} | {_f(over('eager'), '{:.2f}x')} | "
                 f"{_f(over('compile'), '{:.2f}x')} |")
    L += ["", "CODA / cuBLAS GEMM: CODA's median time over cuBLAS's. Paired: the median over repeats of the same "
          "quotient taken within each repeat (the implementations run one after another there, so drift between "
          "repeats cancels); where the two differ by more than a few percent, the card's noise decides the "
          "difference.", ""]
    if rep.get("skipped"):
        L += ["## Skipped", ""] + [f"- `{s['op']}`: {s['reason']}" for s in rep["skipped"]] + [""]

    ops = []
    for c in rep["results"]:
        if (c["op"], c["mode"]) not in ops:
            ops.append((c["op"], c["mode"]))
    for op, mode in ops:
        cases = [c for c in rep["results"] if (c["op"], c["mode"]) == (op, mode)]
        L += [f"## {op} ({mode})", ""]
        if cases[0].get("description"):
            L += [cases[0]["description"], ""]
        L += ["| shape | SoL ms | impl | ms | spread | TFLOP/s | GB/s | % SoL | / cuBLAS GEMM | extra mem GB | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in cases:
            first = True
            for k in [i for i in IMPLS if i in c["impls"]] + [i for i in c["impls"] if i not in IMPLS]:
                r = c["impls"][k]
                head = (f"{shape_label(c['shape'])} | {_f(c['sol_ms'])} ({c['bound']})" if first else " | ")
                first = False
                name = IMPL_LABEL.get(k, k)
                if not _ok(r):
                    L.append(f"| {head} | {name} | - | - | - | - | - | - | - | failed: {_cell(r.get('error', '?'))} |")
                    continue
                notes = []
                if k == "cublas" and not c.get("cublas_complete"):
                    notes.append("the GEMM(s) alone, M x N x K: " + ", ".join("x".join(map(str, gm)) for gm in c["gemms"]))
                if r.get("rel_err") is not None or mismatched(r):
                    notes.append(("MISMATCH " if mismatched(r) else "") + f"rel err {_f(r.get('rel_err'), '{:.1e}')}"
                                 + (f" ({r['compare_note']})" if r.get("compare_note") else ""))
                cells = [name, _f(r["ms"]), _f(r.get("spread_pct"), "{:.1f} %"), _f(r["tflops"], "{:.0f}"),
                         _f(r["gbps"], "{:.0f}"), _f(r["pct_sol"], "{:.1f}"), _f(r["vs_cublas"]),
                         _gb(r.get("extra_mem_bytes"))]
                if k == c["winner"]:
                    cells = [f"**{x}**" if x != "-" else x for x in cells]
                L.append(f"| {head} | " + " | ".join(cells) + f" | {'; '.join(notes)} |")
        L.append("")
    L += ["Extra memory: peak allocated during one call minus what was allocated before it and minus the outputs "
          "it returns (temporaries and saved activations). Winner (bold): the fastest implementation of the whole "
          f"op whose result agrees with the reference (relative error <= {MISMATCH_REL_ERR}).", ""]
    L += [f"![% of speed of light per op and implementation]({images[0]})", "",
          f"![ops on the roofline of the measured ceilings]({images[1]})", ""]
    return "\n".join(L)


def _cell(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")[:200]


# -- plots --------------------------------------------------------------------------------------------------------
def _figure(w, h):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(w, h))
    FigureCanvasAgg(fig)
    return fig


def _series(cases, k):
    """(index, case, result) of implementation ``k``; cuBLAS splits into whole-op GEMMs and GEMM-only baselines."""
    out = {}
    for i, c in enumerate(cases):
        r = c["impls"].get(k)
        if r and _ok(r):
            part = k if k != "cublas" or c.get("cublas_complete") else "cublas_only"
            out.setdefault(part, []).append((i, c, r))
    return out


_STYLE = {"cublas_only": dict(color="#d9d9d9", hatch="///", edgecolor="#7f7f7f", label="cuBLAS GEMM(s) only")}


def plot_sol(report: dict, path: str) -> None:
    """Horizontal grouped bars: % of SoL per (op, shape), one bar per implementation."""
    rep = finalize(report)
    cases = rep["results"]
    impls = [k for k in IMPLS if any(k in c["impls"] for c in cases)]
    fig = _figure(10, 1.6 + 0.11 * max(1, len(cases)) * max(1, len(impls)))
    ax = fig.add_subplot(1, 1, 1)
    height = 0.8 / max(1, len(impls))
    xmax = 100.0
    for j, k in enumerate(impls):
        for part, pts in _series(cases, k).items():
            ys = [i + (j - (len(impls) - 1) / 2) * height for i, _, _ in pts]
            xs = [r["pct_sol"] for _, _, r in pts]
            xmax = max([xmax] + xs)
            style = _STYLE.get(part, dict(color=IMPL_COLOR[k], label=IMPL_LABEL[k]))
            ax.barh(ys, xs, height=height, linewidth=0.4, **style)
    ax.axvline(100, color="black", lw=0.8, ls="--")
    ax.set_yticks(range(len(cases)), [f"{i + 1}. {case_label(c)}" for i, c in enumerate(cases)], fontsize=7)
    ax.set_ylim(len(cases) - 0.5, -0.5)
    ax.set_xlim(0, xmax * 1.05)
    ax.set_xlabel("% of speed of light (higher is better; 100 = SoL of the whole op)")
    m = rep.get("meta", {})
    fig.suptitle(f"{m.get('device', '')} {m.get('dtype', '')}: % of speed of light", fontsize=10)
    ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=5, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=PNG_DPI, bbox_inches="tight")


def plot_roofline(report: dict, path: str) -> None:
    """Achieved TFLOP/s against arithmetic intensity, on the roofline of the measured ceilings (log-log).

    Points are numbered like the bars of sol.png (the number sits next to CODA's point)."""
    rep = finalize(report)
    peak, bw = rep["ceilings"]["gemm"]["peak_tflops"], rep["ceilings"]["bandwidth"]["gbps"]
    ridge = peak * 1e3 / bw
    cases = rep["results"]
    ai = [c["intensity"] for c in cases] or [ridge]
    lo, hi = min(min(ai), ridge) / 4, max(max(ai), ridge) * 3
    fig = _figure(10, 5.5)
    ax = fig.add_axes([0.08, 0.1, 0.58, 0.82])
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(xs, [min(peak, x * bw / 1e3) for x in xs], color="black", lw=1.2,
            label=f"roofline: {peak:.0f} TFLOP/s, {bw:.0f} GB/s")
    ys_all = [peak]
    for k in IMPLS:
        for part, pts in _series(cases, k).items():
            style = dict(color=IMPL_COLOR[k], label=IMPL_LABEL[k])
            if part == "cublas_only":
                style = dict(facecolors="none", edgecolors=IMPL_COLOR[k], label=_STYLE[part]["label"])
            ys = [r["tflops"] for _, _, r in pts]
            ys_all += ys
            ax.scatter([c["intensity"] for _, c, _ in pts], ys, s=24, marker=IMPL_MARKER[k], alpha=0.85, zorder=3,
                       **style)
    labels = {}
    for i, c in enumerate(cases):
        r = c["impls"].get("coda")
        if r and _ok(r):
            key = round(math.log10(c["intensity"]), 2), round(math.log10(r["tflops"]), 2)
            labels.setdefault(key, (c["intensity"], r["tflops"], []))[2].append(str(i + 1))
    for x, y, idx in labels.values():
        ax.annotate(",".join(idx), (x, y), fontsize=6, xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(min(peak / 6, min(ys_all) / 1.5), max(ys_all) * 1.6)
    ax.set_xlabel("arithmetic intensity (FLOP / minimal byte)")
    ax.set_ylabel("achieved TFLOP/s")
    m = rep.get("meta", {})
    ax.set_title(f"{m.get('device', '')} {m.get('dtype', '')}: roofline of the measured ceilings", fontsize=10)
    ax.grid(which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="lower right")
    key = "\n".join(f"{i + 1}. {case_label(c)}" for i, c in enumerate(cases))
    fig.text(0.68, 0.92, key, fontsize=min(6.5, 330 / max(1, len(cases))), va="top", family="monospace")
    fig.savefig(path, dpi=PNG_DPI, bbox_inches="tight")


def progress_line(k: str, r: dict, case: dict, peak: float, bw: float) -> str:
    """One implementation's result as printed while the benchmark runs."""
    if "error" in r:
        return f"    {k:8s} FAILED {r['error']}"
    sol = sol_ms(case["flops"], case["bytes"], peak, bw)
    extra = f"  extra {r['extra_mem_bytes'] / 1e9:.3f} GB" if "extra_mem_bytes" in r else ""
    err = f"  rel err {r['rel_err']:.1e}" if r.get("rel_err") is not None else ""
    bad = "  MISMATCH" if mismatched(r) else ""
    return (f"    {k:8s} {r['ms']:9.3f} ms ±{r['spread_pct']:4.1f}%  {tflops(case['flops'], r['ms']):6.0f} TFLOP/s"
            f"  {pct_sol(r['ms'], sol):5.1f}% SoL{extra}{err}{bad}")


def save_json(report: dict, out_dir: str) -> str:
    """Write the raw report (atomically: a crash mid-run leaves the last complete version)."""
    os.makedirs(out_dir, exist_ok=True)
    path, tmp = os.path.join(out_dir, "report.json"), os.path.join(out_dir, "report.json.tmp")
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, allow_nan=False)
    os.replace(tmp, path)
    return path


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_report(report: dict, out_dir: str, write_json: bool = True) -> dict:
    """Write report.json (optional), report.md, sol.png and roofline.png into ``out_dir``.

    Returns {"written": [paths], "missing": [(path, reason)]}; the PNGs are missing when matplotlib is not installed.
    """
    os.makedirs(out_dir, exist_ok=True)
    written, missing = [], []
    if write_json:
        written.append(save_json(finalize(report), out_dir))
    p = os.path.join(out_dir, "report.md")
    with open(p, "w") as f:
        f.write(render_markdown(report))
    written.append(p)
    for name, fn in (("sol.png", plot_sol), ("roofline.png", plot_roofline)):
        p = os.path.join(out_dir, name)
        if not matplotlib_available():
            missing.append((p, "matplotlib is not installed (pip install 'coda-gemm[bench]')"))
            continue
        fn(report, p)
        written.append(p)
    return {"written": written, "missing": missing}
