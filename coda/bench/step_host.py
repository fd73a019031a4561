"""``python -m coda.bench.step_host [--model llama-1b] [--layers N] [--optimizer coda-adamw]``: is a training step
paced by the host? One preset step (:func:`coda.bench.step_ops.one_step`) timed three ways, after three warm-up
steps: its GPU time (CUDA events around back-to-back steps), its host time when the GPU never waits (the step's
launches queued behind ``torch.cuda._sleep``: the time until ``step()`` returns), and a cProfile of one step
(autograd's worker threads off, so the backward's Python runs on the profiled thread) by total time per function.
A host time near or above the GPU time means idle GPU stretches that faster kernels cannot recover."""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time


def main(argv=None) -> int:
    from .step import shape_parser
    ap = shape_parser()
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    ap.add_argument("--stock", action="store_true", help="the stock model (default: coda.fuse)")
    ap.add_argument("--optimizer", default="coda-adamw", choices=["adamw-fused", "coda-adamw"])
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--forward", action="store_true", help="time and profile the forward (with the loss) alone")
    args = ap.parse_args(argv)
    import torch

    from .step_ops import one_step
    step = one_step(args.model, args.layers, args.batch, args.seq, stock=args.stock, optimizer=args.optimizer)
    for _ in range(3):
        step()
    if args.forward:
        step = step.forward
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        step()
    b.record()
    b.synchronize()
    gpu_ms = a.elapsed_time(b) / 5
    hosts = []
    for _ in range(3):
        torch.cuda._sleep(int(1.5e9))  # ~1 s of GPU time queued first: the step's launches never wait
        t0 = time.perf_counter()
        step()
        hosts.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    torch.autograd.set_multithreading_enabled(False)
    torch.cuda._sleep(int(1.5e9))
    pr = cProfile.Profile()
    pr.enable()
    step()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.top)
    pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(args.top)
    print(f"{torch.cuda.get_device_name()} {args.model} {'stock' if args.stock else 'fused'} ({args.optimizer}): "
          f"GPU {gpu_ms:.1f} ms a step, host {min(hosts):.1f} ms a step (GPU backlogged; {hosts})")
    print(s.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
