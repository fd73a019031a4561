"""``ncu ... python -m coda.bench.expand_ncu CFG...``: the SwiGLU backward fused into da's GEMM (llama-1b: 8192 x
8192 x 2048) once per config ("tm,tn,pp,cm,sched,epi_n,stages"), each inside an NVTX range named by the config, for
Nsight Compute's counters (tensor-pipe activity, DRAM throughput) next to cuBLAS's plain da GEMM.

The run of session 22 (clocks not locked; ``python -m coda.bench.expand_ncu --table raw.csv`` prints its table)::

    C="128,256,coop,2,dynamic,16,- 64,256,pp,2,static,32,- 128,128,pp,1,static,32,- 128,128,coop,2,dynamic,32,-"
    INC="--nvtx-include cublas/"; for c in $C; do INC="$INC --nvtx-include $c/"; done
    ncu --clock-control none --nvtx $INC --kernel-name regex:"GemmSm90|gemm|nvjet|xmma" --metrics <METRICS, comma-
        separated> -o rep python -m coda.bench.expand_ncu $C
    ncu --import rep.ncu-rep --page raw --csv > raw.csv
"""
import sys

import torch

import coda
from coda.config import GemmConfig
from coda.ops.mlp import dacc_on_da


METRICS = {"time": "gpu__time_duration.sum",
           "tensor %": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
           "DRAM %": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
           "SMEM (LSU) %": "l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed",
           "stall long scoreboard": "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
           "stall barrier": "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"}


def parse_variant(text: str):
    """``"tm,tn,pp|coop,cm,static|dynamic,epi_n,stages|-[,ewg][,pfP]"`` -> GemmConfig (this module's and
    coda.bench.optim's config arguments; ``ewg``: the epilogue in the epilogue warps, ``epi_wg=True``; ``pfP``: the
    L2 prefetch of TileMN operands over the last P k-tiles, ``l2_prefetch=P``)."""
    tm, tn, pp, cm, sched, en, st, *rest = text.split(",")
    pf = [int(r[2:]) for r in rest if r.startswith("pf") and r[2:].isdigit()]
    if len(rest) != len(set(rest)) or len(rest) != rest.count("ewg") + len(pf):  # each one 'ewg' or a 'pfP'
        raise ValueError(f"config {text!r}: fields after the seventh can only be 'ewg' and 'pfP'")
    return GemmConfig(tile_m=int(tm), tile_n=int(tn), pingpong=pp == "pp", cluster_m=int(cm), sched=sched,
                      epi_n=int(en), stages=None if st == "-" else int(st), epi_wg="ewg" in rest,
                      l2_prefetch=pf[0] if pf else 0)


def table(raw_csv: str) -> str:
    """The markdown table of ``ncu --page raw --csv`` output of this run: one row per NVTX range (config)."""
    import csv
    import re
    rows = list(csv.reader(raw_csv.splitlines()))
    head, units = rows[0], rows[1]
    nvtx = next((c for c in head if c.startswith("thread Domain:Push/Pop_Range")), None)
    out = ["| range | " + " | ".join(METRICS) + " |", "|---" * (len(METRICS) + 1) + "|"]
    for r in rows[2:]:
        d, u = dict(zip(head, r)), dict(zip(head, units))
        names = re.findall(r"<default domain>:([^:\"]+):", d.get(nvtx, "")) if nvtx else []
        cells = [f"{d.get(m, '')} {u.get(m, '')}".strip() if k == "time" else d.get(m, "") for k, m in METRICS.items()]
        out.append(f"| {names[-1] if names else '?'} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv):
    if argv[:1] == ["--table"]:
        print(table(open(argv[1]).read()))
        return
    M, H, I = 8192, 2048, 8192
    bf = dict(device="cuda", dtype=torch.bfloat16)
    dy, wd, g, u = torch.randn(M, H, **bf), torch.randn(H, I, **bf), torch.randn(M, I, **bf), torch.randn(M, I, **bf)
    ops = dict(r=torch.rand(M, device="cuda") + 0.5, _preact_even=g, _preact_odd=u)
    prog = dacc_on_da((("out",), ("r",), False))
    cfgs = [(text, parse_variant(text)) for text in argv]
    for _, cfg in cfgs:  # compile and warm up outside the profiled ranges
        coda.gemm(dy, wd.t(), epilogue=prog, config=cfg, **ops)
    torch.mm(dy, wd)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("cublas")
    torch.mm(dy, wd)
    torch.cuda.nvtx.range_pop()
    for name, cfg in cfgs:
        torch.cuda.nvtx.range_push(name)
        coda.gemm(dy, wd.t(), epilogue=prog, config=cfg, **ops)
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
