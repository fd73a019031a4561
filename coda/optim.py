"""``coda.optim.AdamW``: torch's AdamW whose update of each CODA-fused weight runs inside the backward, where that
weight's gradient is formed, so that the gradient is never stored (the optimizer in the backward's epilogue).

A weight's gradient dW = dY^T X is a GEMM of CODA's kernel; its epilogue holds a dW tile in registers. There the
epilogue (``epilogues/adamw.py``) reads the weight and its two moments, applies torch's fused AdamW update in fp32
and writes them back in place; the cross entropy's fast mode keeps the logits' gradient for the backward and runs the
LM head's dW GEMM there with the update in its epilogue (``ops/cross_entropy_fast.py``: when it fits
``DEFER_BUDGET``), else forms dW in the forward and applies the update in the K = 0 pass that scales dW by the
upstream gradient. Parameters whose gradient no CODA op forms
(embeddings, norm weights, anything stock) are updated by ``step()`` exactly as ``torch.optim.AdamW`` (same
``fused`` / ``foreach`` options); with ``kernel_step=True`` a large 16-bit matrix (at least ``KERNEL_STEP_MIN``
elements, rows of a multiple of 8, moments of its dtype: the input embedding; under torch.compile every weight) takes
the same AdamW epilogue over its stored gradient in one K = 0 pass of CODA's kernel (the pass the LM head's update
runs). Off by default: in the llama-1b step on the H100 (session 28) it made the optimizer's kernel time 4.9 ms
instead of 4.1 (eager; step 131.9 vs 132.3 ms, within noise) and 11.9 instead of torch's fused 10.4 under compile.
One state either way (``exp_avg``, ``exp_avg_sq``, ``step``): ``state_dict()`` is torch's.

What it buys, measured on the H100 (``python -m coda.bench.optim``, llama-1b shapes, T = 8192 tokens): memory -- no
gradient is allocated for those weights (2 bytes a parameter; for llama-1b 2.5 GB, though its step's peak is in the
activations) -- and time where the update hides under the dW GEMM's mainloop (:func:`update_config`: the epilogue
warps; gate/up dW + update 0.887 ms vs dW 0.706 + torch's step 0.276, session 23).

When it applies: in eager mode, for weights of ``coda.ops`` / ``coda.nn`` / ``coda.fuse`` ops whose dW runs on
CODA's kernel; under ``torch.compile`` (``fullgraph`` too) for the MLP's two weights, the input embedding and the LM
head (``ops.mlp``, ``ops.embedding``, the cross entropy's fast mode: all of llama-1b's parameters but the
attention's and the norms'; the attention's QKV and O weights too where the attention block is fused under compile,
``coda.nn.INDUCTOR_UNDER_COMPILE``), whose backward ops then run an in-place twin (``ops._builder``): the graph
carries each weight's slot (an int this optimizer gives the Parameter) and the optimizer's token, a 0-d tensor the
twin declares mutated so that the graph keeps and orders it (:func:`compile_slots`); at run time the twin finds the
optimizer by the slot and updates the Parameter as the eager backward does. The other weights' ops return gradients
there and ``step()`` updates them (a weight whose compiled update no live optimizer takes gets its gradient in
``.grad``). Either way for bf16 / fp16 weights, moments of the weight's dtype, the token count a multiple of 8 (on
CPU tensors the reference path does the same). An LM head tied to the input embedding is never updated in backward
(``coda.fuse`` marks it: its gradient has two parts). The training loop is unchanged (``loss.backward(); opt.step();
opt.zero_grad()``; the updated weights have no ``.grad``); what such an update cannot do, as with torchtune's
``optimizer_in_bwd`` -- gradient accumulation over several backward passes, clipping by the global norm, reading
those ``.grad`` -- needs ``in_backward=False`` (plain torch AdamW). A second in-backward update of a weight before
``step()`` raises, and so does a weight updated in backward that also received a ``.grad``.

Hyper-parameters are read from ``param_groups`` at each update (a learning-rate scheduler works as with torch): they
reach the kernels as run-time device scalars, one small host-to-device copy per group and step. With
``capturable=True`` (as torch's) the step count stays on the device and the step-dependent terms are computed there,
so a whole training step -- forward, backward with its in-backward updates, ``step()`` -- can be captured in one CUDA
graph and replayed (``torch.cuda.graph``; run one step before capturing; the learning rate is then the captured
one, as with torch's capturable AdamW and a float lr).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import threading
import weakref
from typing import Optional

import torch

__all__ = ["AdamW", "in_backward_operands", "updates_in_backward", "eager_backward", "compile_slots",
           "slot_updates"]

_local = threading.local()
_registry: dict = {}  # (data_ptr, shape) -> (weakref to the Parameter, optimizer weakref, group index)
# under torch.compile: a registered Parameter's ``_coda_slot`` (an int, kept for the Parameter's life) -> the same
# entry; the compiled graph carries the int, the backward op finds the optimizer by it at run time
_slots: dict = {}
_tokens: dict = {}  # slot -> the token of that weight, on its device, held by its optimizer (compile_slots)
_slot_ids = itertools.count()


@contextlib.contextmanager
def eager_backward():
    """Marks the eager backward of a CODA op (``ops._common.call``): only there may a weight be updated in place."""
    prev = getattr(_local, "on", False)
    _local.on = True
    try:
        yield
    finally:
        _local.on = prev


@contextlib.contextmanager
def slot_updates(weights, slots):
    """Marks the backward op that a compiled graph runs for weights it declared mutated (``ops._builder``'s
    ``<backward>_update`` ops, under torch.compile): inside, :func:`in_backward_operands` updates exactly
    ``weights`` (the tensors the op received: the Parameters, or functional copies that the graph writes back),
    each found through its ``slot`` (:func:`compile_slots`; -1: none), and no other weight."""
    prev = getattr(_local, "on", False), getattr(_local, "redirect", None)
    _local.on = True
    _local.redirect = {w.data_ptr(): s for w, s in zip(weights, slots) if w is not None and s >= 0}
    try:
        yield
    finally:
        _local.on, _local.redirect = prev


def compile_slots(*weights) -> tuple:
    """(slots, token) of ``weights`` for a compiled graph's in-backward update (read while torch.compile traces an
    op's entry): each weight's ``_coda_slot`` when an :class:`AdamW` with ``in_backward=True`` registered it and it
    requires a gradient, else -1, and the first such weight's token (a 0-d tensor on its device: the update op
    declares it mutated, so the graph keeps the op and orders it; the weights' own writes stay outside the graph,
    as in eager, because a graph may not mutate a leaf that requires grad); ``([], None)`` when no weight has a
    slot (the op then returns gradients, as before)."""
    slots = [getattr(w, "_coda_slot", -1) if w.requires_grad else -1 for w in weights]
    token = next((_tokens[s] for s in slots if s in _tokens), None)
    return (slots, token) if token is not None else ([], None)


def accumulate_grad(slot: int, grad: torch.Tensor) -> None:
    """A compiled backward's fallback for a weight it declared updated in place but that no live optimizer took
    (dropped, moments loaded in another dtype, a shape the kernel does not take): the gradient goes to the
    Parameter's ``.grad`` (added to one already there), where ``step()`` finds it."""
    entry = _slots.get(slot)
    p = entry[0]() if entry is not None else None
    if p is None:
        return
    with torch.no_grad():
        if p.grad is None:
            p.grad = grad.detach().to(p.dtype).reshape(p.shape).clone()
        else:
            p.grad.add_(grad.reshape(p.shape))


def _key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.device)


def _registered(weight: torch.Tensor) -> Optional[tuple]:
    """(Parameter, optimizer, group index) of a live :class:`AdamW` with ``in_backward=True`` holding ``weight``
    (or a detached view of the same memory), else None."""
    entry = _registry.get(_key(weight)) if _registry else None
    if entry is None:
        return None
    p, opt = entry[0](), entry[1]()
    if p is None or opt is None or p.data_ptr() != weight.data_ptr():
        return None
    return p, opt, entry[2]


def in_backward_operands(weight: torch.Tensor) -> Optional[dict]:
    """The epilogue operands of an in-backward AdamW step of ``weight`` (p, m, v and the hyper-parameters, as
    ``epilogues.adamw`` takes them), or None: not in an eager CODA backward, or no :class:`AdamW` with
    ``in_backward=True`` registered the weight. ``weight`` may be a detached view of the Parameter (same memory). A
    non-None result commits to the update: the optimizer counts it."""
    if not getattr(_local, "on", False):
        return None
    redirect = getattr(_local, "redirect", None)
    if redirect is None:
        found = _registered(weight)
    else:  # a compiled graph's update op (slot_updates): the weights it received, found by slot
        entry = _slots.get(redirect.get(weight.data_ptr(), -1))
        p, opt = (entry[0](), entry[1]()) if entry is not None else (None, None)
        found = None if p is None or opt is None or p.shape != weight.shape else (p, opt, entry[2])
    if found is None:
        return None
    p, opt, group = found
    ops = opt._in_backward(p, group)
    if ops is not None and redirect is not None:
        ops["p"] = weight.detach()  # the tensor the graph handed over (it writes it back to p if it is a copy)
    return ops


def updates_in_backward(weight: torch.Tensor) -> bool:
    """Whether an :class:`AdamW` with ``in_backward=True`` holds ``weight`` (as :func:`in_backward_operands` would
    find it in an eager backward), without committing to the update: the cross entropy's fast mode asks in its
    forward whether to leave its dW GEMM for the backward, where the update then runs in that GEMM's epilogue.
    The backward still asks :func:`in_backward_operands`, and forms the gradient when that declines."""
    found = _registered(weight)
    return found is not None and id(found[0]) not in found[1]._done


# the configs of the update's launches (coda.bench.optim, H100 / H200, llama-1b shapes): the dW GEMMs with the AdamW
# epilogue in the epilogue warps (below) when they have tiles to hide it under, 128 x 128 cooperative tiles (every
# warp on the epilogue) when they fill fewer than two waves, and for the LM head's K = 0 pass (1.47 ms vs 3.76)
# step()'s K = 0 pass: matrices of at least this many elements (the llama-1b embedding: 262 M; H100 session 26,
# torch's fused AdamW on it 2.4 ms a step, the same pass on the LM head of the same shape 1.6 ms)
KERNEL_STEP_MIN = 1 << 20


def update_config(k_zero: bool = False, mn=None, sm_count: int = 132):
    """The config of an in-backward update's dW GEMM (``mn``: its M x N, the weight's shape): 128 x 256 tiles whose
    epilogue runs in the epilogue warps (``epi_wg``, hidden under the next tile's mainloop); with fewer 128 x 256
    tiles than two waves of ``sm_count`` SMs, and for a K = 0 pass (``k_zero``: nothing to hide under), cooperative
    tiles with every consumer warp on the epilogue: 128 x 192 (static schedule) where they fill the waves as well
    as 128 x 128 do, else 128 x 128 (dynamic schedule). Measured (``python -m coda.bench.optim``, ms): H100,
    session 23: gate/up 16384 x 2048 (with dgamma) 0.887 vs 0.995 at 128 x 128; down 2048 x 8192 0.433 vs 0.600
    heuristic (cuBLAS dW 0.387); H200, session 26: qkv 3072 x 2048 (192 tiles) 0.188 at 128 x 128 vs 0.211 in the
    epilogue warps, o 2048 x 2048 0.129 vs 0.130, down 0.421 vs 0.502, gate/up 0.855 vs 0.988; H100, session 35:
    qkv 0.184 at 128 x 192 static (264 tiles: two full waves) vs 0.196 at 128 x 128 dynamic (o: 128 x 192 leaves
    a third of its second wave empty, 0.173 vs 0.133)."""
    from coda.config import GemmConfig, epi_wg_config
    small = GemmConfig(tile_m=128, tile_n=128, cluster_m=2, sched="dynamic", epi_n=32)
    if k_zero:
        return small
    if mn is None:
        return epi_wg_config()
    tiles = {n: -(-mn[0] // 128) * -(-mn[1] // n) for n in (256, 192, 128)}
    if tiles[256] >= 2 * sm_count:
        return epi_wg_config()

    def filled(n):  # the output's share of the waves' tile slots (ragged edge tiles count as whole slots)
        return mn[0] * mn[1] / (-(-tiles[n] // sm_count) * sm_count * 128 * n)
    return GemmConfig(tile_m=128, tile_n=192, cluster_m=2, epi_n=32) if filled(192) >= filled(128) else small


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (same arguments) with ``in_backward`` (default True): update CODA-fused weights inside
    the backward (module docstring). Create it after ``coda.fuse`` (it registers the Parameters it holds)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 *, in_backward: bool = True, kernel_step: bool = False, **kwargs):
        for name, flag in (("in_backward", in_backward), ("kernel_step", kernel_step)):
            if not isinstance(flag, bool):
                raise TypeError(f"coda.optim.AdamW: {name} must be True or False, got {flag!r}")
        if in_backward and any(kwargs.get(k) for k in ("amsgrad", "maximize", "differentiable")):
            raise ValueError("coda.optim.AdamW: in_backward=True supports neither amsgrad, maximize nor "
                             "differentiable; pass in_backward=False")
        if isinstance(lr, bool) or not isinstance(lr, (float, int)):
            raise TypeError(f"coda.optim.AdamW: lr must be a float, got {type(lr).__name__}")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
        self.in_backward, self.kernel_step = in_backward, kernel_step
        self._done: dict = {}  # id(p) -> p: updated in backward since the last step()
        self._steps: dict = {}  # id(p) -> host step count of the parameters updated in backward
        self._hyper: dict = {}  # (group, step, device, hyper-parameters) -> (8, 4) fp32 device tensor
        self._const: dict = {}  # capturable: (group, device) -> (hyper-parameters, the step-independent rows)
        self._ones: dict = {}  # device -> the K = 0 update pass's scale operand (kernel_step)
        # slot -> the token compiled graphs' update ops of that weight declare mutated (compile_slots): one per weight,
        # so that a graph's backward bumps no token another graph saved (a graph break between two layers)
        self._tokens: dict = {}
        if in_backward:
            me = weakref.ref(self)
            for gi, group in enumerate(self.param_groups):
                for p in group["params"]:
                    if p.requires_grad and not getattr(p, "_coda_no_in_backward", False):
                        _registry[_key(p)] = (weakref.ref(p), me, gi)
                        if getattr(p, "_coda_slot", None) is None:
                            p._coda_slot = next(_slot_ids)
                        _slots[p._coda_slot] = _registry[_key(p)]
                        self._tokens[p._coda_slot] = torch.zeros((), device=p.device)
                        _tokens[p._coda_slot] = self._tokens[p._coda_slot]

    # -- the in-backward update ----------------------------------------------------------------------------------
    def _in_backward(self, p: torch.Tensor, gi: int) -> Optional[dict]:
        state = self.state[p]
        if state and (state["exp_avg"].dtype != p.dtype or not state["exp_avg"].is_contiguous()
                      or not state["exp_avg_sq"].is_contiguous()):
            return None  # e.g. float32 moments loaded from a state dict: the kernel stores p's dtype only
        if id(p) in self._done:
            raise RuntimeError("coda.optim.AdamW: a weight was updated in backward twice without optimizer.step() "
                               "(gradient accumulation or a second backward): pass in_backward=False")
        group = self.param_groups[gi]
        if not state:  # torch's AdamW state layout (fused / capturable: a float32 step tensor on p's device)
            on_device = self.defaults.get("fused") or group["capturable"]
            state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if on_device
                             else torch.tensor(0.0, dtype=torch.float32))
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        from coda.epilogues.adamw import HYPER
        if group["capturable"]:  # no host read: the step's terms from the device step count
            hyper = self._hyper_on_device(gi, group, state["step"], p.device)
        else:
            if id(p) not in self._steps:  # first in-backward update (or resumed from a state dict): one host read
                self._steps[id(p)] = int(state["step"].item())
            hyper = self._hyper_tensor(gi, group, self._steps[id(p)] + 1, p.device)
        self._done[id(p)] = p
        ops = dict(p=p.detach(), m=state["exp_avg"], v=state["exp_avg_sq"])
        ops.update({name: hyper[i, :1] for i, name in enumerate(HYPER)})
        return ops

    def _hyper_tensor(self, gi: int, group: dict, t: int, device) -> torch.Tensor:
        lr, (b1, b2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
        key = (gi, t, device, lr, b1, b2, eps, wd)
        h = self._hyper.get(key)
        if h is None:
            vals = [b1, 1.0 - b1, b2, 1.0 - b2, 1.0 / math.sqrt(1.0 - b2 ** t), eps, lr / (1.0 - b1 ** t),
                    1.0 - lr * wd]
            # one 16-byte row per value: each Scalar operand h[i, :1] starts 16-byte aligned, as the kernel's
            # tensor arguments must
            host = torch.tensor(vals, dtype=torch.float32).unsqueeze(1).repeat(1, 4)
            if device.type == "cuda":
                host = host.pin_memory()
            h = self._hyper[key] = host.to(device, non_blocking=True)
        return h

    def _hyper_on_device(self, gi: int, group: dict, step: torch.Tensor, device) -> torch.Tensor:
        """``_hyper_tensor``'s rows with t = step + 1 read on the device (``capturable``): a few small kernels
        once per group and step, no host read, so that a CUDA graph of the step replays with the right t. The
        group's parameters share one step count (as torch's steps keep them); the step-independent rows are
        made once, outside any capture (the first update of a group, e.g. in the warm-up before a capture)."""
        key = (gi, device)
        h = self._hyper.get(key)
        if h is not None:
            return h
        lr, (b1, b2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
        made, const = self._const.get(key, (None, None))
        if made != (lr, b1, b2, eps, wd):  # the first update of the group, or its hyper-parameters changed
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("coda.optim.AdamW(capturable=True): run one step before the capture (the "
                                   "hyper-parameters changed, or this is the first step)")
            const = self._hyper_tensor(gi, group, 1, device)
            self._const[key] = ((lr, b1, b2, eps, wd), const)
        t = step.to(device=device, dtype=torch.float32) + 1.0
        h = const.clone()
        h[4].copy_(torch.rsqrt(1.0 - torch.pow(b2, t)).expand(4))
        h[6].copy_((lr / (1.0 - torch.pow(b1, t))).expand(4))
        self._hyper[key] = h
        return h

    # -- step ------------------------------------------------------------------------------------------------------
    def _on_kernel(self, p: torch.Tensor, group: dict) -> bool:
        """Whether ``step()`` updates ``p`` by the AdamW epilogue's K = 0 pass over its ``.grad`` (module
        docstring): a dense, contiguous 16-bit matrix with rows of a multiple of 8 and at least ``KERNEL_STEP_MIN``
        elements, its gradient of its dtype, moments (if any yet) of its dtype, plain tensors (not a DTensor shard),
        on a Hopper GPU or the CPU (the reference path), in a group without amsgrad / maximize."""
        from coda import _device
        from coda.ops._common import IN_DTYPES
        g = p.grad
        if (g is None or type(p.data) is not torch.Tensor or type(g) is not torch.Tensor  # a DTensor (FSDP2): torch
                or p.dim() != 2 or p.dtype not in IN_DTYPES or g.dtype != p.dtype or g.layout != torch.strided
                or p.numel() < KERNEL_STEP_MIN or p.shape[1] % 8 or not p.is_contiguous() or not g.is_contiguous()
                or group["amsgrad"] or group["maximize"] or group.get("differentiable")):
            return False
        if p.is_cuda and not _device.is_hopper(p.device):
            return False
        state = self.state[p]
        return not state or all(state[k].dtype == p.dtype and state[k].is_contiguous()
                                for k in ("exp_avg", "exp_avg_sq"))

    def _kernel_updates(self) -> list:
        """Run ``step()``'s K = 0 update passes (``epilogues.adamw.adamw_scaled`` with t = the gradient, s = 1, in
        place on p, m, v); returns the parameters updated (their ``.grad`` stays)."""
        from coda import _device
        from coda.epilogues.adamw import adamw_scaled
        from coda.ops._common import epilogue_pass, gemm_for
        out = []
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if id(p) in self._done or not self._on_kernel(p, group):
                    continue
                ops = self._in_backward(p, gi)  # state, hyper-parameter rows; counted with the in-backward ones
                N, K = p.shape
                cfg = {"config": update_config(True, p.shape, _device.sm_count(p.device))} if p.is_cuda else {}
                one = self._ones.get(p.device)
                if one is None:  # the scale s = 1 (a 16-byte aligned fp32 Scalar operand), one per device
                    one = self._ones[p.device] = torch.ones(4, dtype=torch.float32, device=p.device)[:1]
                epilogue_pass(gemm_for(p.device, "coda.optim.AdamW.step"), p, N, K, epilogue=adamw_scaled,
                              out=ops["p"], t=p.grad, s=one, **cfg, **ops)
                out.append(p)
        return out

    @torch.no_grad()
    def step(self, closure=None):
        """torch's AdamW step for every parameter with a ``.grad``, large 16-bit matrices by CODA's K = 0 pass
        (``kernel_step``); the parameters updated in backward since the last step only have their ``step``
        counts advanced."""
        for p in self._done.values():
            if p.grad is not None:
                raise RuntimeError(f"coda.optim.AdamW: a weight of shape {tuple(p.shape)} was updated in backward "
                                   "and also received a gradient (used outside the CODA op too, e.g. tied "
                                   "weights): pass in_backward=False")
        kernel = self._kernel_updates() if self.kernel_step and closure is None else []
        held = [(p, p.grad) for p in kernel]
        for p, _ in held:  # torch's step skips them
            p.grad = None
        try:
            loss = super().step(closure)
        finally:
            for p, g in held:
                p.grad = g
        done = list(self._done.values())
        if done:
            steps = [self.state[p]["step"] for p in done]
            if steps[0].is_cuda:
                torch._foreach_add_(steps, 1.0)
            else:
                for s in steps:
                    s.add_(1.0)
            for p in done:
                if id(p) in self._steps:
                    self._steps[id(p)] += 1
        mine = {id(p) for p in done}
        for group in self.param_groups:  # torch's step advanced these: their host counts are re-read if needed
            for p in group["params"]:
                if p.grad is not None and id(p) in self._steps and id(p) not in mine:
                    del self._steps[id(p)]
        self._done.clear()
        self._hyper.clear()
        return loss

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._steps.clear()  # re-read from the loaded state at the next in-backward update
        self._hyper.clear()
