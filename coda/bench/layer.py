"""``python -m coda.bench.layer [--model llama-1b] [--batch 2] [--seq 4096]``: one decoder layer's forward + backward
(bf16, eager, the step report's model and shapes) in the variants that decide the fused step's eager layer time:
stock; fused as ``coda.fuse`` builds it; without the residuals moved into the MLP and the attention (the stock
layer forward and ``add_residual=False``); without the attention's only; with q, k, v as one QKV output split in
torch (``FusedAttention.qkv_apart = False``); with grouped-query k, v repeated before SDPA
(``FusedAttention.gqa_by_repeat``) instead of SDPA's ``enable_gqa``. Each: the median over ``--rounds``
interleaved rounds of a do_bench median, ms, on one GPU."""
from __future__ import annotations

import copy
import json
import statistics
import warnings


def main(argv=None) -> int:
    from .step import shape_parser
    ap = shape_parser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="also print each fused variant's kernels")
    args = ap.parse_args(argv)
    import torch

    import coda
    from coda.nn_attention import FusedAttention

    from .gemm import median_of_runs
    from . import step_report as SR
    from .step import PRESETS, build_model

    cfg = dict(PRESETS[args.model], layers=1)
    torch.manual_seed(0)
    model, _ = build_model(cfg, args.seq)
    model = model.to("cuda", torch.bfloat16)
    B, T, H = args.batch, args.seq, cfg["hidden"]
    x = torch.randn(B, T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(B, T, H, device="cuda", dtype=torch.bfloat16)
    d = SR.head_dim(cfg)
    inv = model.model.inv_freq.float()
    ang = torch.outer(torch.arange(T, device="cuda", dtype=torch.float32), inv)
    emb = torch.cat((ang, ang), -1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    assert cos.shape[-1] == d

    fused_model = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        coda.fuse(fused_model)
    stock, layer = model.model.layers[0], fused_model.model.layers[0]
    patched = layer.forward

    def variant(lyr, repeat=False, residual=True, attn_residual=True, apart=True):
        def step():
            FusedAttention.gqa_by_repeat, FusedAttention.qkv_apart = repeat, apart
            if lyr is layer:  # the residuals in the MLP and the attention (patched forward) or added by torch
                lyr.__dict__.pop("forward", None)
                if residual:
                    lyr.forward = patched
                lyr.mlp.add_residual = residual
                lyr.self_attn.add_residual = residual and attn_residual
            x.grad = None
            lyr(x, cos, sin).backward(dy)
        return step

    fns = {"stock": variant(stock), "fused": variant(layer), "fused, gqa by repeat": variant(layer, repeat=True),
           "fused, residual added by torch": variant(layer, residual=False),
           "fused, attention residual added by torch": variant(layer, attn_residual=False),
           "fused, q k v as one output (split's cat + 4 passes)": variant(layer, apart=False)}
    times = {k: [] for k in fns}
    for _ in range(args.rounds):  # interleaved: a clock drift hits every variant alike
        for k, f in fns.items():
            times[k].append(median_of_runs(f, runs=1))
    out = {k: round(statistics.median(v), 4) for k, v in times.items()}
    if args.profile:  # kernels by CUDA time per variant (3 steps each)
        from torch.profiler import ProfilerActivity, profile
        for k in ("fused", "fused, residual added by torch"):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fns[k]()
                torch.cuda.synchronize()
            print(f"== {k} (3 steps)\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                                                      max_name_column_width=70))
    variant(layer)()  # leave the layer as coda.fuse built it
    print(json.dumps({"device": torch.cuda.get_device_name(), "model": args.model, "batch": B, "seq": T,
                      "ms fwd+bwd per layer": out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
