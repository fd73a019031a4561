"""What an epilogue costs: fused GEMM + epilogue vs CODA's plain GEMM vs cuBLAS, one process, interleaved.

``python -m coda.bench.epilogue [--shapes 8192x28672x4096,...] [--repeats 5] [--json FILE]``

Each repeat times every implementation once (triton ``do_bench`` median, L2 flushed before each run), in turn, so
a clock drift hits all of them alike; the table gives the median over repeats and the ratios to our plain GEMM of
the same shape (the issue-3 targets: ``bias_gelu`` within 3 %, a ``reduce_n`` epilogue within 5 %) and to cuBLAS.
Heuristic configs (no autotuning), bf16 in and out.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

import coda
from coda.epilogues.gated import swiglu
from coda.epilogues.scale_bias import ScaleBias
from coda.ops.mlp import residual_add

SHAPES = [(8192, 28672, 4096), (8192, 4096, 4096)]


@coda.epilogue
def bias_gelu(acc, bias: coda.VecN):
    return coda.gelu(acc + bias)


@coda.epilogue
def sumsq(acc):
    """The main output plus a per-row reduction (RMSNorm's sum of squares in a producer GEMM)."""
    return {"out": acc, "ss": coda.reduce_n(acc * acc, "sum")}


def operands(name: str, M: int, N: int, device="cuda") -> dict:
    """Fresh operands of epilogue ``name`` for an M x N accumulator."""
    return {"bias_gelu": lambda: {"bias": torch.randn(N, device=device)},
            "sumsq": dict,
            "scale_bias": lambda: {"scale": torch.rand(M, device=device) + 0.5, "bias": torch.randn(N, device=device)},
            "residual": lambda: {"res": torch.randn(M, N, device=device, dtype=torch.bfloat16)},
            "swiglu": dict}[name]()


# the library's own epilogues where it has one (scale + bias, the MLP's residual add, SwiGLU)
EPILOGUES = {"bias_gelu": bias_gelu, "sumsq": sumsq, "scale_bias": ScaleBias(), "residual": residual_add,
             "swiglu": swiglu}


def run(shapes=SHAPES, repeats: int = 5) -> list:
    from triton.testing import do_bench
    rows = []
    for M, N, K in shapes:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 64
        fns = {"cublas": lambda: torch.mm(a, b.t()), "identity": lambda: coda.gemm(a, b)}
        for name, epi in EPILOGUES.items():
            ops = operands(name, M, N)
            fns[name] = lambda epi=epi, ops=ops: coda.gemm(a, b, epilogue=epi, **ops)
        for f in fns.values():  # compile / load every kernel before timing
            f()
        torch.cuda.synchronize()
        times = {k: [] for k in fns}
        for _ in range(repeats):
            for k, f in fns.items():
                times[k].append(do_bench(f, warmup=25, rep=100))
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"shape": f"{M}x{N}x{K}", "ms": med,
               "vs_ours": {k: med[k] / med["identity"] for k in med},
               "vs_cublas": {k: med[k] / med["cublas"] for k in med}}
        rows.append(row)
        print(f"{row['shape']}: " + ", ".join(f"{k} {med[k]:.3f} ms (x{row['vs_ours'][k]:.3f} ours, "
                                             f"x{row['vs_cublas'][k]:.3f} cuBLAS)" for k in med), flush=True)
    return rows


def table(rows) -> str:
    names = list(rows[0]["ms"])
    lines = ["| shape | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for r in rows:
        lines.append(f"| {r['shape']} (ms) | " + " | ".join(f"{r['ms'][k]:.3f}" for k in names) + " |")
        lines.append("| / our plain GEMM | " + " | ".join(f"{r['vs_ours'][k]:.3f}" for k in names) + " |")
        lines.append("| / cuBLAS | " + " | ".join(f"{r['vs_cublas'][k]:.3f}" for k in names) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=None, help="MxNxK,MxNxK,...")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    shapes = SHAPES if not args.shapes else [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows = run(shapes, args.repeats)
    print(f"\n{torch.cuda.get_device_name()}\n" + table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
