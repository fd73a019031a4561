"""CPU micro-benchmark of ``coda.gemm``'s per-call host work, without a GPU: ``python -m coda.bench.launch``.

The kernel is compiled for sm_90a on the CPU (through the same compile cache ``coda.gemm`` uses) with CPU tensors
standing in for the GPU ones, and a launch plan is built exactly as ``coda.gemm`` builds it, then registered in
``coda.gemm``'s plan cache with its host-function call replaced by a no-op and the stream query by a constant.
What is timed is then ``coda.gemm``'s own repeated-call path up to (not including) the C launch function, next to
what the first-call path does per call (the cute tensors via ``from_dlpack`` and the DSL's argument marshalling).

Not measured here (GPU only): the compiled host function itself (TMA descriptor encoding + ``cudaLaunchKernelEx``),
``torch.empty`` on CUDA for the output, and the real stream query (``torch._C._cuda_getCurrentRawStream``).
"""
from __future__ import annotations

import argparse
import importlib
import time

import torch

from .. import _launch
from .._validate import check_gemm_args
from ..config import GemmConfig
from coda.epilogues.scale_bias import ScaleBiasSumsq

from ..kernels.epilogue import IDENTITY

gemm_mod = importlib.import_module("coda.gemm")  # the module (``coda.gemm`` the attribute is the function)
FAKE_STREAM = 0x5EED


def cpu_plan(a, b, out, epi=None, cfg=GemmConfig(), operands=None, max_clusters=66):
    """``(plan_key, plan, cute_args, views, leads)`` for a CPU call, built by ``coda.gemm``'s own helpers; the kernel is
    compiled for sm_90a (CPU-only machines can compile, not run)."""
    import cuda.bindings.driver as cuda

    from coda.autotune import compile_cache
    operands = dict(operands or {})
    e = epi if epi is not None else IDENTITY
    prob = check_gemm_args(a, b, out=out)
    res, key, views, leads, _, _ = gemm_mod._kernel_views(prob, e, cfg, a, b, out, operands)
    ts = [gemm_mod._cute(v, lead) for v, lead in zip(views, leads)]
    cute_args = [*ts[:3], cuda.CUstream(FAKE_STREAM), *ts[3:]]
    fn, _ = compile_cache.compile_kernel(cfg, e, prob.in_dtype, prob.out_dtype, key[-1], cute_args, max_clusters,
                                         "sm_90a", options="--gpu-arch=sm_90a")
    plan = gemm_mod._make_plan(fn, cute_args, views, FAKE_STREAM, prob, cfg, e, (a, b, out), 0, operands)
    if plan is None:
        raise _launch.PlanError("the plan did not match the DSL's marshalling")
    return gemm_mod._plan_key(a, b, epi, out, None, cfg, operands), plan, cute_args, views, leads


class NullRun:
    """Stands in for the compiled host function: counts calls and keeps the last argument list."""

    def __init__(self):
        self.calls, self.last = 0, None

    def __call__(self, exe_args):
        self.calls += 1
        self.last = exe_args


def per_call_us(fn, n: int) -> float:
    for _ in range(min(200, n)):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args(argv)
    M, N, K = 512, 1024, 256
    a = torch.randn(M, K, dtype=torch.bfloat16)
    b = torch.randn(N, K, dtype=torch.bfloat16)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    ops = {"scale": torch.rand(M), "bias": torch.randn(N)}
    saved = _launch.stream_handle
    _launch.stream_handle = lambda index: FAKE_STREAM
    try:
        rows = []
        for epi, kw in ((None, {}), (ScaleBiasSumsq(), ops)):
            t0 = time.perf_counter()
            pkey, plan, cute_args, views, leads = cpu_plan(a, b, out, epi, operands=kw)
            t_build = time.perf_counter() - t0
            plan.run = NullRun()
            gemm_mod._plans[pkey] = plan
            cfg = plan.cfg

            def fast():
                return gemm_mod.gemm(a, b, epilogue=epi, out=out, config=cfg, **kw)

            assert fast() is not None and plan.run.calls == 1, "the repeated call did not take the plan"
            t_fast = per_call_us(fast, args.n)
            t_key = per_call_us(lambda: gemm_mod._plan_key(a, b, epi, out, None, cfg, kw), args.n)
            t_check = per_call_us(lambda: check_gemm_args(a, b, out=out), args.n // 4)

            def old_marshal():  # what the first-call path does per call on top of the checks
                ts = [gemm_mod._cute(v, lead) for v, lead in zip(views, leads)]
                return plan.fn.generate_execution_args(*ts[:3], cute_args[3], *ts[3:])

            t_old = per_call_us(old_marshal, args.n // 4)
            rows.append((epi.name if epi else "identity", t_fast, t_key, t_check, t_old, t_build))
            del gemm_mod._plans[pkey]
    finally:
        _launch.stream_handle = saved
    print(f"{'epilogue':26s} {'plan path us':>12s} {'(key us)':>9s} {'checks us':>10s} {'from_dlpack+marshal us':>23s}"
          f" {'plan build s':>12s}")
    for name, f, k, c, o, bt in rows:
        print(f"{name:26s} {f:12.2f} {k:9.2f} {c:10.2f} {o:23.2f} {bt:12.2f}")
    print("plan path = coda.gemm's repeated call minus the C launch function (see the module docstring); "
          "the first-call path pays checks + from_dlpack/marshalling + launch on every call without a plan.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
