"""``python -m coda.bench.step_ops [--model llama-1b] [--layers 2] [--fused/--stock] [--top 25]``: which torch ops
launch a training step's non-GEMM kernels. One step (forward with the loss, backward, optimizer) of a preset of
:mod:`coda.bench.step` -- with ``--layers`` fewer decoder layers (the per-layer ops are the same) -- under
torch.profiler, after two warm-up steps; prints the ops by self CUDA time with their input shapes, so that a copy or
an add in the step report's "other" class can be traced to the code that launched it."""
from __future__ import annotations

import sys


def one_step(model: str, layers, batch: int, seq: int, *, stock: bool = False, compile: bool = False,
             device: str = "cuda", optimizer: str = "adamw-fused", graph: bool = False):
    """A function running one training step (forward with the loss, backward, fused AdamW) of a preset of
    :mod:`coda.bench.step` on the GPU in bf16 (``layers``: fewer decoder layers; None: the preset's), stock or
    ``coda.fuse``'d, optionally under torch.compile; shared by the step benchmarks that profile one step.
    ``optimizer``: "adamw-fused" (torch's), or "coda-adamw" (``coda.optim.AdamW``, fused models only: the step
    report's fused modes with ``--optimizer coda-adamw``). ``graph``: the step (forward, backward, update) captured
    whole in one CUDA graph after two eager steps on a side stream, as the step report's +graph modes; each call
    replays it."""
    import torch

    from .step import PRESETS, build_model, make_batches

    cfg = dict(PRESETS[model])
    if layers:
        cfg["layers"] = layers
    torch.manual_seed(0)
    m = build_model(cfg, seq)[0].to(device, torch.bfloat16)
    if not stock:
        import coda
        coda.fuse(m)
    fn = torch.compile(m) if compile else m
    if optimizer == "coda-adamw" and not stock:
        import coda.optim
        opt = coda.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.0, fused=True, capturable=graph)
    else:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True, capturable=graph)
    ids = make_batches(cfg["vocab"], batch, seq, 1, 1)[0].to(device)

    def eager():
        fn(ids, labels=ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step = eager
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                eager()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(ids, labels=ids).backward()
            opt.step()

        def step():
            g.replay()
    step.forward = lambda: fn(ids, labels=ids)  # the forward alone (coda.bench.step_host --forward)
    return step


def main(argv=None) -> int:
    from .step import shape_parser
    ap = shape_parser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--stock", action="store_true", help="the stock model (default: coda.fuse)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--optimizer", default="adamw-fused", choices=["adamw-fused", "coda-adamw"])
    ap.add_argument("--stack", type=int, default=0, help="group by this many Python frames (0: by input shapes)")
    args = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    step = one_step(args.model, args.layers, args.batch, args.seq, stock=args.stock, optimizer=args.optimizer)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
                 with_stack=args.stack > 0) as prof:
        step()
        torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()} {args.model} with {args.layers} layers, "
          f"{'stock' if args.stock else 'fused'}: ops by self CUDA time (one step)")
    avg = (prof.key_averages(group_by_stack_n=args.stack) if args.stack
           else prof.key_averages(group_by_input_shape=True))
    print(avg.table(sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=40,
                    max_shapes_column_width=70))
    return 0


if __name__ == "__main__":
    sys.exit(main())
