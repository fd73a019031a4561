"""What every op in ``coda.ops`` shares: which GEMM runs the work on a given device.

- a Hopper (sm_90) GPU: ``coda.gemm`` (the fused CuTeDSL kernels);
- CPU tensors: ``coda.reference.gemm_wide`` (the same epilogue programs as torch ops, fp32 math; float32 / float64
  inputs are taken too and computed in their own precision, so ``torch.autograd.gradcheck`` works; autocast off) --
  the documented reference path, so models built with CODA run and test anywhere;
- any other GPU: a clear error (``coda.reference.gemm`` can be called explicitly; it is never substituted silently).
"""
from __future__ import annotations

import functools
import hashlib
import pathlib
import sys

import torch
from torch.autograd.function import once_differentiable

from coda import _device
from coda.runtime import precompile as _precompile
from coda.epilogues.adamw import adamw
from coda.optim import compile_slots, eager_backward, in_backward_operands, update_config


def gemm_for(device: torch.device, entry: str = "coda.ops"):
    """The GEMM function for tensors on ``device`` (see the module docstring)."""
    if device.type == "cpu":
        from coda.reference import gemm_wide
        return gemm_wide
    _device.require_hopper(device, entry)
    from coda.gemm import gemm
    return gemm


IN_DTYPES = (torch.bfloat16, torch.float16)  # what the kernels read; float32 / float64 only on the CPU path


def check_inputs(entry: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    """dtypes and devices of an op's ``x`` and ``weight``, named as the user passed them: both bfloat16 or both
    float16; on CPU tensors (the reference path) both float32 or both float64 too (``TypeError``); one device
    (``ValueError``)."""
    cpu = x.device.type == "cpu"
    allowed = IN_DTYPES + ((torch.float32, torch.float64) if cpu else ())
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in allowed:
            names = ", ".join(str(d).replace("torch.", "") for d in allowed)
            raise TypeError(f"{entry}: {name}: expected dtype {names}"
                            f"{'' if cpu else ' (float32 / float64 only on CPU tensors, the reference path)'}; "
                            f"got {str(t.dtype).replace('torch.', '')}")
    if x.dtype != weight.dtype:
        raise TypeError(f"{entry}: x and weight must have the same dtype; got x {x.dtype} and weight "
                        f"{weight.dtype}".replace("torch.", ""))
    if x.device != weight.device:
        raise ValueError(f"{entry}: x and weight must be on the same device; got x on {x.device} and weight on "
                         f"{weight.device}")


def kernel_aligned(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether CODA's kernel reads ``a @ b.T`` as given (``coda.gemm``'s 16-byte row rules)."""
    from coda._validate import check_gemm_args
    try:
        check_gemm_args(a, b)
    except ValueError:
        return False
    return True


def epilogue_pass(gemm, like: torch.Tensor, M: int, N: int, **kw):
    """The epilogue alone over an M x N result: a K = 0 GEMM (nothing to multiply; CODA's kernel runs only the
    epilogue, one pass over its operands). ``like`` gives the (empty) inputs' dtype and device."""
    return gemm(like.new_empty(M, 0), like.new_empty(N, 0), **kw)


def backward_gemm(a: torch.Tensor, b: torch.Tensor, entry: str = "coda.ops") -> torch.Tensor:
    """``a @ b.T`` for a backward product (dX = dY W, dW = dY^T X) whose operands are transposed views.

    Runs on CODA's kernel (``gemm_for``: MN-major operands are read without copies) when the shapes meet its
    16-byte row alignment; when they do not (e.g. a forward output width N that is not a multiple of 8 makes dX's
    contraction rows unaligned), on ``torch.matmul`` -- the documented fallback for unaligned shapes, tested in
    tests/test_ops_linear.py."""
    if a.dtype not in IN_DTYPES or not kernel_aligned(a, b):  # float32 / float64: the CPU reference path
        from coda.reference import no_autocast
        with no_autocast(a.device):
            return torch.matmul(a, b.transpose(-1, -2))
    return gemm_for(a.device, entry)(a, b)


def linear_grads(dacc: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_x: bool, need_w: bool,
                 entry: str = "coda.ops"):
    """(dX, dW) of a linear layer from the gradient of its accumulator: dX = dacc W (W^T an MN-major view) and
    dW = dacc^T X (both operands transposed views), each through :func:`backward_gemm` (dW: :func:`weight_grad`);
    None where not needed. dX first: it reads the weight that dW's GEMM may update."""
    dx = backward_gemm(dacc, weight.t(), entry) if need_x else None
    dw = weight_grad(dacc, x, weight, entry) if need_w else None
    return dx, dw


def update_in_backward(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, entry: str, epilogue=adamw,
                       **operands):
    """The optimizer step of ``weight`` in the epilogue of its gradient's GEMM ``a @ b.T`` (``coda.optim``), when
    this is an eager backward, an optimizer registered ``weight`` and the GEMM runs on CODA's kernel (or the CPU
    reference): returns the epilogue's results, else None (the caller forms dW). ``epilogue``: ``epilogues.adamw``'s
    ``adamw``, or a variant with its extra ``operands`` (``adamw_fold``: gamma; ``adamw_scaled`` over a K = 0 pass:
    t, s). The weight's caller must have finished every product that reads it (dX)."""
    if not (weight.device.type == "cpu" or (a.dtype in IN_DTYPES and weight.dtype in IN_DTYPES
                                            and kernel_aligned(a, b))):
        return None
    ops = in_backward_operands(weight)
    if ops is None:
        return None
    # the reference path takes no config
    cfg = {"config": update_config(a.shape[-1] == 0, weight.shape, _device.sm_count(weight.device))
           } if weight.is_cuda else {}
    return gemm_for(weight.device, entry)(a, b, epilogue=epilogue, out=ops["p"], **cfg, **operands, **ops)


def weight_grad(dacc: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, entry: str = "coda.ops"):
    """dW = dacc^T X, or -- updated in its GEMM's epilogue (:func:`update_in_backward`) -- the empty 1-D tensor
    that :func:`grad_of` turns into no gradient."""
    if update_in_backward(weight, dacc.t(), x.t(), entry) is not None:
        return weight.new_empty(0)
    return backward_gemm(dacc.t(), x.t(), entry)


def grad_of(g):
    """A backward op's result as autograd's gradient: None for the empty 1-D tensor an op returns for a weight
    updated in backward (or a gradient not needed); a tensor of an empty 2-D input keeps its shape."""
    return None if g is None or (g.dim() == 1 and g.numel() == 0) else g


def save_preact_for(entry: str, save_preact, *tensors) -> bool:
    """Whether the forward stores its pre-activation: ``save_preact`` (a bool, else ``TypeError``) and autograd
    records the call (grad mode on, one of ``tensors`` requiring grad); what only the backward reads is not written
    otherwise."""
    if not isinstance(save_preact, bool):
        raise TypeError(f"{entry}: save_preact must be True or False, got {type(save_preact).__name__}")
    return save_preact and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def check_tensors(entry: str, named) -> None:
    """``TypeError`` naming the first of the (name, value) pairs that is not a tensor."""
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{entry}: {name} must be a torch.Tensor, got {type(t).__name__}")


def check_last_dim_contiguous(entry: str, named) -> None:
    """``ValueError`` naming the first tensor whose last dim is not contiguous (the ops never copy silently)."""
    for name, t in named:
        if t.numel() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{entry}: {name}: the last dim must be contiguous (stride 1), got strides "
                             f"{tuple(t.stride())}; call .contiguous() if a copy is acceptable")


# ------------------------------------------------------------------------------------------------ custom ops
# Every op is a torch.library custom op (torch.compile sees one opaque node per op). In eager mode the dispatcher
# costs ~40 us of host time per call (a trivial custom op: 48 us, an autograd.Function: 5 us on the CI CPU), so
# there :func:`call` runs the op's own implementation, context and backward through an autograd.Function instead.
EAGER_FUNCTIONS = True  # False: eager calls go through the dispatcher too (torch.ops.coda.<name>), as under compile
_impls: dict = {}  # name -> (what call() runs outside the dispatcher, the custom op)
_eager: dict = {}  # name -> (implementation, backward, setup_context): the eager autograd.Functions' parts


def custom_op(name: str, eager=None, mutates_args: tuple = ()):
    """``torch.library.custom_op("coda::<name>", mutates_args=mutates_args)`` that also records the implementation
    for :func:`call`: the decorated function, or ``eager`` where the op's own must do more (e.g. copy results that
    alias its inputs, which a custom op may not return)."""
    def wrap(fn):
        op = torch.library.custom_op(f"coda::{name}", fn, mutates_args=mutates_args)
        _impls[name] = (eager or fn, op)
        register = op.register_fake

        def register_fake(fake):  # the fake first makes the ops inductor fallbacks (inductor_fallbacks) and tags
            # torch.compile's caches with this CODA's sources (tag_compile_caches)
            @functools.wraps(fake)
            def run(*args, **kwargs):
                inductor_fallbacks()
                tag_compile_caches()
                return fake(*args, **kwargs)
            return register(run)
        op.register_fake = register_fake
        return op
    return wrap


_fallbacks: set = set()  # the ops made inductor fallbacks
_tag: list = []  # the cache key tag tag_compile_caches() added, once per process


@functools.lru_cache(maxsize=None)
def package_source_hash() -> str:
    """sha256 of every Python source of the installed ``coda``, ``coda.ops`` and ``coda.epilogues`` packages (what
    the ops do under torch.compile: :func:`tag_compile_caches`)."""
    import coda
    import coda.epilogues
    h = hashlib.sha256()
    for base in (pathlib.Path(coda.__file__).resolve().parent, pathlib.Path(__file__).resolve().parent,
                 pathlib.Path(coda.epilogues.__file__).resolve().parent):
        for f in sorted(base.rglob("*.py")):
            h.update(str(f.relative_to(base)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def tag_compile_caches() -> None:
    """Add CODA's version and a hash of its Python sources (``coda``, ``coda.ops``, ``coda.epilogues``) to
    ``torch.compiler.config.cache_key_tag`` (appended to a user's own tag), once per process: run by the ops' fake
    implementations, so while torch.compile traces, before it looks a graph up in its FX graph and AOT autograd
    caches. Those caches key a graph by the graph, not by what the custom ops in it do: after CODA changed what an op
    returns or saves for the same arguments (an upgrade, an edit), a stale compiled graph from the old CODA was
    served (session 43: a weight that the compiled backward no longer updated as it should)."""
    if _tag:
        return
    try:
        from coda.runtime.keys import coda_version
        tag = f"coda-{coda_version()}-{package_source_hash()[:16]}"
        cfg = torch.compiler.config
        if tag not in cfg.cache_key_tag:
            cfg.cache_key_tag = f"{cfg.cache_key_tag}+{tag}" if cfg.cache_key_tag else tag
        _tag.append(tag)
    except Exception:  # no such config (an older torch): the caches as they are
        _tag.append(None)


def inductor_fallbacks() -> None:
    """Every CODA op as an explicit inductor fallback, with the layout constraint inductor would choose itself (its
    implicit path in torch/_inductor/graph.py's call_function), once inductor's lowering module is loaded: run by
    the ops' fake implementations, so under torch.compile before inductor lowers a graph. Why: torch 2.11's
    implicit path formats each op's arguments for an INFO log line eagerly -- the string of every IR node upstream,
    nested -- which grows faster than quadratically with a graph's chain of custom ops (a fused llama-1b step with
    the attention fused under compile had no first step after 8 minutes on an H200; on the CPU 8 layers took 107 s
    against 19 s for 4); torch 2.13 defers that string. Where the private API differs, nothing is registered and
    inductor takes its implicit path as before."""
    if len(_fallbacks) == len(_impls):
        return
    low = sys.modules.get("torch._inductor.lowering")
    if low is None:
        return
    try:
        from torch._library.utils import get_layout_constraint_tag
        for name in [n for n in _impls if n not in _fallbacks]:
            op = getattr(torch.ops.coda, name).default
            if op not in low.lowerings:
                constraint = low.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
                low.make_fallback(op, layout_constraint=constraint)
            _fallbacks.add(name)
    except Exception:  # a moved private API: inductor's implicit fallbacks, as without this
        _fallbacks.update(_impls)


def _spec(args) -> tuple:
    """The structure of a call's arguments: a list's length, -1 for anything else (autograd.Function takes tensors
    as separate arguments only, so list arguments travel flattened)."""
    return tuple(len(a) if isinstance(a, list) else -1 for a in args)


def _flatten(spec, items) -> list:
    """One entry per argument -> the flat form; a list argument's entry may be None (a gradient: None each)."""
    flat = []
    for n, v in zip(spec, items):
        flat.extend([v] if n < 0 else ([None] * n if v is None else v))
    return flat


def _nest(spec, flat) -> list:
    args, i = [], 0
    for n in spec:
        args.append(flat[i] if n < 0 else list(flat[i:i + n]))
        i += 1 if n < 0 else n
    return args


def _plain(a):
    if isinstance(a, list):
        return [_plain(v) for v in a]
    return a.detach() if isinstance(a, torch.Tensor) else a


def register_autograd(name: str, backward, setup_context) -> None:
    """The custom op ``name``'s ``register_autograd(backward, setup_context=setup_context)``, and what
    :func:`_function` builds its eager autograd.Functions from."""
    impl, op = _impls[name]
    op.register_autograd(backward, setup_context=setup_context)
    _eager[name] = (impl, backward, setup_context)


@functools.lru_cache(maxsize=None)
def _function(name: str, spec: tuple):
    """The eager autograd.Function of op ``name`` for arguments of structure ``spec`` (:func:`_spec`; its flat
    arguments are the Function's, so ``ctx.needs_input_grad`` is the custom op's wherever no argument is a list):
    the op's implementation, ``setup_context`` and ``backward`` (its ctx carries ``coda_eager = True``). As through
    torch.library, an op returning a list has its backward called with one list of gradients, and a list argument
    gets one list (or None) of gradients."""
    impl, backward, setup_context = _eager[name]

    def forward(ctx, *flat):
        args = _nest(spec, flat)
        out = impl(*(_plain(a) for a in args))
        ctx.coda_eager, ctx.coda_list_out = True, isinstance(out, list)
        setup_context(ctx, args, out)
        return tuple(out) if isinstance(out, (tuple, list)) else out

    # once_differentiable: the backward's kernels are not differentiable, so a double backward raises (as it does
    # through the custom op, whose backward op has no autograd) instead of differentiating only its torch parts
    @once_differentiable
    def eager_backward(ctx, *grads):
        return tuple(_flatten(spec, backward(ctx, list(grads)) if ctx.coda_list_out else backward(ctx, *grads)))

    return type(f"Eager_{name}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(eager_backward)})


def eager_call() -> bool:
    """Whether :func:`call` would run an op outside the dispatcher now (no torch.compile / export tracing, no
    ``coda.precompile(..., dispatcher=True)`` dry run, ``EAGER_FUNCTIONS``)."""
    rec = _precompile.recorder()
    return EAGER_FUNCTIONS and not torch.compiler.is_compiling() and not (rec is not None and rec.dispatcher)


def graph_call() -> bool:
    """Whether an op's entry is being traced into a graph (torch.compile / export) or runs a ``coda.precompile(...,
    dispatcher=True)`` dry run of one: what picks the ops' in-place update twins for ``coda.optim`` (``slots``)."""
    rec = _precompile.recorder()
    return torch.compiler.is_compiling() or (rec is not None and rec.dispatcher)


def update_args(*weights, when: bool = True) -> list:
    """The trailing (slots, token) arguments an op's entry passes when a compiled graph (:func:`graph_call`) should
    update ``weights`` in its backward (``coda.optim.compile_slots``; ``when``: the entry's own condition, e.g. grad
    mode on), else none: ``call(name, *args, *update_args(w))``."""
    if not (when and graph_call()):
        return []
    slots, token = compile_slots(*weights)
    return [slots, token] if slots else []


def call(name: str, *args, ctx=None):
    """Run ``torch.ops.coda.<name>(*args)``: through the dispatcher under torch.compile / export (and in the
    backward of a call that went through it: ``ctx`` without ``coda_eager``; and in a ``coda.precompile(...,
    dispatcher=True)`` dry run); otherwise the op's implementation,
    through its eager autograd.Function when it has one (:func:`register_autograd`)."""
    if not eager_call() or (ctx is not None and not getattr(ctx, "coda_eager", False)):
        return getattr(torch.ops.coda, name)(*args)
    if name not in _eager:
        if ctx is not None:  # an eager backward: weights may be updated in place (coda.optim)
            with eager_backward():
                return _impls[name][0](*args)
        return _impls[name][0](*args)
    spec = _spec(args)
    return _function(name, spec).apply(*_flatten(spec, args))
