"""``python -m coda.bench.layer [--model llama-1b] [--batch 2] [--seq 4096]``: one decoder layer's forward + backward
(bf16, eager, the step report's model and shapes) in the variants that decide the fused step's eager layer time:
stock; fused as ``coda.fuse`` builds it; without the residual moved into the MLP (the stock layer forward and
``add_residual=False``); with grouped-query k, v repeated before SDPA (``FusedAttention.gqa_by_repeat``) instead of
SDPA's ``enable_gqa``. Each: the median of do_bench medians (``bench.gemm.median_of_runs``), ms, on one GPU."""
from __future__ import annotations

import argparse
import copy
import json
import warnings


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args(argv)
    import torch

    import coda
    from coda.nn_attention import FusedAttention

    from .gemm import median_of_runs
    from .step import PRESETS, build_model

    cfg = dict(PRESETS[args.model], layers=1)
    torch.manual_seed(0)
    model, _ = build_model(cfg, args.seq)
    model = model.to("cuda", torch.bfloat16)
    B, T, H = args.batch, args.seq, cfg["hidden"]
    x = torch.randn(B, T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(B, T, H, device="cuda", dtype=torch.bfloat16)
    d = H // cfg["heads"]
    inv = model.model.inv_freq.float()
    ang = torch.outer(torch.arange(T, device="cuda", dtype=torch.float32), inv)
    emb = torch.cat((ang, ang), -1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    assert cos.shape[-1] == d

    def timed(layer):
        def step():
            x.grad = None
            layer(x, cos, sin).backward(dy)
        return round(median_of_runs(step), 4)

    out = {"stock": timed(model.model.layers[0])}
    fused_model = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        coda.fuse(fused_model)
    layer = fused_model.model.layers[0]
    out["fused"] = timed(layer)
    FusedAttention.gqa_by_repeat = True
    out["fused, gqa by repeat"] = timed(layer)
    FusedAttention.gqa_by_repeat = False
    patched = layer.__dict__.pop("forward")
    layer.mlp.add_residual = False
    out["fused, residual added by torch"] = timed(layer)
    layer.forward, layer.mlp.add_residual = patched, True
    print(json.dumps({"device": torch.cuda.get_device_name(), "model": args.model, "batch": B, "seq": T,
                      "ms fwd+bwd per layer": out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
