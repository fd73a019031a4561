"""Speed-of-light benchmark report: ``python -m coda.bench [--ops ...] [--shapes ...] [--dtype ...] [--out DIR]``.

One run on a Hopper GPU measures, in this order:

1. the machine's ceilings: dense GEMM peak (cuBLAS ``torch.mm`` and ``coda.gemm`` at 8192^3; the better one is the
   peak) and device-memory bandwidth (a 2 GiB device-to-device copy, read + write bytes);
2. every registered op and shape (see :data:`REGISTRY`): its FLOPs and minimal bytes, the speed-of-light time
   max(FLOPs / GEMM peak, bytes / bandwidth), and for each implementation -- ``coda``, ``cublas`` (the plain
   ``torch.mm`` GEMM(s) of the same shapes), ``eager`` (torch eager) and ``compile`` (``torch.compile`` of the eager
   function) -- the median time, TFLOP/s, GB/s, % of SoL, the spread over repeats, and the peak extra memory.
   Where the op's result is well defined, each implementation's output is compared with the reference's.

Timing: ``triton.testing.do_bench`` (median and quartiles, after warm-up), repeated ``--repeats`` times with the
implementations interleaved inside each repeat, so that slow drift (clocks, temperature) hits all of them alike.
do_bench flushes L2 before every timed run (it overwrites a 256 MB buffer); ``--l2-cold`` in addition rotates the
inputs over several fresh copies (together > 2x L2) so that no call reads the buffers of the call before it.

It writes ``report.json``, ``report.md``, ``sol.png`` and ``roofline.png`` into ``--out`` (rendering:
:mod:`coda.bench.report`); ``--from report.json`` re-renders a saved report anywhere, without a GPU.

Ops are registered in one place (:func:`register`). The transformer ops of ``coda.ops`` are registered here too, but
only measured when ``coda.ops`` provides the function; the others are listed as skipped, with the reason.

The package: this module is the speed-of-light report's ops and measurement, its command line is
``coda/bench/__main__.py``; the other benchmarks are its submodules, each a ``python -m`` command of its own:
:mod:`coda.bench.report` (rendering), :mod:`coda.bench.step` and :mod:`coda.bench.step_report` (the training-step
report, ``python -m coda.bench --model``), :mod:`coda.bench.gemm`, :mod:`coda.bench.epilogue`,
:mod:`coda.bench.launch`, :mod:`coda.bench.ncu` and :mod:`coda.bench.ce`.
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import importlib
import importlib.util
import math
import os
import platform
import subprocess
import time
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from . import report as R
from coda.epilogues.scale_bias import ScaleBias, ScaleBiasSumsq

IMPLS = R.IMPLS
GEMM_SHAPES = ((8192, 8192, 8192), (8192, 4096, 4096), (8192, 28672, 4096), (8192, 4096, 14336),
               (8192, 128256, 4096))
EPILOGUE_SHAPES = ((8192, 8192, 8192), (8192, 4096, 4096), (8192, 28672, 4096))
LLAMA3_8B = dict(M=8192, H=4096, I=14336, V=128256)  # tokens per step M, hidden H, MLP I, vocabulary V
PEAK_SHAPE = (8192, 8192, 8192)
COPY_BYTES = 2 * 2**30        # bandwidth ceiling: one 2 GiB buffer copied into another
ROTATE_BUDGET = 8 * 2**30     # --l2-cold: at most this many bytes of rotated input copies per op and shape
MAX_SETS = 8
DEFAULT_L2 = 50 * 2**20


# -- epilogues of the fused-GEMM ops ----------------------------------------------------------------------------
SCALE_BIAS, SCALE_BIAS_SUMSQ = ScaleBias(), ScaleBiasSumsq()


# -- the registry ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One benchmarked op in one mode. FLOPs and bytes are derived from what is declared here:

    - ``gemms(shape)``: the forward GEMMs as (M, N, K) problems of ``a @ b.T``; FLOPs = sum 2MNK, and forward +
      backward adds each GEMM's data gradient (M, K, N) and weight gradient (N, K, M);
    - bytes: every tensor of ``make_inputs`` read once and every output of ``eager`` written once (counted on the
      meta device, i.e. exactly the tensors benchmarked); forward + backward adds the gradient of the (first)
      output, read once, and the gradients of ``grad_inputs``, written once.
    """
    op: str
    mode: str                                   # "fwd" | "fwd+bwd"
    params: tuple                               # shape parameter names, e.g. ("M", "N", "K")
    shapes: tuple                               # default shapes, tuples in ``params`` order
    gemms: Callable[[dict], list]
    make_inputs: Callable[..., dict]            # (shape, dtype, device) -> named inputs (tensors, python scalars)
    eager: Callable[[dict], Any]                # inputs -> output tensor (or dict of tensors)
    coda: Callable[[dict], Any]
    requires: Optional[str] = None              # the function of coda.ops that ``coda`` calls
    grad_inputs: tuple = ()                     # fwd+bwd: the inputs whose gradients are computed
    impls: tuple = IMPLS
    compare: bool = True                        # outputs comparable with the reference implementation
    cublas_complete: bool = False               # the op *is* the plain GEMM (cuBLAS computes all of it)
    description: str = ""

    @property
    def key(self) -> str:
        return f"{self.op}.{self.mode}"

    @property
    def reference(self) -> str:
        return "cublas" if self.cublas_complete else "eager"

    def shape_dicts(self) -> list:
        return [dict(zip(self.params, s)) for s in self.shapes]

    def gemm_list(self, shape: dict) -> list:
        fwd = [tuple(int(x) for x in g) for g in self.gemms(shape)]
        if self.mode == "fwd":
            return fwd
        return [p for m, n, k in fwd for p in ((m, n, k), (m, k, n), (n, k, m))]

    def flops(self, shape: dict) -> int:
        return sum(2 * m * n * k for m, n, k in self.gemm_list(shape))

    def nbytes(self, shape: dict, dtype: torch.dtype) -> int:
        inp = self.make_inputs(shape, dtype, "meta")
        outs = tensors(self.eager(inp))
        n = sum(_nb(t) for t in tensors(inp)) + sum(_nb(t) for t in outs)
        if self.mode == "fwd+bwd":
            n += _nb(outs[0]) + sum(_nb(inp[k]) for k in self.grad_inputs)
        return n


REGISTRY: list = []


def register(spec: OpSpec) -> OpSpec:
    """Add an op to the benchmark (the one place where ops are declared)."""
    if spec.mode not in ("fwd", "fwd+bwd"):
        raise ValueError(f"{spec.op}: mode must be 'fwd' or 'fwd+bwd', got {spec.mode!r}")
    if any(s.key == spec.key for s in REGISTRY):
        raise ValueError(f"op {spec.key!r} is already registered")
    if set(spec.impls) - set(IMPLS):
        raise ValueError(f"{spec.key}: unknown implementations {sorted(set(spec.impls) - set(IMPLS))}")
    if spec.mode == "fwd+bwd" and (not spec.grad_inputs or spec.cublas_complete):
        raise ValueError(f"{spec.key}: forward+backward needs grad_inputs and a non-GEMM op")
    if not spec.shapes or any(len(s) != len(spec.params) for s in spec.shapes):
        raise ValueError(f"{spec.key}: default shapes must have one value per parameter {spec.params}")
    REGISTRY.append(spec)
    return spec


def register_op(op: str, modes=("fwd", "fwd+bwd"), **kw) -> None:
    for mode in modes:
        register(OpSpec(op=op, mode=mode, **kw))


def tensors(obj) -> list:
    """The tensors of an output or input structure (tensor, dict, list/tuple), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors(v)]
    return []


def _nb(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _randn(shape, dtype, device, scale=1.0):
    t = torch.randn(shape, dtype=dtype, device=device)
    return t.mul_(scale) if scale != 1.0 else t


def _coda_ops(name: str):
    return getattr(importlib.import_module("coda.ops"), name)


def _gemm_inputs(s, dtype, device):
    return {"a": _randn((s["M"], s["K"]), dtype, device), "b": _randn((s["N"], s["K"]), dtype, device, s["K"] ** -0.5)}


def _coda_gemm(inp, **kw):
    import coda
    return coda.gemm(inp["a"], inp["b"], **kw)


register_op("gemm", modes=("fwd",), params=("M", "N", "K"), shapes=GEMM_SHAPES,
            gemms=lambda s: [(s["M"], s["N"], s["K"])], make_inputs=_gemm_inputs,
            eager=lambda i: torch.mm(i["a"], i["b"].T), coda=_coda_gemm, impls=("coda", "cublas", "compile"), cublas_complete=True,
            description="Plain GEMM `a @ b.T` (a: M x K, b: N x K); cuBLAS `torch.mm` is the whole op (torch "
                        "eager would be the same call).")


def _epi_inputs(s, dtype, device):
    inp = _gemm_inputs(s, dtype, device)
    inp["scale"] = torch.rand(s["M"], dtype=torch.float32, device=device).add_(0.5)
    inp["bias"] = torch.randn(s["N"], dtype=torch.float32, device=device)
    return inp


def _eager_scale_bias(inp):
    y = torch.mm(inp["a"], inp["b"].T)
    return y * inp["scale"][:, None].to(y.dtype) + inp["bias"].to(y.dtype)


def _eager_scale_bias_sumsq(inp):
    y = _eager_scale_bias(inp)
    return {"out": y, "sumsq": y.float().square().sum(-1)}


_EPI = dict(modes=("fwd",), params=("M", "N", "K"), shapes=EPILOGUE_SHAPES, gemms=lambda s: [(s["M"], s["N"], s["K"])],
            make_inputs=_epi_inputs)
register_op("gemm_scale_bias", eager=_eager_scale_bias,
            coda=lambda i: _coda_gemm(i, epilogue=SCALE_BIAS, scale=i["scale"], bias=i["bias"]),
            description="Fused GEMM + epilogue: `y = (a @ b.T) * scale[row] + bias[col]` (scale, bias fp32).", **_EPI)
register_op("gemm_scale_bias_sumsq", eager=_eager_scale_bias_sumsq,
            coda=lambda i: _coda_gemm(i, epilogue=SCALE_BIAS_SUMSQ, scale=i["scale"], bias=i["bias"]),
            description="Fused GEMM + epilogue with a row reduction: y as in gemm_scale_bias, plus "
                        "`sumsq = (y * y).sum(-1)` (fp32).", **_EPI)


# -- transformer ops of coda.ops (Llama-3-8B dims) ------------------------------------------------------------------
def _rmsnorm(x, weight, eps):
    """Llama/HF RMSNorm: normalise in fp32, cast back, scale by the weight."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def _norm_weight(n, dtype, device):
    return _randn((n,), dtype, device, 0.1).add_(1.0)


def _rmsnorm_linear_inputs(s, dtype, device):
    return {"x": _randn((s["M"], s["H"]), dtype, device), "norm_weight": _norm_weight(s["H"], dtype, device),
            "weight": _randn((s["N"], s["H"]), dtype, device, s["H"] ** -0.5), "eps": 1e-5}


def _glu_inputs(s, dtype, device):
    return {"x": _randn((s["M"], s["H"]), dtype, device),
            "weight": _randn((2 * s["I"], s["H"]), dtype, device, s["H"] ** -0.5)}


def _glu(h, act=F.silu):
    g, u = h.chunk(2, dim=-1)
    return act(g) * u


def _ce_inputs(s, dtype, device):
    return {"x": _randn((s["M"], s["H"]), dtype, device),
            "weight": _randn((s["V"], s["H"]), dtype, device, s["H"] ** -0.5),
            "target": torch.randint(0, s["V"], (s["M"],), dtype=torch.int64, device=device)}


def _mlp_inputs(s, dtype, device):
    return {"x": _randn((s["M"], s["H"]), dtype, device), "norm_weight": _norm_weight(s["H"], dtype, device),
            "w_gate_up": _randn((2 * s["I"], s["H"]), dtype, device, s["H"] ** -0.5),
            "w_down": _randn((s["H"], s["I"]), dtype, device, s["I"] ** -0.5), "eps": 1e-5}


def _mlp_eager(i):
    h = _rmsnorm(i["x"], i["norm_weight"], i["eps"])
    return i["x"] + F.linear(_glu(F.linear(h, i["w_gate_up"])), i["w_down"])


# The coda callables follow the signatures of the ops issue; if coda.ops lands with other ones, adapt them here.
_LLAMA = LLAMA3_8B
register_op("rmsnorm_linear", params=("M", "H", "N"), shapes=((_LLAMA["M"], _LLAMA["H"], 2 * _LLAMA["I"]),),
            gemms=lambda s: [(s["M"], s["N"], s["H"])], make_inputs=_rmsnorm_linear_inputs,
            eager=lambda i: F.linear(_rmsnorm(i["x"], i["norm_weight"], i["eps"]), i["weight"]),
            coda=lambda i: _coda_ops("rmsnorm_linear")(i["x"], i["norm_weight"], i["weight"], i["eps"]),
            requires="rmsnorm_linear", grad_inputs=("x", "norm_weight", "weight"),
            description="`rmsnorm_linear(x, norm_weight, weight, eps)` = RMSNorm(x) @ weight.T; x: M x H, weight: "
                        "N x H (default N = 2I: the norm before the MLP's gate/up projection).")
for _name, _act in (("linear_swiglu", F.silu), ("linear_geglu", F.gelu)):
    register_op(_name, params=("M", "H", "I"), shapes=((_LLAMA["M"], _LLAMA["H"], _LLAMA["I"]),),
                gemms=lambda s: [(s["M"], 2 * s["I"], s["H"])], make_inputs=_glu_inputs,
                eager=lambda i, act=_act: _glu(F.linear(i["x"], i["weight"]), act),
                coda=lambda i, name=_name: _coda_ops(name)(i["x"], i["weight"]), requires=_name,
                grad_inputs=("x", "weight"), compare=False,
                description=f"`{_name}(x, weight)` = {_act.__name__}(gate) * up of x @ weight.T; weight: 2I x H "
                            "(outputs not compared: CODA interleaves the gate/up rows, the weight layout is its own).")
for _name, _mode, _what in (
        ("linear_cross_entropy", {}, "the default mode (the memory budget's choice: here the fast one, the gradients "
         "formed in the forward through a <= 1 GB chunk); torch eager materialises the M x V logits."),
        ("linear_cross_entropy_lean", {"mode": "lean"}, "the lean mode: no logits stored (the backward recomputes "
         "them chunk by chunk: four GEMMs, <= 0.1 GB extra).")):
    register_op(_name, params=("M", "H", "V"), shapes=((_LLAMA["M"], _LLAMA["H"], _LLAMA["V"]),),
                gemms=lambda s: [(s["M"], s["V"], s["H"])], make_inputs=_ce_inputs,
                eager=lambda i: F.cross_entropy(F.linear(i["x"], i["weight"]).float(), i["target"]),
                coda=lambda i, kw=_mode: _coda_ops("linear_cross_entropy")(i["x"], i["weight"], i["target"], **kw),
                requires="linear_cross_entropy", grad_inputs=("x", "weight"),
                description="`linear_cross_entropy(x, weight, target)`: mean cross entropy of the LM head logits "
                            "x @ weight.T (weight: V x H), " + _what)
register_op("mlp", params=("M", "H", "I"), shapes=((_LLAMA["M"], _LLAMA["H"], _LLAMA["I"]),),
            gemms=lambda s: [(s["M"], 2 * s["I"], s["H"]), (s["M"], s["H"], s["I"])], make_inputs=_mlp_inputs,
            eager=_mlp_eager,
            coda=lambda i: _coda_ops("mlp")(i["x"], i["norm_weight"], i["w_gate_up"], i["w_down"], i["eps"]),
            requires="mlp", grad_inputs=("x", "norm_weight", "w_gate_up", "w_down"), compare=False,
            description="`mlp(x, norm_weight, w_gate_up, w_down, eps)` = x + down(SwiGLU(gate_up(RMSNorm(x)))) "
                        "(the Llama MLP sub-block; outputs not compared: weight layout is the op's own).")


def unavailable(spec: OpSpec) -> Optional[str]:
    """Why ``spec`` cannot be measured in this process (None: it can)."""
    if spec.requires is None:
        return None
    try:
        mod = importlib.import_module("coda.ops")
    except Exception as e:  # a broken coda.ops skips its ops, nothing else
        return f"`coda.ops` failed to import ({type(e).__name__}: {e})"
    if getattr(mod, spec.requires, None) is None:
        return f"`coda.ops` has no `{spec.requires}` (not implemented yet)"
    return None


# -- measurement ----------------------------------------------------------------------------------------------------
def cuda_timer(fn, warmup_ms, rep_ms):
    """(q25, median, q75) ms of ``fn`` by triton.testing.do_bench (which flushes L2 before every timed run)."""
    from triton.testing import do_bench
    try:
        return tuple(float(x) for x in do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.25, 0.5, 0.75]))
    except TypeError:  # a triton without ``quantiles``: all the times
        return R.quantiles(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all"), (0.25, 0.5, 0.75))


@dataclasses.dataclass
class Runner:
    """How to measure: device, dtype, implementations, repeats, timer (``(fn, warmup_ms, rep_ms) -> quartiles``)."""
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    impls: tuple = IMPLS
    repeats: int = 5
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    l2_cold: bool = False
    compile_mode: str = "default"
    timer: Optional[Callable] = None
    log: Callable = print

    @property
    def cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn, est_ms: float = 0.0):
        """Quartiles of ``fn``'s time; slow calls get a longer budget (>= 2 warm-up and >= 10 timed runs)."""
        return (self.timer or cuda_timer)(fn, max(self.warmup_ms, 2 * est_ms), max(self.rep_ms, 10 * est_ms))

    def n_sets(self, set_bytes: int) -> int:
        """Copies of the inputs to rotate over: 1, or with --l2-cold enough to exceed 2x L2 (budget permitting)."""
        if not self.l2_cold:
            return 1
        l2 = DEFAULT_L2
        if self.cuda:
            l2 = getattr(torch.cuda.get_device_properties(torch.device(self.device)), "L2_cache_size", 0) or l2
        n = math.ceil(2 * l2 / max(set_bytes, 1)) + 1
        return max(2, min(n, MAX_SETS, ROTATE_BUDGET // max(set_bytes, 1)))

    def memory(self, call, keep: set) -> dict:
        """Peak memory of one call above what was allocated before it; 'extra' also leaves out the returned
        tensors (those not sharing storage with ``keep``, the input storages)."""
        if not self.cuda:
            t0 = time.perf_counter()
            call()
            return {"probe_ms": (time.perf_counter() - t0) * 1e3}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        out = call()
        torch.cuda.synchronize()
        probe_ms = (time.perf_counter() - t0) * 1e3
        peak = torch.cuda.max_memory_allocated() - base
        seen, ret = set(), 0
        for t in tensors(out):
            st = t.untyped_storage()
            if st.data_ptr() not in keep and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                ret += st.nbytes()
        del out
        return {"peak_mem_bytes": int(peak), "extra_mem_bytes": int(max(0, peak - ret)), "probe_ms": probe_ms}


class Rotation:
    """Cycles through input sets: each call of the benchmarked function reads the next copy."""

    def __init__(self, sets):
        self.sets, self.i = sets, -1

    def __call__(self):
        self.i = (self.i + 1) % len(self.sets)
        return self.sets[self.i]


def build_inputs(spec: OpSpec, shape: dict, dtype, device) -> dict:
    inp = spec.make_inputs(shape, dtype, device)
    if spec.mode == "fwd+bwd":
        for k in spec.grad_inputs:
            inp[k].requires_grad_(True)
        out = tensors(spec.eager(spec.make_inputs(shape, dtype, "meta")))[0]
        inp["dout"] = torch.randn(out.shape, dtype=out.dtype, device=device)
    return inp


def cublas_inputs(gemms: list, dtype, device) -> dict:
    return {"pairs": [(_randn((m, k), dtype, device), _randn((n, k), dtype, device, k ** -0.5)) for m, n, k in gemms]}


def cublas_gemms(inp) -> list:
    """The op's GEMM problems alone, each as cuBLAS ``torch.mm(a, b.T)`` (the layout coda.gemm takes)."""
    return [torch.mm(a, b.T) for a, b in inp["pairs"]]


def with_backward(fwd: Callable, grad_inputs: tuple) -> Callable:
    """forward, then the gradients of ``grad_inputs`` for the output gradient ``dout`` (of the first output)."""
    def run(inp):
        out = tensors(fwd(inp))[0]
        dout = inp["dout"] if inp["dout"].dtype == out.dtype else inp["dout"].to(out.dtype)
        grads = torch.autograd.grad(out, [inp[k] for k in grad_inputs], grad_outputs=dout)
        return (out.detach(), *grads)
    return run


def impl_function(spec: OpSpec, impl: str, compile_mode: str = "default") -> Callable:
    """inputs -> outputs for one implementation (forward+backward wrapped, except the cuBLAS GEMMs)."""
    if impl == "cublas":
        return spec.eager if spec.cublas_complete else cublas_gemms
    if impl == "coda":
        fwd = spec.coda
    elif impl == "eager":
        fwd = spec.eager
    elif impl == "compile":
        fwd = torch.compile(spec.eager, dynamic=False, mode=None if compile_mode == "default" else compile_mode)
    else:
        raise ValueError(f"unknown implementation {impl!r}")
    return fwd if spec.mode == "fwd" else with_backward(fwd, spec.grad_inputs)


def compare(out, ref) -> dict:
    """Relative Frobenius error of each output against the reference (the largest), computed in chunks."""
    a, b = tensors(out), tensors(ref)
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return {"rel_err": None, "compare_note": f"not compared: outputs {[tuple(x.shape) for x in a]} vs "
                                                 f"reference {[tuple(y.shape) for y in b]}"}
    worst = 0.0
    for x, y in zip(a, b):
        x, y = x.detach().reshape(-1), y.detach().reshape(-1)
        num = den = 0.0
        for i in range(0, x.numel(), 1 << 26):
            xs, ys = x[i:i + (1 << 26)].double(), y[i:i + (1 << 26)].double()
            num += (xs - ys).square().sum().item()
            den += ys.square().sum().item()
        err = math.sqrt(num / den) if den > 0 else math.sqrt(num)
        if not math.isfinite(err):
            return {"rel_err": None, "mismatch": True, "compare_note": "non-finite values"}
        worst = max(worst, err)
    return {"rel_err": worst}


def _err(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


def _free(run: Runner):
    gc.collect()
    if run.cuda:
        torch.cuda.empty_cache()


def measure_case(spec: OpSpec, shape: dict, run: Runner) -> dict:
    """Measure every implementation of one op at one shape; failures are recorded, never fatal."""
    case = dict(op=spec.op, mode=spec.mode, key=spec.key, shape=dict(shape), flops=spec.flops(shape),
                bytes=spec.nbytes(shape, run.dtype), gemms=[list(g) for g in spec.gemm_list(shape)],
                cublas_complete=spec.cublas_complete, description=spec.description, impls={})
    impls = sorted((k for k in run.impls if k in spec.impls), key=lambda k: k != spec.reference)
    if run.cuda:
        torch._dynamo.reset()  # each case compiles afresh (and never hits the recompile limit)
    try:
        sets = [build_inputs(spec, shape, run.dtype, run.device)]
        case["n_sets"] = run.n_sets(sum(_nb(t) for t in tensors(sets[0])))
        sets += [build_inputs(spec, shape, run.dtype, run.device) for _ in range(case["n_sets"] - 1)]
        sources = {"op": sets}
        if "cublas" in impls and not spec.cublas_complete:
            g = spec.gemm_list(shape)
            sources["gemms"] = [cublas_inputs(g, run.dtype, run.device) for _ in range(case["n_sets"])]
    except Exception as e:  # e.g. out of memory: every implementation is reported as failed
        sets = sources = None
        _free(run)
        case["impls"] = {k: {"error": f"creating the inputs failed: {_err(e)}"} for k in impls}
        run.log(f"    FAILED creating the inputs: {_err(e)}")
        return case
    calls, ref_out = {}, None
    for k in impls:
        r = case["impls"][k] = {}
        src = sources["gemms"] if k == "cublas" and not spec.cublas_complete else sources["op"]
        keep = {t.untyped_storage().data_ptr() for s in src for t in tensors(s)}
        try:
            fn = impl_function(spec, k, run.compile_mode)
            t0 = time.perf_counter()
            out = fn(src[0])
            run.sync()
            r["first_call_s"] = time.perf_counter() - t0
            if spec.compare and src is sources["op"]:
                if k == spec.reference:
                    ref_out = out
                elif ref_out is not None:
                    r.update(compare(out, ref_out))
            del out
            rot = Rotation(src)
            call = (lambda fn=fn, rot=rot: fn(rot()))
            r.update(run.memory(call, keep))
            calls[k] = call
        except Exception as e:  # recorded in the report; the other implementations go on
            r["error"] = _err(e)
            run.log(f"    {k}: FAILED {r['error']}")
            _free(run)
    ref_out = None
    quartiles = {k: [] for k in calls}
    for _ in range(run.repeats):
        for k in list(calls):
            try:
                quartiles[k].append(run.time(calls[k], case["impls"][k].get("probe_ms", 0.0)))
            except Exception as e:
                case["impls"][k]["error"] = _err(e)
                run.log(f"    {k}: FAILED while timing: {case['impls'][k]['error']}")
                del calls[k]
    for k in calls:
        case["impls"][k].update(R.summarize_timings(quartiles[k]))
    del calls, sources, sets
    _free(run)
    return case


def measure_ceilings(run: Runner, gemm_shape=PEAK_SHAPE, copy_bytes: int = COPY_BYTES) -> dict:
    """GEMM peak (cuBLAS and CODA at ``gemm_shape``; the faster correct one counts) and copy bandwidth (read +
    write bytes of a device-to-device copy)."""
    gemm = next(s for s in REGISTRY if s.key == "gemm.fwd")
    shape = dict(zip(gemm.params, gemm_shape))
    peak_run = dataclasses.replace(run, impls=("cublas", "coda"), l2_cold=False)
    case = measure_case(gemm, shape, peak_run)
    ok = {k: r for k, r in case["impls"].items() if "error" not in r and r.get("ms") and not R.mismatched(r)}
    if not ok:
        raise RuntimeError("no GEMM ceiling could be measured: " + "; ".join(
            f"{k}: {r.get('error')}" for k, r in case["impls"].items()))
    rates = {k: R.tflops(case["flops"], r["ms"]) for k, r in ok.items()}
    for k, r in ok.items():
        r["tflops"] = rates[k]
    src = max(rates, key=rates.get)
    ceil = {"gemm": dict(shape=list(gemm_shape), flops=case["flops"], impls=case["impls"], peak_tflops=rates[src],
                         peak_source=src)}
    bufs = [torch.empty(copy_bytes, dtype=torch.uint8, device=run.device).fill_(1) for _ in range(2)]
    bw = R.summarize_timings([run.time(lambda: bufs[1].copy_(bufs[0])) for _ in range(run.repeats)])
    bw.update(bytes=2 * copy_bytes, gbps=R.gbps(2 * copy_bytes, bw["ms"]))
    ceil["bandwidth"] = bw
    bufs.clear()
    _free(run)
    return ceil


# -- selection, metadata, CLI ---------------------------------------------------------------------------------------
def select_specs(ops: Optional[str]) -> list:
    """``--ops``: comma-separated op names (all modes) or op.mode keys; None: every registered op."""
    if not ops:
        return list(REGISTRY)
    out = []
    for name in (x.strip() for x in ops.split(",") if x.strip()):
        hit = [s for s in REGISTRY if name in (s.op, s.key)]
        if not hit:
            raise ValueError(f"unknown op {name!r}; registered: {', '.join(s.key for s in REGISTRY)}")
        out += [s for s in hit if s not in out]
    return out


def parse_shapes(text: Optional[str], specs: list) -> dict:
    """``--shapes``: ';'-separated entries, each ``K=V,K=V`` (merged over an op's first default shape; applies to
    the ops that have those parameters) or ``AxBxC`` (all selected ops must share one parameter list).
    Returns {spec.key: [shape dict, ...]}; ops that no entry applies to keep their default shapes."""
    per = {s.key: [] for s in specs}
    if text:
        used = set()
        for entry in (e.strip() for e in text.split(";") if e.strip()):
            if "=" in entry:
                kv = {k.strip(): _positive(v, entry) for k, _, v in (p.partition("=") for p in entry.split(","))}
                for s in specs:
                    keys = set(kv) & set(s.params)
                    if keys:
                        used |= keys
                        per[s.key].append({**dict(zip(s.params, s.shapes[0])), **{k: kv[k] for k in keys}})
                if set(kv) - used:
                    raise ValueError(f"--shapes {entry!r}: no selected op has parameter(s) "
                                     f"{sorted(set(kv) - used)}; parameters: "
                                     + "; ".join(f"{s.key} {','.join(s.params)}" for s in specs))
            else:
                dims = [_positive(x, entry) for x in entry.lower().split("x")]
                params = {s.params for s in specs}
                if len(params) != 1 or len(dims) != len(next(iter(params))):
                    raise ValueError(f"--shapes {entry!r}: positional shapes need the selected ops to share one "
                                     f"parameter list of that length ({sorted(params)}); use K=V,K=V")
                for s in specs:
                    per[s.key].append(dict(zip(s.params, dims)))
    out = {}
    for s in specs:
        shapes = per[s.key] or s.shape_dicts()
        out[s.key] = [dict(t) for t in dict.fromkeys(tuple(d.items()) for d in shapes)]
    return out


def _positive(v: str, entry: str) -> int:
    try:
        n = int(v.strip())
    except ValueError:
        raise ValueError(f"--shapes {entry!r}: {v.strip()!r} is not an integer") from None
    if n <= 0:
        raise ValueError(f"--shapes {entry!r}: sizes must be positive, got {n}")
    return n


RUN_KEYS = ("commit", "dirty", "date", "argv")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def gpu_problem() -> Optional[str]:
    """Why this machine cannot run the benchmark (None: it can)."""
    from .._device import hopper_available
    if not torch.cuda.is_available():
        return f"no CUDA GPU is visible to torch (torch {torch.__version__}, torch.cuda.is_available() is False)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (the timer is triton.testing.do_bench; CUDA builds of torch ship it)"
    if not hopper_available():
        names = ", ".join(f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
                          for i in range(torch.cuda.device_count()))
        return f"CODA's kernels need a Hopper (sm_90) GPU; found {names}"
    return None


def _version(dist: str) -> Optional[str]:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _driver() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        from cuda.bindings import driver
        err, v = driver.cuDriverGetVersion()
        return f"CUDA driver API {v // 1000}.{v % 1000 // 10}" if int(err) == 0 else None
    except Exception:
        return None


def _git() -> tuple:
    """(commit, dirty) of the checkout; ``CODA_COMMIT`` overrides it (a copied tree whose .git is stale, as on the
    device machine, would otherwise report the wrong commit)."""
    if os.environ.get("CODA_COMMIT"):
        return os.environ["CODA_COMMIT"], False
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=20)
        if head.returncode != 0:
            return None, None
        st = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, timeout=20)
        return head.stdout.strip(), bool(st.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


def collect_meta(run: Runner, argv: list) -> dict:
    import coda
    dev = torch.device(run.device)
    props = torch.cuda.get_device_properties(dev)
    commit, dirty = _git()
    return dict(device=torch.cuda.get_device_name(dev), capability=f"sm_{props.major}{props.minor}",
                sms=props.multi_processor_count, memory_bytes=props.total_memory,
                l2_bytes=getattr(props, "L2_cache_size", None), driver=_driver(), cuda=torch.version.cuda,
                torch=torch.__version__, triton=_version("triton"), cutlass_dsl=_version("nvidia-cutlass-dsl"),
                coda=coda.__version__, commit=commit, dirty=dirty, python=platform.python_version(),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                argv=list(argv), dtype=str(run.dtype).replace("torch.", ""),
                timing=dict(timer="triton.testing.do_bench (L2 flushed before every timed run)", repeats=run.repeats,
                            warmup_ms=run.warmup_ms, rep_ms=run.rep_ms, l2_cold=run.l2_cold,
                            compile_mode=run.compile_mode))


def main(argv=None) -> int:
    """``python -m coda.bench`` with these arguments (the command line: ``coda/bench/__main__.py``)."""
    from .__main__ import main as cli_main
    return cli_main(argv)
