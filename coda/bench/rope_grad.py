"""``python -m coda.bench.rope_grad``: ``coda.kernels.rope_grad`` on the GPU -- its time against the four passes it
replaced and against a copy of the bytes it moves, and its host time per call (the GPU kept busy) with a cProfile of
its calls: where a memory-bound pass's launch spends its microseconds. H100, llama-1b shapes (session 24): 0.061 ms
(2475 GB/s) vs 0.309 ms for the four passes, a copy 0.055 ms; ~107 us of host time a call."""
from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch

from coda.kernels.rope_grad import rope_grad, rope_grad_bias


def host_us(fn, n: int = 50) -> float:
    """Host microseconds per call of ``fn`` while the GPU is busy (its launches only queue)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the GPU busy: what follows is the host's time alone
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def bench(M=8192, widths=(2048, 512, 512), head_dim=64) -> dict:
    """The kernel vs the four passes it replaced (cat of dq, dk, dv, the two
    deinterleaving copies + K = 0 un-rotation pass of ``ops.rope.unrotate``, the K = 0 row-dot pass) and vs a copy
    of the bytes it moves (reads dq, dk, dv, q, k, v; writes dacc), ms (do_bench medians, one process)."""
    from triton.testing import do_bench

    from coda.epilogues.rmsnorm import row_dot
    from coda.epilogues.rope import rope_freqs
    from coda.gemm import gemm
    from ops._common import epilogue_pass
    from ops.rope import unrotate
    dev, N = "cuda", sum(widths)
    g = torch.Generator(device=dev).manual_seed(0)
    big = torch.randn(M, N, generator=g, device=dev).to(torch.bfloat16)
    y = torch.randn(M, N, generator=g, device=dev).to(torch.bfloat16)
    grads, ys = big.split(widths, 1), y.split(widths, 1)
    pos = torch.arange(M, device=dev, dtype=torch.float32) % 4096
    fr = rope_freqs(head_dim, N // head_dim, rotary_heads=(widths[0] + widths[1]) // head_dim, device=dev)
    r = torch.rand(M, generator=g, device=dev) + 0.5

    def old():
        dy = torch.cat(grads, 1)
        return unrotate(gemm, dy, pos, fr), epilogue_pass(gemm, dy, M, N, epilogue=row_dot, dy=dy, y=y)["dot"]

    src = torch.empty(3 * M * N // 2, device=dev, dtype=torch.bfloat16)  # 3 M N bytes read and written: 6 M N
    dst = torch.empty_like(src)
    res = dict(M=M, widths=widths, kernel_ms=do_bench(lambda: rope_grad(grads, ys, pos, fr, r)),
               old_ms=do_bench(old), copy_ms=do_bench(lambda: dst.copy_(src)))
    bias = torch.randn(N, generator=g, device=dev)
    res["bias_ms"] = do_bench(lambda: rope_grad_bias(grads, ys, pos, fr, r, bias))  # Qwen2's variant
    res["gbps"] = 6 * M * N / res["kernel_ms"] / 1e6
    res["host_us"] = host_us(lambda: rope_grad(grads, ys, pos, fr, r))
    print(f"rope_grad {M} x {widths}: {res['kernel_ms']:.4f} ms ({res['gbps']:.0f} GB/s); the four passes "
          f"{res['old_ms']:.4f} ms; a copy of the same bytes {res['copy_ms']:.4f} ms; host {res['host_us']:.0f} us "
          f"a call; the bias variant {res['bias_ms']:.4f} ms")
    return res


def main() -> int:
    bench()
    from coda.epilogues.rope import rope_freqs
    M, widths, dev = 8192, (2048, 512, 512), "cuda"
    N = sum(widths)
    big = torch.randn(M, N, device=dev).to(torch.bfloat16)
    y = torch.randn(M, N, device=dev).to(torch.bfloat16)
    grads, ys = big.split(widths, 1), y.split(widths, 1)
    pos = torch.arange(M, device=dev, dtype=torch.float32)
    fr = rope_freqs(64, N // 64, rotary_heads=40, device=dev)
    r = torch.rand(M, device=dev) + 0.5
    call = lambda: rope_grad(grads, ys, pos, fr, r)  # noqa: E731
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
