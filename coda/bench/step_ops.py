"""``python -m coda.bench.step_ops [--model llama-1b] [--layers 2] [--fused/--stock] [--top 25]``: which torch ops
launch a training step's non-GEMM kernels. One step (forward with the loss, backward, optimizer) of a preset of
:mod:`coda.bench.step` -- with ``--layers`` fewer decoder layers (the per-layer ops are the same) -- under
torch.profiler, after two warm-up steps; prints the ops by self CUDA time with their input shapes, so that a copy or
an add in the step report's "other" class can be traced to the code that launched it."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--stock", action="store_true", help="the stock model (default: coda.fuse)")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from .step import PRESETS, build_model, make_batches
    cfg = dict(PRESETS[args.model], layers=args.layers)
    torch.manual_seed(0)
    model = build_model(cfg, args.seq)[0].to("cuda", torch.bfloat16)
    if not args.stock:
        import coda
        coda.fuse(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = make_batches(cfg["vocab"], args.batch, args.seq, 1, 1)[0].to("cuda")

    def step():
        model(ids, labels=ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()} {args.model} with {args.layers} layers, "
          f"{'stock' if args.stock else 'fused'}: ops by self CUDA time (one step)")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=args.top,
                                                             max_name_column_width=40,
                                                             max_shapes_column_width=70))
    return 0


if __name__ == "__main__":
    sys.exit(main())
