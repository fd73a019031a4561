"""The LM head's share of a training step (issue 28): the final norm + LM head + loss, forward and backward, timed
alone on the step's shapes in each mode of :mod:`coda.bench.step` (``--head-reps``; the report's "LM head ms").

The stock modes run what the model's forward runs from the last hidden state (``examples/llama_model.py`` and Hugging
Face's loss alike: logits upcast to fp32, mean cross entropy over the shifted labels), under ``torch.compile`` in the
``+compile`` modes (the head alone, so inductor fuses the loss kernels as in the whole step); the fused modes run
``coda.fuse``'s head (the deferred norm, then ``LMHeadCrossEntropy`` on the same labels; under compile a custom op, so
the same kernels as eager). Included on both sides: the gradients of the hidden state, the LM head weight and the
norm weight, and the update of those two weights (the optimizer's step; with ``--optimizer coda-adamw`` the fused
eager modes update the LM head weight inside the backward instead), so each side carries the same work.

``python -m coda.bench.step_head`` (:func:`main`) profiles one pass of each side. H100, session 29 (3bb9658; ms of
kernel time in one pass): stock + compile 20.85 ms a pass queued, cuBLAS logits 5.95, dX 5.61, dW 5.65, inductor's
two softmax passes 1.64 + 1.56, torch's AdamW step of the head 1.70; fused 21.97 a pass, the logits GEMM with the loss
partials 7.12 (+1.17 over cuBLAS's), dX 5.72, dW in chunks 4.22 + 2.08 (+0.64), the update pass 1.58, the softmax
gradient pass 1.44, and ~0.85 of torch's fp32 ops of the final norm (the DeferredRMSNorm forward and backward).
"""
from __future__ import annotations


def head_loss(model, fused: bool, ids):
    """loss(h) from the last hidden state h (B, T, H), as the model's forward computes it."""
    import torch
    import torch.nn.functional as F
    norm, head = model.model.norm, model.lm_head
    if fused:
        shift = F.pad(ids, (0, 1), value=head.ignore_index)[..., 1:]
        return lambda h: head(norm(h), shift)
    shift = F.pad(ids, (0, 1), value=-100)[..., 1:].flatten()
    return lambda h: F.cross_entropy(head(norm(h)).flatten(0, -2).to(torch.float32), shift, ignore_index=-100)


def head_ms(model, opt, mode: str, ids, reps: int, warmup: int = 2):
    """ms per pass of the head: the median over ~``reps`` passes (``triton.testing.do_bench``) of forward +
    backward + ``opt.step()`` (the update of the LM head and norm weights: in the fused eager modes coda.optim's
    update inside the backward, elsewhere the optimizer's step), after ``warmup`` passes (the first compiles); the
    passes are queued, so the host's launch time overlaps the GPU's work as in the step."""
    import torch
    f = head_loss(model, mode.startswith("fused"), ids)
    if "+compile" in mode:
        f = torch.compile(f)
    w = model.lm_head.weight
    h = torch.randn(*ids.shape, w.shape[1], device=w.device, dtype=w.dtype, requires_grad=True)

    def one():
        f(h).backward()
        h.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(warmup):
        one()
    from triton.testing import do_bench
    return do_bench(one, warmup=25, rep=25 * reps)  # median ms; the passes queued (its events do not sync)


def main(argv=None) -> int:
    """``python -m coda.bench.step_head [--top N]``: the head of a 1-layer llama-1b (the head is the model's) alone,
    stock (+ compile) and fused, coda.optim.AdamW on the fused one as in the step report: ms per pass (queued), then
    the kernels of one pass by GPU time, so the head's share can be traced."""
    import argparse

    import torch
    from torch.profiler import ProfilerActivity, profile

    from .step import PRESETS, build_model, make_batches
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args(argv)
    cfg = dict(PRESETS["llama-1b"], layers=1)
    ids = make_batches(cfg["vocab"], 2, 4096, 1, 1)[0].cuda()
    for mode in ("stock+compile", "fused"):
        torch.manual_seed(0)
        model = build_model(cfg, 4096)[0].cuda().to(torch.bfloat16)
        if mode == "fused":
            import coda
            import coda.optim
            coda.fuse(model)
            opt = coda.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
        ms = head_ms(model, opt, mode, ids, 5)
        f = head_loss(model, mode.startswith("fused"), ids)
        f = torch.compile(f) if "+compile" in mode else f
        h = torch.randn(*ids.shape, cfg["hidden"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            f(h).backward()
            opt.step()
            torch.cuda.synchronize()
        ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
        tot = {}
        for e in ev:
            tot[e.name] = tot.get(e.name, 0.0) + e.device_time / 1e3
        print(f"{mode}: {ms:.2f} ms per pass queued; one profiled pass: {sum(tot.values()):.2f} ms of kernels")
        for name, t in sorted(tot.items(), key=lambda x: -x[1])[:args.top]:
            print(f"  {t:7.3f}  {name[:120]}")
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
