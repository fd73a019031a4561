"""The training-step report's arithmetic and rendering (no GPU, no torch): ``python -m coda.bench --model ...``.

- :func:`classify` puts a GPU kernel, by name, into one of four classes: ``gemm`` (ours and cuBLAS's), ``attention``
  (flash / cuDNN / memory-efficient SDPA), ``optimizer`` (``multi_tensor_apply`` and fused Adam kernels), ``other``
  (the memory-bound remainder CODA exists to remove). The rules are ordered; the first that matches wins.
- :func:`step_flops` counts a preset's model FLOPs per training step (GEMMs and causal attention, forward + backward
  as 3x forward, no recomputation counted).
- :func:`summarize` turns per-mode measurements (step times, kernel times) into the report's rows;
  :func:`render_markdown` and :func:`plot_step` write it; :func:`write_step_report` writes all three.
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Optional

CLASSES = ("gemm", "attention", "optimizer", "other")
DATASHEET_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "GH200": 989.4}  # dense bf16 tensor-core peak

# (class, pattern): matched in order against the kernel name (case-insensitive). The exceptions come first: our own
# memory-bound CuTeDSL kernels carry "cutlass" in their names but are not GEMMs.
RULES = (
    ("other", r"ce_grad|softmax_grad|rope_grad"),  # the CE's softmax-gradient pass, the QKV backward's RoPE pass
    # cuBLAS matrix-vector products: the finishing sums of the epilogues' tile partials (kernels.epilogue's
    # _sum_tiles), memory-bound; the model's own GEMMs never run as gemv at training shapes
    ("other", r"gemv"),
    # coda.optim's AdamW as a K = 0 pass of our kernel (its epilogue's name is in the kernel's); in a dW GEMM's
    # epilogue (in_backward=True) it is GEMM time
    ("optimizer", r"GemmSm90_adamw_scaled"),
    ("gemm", r"GemmSm90_adamw"),
    ("optimizer", r"multi_tensor_apply|fused_?adam|adamw|_fused_sgd|FusedAdam"),
    # cuDNN's SDPA backward runs its preprocessing (rowsum(dO * O)) and the dQ accumulator's conversion as kernels
    # of their own (cudnn::fusion::compute_dot_do_o, convert_dq_to_16bits): attention time, as in FlashAttention
    ("attention", r"flash|fmha|sdpa|attention|_mha_|mha_fwd|mha_bwd|compute_dot_do_o|convert_dq_to_16bits"),
    ("gemm", r"nvjet|gemm|xmma|splitkreduce|cutlass|triton_tem_\w*mm"),
)
_COMPILED = tuple((c, re.compile(p, re.IGNORECASE)) for c, p in RULES)


def classify(name: str) -> str:
    """The class of one kernel name (see :data:`RULES`)."""
    for cls, pat in _COMPILED:
        if pat.search(name):
            return cls
    return "other"


# -- model FLOPs -------------------------------------------------------------------------------------------------
def linear_shapes(cfg: dict) -> list:
    """(in, out, count) of every projection of a Llama-style model; ``cfg`` has hidden, intermediate, layers,
    heads, kv_heads, vocab (optional head_dim: default hidden // heads)."""
    h, i, n = cfg["hidden"], cfg["intermediate"], cfg["layers"]
    d = head_dim(cfg)
    q, kv = cfg["heads"] * d, cfg["kv_heads"] * d
    return [(h, q, n), (h, kv, n), (h, kv, n), (q, h, n),        # q, k, v, o
            (h, i, n), (h, i, n), (i, h, n),                      # gate, up, down
            (h, cfg["vocab"], 1)]                                 # lm_head


def head_dim(cfg: dict) -> int:
    """A preset's head_dim: its own, else hidden // heads."""
    return cfg.get("head_dim") or cfg["hidden"] // cfg["heads"]


def step_flops(cfg: dict, batch: int, seq: int) -> dict:
    """Model FLOPs of one training step: GEMMs 3 x 2 M sum(in x out) (forward, data and weight gradients); causal
    attention 3 x (QK^T and PV: 2 x 2 B heads T^2 d, halved by the mask) per layer."""
    m = batch * seq
    gemm = 3 * 2 * m * sum(a * b * c for a, b, c in linear_shapes(cfg))
    d = head_dim(cfg)
    attn = 3 * cfg["layers"] * (2 * 2 * batch * cfg["heads"] * seq * seq * d) // 2
    return {"gemm": gemm, "attention": attn, "total": gemm + attn}


# -- summary -----------------------------------------------------------------------------------------------------
def median(xs):
    xs = sorted(x for x in xs if x is not None and not math.isnan(x))
    if not xs:
        return float("nan")
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def kernel_classes(kernels: dict) -> dict:
    """{kernel name: ms per step} -> ms per step of each class."""
    out = {c: 0.0 for c in CLASSES}
    for name, ms in kernels.items():
        out[classify(name)] += ms
    return out


def top_kernels(kernels: dict, cls: str = "other", n: int = 10) -> list:
    return sorted(((k, v) for k, v in kernels.items() if classify(k) == cls), key=lambda kv: -kv[1])[:n]


def datasheet_tflops(device: str) -> Optional[float]:
    for key, v in sorted(DATASHEET_TFLOPS.items(), key=lambda kv: -len(kv[0])):
        if key in (device or ""):
            return v
    return None


def summarize(report: dict) -> dict:
    """Fill each mode's derived numbers (tokens/s, MFU, classes, SoL %) and the report's speed of light."""
    meta, flops = report["meta"], report["flops"]
    peak = report.get("gemm_peak_tflops")
    sheet = datasheet_tflops(meta.get("device", ""))
    tokens = meta["batch"] * meta["seq"]
    modes = [m for m in report["modes"] if not m.get("error")]
    for m in modes:
        m["step_ms"] = median(m["step_ms_all"])
        m["tok_s"] = tokens / m["step_ms"] * 1e3
        m["mfu_measured"] = flops["total"] / (m["step_ms"] * 1e-3) / (peak * 1e12) if peak else None
        m["mfu_datasheet"] = flops["total"] / (m["step_ms"] * 1e-3) / (sheet * 1e12) if sheet else None
        m["classes"] = kernel_classes(m.get("kernels", {}))
        m["gpu_ms"] = sum(m["classes"].values())
        m["top_other"] = top_kernels(m.get("kernels", {}))
    sol = None
    if peak and modes and all(m.get("kernels") for m in modes):  # not without a profile (--profile-steps 0)
        attn = min(m["classes"]["attention"] for m in modes)
        opt = min(m["classes"]["optimizer"] for m in modes)
        sol = {"gemm_ms": flops["gemm"] / (peak * 1e12) * 1e3, "attention_ms": attn, "optimizer_ms": opt}
        sol["ms"] = sol["gemm_ms"] + attn + opt
        for m in modes:
            m["pct_sol"] = 100.0 * sol["ms"] / m["step_ms"]
    report["sol"] = sol
    base = next((m for m in modes if m["mode"] == "stock+compile"), None)
    for m in modes:
        m["vs_stock_compile"] = m["tok_s"] / base["tok_s"] if base else None
    return report


# -- rendering ---------------------------------------------------------------------------------------------------
def _f(x, fmt="{:.1f}", none="-"):
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def render_markdown(report: dict, image: Optional[str] = "step.png") -> str:
    r, meta = summarize(report), report["meta"]
    c = meta["config"]
    lines = [f"# Training step: {meta['model']} ({c['layers']} layers, H {c['hidden']}, I {c['intermediate']}, "
             f"{c['heads']}/{c['kv_heads']} heads, V {c['vocab']})", "",
             f"{meta.get('device')}, commit {meta.get('commit')}{' (dirty)' if meta.get('dirty') else ''}, "
             f"{meta.get('date')}; batch {meta['batch']} x {meta['seq']} tokens, {meta['dtype']}, optimizer "
             f"{meta['optimizer']}, {meta['steps']} timed steps after {meta['warmup']} warm-up (median), "
             f"CODA_AUTOTUNE={meta.get('autotune') or 'unset (stored / shipped configs, else the heuristic)'}; "
             f"torch {meta.get('torch')}, cutlass-dsl {meta.get('cutlass_dsl')}.",
             "", f"Model FLOPs per step: GEMM {r['flops']['gemm'] / 1e12:.2f} T, attention (causal) "
                 f"{r['flops']['attention'] / 1e12:.2f} T; measured GEMM peak {_f(r.get('gemm_peak_tflops'), '{:.0f}')}"
                 f" TFLOP/s (cuBLAS bf16 8192^3)."]
    if r["sol"]:
        s = r["sol"]
        lines += ["", f"Speed of light: {s['ms']:.1f} ms per step = GEMM FLOPs / peak {s['gemm_ms']:.1f} + attention "
                      f"{s['attention_ms']:.1f} + optimizer {s['optimizer_ms']:.1f} (the step with every "
                      "memory-bound kernel gone; attention and optimizer: the fastest mode's)."]
    n = meta.get("nproc") or 1
    if n > 1:
        lines += ["", f"{n} processes, one GPU each, FSDP2 (`fully_shard` per decoder layer and the root; under "
                      f"compile each layer compiled): tokens/s and MFU are per GPU, over all GPUs "
                      + ", ".join(f"{m['mode']} {n * m['tok_s'] / 1e3:.1f}k" for m in r["modes"] if not m.get("error"))
                      + " tokens/s."]
    lines += ["", "| mode | tokens/s | vs stock+compile | step ms | % of SoL | MFU (meas. / sheet) | peak GB | loss | "
                  "first step s | GEMM ms | attention ms | optimizer ms | other ms | LM head ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in r["modes"]:
        if m.get("error"):
            lines.append(f"| {m['mode']} | failed: {str(m['error'])[:120].replace('|', '/')} |" + " |" * 12)
            continue
        cl = m["classes"]
        lines.append(
            f"| {m['mode']} | {m['tok_s'] / 1e3:.1f}k | {_f(m['vs_stock_compile'], '{:.3f}x')} | {m['step_ms']:.1f} | "
            f"{_f(m.get('pct_sol'), '{:.0f}')} | {_f(m['mfu_measured'] and 100 * m['mfu_measured'], '{:.1f}')} / "
            f"{_f(m['mfu_datasheet'] and 100 * m['mfu_datasheet'], '{:.1f}')} % | {m['peak_bytes'] / 1e9:.1f} | "
            f"{_f(m.get('loss'), '{:.3f}')} | {_f(m.get('first_step_s'), '{:.0f}')} | {cl['gemm']:.1f} | "
            f"{cl['attention']:.1f} | {cl['optimizer']:.1f} | {cl['other']:.1f} | {_f(m.get('head_ms'))} |")
    timed = [m for m in r["modes"] if not m.get("error")]
    if timed:  # what the classes do not show: the step's time outside kernels, and the spread of the timed steps
        lines += ["", "Step ms minus the profiled step's kernel time (time the GPU had no kernel to run, if the "
                      "kernels ran as fast in the timed steps) and the timed steps' range (min-max ms): " + "; ".join(
                          f"**{m['mode']}** " + (f"{m['step_ms'] - m['gpu_ms']:.1f}, " if m.get("kernels") else "")
                          + f"{min(m['step_ms_all']):.1f}-{max(m['step_ms_all']):.1f}" for m in timed) + "."]
    if any(m.get("head_ms") is not None for m in r["modes"]):
        lines += ["", "LM head ms: the final norm + LM head + loss alone on the step's shapes, forward, backward and "
                      "the update of the head and norm weights, the median of queued passes "
                      "(`coda.bench.step_head`)."]
    powered = [m for m in r["modes"] if not m.get("error") and m.get("power")]
    if powered:  # --power: the board's mean draw and SM clock over the timed steps (coda.bench.power)
        lines += ["", "Power while the timed steps ran (nvidia-smi, mean of its samples; the H100 caps the board at "
                      "700 W): " + "; ".join(
                          f"**{m['mode']}** {m['power']['w']:.0f} W at {m['power']['mhz']:.0f} MHz, "
                          f"{m['power']['w'] * m['step_ms'] * 1e-3:.1f} J a step"
                          for m in powered) + "."]
    phased = [m for m in r["modes"] if not m.get("error") and m.get("first_step_phases")]
    if phased:  # where the time to the first step went (seconds, from the mode's process start)
        lines += ["", "Time to the first step, by phase (s): " + "; ".join(
            f"**{m['mode']}** " + ", ".join(f"{k} {v:.1f}" for k, v in m["first_step_phases"].items())
            for m in phased) + "."]
    lines += ["", "GPU time per step from torch.profiler (kernel time, summed by class; the class rule is "
                  "`coda.bench.step_report.RULES`). Largest kernels of the *other* class:"]
    for m in r["modes"]:
        if m.get("error") or not m["top_other"]:
            continue
        lines += ["", f"**{m['mode']}** ({m['classes']['other']:.1f} ms):", "", "| ms/step | kernel |", "|---|---|"]
        lines += [f"| {ms:.2f} | `{name[:110].replace('|', '/')}` |" for name, ms in m["top_other"]]
    if image:
        lines += ["", f"![GPU time per step]({image})"]
    return "\n".join(lines) + "\n"


def plot_step(report: dict, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    r = summarize(report)
    modes = [m for m in r["modes"] if not m.get("error")]
    fig = Figure(figsize=(1.6 + 1.3 * len(modes), 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(111)
    colors = {"gemm": "#4c72b0", "attention": "#55a868", "optimizer": "#8172b2", "other": "#c44e52"}
    xs = range(len(modes))
    bottom = [0.0] * len(modes)
    for cls in CLASSES:
        vals = [m["classes"][cls] for m in modes]
        ax.bar(xs, vals, bottom=bottom, color=colors[cls], label=cls)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.scatter(xs, [m["step_ms"] for m in modes], marker="_", s=600, color="k", label="step (wall)", zorder=3)
    if r["sol"]:
        ax.axhline(r["sol"]["ms"], color="k", ls="--", lw=1, label=f"speed of light {r['sol']['ms']:.0f} ms")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([m["mode"] for m in modes], rotation=20, fontsize=8)
    ax.set_ylabel("ms per step")
    ax.set_title(f"{r['meta']['model']} on {r['meta'].get('device')}", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table_lines(markdown: str) -> list:
    """The modes table of a rendered report (its first markdown table): what ``coda.bench.step`` also prints, so
    that a log keeps the numbers when the report files do not come back from a remote run."""
    lines = markdown.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("| mode |")), len(lines))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def write_step_report(report: dict, out_dir: str, write_json: bool = True) -> list:
    """report.json (optional), report.md and step.png (when matplotlib is installed) into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    summarize(report)
    if write_json:
        p = os.path.join(out_dir, "report.json")
        with open(p + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(p + ".tmp", p)
        written.append(p)
    try:
        import matplotlib  # noqa: F401
        image = "step.png"
    except ImportError:
        image = None
    p = os.path.join(out_dir, "report.md")
    with open(p, "w") as f:
        f.write(render_markdown(report, image))
    written.append(p)
    if image:
        p = os.path.join(out_dir, image)
        plot_step(report, p)
        written.append(p)
    return written
