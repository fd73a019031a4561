"""``coda.precompile(fn, *args, **kwargs)``: run one training step as a dry run, then compile every kernel it met in
parallel worker processes into the disk cache, so that the real first step only loads them (issue 31).

The step runs under ``coda.runtime.precompile.recording`` (see that module for the design: dry run -> recipes ->
spawned workers -> disk cache -> the real step loads): CODA's kernels are neither compiled nor launched, their
outputs stay unwritten, every torch op runs as usual on them. ``fn`` is typically the forward and
``loss.backward()`` of one batch -- never ``optimizer.step()`` (it would apply the garbage gradients). What the dry
run leaves behind is undone here:

- the ``.grad`` of every parameter of the modules that ran (and of ``coda.optim.AdamW``'s parameters and of tensor
  arguments that require grad) is put back as it was: None, or a copy of the gradient held before;
- ``coda.optim.AdamW``'s in-backward bookkeeping (``_done``, ``_steps``, ``_hyper`` and the state it created): the
  dry run still meets the in-backward update's dW kernels -- those are what the real step runs -- but commits
  nothing (the weights and moments were never written: the kernels did not run);
- the CPU and current CUDA device's random number generators (dropout draws the same masks in the real step).

Module buffers changed by a forward (batch-norm statistics) are not restored. ``fn`` runs eagerly; for a step that
will run under ``torch.compile`` pass the uncompiled model's step with ``dispatcher=True``: the ops then go through
torch's dispatcher as they do in a compiled graph (``ops._common.call`` sees the dry run's recorder; their
backward returns the gradients a compiled graph's does: none for the weights a compiled ``ops.mlp`` updates in its
backward, ``ops._builder``'s update twins), so the dry run meets the compiled step's kernels (those
whose operands inductor lays out differently still compile in the step). The worker processes use ``multiprocessing``'s
"spawn", which imports the main script again in each worker: a script must keep its top-level code under
``if __name__ == "__main__":`` (Python's rule for spawned processes).
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Optional

import torch

from .runtime import precompile as _pc


def precompile(fn, *args, workers: Optional[int] = None, dispatcher: bool = False, background: bool = False,
               **kwargs):
    """Dry-run ``fn(*args, **kwargs)`` (one step's forward and backward, no optimizer step) and compile the kernels
    it needs in ``workers`` processes (default ``CODA_COMPILE_WORKERS``, else min(kernels, cores - 1, 8); 0: record
    only, the step compiles as before). ``dispatcher``: the kernels of a step that will run under torch.compile
    (module docstring). Returns a :class:`coda.runtime.precompile.Summary` (kernels found, already cached,
    compiled, seconds). ``fn``'s result is discarded (computed from unwritten kernel outputs).

    ``background=True``: return as soon as the workers are started, a :class:`coda.runtime.precompile.Background`
    (``.wait()`` gives the Summary): the caller goes on -- typically torch.compile tracing and compiling the step
    while CODA's kernels compile beside it -- and a kernel the step meets while its worker is still compiling it is
    waited for and loaded, not compiled twice."""
    if not callable(fn):
        raise TypeError(f"coda.precompile: fn must be callable (one training step), got {type(fn).__name__}")
    for name, flag in (("dispatcher", dispatcher), ("background", background)):
        if not isinstance(flag, bool):
            raise TypeError(f"coda.precompile: {name} must be True or False, got {flag!r}")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)):
        raise TypeError(f"coda.precompile: workers must be an int or None, got {type(workers).__name__}")
    if workers is not None and workers < 0:
        raise ValueError(f"coda.precompile: workers must be >= 0, got {workers}")
    t0 = time.perf_counter()
    with _restored(args, kwargs), _pc.recording(dispatcher) as rec:
        fn(*args, **kwargs)
    out = _pc.compile_recipes(rec.pending(), workers, background)
    summary = out.summary if background else out
    summary.found += len(rec.in_memory)
    summary.cached += len(rec.in_memory)
    summary.seconds = time.perf_counter() - t0
    return out


@contextlib.contextmanager
def _restored(args, kwargs):
    """Undo what a dry run of a step leaves: gradients, coda.optim.AdamW's bookkeeping, the RNG states."""
    grads: dict = {}  # id(p) -> (p, grad before or None)
    seen: set = set()

    def keep(p):
        if id(p) not in grads:
            g = p.grad
            grads[id(p)] = (p, None if g is None else g.detach().clone())

    def pre_hook(module, inputs):
        if id(module) not in seen:
            seen.add(id(module))
            for p in module.parameters():
                keep(p)

    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.nn.Module):
            pre_hook(a, ())
        elif isinstance(a, torch.Tensor) and a.requires_grad and a.is_leaf:
            keep(a)
    opts = _in_backward_optimizers()
    for opt in opts:
        for group in opt.param_groups:
            for p in group["params"]:
                keep(p)
    saved = [(opt, dict(opt._done), dict(opt._steps), dict(opt._hyper), {id(p) for p in opt.state})
             for opt in opts]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    handle = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        handle.remove()
        for p, g in grads.values():
            p.grad = g
        for opt, done, steps, hyper, state in saved:
            for d, old in ((opt._done, done), (opt._steps, steps), (opt._hyper, hyper)):
                d.clear()
                d.update(old)
            for p in [p for p in opt.state if id(p) not in state]:
                del opt.state[p]


def _in_backward_optimizers() -> list:
    """Every live ``coda.optim.AdamW`` registered for in-backward updates (none if coda.optim was never imported)."""
    optim = sys.modules.get("coda.optim")
    if optim is None:
        return []
    opts = {}
    for _, oref, _ in list(optim._registry.values()):
        opt = oref()
        if opt is not None:
            opts[id(opt)] = opt
    return list(opts.values())
