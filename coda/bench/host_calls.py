"""``python -m coda.bench.host_calls``: the host time of one call of the fused attention's backward pieces (the GPU
kept busy, so only the host's work is timed) and a cProfile of ``coda.kernels.rope_grad.rope_grad``'s calls:
where a memory-bound pass's launch spends its microseconds."""
from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch


def host_us(fn, n: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the GPU busy: what follows is the host's time alone
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def main() -> int:
    from coda.epilogues.rope import rope_freqs
    from coda.kernels.rope_grad import rope_grad
    M, widths, dev = 8192, (2048, 512, 512), "cuda"
    N = sum(widths)
    big = torch.randn(M, N, device=dev).to(torch.bfloat16)
    y = torch.randn(M, N, device=dev).to(torch.bfloat16)
    grads, ys = big.split(widths, 1), y.split(widths, 1)
    pos = torch.arange(M, device=dev, dtype=torch.float32)
    fr = rope_freqs(64, N // 64, rotary_heads=40, device=dev)
    call = lambda: rope_grad(grads, ys, pos, fr, 1.0 / 2048)  # noqa: E731
    e = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    print(f"host us a call: rope_grad {host_us(call):.1f}, torch.empty {host_us(lambda: torch.empty_like(e)):.1f}, "
          f"a copy_ {host_us(lambda: e.copy_(big)):.1f}")
    torch.cuda._sleep(200_000_000)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(50):
        call()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    print(s.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
