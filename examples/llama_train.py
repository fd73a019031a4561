"""Train the small Llama-style model of ``examples/llama_model.py``: stock (optionally ``torch.compile``) vs
``coda.fuse`` (norm + gate/up + SwiGLU in one GEMM; final norm + LM head + cross entropy without logits).

    python examples/llama_train.py --device cuda --steps 300                  # both, same init and data
    python examples/llama_train.py --device cuda --steps 300 --stock --compile
    python examples/llama_train.py --device cuda --compile --compile-fused --compile-mode reduce-overhead
    python examples/llama_train.py --device cpu --steps 3                     # tiny smoke test (reference path)
    python examples/llama_train.py --device cuda --grad-check [--compile]     # one batch: gradients vs float64

The fused model (eager, CUDA) first runs ``coda.precompile`` on its first batch: a dry run of one step finds every
kernel it needs and worker processes compile them in parallel into the disk cache (``--no-precompile``: the first
step compiles them one after another, as before).

Data: sequences from a fixed random sparse bigram chain (each token has 4 likely successors), so the loss falls
from log(V) towards the chain's entropy. Prints loss points, tokens/s (after --warmup steps) and peak memory.
Parameters in --dtype (default bfloat16) with AdamW.

--grad-check trains nothing: on one batch it compares every parameter gradient (by stock name; the fused gate/up
split back) and the loss of the stock model in --dtype (and stock + torch.compile with --compile) and of the fused
model in --dtype with those of the stock model in float64, same init and batch. In float64 (CPU) stock and fused
follow the same trajectory to 1e-15 (tests/test_nn.py), so a fused error well above the stock one at the same dtype
points at the kernels, not at the model plumbing.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_model import LlamaConfig, LlamaForCausalLM  # noqa: E402

PRESETS = {  # (hidden, intermediate, layers, heads, kv heads, vocab)
    "tiny": LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2),
    "small": LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048),
    "1b": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096),
}


def make_chain(vocab: int, seed: int):
    """A sparse random bigram chain: each token's 4 successors and their probabilities (V x 4 each; a dense V x V
    table would be 4 GB at V = 32000)."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, 4), generator=g)
    return succ, torch.randn(vocab, 4, generator=g).softmax(-1)


def batch(chain, b: int, t: int, g: torch.Generator) -> torch.Tensor:
    succ, probs = chain
    ids = torch.empty(b, t, dtype=torch.long)
    ids[:, 0] = torch.randint(0, succ.shape[0], (b,), generator=g)
    for i in range(1, t):
        prev = ids[:, i - 1]
        pick = torch.multinomial(probs[prev], 1, generator=g).squeeze(1)
        ids[:, i] = succ[prev, pick]
    return ids


def train(mode: str, args, cfg: LlamaConfig) -> dict:
    import coda

    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg).to(dev, dtype)
    if mode == "fused":
        coda.fuse(model)
    step_fn = model
    if args.compile and (mode == "stock" or args.compile_fused):
        step_fn = torch.compile(model, mode=args.compile_mode)
    if mode == "fused" and args.coda_optim:  # each fused weight updated inside its dW GEMM in the backward
        opt = coda.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    chain, g = make_chain(cfg.vocab_size, args.seed), torch.Generator().manual_seed(args.seed + 1)
    data = [batch(chain, args.batch, args.seq, g) for _ in range(min(args.steps, 64))]
    if mode == "fused" and dev.type == "cuda" and args.precompile:
        # the first step's kernels, compiled in parallel worker processes (a dry run of the step finds them; no
        # optimizer step in it): the first real step only loads them from the disk cache. A compiled step: the
        # uncompiled model through the dispatcher, the compiled graph's path, its kernels compiled in the background
        # while torch.compile traces and compiles the step (a kernel the step meets first is waited for)
        ids = data[0].to(dev)
        compiled = step_fn is not model
        summary = coda.precompile(lambda: model(ids, labels=ids).backward(), dispatcher=compiled,
                                  background=compiled)
        print(f"  [{mode}] {summary}", flush=True)
    points, tok_s, peak = run_steps(step_fn, opt, data, dev, args,
                                    lambda step, loss: _logged(f"  [{mode}] step {step:5d}", loss.item()))
    comp = "" if step_fn is model else "+compile" + ("" if args.compile_mode == "default" else f"({args.compile_mode})")
    return {"mode": mode + comp, "points": points, "tok_s": tok_s, "peak_mib": peak}


def _logged(prefix: str, value: float) -> float:
    print(f"{prefix}  loss {value:.4f}", flush=True)
    return value


def run_steps(step_fn, opt, data: list, dev: torch.device, args, loss_value) -> tuple:
    """``args.steps`` training steps (forward with the loss, backward, ``opt.step()``) over ``data`` in turn:
    ``(points, tokens/s after args.warmup steps, peak MiB)``; at every ``args.log_every``-th step and the last,
    ``loss_value(step, loss)`` gives the loss value kept in ``points`` (and prints it). Shared with
    ``examples/distributed_train.py``."""
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    points, t0, tokens = [], None, 0
    for step in range(args.steps):
        if step == args.warmup:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
        ids = data[step % len(data)].to(dev, non_blocking=True)
        loss = step_fn(ids, labels=ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= args.warmup:
            tokens += ids.numel()
        if step % args.log_every == 0 or step == args.steps - 1:
            points.append((step, loss_value(step, loss)))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elapsed = time.perf_counter() - t0 if t0 is not None else float("nan")
    peak = torch.cuda.max_memory_allocated(dev) / 2 ** 20 if dev.type == "cuda" else float("nan")
    return points, tokens / elapsed if tokens else float("nan"), peak


def grad_check(args, cfg: LlamaConfig) -> dict:
    """One batch: loss and every gradient of stock / fused (--dtype) against the stock model in float64."""
    import coda

    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    base = LlamaForCausalLM(cfg)  # train()'s init
    ids = batch(make_chain(cfg.vocab_size, args.seed), args.batch, args.seq,
                torch.Generator().manual_seed(args.seed + 1)).to(dev)
    runs = [("stock float64", torch.float64, False, False), (f"stock {args.dtype}", dtype, False, False)]
    if args.compile:
        runs.append((f"stock+compile {args.dtype}", dtype, False, True))
    runs.append((f"fused {args.dtype}", dtype, True, args.compile and args.compile_fused))
    losses, grads = {}, {}
    for name, dt, fuse, comp in runs:
        model = copy.deepcopy(base).to(dev, dt)
        if fuse:
            coda.fuse(model)
        loss = (torch.compile(model) if comp else model)(ids, labels=ids)
        loss.backward()
        losses[name] = loss.item()
        grads[name] = {k: g.detach().double().cpu() for k, g in coda.stock_grads(model).items()}
        del model, loss
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    ref, others = runs[0][0], [r[0] for r in runs[1:]]
    rel = {o: {k: ((grads[o][k] - g).norm() / g.norm().clamp_min(1e-300)).item() for k, g in grads[ref].items()}
           for o in others}
    print(f"\nloss: {ref} {losses[ref]:.6f}; " + ", ".join(f"{o} {losses[o]:.6f} ({losses[o] - losses[ref]:+.2e})"
                                                       for o in others))
    print(f"gradient error vs {ref}: |g - g_ref| / |g_ref| per parameter (Frobenius)")
    print(f"{'parameter':<48}" + "".join(f"{o:>24}" for o in others))
    for k in grads[ref]:
        print(f"{k:<48}" + "".join(f"{rel[o][k]:24.3e}" for o in others))
    print(f"{'max':<48}" + "".join(f"{max(rel[o].values()):24.3e}" for o in others))
    return {"losses": losses, "rel": rel}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--fused", action="store_true", help="only the coda.fuse model")
    which.add_argument("--stock", action="store_true", help="only the stock model")
    p.add_argument("--compile", action="store_true", help="torch.compile the stock model")
    p.add_argument("--compile-fused", action="store_true", help="with --compile, compile the fused model too")
    p.add_argument("--coda-optim", action="store_true",
                   help="train the fused model with coda.optim.AdamW: each fused weight's update inside its dW GEMM "
                        "in the backward (eager and with --compile-fused)")
    p.add_argument("--compile-mode", default="default", choices=["default", "reduce-overhead", "max-autotune"],
                   help="torch.compile mode (reduce-overhead: CUDA-graph trees, no per-op host cost)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model size (default: tiny on CPU, small on CUDA)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 2 on CPU, 8 on CUDA)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 32 on CPU, 1024 on CUDA)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=None, help="steps not timed (default min(10, steps // 3))")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-precompile", dest="precompile", action="store_false",
                   help="fused (eager): compile the kernels in the first step, one after another, instead of ahead "
                        "in worker processes (coda.precompile)")
    p.add_argument("--grad-check", action="store_true",
                   help="no training: one batch's loss and gradients of stock / fused (--dtype) vs stock float64")
    args = p.parse_args(argv)
    cpu = torch.device(args.device).type == "cpu"
    cfg = PRESETS[args.preset or ("tiny" if cpu else "small")]
    args.batch = args.batch or (2 if cpu else 8)
    args.seq = min(args.seq or (32 if cpu else 1024), cfg.max_position_embeddings)
    args.warmup = min(10, args.steps // 3) if args.warmup is None else args.warmup
    modes = ["fused"] if args.fused else ["stock"] if args.stock else ["stock", "fused"]
    print(f"config {cfg}\ndevice {args.device}, dtype {args.dtype}, batch {args.batch} x {args.seq} tokens, "
          f"{args.steps} steps; loss starts near log(V) = {math.log(cfg.vocab_size):.3f}")
    if args.grad_check:
        grad_check(args, cfg)
        return 0
    results = [train(m, args, cfg) for m in modes]
    w = max(16, *(len(r["mode"]) for r in results))
    print(f"\n{'mode':<{w}} final loss   tokens/s   peak MiB")
    for r in results:
        print(f"{r['mode']:<{w}} {r['points'][-1][1]:10.4f} {r['tok_s']:10.0f} {r['peak_mib']:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
