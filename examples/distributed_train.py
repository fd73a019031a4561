"""Train the Llama-style model of ``examples/llama_model.py``, ``coda.fuse``'d, on several processes:

    torchrun --nproc_per_node 2 examples/distributed_train.py --parallel fsdp       # FSDP2: data parallel, sharded
    torchrun --nproc_per_node 2 examples/distributed_train.py --parallel tp         # tensor parallel (Megatron)
    torchrun --nproc_per_node 2 examples/distributed_train.py --parallel tp --sequence-parallel
    torchrun --nproc_per_node 2 examples/distributed_train.py --device cpu --steps 5   # gloo, the CPU reference path
    torchrun --nproc_per_node 2 examples/distributed_train.py --parallel tp --stock    # the baseline: torch's own TP

``--stock`` trains the unfused model the same way, for a side-by-side number: FSDP2 as above, or torch's tensor
parallel plan (``torch.distributed.tensor.parallel``, as torchtitan shards Llama: column-parallel q/k/v and
gate/up, row-parallel o and down, the LM head's logits sharded along the vocabulary and the loss under
``loss_parallel()``; the embedding replicated as in CODA's plan; no sequence parallelism).

- ``fsdp``: each decoder layer and then the root are ``torch.distributed.fsdp.fully_shard``\\ ed after
  ``coda.fuse``; each rank trains on its own batches (the global batch is ``--batch`` x ranks). Checkpoints:
  ``coda.distributed.stock_state_dict`` (the stock layout, for ``torch.distributed.checkpoint``).
- ``tp``: ``coda.tensor_parallel.parallelize`` splits the heads, the SwiGLU pairs and the vocabulary over the ranks
  (``--sequence-parallel``: the hidden states between blocks sharded along the sequence); every rank feeds the same
  batch. ``model.state_dict()`` gathers the stock layout.

Data as in ``examples/llama_train.py`` (a random sparse bigram chain: the loss falls from log V). The model starts
from the same seed on every rank. Rank 0 prints the loss every ``--log-every`` steps, then tokens/s per GPU (tp: and
of the group, which trains on one batch) and the peak memory. Parameters in ``--dtype`` with ``torch.optim.AdamW``.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_model import LlamaForCausalLM  # noqa: E402
from llama_train import PRESETS, batch, make_chain, run_steps  # noqa: E402


def stock_tp(model: torch.nn.Module) -> torch.nn.Module:
    """torch's tensor parallel plan over the stock model (the ``--stock`` baseline of ``--parallel tp``), in place:
    heads and SwiGLU columns split over the ranks, o / down row-parallel (an all-reduce each), the LM head's logits
    left sharded along the vocabulary for ``loss_parallel()``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    tp = dist.get_world_size()
    mesh = init_device_mesh(next(model.parameters()).device.type, (tp,))
    for layer in model.model.layers:
        attn = layer.self_attn
        if attn.n_heads % tp or attn.n_kv % tp:
            raise ValueError(f"tp = {tp} does not divide the {attn.n_heads} query and {attn.n_kv} key/value heads")
        attn.n_heads //= tp
        attn.n_kv //= tp
        parallelize_module(layer, mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    return parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Shard(-1),
                                                                       use_local_output=False)})


def build(args, dev: torch.device, cfg) -> torch.nn.Module:
    """The model on this rank (fused unless ``--stock``), sharded as ``--parallel`` says (same init on every
    rank)."""
    import coda
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg).to(dev, getattr(torch, args.dtype))
    if args.stock:
        if args.parallel == "tp":
            return stock_tp(model)
    else:
        coda.fuse(model)
    if args.parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        import coda.tensor_parallel as ctp
        ctp.parallelize(model, sequence_parallel=args.sequence_parallel)
    return model


def train(args) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(dev)
    cfg = PRESETS[args.preset or ("tiny" if dev.type == "cpu" else "small")]
    model = build(args, dev, cfg)
    # torch's TP plan leaves DTensor and plain parameters side by side: one group each (a foreach step over a mix
    # raises "got mixed torch.Tensor and DTensor"); foreach as torch's default on CUDA, on the CPU too
    from torch.distributed.tensor import DTensor
    params = list(model.parameters())
    groups = [g for g in ([p for p in params if isinstance(p, DTensor)],
                          [p for p in params if not isinstance(p, DTensor)]) if g]
    opt = torch.optim.AdamW([{"params": g} for g in groups], lr=args.lr, weight_decay=0.0, foreach=True)
    # fsdp: this rank's own batches; tp: the same batches on every rank
    g = torch.Generator().manual_seed(args.seed + 1 + (rank if args.parallel == "fsdp" else 0))
    chain = make_chain(cfg.vocab_size, args.seed)
    data = [batch(chain, args.batch, args.seq, g) for _ in range(min(args.steps, 16))]
    if rank == 0:
        print(f"{args.parallel}{' + sequence parallel' if args.sequence_parallel else ''} over {world} processes "
              f"({dev.type}), batch {args.batch} x {args.seq} per process, {args.steps} steps; loss starts near "
              f"log(V) = {math.log(cfg.vocab_size):.3f}", flush=True)
    def loss_value(step, loss):
        value = loss.detach().float()
        if args.parallel == "fsdp":  # the ranks' batches differ: their mean
            dist.all_reduce(value)
            value /= world
        if rank == 0:
            print(f"  step {step:5d}  loss {value.item():.4f}", flush=True)
        return value.item()

    if args.stock and args.parallel == "tp":  # the vocab-sharded logits' loss, forward and backward
        from torch.distributed.tensor.parallel import loss_parallel
        ctx = loss_parallel()
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        points, tok_s, peak = run_steps(model, opt, data, dev, args, loss_value)
    # fsdp: each process trains on its own tokens; tp: the group trains on one batch
    per_gpu = tok_s if args.parallel == "fsdp" else tok_s / world
    if rank == 0:
        what = "" if args.parallel == "fsdp" else f"{tok_s:,.0f} tokens/s for the group of {world}, "
        print(f"final loss {points[-1][1]:.4f}, {what}{per_gpu:,.0f} tokens/s per GPU, peak {peak:.0f} MiB",
              flush=True)
    return {"points": points, "tok_s": tok_s, "tok_s_per_gpu": per_gpu, "peak_mib": peak}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parallel", choices=["fsdp", "tp"], default="fsdp")
    p.add_argument("--sequence-parallel", action="store_true", help="tp: shard the hidden states along the sequence")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: tiny on CPU, small on CUDA")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batch", type=int, default=None, help="sequences per step and process (2 on CPU, 8 on CUDA)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (32 on CPU, 1024 on CUDA)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=None, help="steps not timed (default min(10, steps // 3))")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stock", action="store_true", help="the unfused model (FSDP2, or torch's own TP plan)")
    args = p.parse_args(argv)
    if args.stock and args.sequence_parallel:
        p.error("--stock runs torch's tensor parallel plan without sequence parallelism")
    if args.sequence_parallel and args.parallel != "tp":
        p.error("--sequence-parallel needs --parallel tp")
    cpu = torch.device(args.device).type == "cpu"
    args.batch = args.batch or (2 if cpu else 8)
    args.seq = args.seq or (32 if cpu else 1024)
    args.warmup = min(10, args.steps // 3) if args.warmup is None else args.warmup
    if "RANK" not in os.environ:
        p.error("run it under torchrun: torchrun --nproc_per_node N examples/distributed_train.py ...")
    if cpu:
        torch.set_num_threads(1)
    dist.init_process_group("gloo" if cpu else "nccl")
    try:
        train(args)
        dist.barrier()  # every rank done before the group goes
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
