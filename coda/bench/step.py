"""Training-step report: ``python -m coda.bench --model PRESET [--batch B] [--seq T] [--steps N] [--modes ...]``.

Trains the stock Llama-style model of ``examples/llama_model.py`` (Hugging Face's ``LlamaForCausalLM`` when that file
is not there and transformers is installed) in several modes -- ``stock``, ``stock+compile``, ``fused``
(``coda.fuse``), ``fused+compile``, the ``-ro`` variants (torch.compile mode="reduce-overhead"), the ``+graph``
variants (the eager step -- forward, backward, optimizer step -- captured whole in one CUDA graph after two eager
steps, then replayed; the optimizer ``capturable``) and the ``-noattn``
variants (``coda.fuse(model, attention=False)``: the attention half left stock) -- each in its own
process (same seed, same init, same data), and reports per mode: tokens/s (median step over the timed steps),
MFU (model FLOPs over the measured GEMM peak and over the datasheet peak), peak memory, the loss of the last step,
the time from process start to the end of the first step, and the GPU time per step in four classes (GEMM,
attention, optimizer, other) from torch.profiler, with the step's speed of light (GEMM FLOPs / measured GEMM peak +
attention + optimizer). Writes report.json, report.md and step.png into ``--out`` (rendering:
:mod:`coda.bench.step_report`); ``--from report.json`` re-renders without a GPU.

The fused modes call ``coda.precompile`` before their first step (a dry run of one step, its kernels compiled in
worker processes into the disk cache; for ``+compile`` modes the uncompiled model through torch's dispatcher; env
``CODA_PRECOMPILE=0``: not; for ``+compile`` modes in the background, beside torch.compile). ``--env NAME=VALUE``
adds a variant of every mode run with those environment variables (an experiment switch such as
``CODA_L2_PREFETCH=16``, or ``CODA_BENCH_KERNEL_STEP=1``: coda.optim.AdamW(kernel_step=True)),
``--rounds R`` alternates the mode and its variants R times on the same machine: paired
numbers. ``--power``: each mode's mean board power and SM clock over its timed steps (``coda.bench.power``,
nvidia-smi) and the joules a step (H100, session 38: the sampler does not perturb the step, fused 124.5 ms with it,
124.7 without).

Phases of a run: (1) a process measures the GEMM peak (cuBLAS bf16 8192^3, do_bench median); (2) one process per mode
builds, trains (``--warmup`` untimed steps, then ``--steps`` timed ones, CUDA events per step, one sync at the
end), profiles ``--profile-steps`` more steps, and prints its result as one JSON line; (3) the parent renders.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Optional

from . import power
from . import step_report as SR

# hidden, intermediate, layers, heads, kv heads, vocab; optional: head_dim (default hidden // heads), qkv_bias (Qwen2:
# biases on q/k/v), qk_norm (Qwen3: per-head RMSNorm on q and k). The Qwen presets keep few layers (one H100 holds a
# step at batch 2 x 4096) and give the tuner (python -m autotune --model PRESET) their GEMM shapes
PRESETS = {
    "small": dict(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=8, vocab=32000),
    "llama-1b": dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256),
    "llama-8b-4l": dict(hidden=4096, intermediate=14336, layers=4, heads=32, kv_heads=8, vocab=128256),
    # one rank's shard of Llama-3-70B under 8-way tensor parallelism (heads, kv heads, intermediate and vocabulary
    # split 8 ways): the GEMM shapes of a TP8 training step, all-reduces left out (issue 31's shipped configs)
    "llama-70b-tp8-2l": dict(hidden=8192, intermediate=3584, layers=2, heads=8, kv_heads=1, vocab=16032,
                             head_dim=128),
    "qwen2.5-7b-2l": dict(hidden=3584, intermediate=18944, layers=2, heads=28, kv_heads=4, vocab=152064, qkv_bias=True),
    "qwen2.5-32b-1l": dict(hidden=5120, intermediate=27648, layers=1, heads=40, kv_heads=8, vocab=152064,
                           qkv_bias=True),
    "qwen3-8b-2l": dict(hidden=4096, intermediate=12288, layers=2, heads=32, kv_heads=8, vocab=151936, head_dim=128,
                        qk_norm=True),
    "qwen3-32b-1l": dict(hidden=5120, intermediate=25600, layers=1, heads=64, kv_heads=8, vocab=151936, head_dim=128,
                         qk_norm=True),
    "tiny": dict(hidden=64, intermediate=176, layers=2, heads=4, kv_heads=2, vocab=256),  # CPU smoke tests
    "tiny-qwen2": dict(hidden=64, intermediate=176, layers=2, heads=4, kv_heads=2, vocab=256, qkv_bias=True),
    "tiny-qwen3": dict(hidden=64, intermediate=176, layers=2, heads=4, kv_heads=2, vocab=256, head_dim=32,
                       qk_norm=True),
}
MODES = ("stock", "stock+compile", "fused", "fused+compile", "stock+compile-ro", "fused+compile-ro",
         "fused-noattn", "fused-noattn+compile", "stock+graph", "fused+graph")  # -noattn: attention=False
DEFAULT_MODES = MODES[:4]
RESULT = "CODA_STEP_RESULT "
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def shape_parser(description=None) -> argparse.ArgumentParser:
    """An argument parser with the step's problem: ``--model`` (a preset, default llama-1b), ``--batch`` (2) and
    ``--seq`` (4096): the benchmarks that take one part of the step report's model at its shapes."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="llama-1b", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    return ap


def _model_module():
    """The stock model: examples/llama_model.py of the checkout, else Hugging Face's."""
    path = os.path.join(ROOT, "examples", "llama_model.py")
    if os.path.exists(path):
        spec = importlib.util.spec_from_file_location("coda_bench_llama_model", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
        return mod
    return None


def build_model(cfg: dict, seq: int):
    mod = _model_module()
    kw = dict(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
              num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
              num_key_value_heads=cfg["kv_heads"], max_position_embeddings=max(seq, 256),
              head_dim=SR.head_dim(cfg))
    bias, qk_norm = bool(cfg.get("qkv_bias")), bool(cfg.get("qk_norm"))
    if mod is not None:
        return (mod.LlamaForCausalLM(mod.LlamaConfig(**kw, attention_bias=bias, qk_norm=qk_norm)),
                "examples/llama_model.py")
    import transformers
    if qk_norm:  # Qwen3 (its q/k/v biases: attention_bias, off in the Qwen3 models)
        hf = transformers.Qwen3Config(**kw, attention_bias=bias, attn_implementation="sdpa")
        return transformers.Qwen3ForCausalLM(hf), f"transformers {transformers.__version__} (Qwen3)"
    if bias:  # Qwen2: biases on q/k/v only (Llama's attention_bias would put one on o_proj too)
        hf = transformers.Qwen2Config(**kw, attn_implementation="sdpa")
        return transformers.Qwen2ForCausalLM(hf), f"transformers {transformers.__version__} (Qwen2)"
    hf = transformers.LlamaConfig(**kw, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(hf), f"transformers {transformers.__version__}"


def make_batches(vocab: int, batch: int, seq: int, n: int, seed: int) -> list:
    """``n`` batches of a fixed random bigram chain (each token has 4 likely successors), so the loss falls."""
    import torch
    g = torch.Generator().manual_seed(seed)
    succ, probs = torch.randint(0, vocab, (vocab, 4), generator=g), torch.randn(vocab, 4, generator=g).softmax(-1)
    cum, succ = probs.cumsum(-1).numpy(), succ.numpy()
    out = []
    for _ in range(n):
        ids = torch.empty(batch, seq, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        u = torch.rand(batch, seq, 1, generator=g).numpy()
        a = ids.numpy()  # the chain in numpy (same float32 comparisons, same tokens): ~10x faster than torch ops
        for t in range(1, seq):  # inverse-CDF draw of the successor slot from the previous token's row
            prev = a[:, t - 1]
            slot = (u[:, t] > cum[prev]).sum(-1).clip(max=3)
            a[:, t] = succ[prev, slot]
        out.append(ids)
    return out


# -- one mode, in its own process --------------------------------------------------------------------------------
def run_mode(args) -> dict:
    import torch
    t_start = float(os.environ.get("CODA_STEP_T0", time.time()))
    phases, t_last = {}, t_start

    def phase(name):  # seconds since the previous phase ended (the first: since the process was spawned)
        nonlocal t_last
        now = time.time()
        phases[name], t_last = round(now - t_last, 2), now

    phase("start + import torch")
    cfg, dev = PRESETS[args.model], torch.device(args.device)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1:  # --nproc: one process per GPU (torch.distributed.run), FSDP2 below
        import torch.distributed as dist
        if dev.type == "cuda":
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    with dev:  # parameters initialised where they train: on the CPU, 1.5 B of them took 15-17 s (H100 machine, s21)
        model, source = build_model(cfg, args.seq)
    phase("build the model")
    model = model.to(dev, dtype)
    phase("to the device")
    mode = args.worker
    if mode.startswith("fused"):
        import coda
        coda.fuse(model, attention="-noattn" not in mode)
        phase("import coda + fuse")
    step_fn = model
    compile_kw = dict(mode="reduce-overhead" if mode.endswith("-ro") else "default")
    if world > 1:  # FSDP2 (fully_shard per decoder layer, then the root), each layer compiled first (torchtitan's
        # order: whole-model compile would trace FSDP's hooks)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(dev.type, (world,))
        for layer in model.model.layers:
            if "+compile" in mode:
                layer.compile(**compile_kw)
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        phase("FSDP2")
    elif "+compile" in mode:
        step_fn = torch.compile(model, **compile_kw)
    kw = {"foreach": True} if args.optimizer == "adamw-foreach" else {"fused": True}
    graphed = mode.endswith("+graph")
    if graphed:
        if dev.type != "cuda" or world > 1:
            raise ValueError(f"--modes {mode}: a CUDA graph of the step needs one CUDA device (--device cuda, "
                             "--nproc 1)")
        kw["capturable"] = True
    if args.optimizer == "coda-adamw" and mode.startswith("fused") and world == 1:
        # coda.optim.AdamW: CODA-fused weights updated inside the backward (eager; under compile step() does it)
        import coda.optim
        # CODA_BENCH_KERNEL_STEP=1 (for --env A/B runs): step()'s K = 0 pass for large matrices (kernel_step)
        kw["kernel_step"] = os.environ.get("CODA_BENCH_KERNEL_STEP", "0") == "1"
        opt = coda.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, **kw)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, **kw)
    batches = [b.to(dev) for b in make_batches(cfg["vocab"], args.batch, args.seq, 4, args.seed + 1 + rank)]
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    phase("batches + optimizer")

    def eager_step(ids):
        if mode.endswith("-ro"):
            torch.compiler.cudagraph_mark_step_begin()
        loss = step_fn(ids, labels=ids)
        loss.backward()
        opt.step()
        return loss

    def step(i):
        if graphed:
            return graph_step(i)
        loss = eager_step(batches[i % len(batches)])
        opt.zero_grad(set_to_none=True)
        return loss

    graph, static = {}, batches[0].clone()

    def graph_step(i):
        """Steps 0 and 1 eager on a side stream (compiles, warms up), step 2 captured whole, then replays; each
        call is one training step (a capture records without running: it is followed by its replay)."""
        static.copy_(batches[i % len(batches)])
        if "g" not in graph and i < 2:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                loss = eager_step(static)
                opt.zero_grad(set_to_none=True)
            torch.cuda.current_stream(dev).wait_stream(side)
            return loss
        if "g" not in graph:
            graph["g"] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph["g"]):
                graph["loss"] = eager_step(static)
        graph["g"].replay()
        return graph["loss"]

    background = None
    if mode.startswith("fused") and world == 1 and cuda and os.environ.get("CODA_PRECOMPILE", "1") != "0":
        # coda.precompile: a dry run of the step finds its kernels, worker processes compile them into the disk
        # cache; for a compiled step the uncompiled model through the dispatcher (the compiled graph's kernels)
        ids0 = batches[0]
        compiled = "+compile" in mode  # then in the background, beside torch.compile's tracing and compiling
        try:
            summary = coda.precompile(lambda: model(ids0, labels=ids0).backward(), dispatcher=compiled,
                                      background=compiled)
            background = summary if compiled else None
        except Exception as e:  # the report still runs (the first step then compiles); the failure is printed
            summary = f"coda.precompile FAILED ({type(e).__name__}: {e}); the first step compiles"
        print(f"  [{mode}] {summary}", flush=True)
        phase("precompile (dry run + compile workers)" if not compiled else "precompile (dry run; workers started)")
    loss = step(0)
    first_loss = loss.item()
    first_step_s = time.time() - t_start
    phase("first step (compiles, or loads cached kernels)")
    print(f"  [{mode}] first step done at {first_step_s:.1f} s (loss {first_loss:.3f})", flush=True)
    if background is not None:  # what the background precompile did beside torch.compile
        print(f"  [{mode}] {background.wait()} (background)", flush=True)
    # --power: power and SM clock while the timed steps run (coda.bench.power: nvidia-smi started during the
    # warm-up, so the timed steps follow the warm-up as before; none where nvidia-smi is missing)
    sampler = power.Sampler(power.smi_id(dev.index or 0)) if cuda and args.power else None
    for i in range(1, args.warmup):
        step(i)
    t_on = time.time()
    events = []
    for i in range(args.steps):
        e0 = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            e0.record()
        t0 = time.perf_counter()
        loss = step(args.warmup + i)
        if cuda:
            e1 = torch.cuda.Event(enable_timing=True)
            e1.record()
            events.append((e0, e1))
        else:
            events.append(time.perf_counter() - t0)
    watts = None
    if cuda:
        torch.cuda.synchronize(dev)
        if sampler is not None:
            watts = power.window(sampler.samples, t_on, time.time())
            sampler.stop()
        step_ms = [a.elapsed_time(b) for a, b in events]
    else:
        step_ms = [1e3 * s for s in events]
    res = dict(mode=mode, model_source=source, nproc=world, rank=rank, step_ms_all=step_ms, loss=loss.item(),
               first_loss=first_loss, first_step_s=first_step_s, first_step_phases=phases,
               peak_bytes=torch.cuda.max_memory_allocated(dev) if cuda else 0, kernels={}, power=watts,
               coda_env={k: v for k, v in os.environ.items() if k.startswith("CODA_") and k != "CODA_STEP_T0"})
    if cuda and args.profile_steps > 0:
        res["kernels"] = profile_kernels(lambda i: step(args.warmup + args.steps + i), args.profile_steps)
    if cuda and args.head_reps > 0 and world == 1:  # the LM head's share (coda.bench.step_head), after the steps
        from .step_head import head_ms
        res["head_ms"] = head_ms(model, opt, mode, batches[0], args.head_reps)
    return res


def profile_kernels(step, n: int) -> dict:
    """{kernel name: GPU ms per step} over ``n`` profiled steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            step(i)
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", None)
        if us is None:
            us = getattr(ev, "self_cuda_time_total", 0)
        if us > 0:
            out[ev.key] = out.get(ev.key, 0.0) + us / 1e3 / n
    return out


def measure_peak() -> dict:
    import torch
    from triton.testing import do_bench
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = sorted(do_bench(lambda: torch.mm(a, b.t()), warmup=50, rep=200) for _ in range(3))[1]
    props = torch.cuda.get_device_properties(0)
    return dict(gemm_peak_tflops=2 * 8192 ** 3 / (ms * 1e-3) / 1e12, device=torch.cuda.get_device_name(0),
                sms=props.multi_processor_count, memory_bytes=props.total_memory, torch=torch.__version__)


# -- the parent ----------------------------------------------------------------------------------------------------
def _spawn(worker_argv: list, timeout: float, nproc: int = 1, extra_env: Optional[dict] = None) -> dict:
    env = dict(os.environ, **(extra_env or {}), CODA_STEP_T0=repr(time.time()))
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
              if nproc > 1 else [sys.executable])
    proc = subprocess.Popen([*launch, "-m", "coda.bench.step", *worker_argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=os.getcwd())
    result, tail = None, []
    t0 = time.time()
    for line in proc.stdout:
        if line.startswith(RESULT):
            result = json.loads(line[len(RESULT):])
        else:
            tail = (tail + [line.rstrip()])[-20:]
            print("   " + line.rstrip(), flush=True)
        if time.time() - t0 > timeout:
            proc.kill()
            break
    proc.wait()
    if result is None:
        return {"error": f"exit {proc.returncode}: " + " / ".join(tail[-3:])}
    return result


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m coda.bench --model", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per mode (the first compiles)")
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--head-reps", type=int, default=5,
                    help="time the final norm + LM head + loss alone this many times per mode (0: not; "
                         "coda.bench.step_head)")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--optimizer", default="adamw-fused",
                    choices=["adamw-fused", "adamw-foreach", "coda-adamw"],
                    help="coda-adamw: the fused modes run coda.optim.AdamW (fused=True; the update of CODA-fused "
                         "weights inside the backward), stock modes torch's fused AdamW")
    ap.add_argument("--power", action="store_true",
                    help="sample the GPU's power draw and SM clock (nvidia-smi, coda.bench.power) while the timed "
                         "steps run: the report gives each mode's W, MHz and joules a step")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nproc", type=int, default=1,
                    help="processes (GPUs) per mode: FSDP2 over them, via torch.distributed.run; --batch is per "
                         "process, tokens/s per GPU (compare with an --nproc 1 report for the scaling)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                    help="a variant: each mode also runs with these environment variables (repeatable), reported "
                         "as 'MODE [NAME=VALUE]' with its step time's ratio to the mode's, round by round")
    ap.add_argument("--env-only", action="store_true",
                    help="run each mode with its --env variants only (not as it is): a variant alone in a call")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run each mode and its --env variants this many times, alternating (step times pooled)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mode")
    ap.add_argument("--out", default="bench-results/step")
    ap.add_argument("--from", dest="from_", metavar="REPORT_JSON", help="re-render a saved report (no GPU)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--peak", action="store_true", help=argparse.SUPPRESS)
    return ap


def parse_modes(text: str) -> list:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"--modes: choose from {','.join(MODES)}, got {text!r}")
    return modes


def parse_env(items: list) -> list:
    """``--env`` values -> [(label, {name: value})]."""
    out = []
    for text in items:
        pairs = [p.strip() for p in text.split(",") if p.strip()]
        if not pairs or any("=" not in p or not p.split("=", 1)[0] for p in pairs):
            raise ValueError(f"--env: expected NAME=VALUE[,NAME=VALUE], got {text!r}")
        out.append((",".join(pairs), dict(p.split("=", 1) for p in pairs)))
    return out


def _pool(runs: list) -> dict:
    """One mode's result from its rounds: the last round's, with every round's step times."""
    ok = [r for r in runs if not r.get("error")]
    if not ok:
        return runs[-1]
    res = dict(ok[-1])
    res["step_ms_all"] = [t for r in ok for t in r["step_ms_all"]]
    res["rounds_ms"] = [SR.median(r["step_ms_all"]) for r in ok]
    return res


def _write(report: dict, out: str, write_json: bool = True) -> None:
    """The report's files, their paths and its modes table on stdout (a remote run's log keeps the numbers when
    the files do not come back)."""
    for p in SR.write_step_report(report, out, write_json=write_json):
        print(f"wrote {p}")
        if p.endswith(".md"):
            with open(p) as f:
                print("\n".join(SR.table_lines(f.read())), flush=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--from" in argv and "--model" not in argv:
        argv += ["--model", "tiny"]  # --from needs no model; the saved report names its own
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.from_:
        with open(args.from_) as f:
            report = json.load(f)
        same = os.path.abspath(os.path.join(args.out, "report.json")) == os.path.abspath(args.from_)
        _write(report, args.out, write_json=not same)
        return 0
    if args.peak:
        print(RESULT + json.dumps(measure_peak()), flush=True)
        return 0
    if args.worker:
        res = run_mode(args)
        if res["rank"] == 0:  # the report's numbers are rank 0's (every rank steps in lockstep)
            print(RESULT + json.dumps(res), flush=True)
        if res["nproc"] > 1:
            import torch.distributed as dist
            dist.destroy_process_group()
        return 0
    try:
        modes = parse_modes(args.modes)
    except ValueError as e:
        ap.error(str(e))
    if args.nproc < 1:
        ap.error("--nproc must be >= 1")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    try:
        variants = ([] if args.env_only else [("", {})]) + parse_env(args.env)
    except ValueError as e:
        ap.error(str(e))
    if not variants:
        ap.error("--env-only needs at least one --env")
    # CODA_AUTOTUNE as the user set it: unset is the library's default (the tuning store, the shipped configs of
    # this GPU, else the heuristic; never tunes); 0 is the heuristic alone (the step reports before session 21)
    from . import _git, _version
    commit, dirty = _git()
    common = ["--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--profile-steps", str(args.profile_steps), "--head-reps",
              str(args.head_reps), "--optimizer", args.optimizer, "--dtype", args.dtype, "--device", args.device,
              "--seed", str(args.seed)] + (["--power"] if args.power else [])
    peak = _spawn(["--model", args.model, "--peak"], 120) if args.device == "cuda" else {}
    meta = dict(model=args.model, config=PRESETS[args.model], batch=args.batch, seq=args.seq, steps=args.steps,
                nproc=args.nproc, warmup=args.warmup, optimizer=args.optimizer, dtype=args.dtype, commit=commit,
                dirty=dirty,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                autotune=os.environ.get("CODA_AUTOTUNE"), cutlass_dsl=_version("nvidia-cutlass-dsl"),
                device=peak.get("device", args.device), torch=peak.get("torch"), argv=argv)
    report = dict(schema=1, meta=meta, gemm_peak_tflops=peak.get("gemm_peak_tflops"),
                  flops=SR.step_flops(PRESETS[args.model], args.batch, args.seq), modes=[])
    print(f"coda.bench --model {args.model} on {meta['device']}: GEMM peak "
          f"{SR._f(report['gemm_peak_tflops'], '{:.0f}')} TFLOP/s; modes {', '.join(modes)}", flush=True)
    for mode in modes:
        runs: dict = {label: [] for label, _ in variants}
        for _ in range(args.rounds):  # the mode, then each variant, alternating round by round
            for label, env in variants:
                name = f"{mode} [{label}]" if label else mode
                t0 = time.time()
                res = _spawn(common + ["--worker", mode], args.timeout, args.nproc, env)
                res["mode"], res["wall_s"] = name, time.time() - t0
                runs[label].append(res)
                if not res.get("error"):
                    base = (runs.get("") or [None])[-1]  # the mode as it is (none with --env-only)
                    ratio = ("" if not label or base is None or base.get("error") else
                             f", {SR.median(res['step_ms_all']) / SR.median(base['step_ms_all']):.3f}x {mode}'s")
                    print(f"  {name}: {SR.median(res['step_ms_all']):.1f} ms/step{ratio}, "
                          f"{args.batch * args.seq / SR.median(res['step_ms_all']) * 1e3:,.0f} tok/s, peak "
                          f"{res['peak_bytes'] / 1e9:.1f} GB ({res['wall_s']:.0f} s)", flush=True)
                else:
                    print(f"  {name}: FAILED {res['error']}", flush=True)
                if len(variants) > 1 or args.rounds > 1:  # after each run: a run cut short keeps what ran before it
                    _write(dict(report, modes=report["modes"] + [_pool(r) for r in runs.values() if r]), args.out)
        report["modes"] += [_pool(runs[label]) for label, _ in variants]
        _write(report, args.out)  # after each mode: a later failure keeps what ran (modes are never empty)
    return 0 if all(not m.get("error") for m in report["modes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
