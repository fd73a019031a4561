"""``coda.nn``: drop-in modules built on ``coda.ops`` (issue 4), parameters kept in CODA's layout, checkpoints in the
stock layout.

- :class:`RMSNormLinear`: RMSNorm followed by one or more projections that share it (q/k/v, ...): one
  ``coda.ops.rmsnorm_linear`` call on the concatenated weight (gamma applied per call to the cheaper GEMM operand,
  x or the weight; the row scale in the GEMM epilogue, the whole norm backward in the dX GEMM's epilogue).
- :class:`SwiGLUMLP`: RMSNorm -> gate/up -> SiLU(gate) * up -> down (-> + residual). The norm, the gate/up GEMM and
  the activation are ONE GEMM: ``coda.ops.linear`` with the pairs epilogue ``rms_swiglu``
  (``silu(g r) (u r)``, r = rsqrt(mean(x^2) + eps) a per-row operand, gamma applied to x or folded into the
  interleaved gate/up weight, whichever is smaller); the normalised activation (M x H) is never written. It is the
  custom op ``coda.ops.mlp`` (with ``residual=add_residual``): the forward also stores the pre-activation (g, u);
  in the backward the GEMM da = dy W_down writes dacc and the per-row gradient of r from them in its epilogue (da is
  never stored), and the dX GEMM's epilogue applies gamma and the norm's radial term (see ``coda.ops.mlp``).
- :class:`LMHeadCrossEntropy`: final RMSNorm + LM head + cross entropy: the norm in torch (M x H), then
  ``coda.ops.linear_cross_entropy`` (logits never stored). Called without a target it returns logits, through
  ``coda.ops.rmsnorm_linear`` (norm fused).
- :class:`DeferredRMSNorm`: identity in forward; it holds an RMSNorm's weight (and its checkpoint key) where the
  stock norm was, and the fused module that consumes its output applies it (used by :func:`coda.fuse`).

Layouts. Internally :class:`SwiGLUMLP` keeps ``weight_gu`` (2I, H) with gate/up rows interleaved (row 2j = gate_j,
row 2j+1 = up_j; ``coda.ops.interleave_gate_up``) and :class:`RMSNormLinear` one concatenated weight. ``state_dict()``
returns the stock layout (``gate_proj.weight``, ``up_proj.weight``, ``down_proj.weight``, ``norm.weight``,
``<name>.weight`` per projection) and ``load_state_dict()`` accepts it (or CODA's own layout), through state-dict
hooks; so checkpoints stay interchangeable with the unfused model. (``state_dict(keep_vars=True)`` returns
converted tensors, not the Parameters, for the converted keys.)

Device and dtype: on bfloat16 / float16 inputs (or under autocast to one of them) with aligned shapes (multiples of
8) the ``coda.ops`` run: the fused kernels on a Hopper GPU, their torch reference on CPU. Other dtypes (float32,
float64) run the same math in plain torch (``coda.ops`` are 16-bit only); shapes are checked at construction.
"""
from __future__ import annotations

import os

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from coda import ops
from coda.ops.cross_entropy import check_softcap, check_targets_option
from coda.ops.mlp import rms_swiglu, rmsnorm_swiglu  # noqa: F401 (re-exported)

__all__ = ["RMSNormLinear", "SwiGLUMLP", "LMHeadCrossEntropy", "DeferredRMSNorm", "rms_norm", "rmsnorm_swiglu",
           "rms_swiglu"]

_FUSED_DTYPES = (torch.bfloat16, torch.float16)
# Blocks whose norm / GEMM / activation are left to inductor while torch.compile traces (the stock math on the same
# weights) instead of the fused kernels: FusedAttention.inductor_under_compile, SwiGLUMLP.inductor_under_compile
# (class attributes; their defaults from CODA_INDUCTOR_UNDER_COMPILE, a comma-separated subset of "attention,mlp";
# default "none": both fused under compile, the faster one on the H200, session 43).
INDUCTOR_UNDER_COMPILE = os.environ.get("CODA_INDUCTOR_UNDER_COMPILE", "none").split(",")


def _cast(w: Tensor, dtype) -> Tensor:
    """``w.to(dtype)``, or ``w`` itself where it has that dtype: under torch.compile a ``.to`` is a graph node that
    would hide the Parameter (and its ``coda.optim`` slot) from the op."""
    return w if w.dtype == dtype else w.to(dtype)


def compiling() -> bool:
    """Whether torch.compile is tracing this call (one place to ask; tests replace it)."""
    return torch.compiler.is_compiling()


# The rows' sums of squares that a fused block's last GEMM emitted for the tensor it returned (the residual stream),
# keyed by that tensor object: the next block's RMSNorm takes r from them instead of reading the stream again
# (issue 30's chain: SwiGLUMLP's down projection -> the next FusedAttention's QKV GEMM). Valid for the same object
# at the same version only (an in-place change drops them); eager only (under torch.compile nothing is recorded).
_ROW_SUMSQ = torch.utils.weak.WeakIdKeyDictionary()
# CODA_SUMSQ_CHAIN=0 (read at import): each block reduces its input itself (A/B measurements)
SUMSQ_CHAIN = os.environ.get("CODA_SUMSQ_CHAIN", "1") != "0"


def remember_sumsq(t: Tensor, ss: Tensor, scaled: Optional[Tensor] = None, gamma: Optional[Tensor] = None) -> Tensor:
    """Record ``ss`` (t's rows' sums of squares) for :func:`recall_sumsq` and, with ``scaled`` = t * gamma, that
    product for :func:`recall_normed`; returns t."""
    if not compiling():
        _ROW_SUMSQ[t] = (ss, t._version, scaled, gamma)
    return t


def _recalled(t: Tensor):
    hit = None if compiling() else _ROW_SUMSQ.get(t)
    return hit if hit is not None and hit[1] == t._version else None


def recall_sumsq(t: Tensor) -> Optional[Tensor]:
    """The sums of squares recorded for this very tensor, unchanged since; else None."""
    hit = _recalled(t)
    return None if hit is None else hit[0]


def recall_normed(t: Tensor, gamma: Tensor) -> Optional[tuple]:
    """(t * gamma, sums of squares) recorded for this very tensor and this very gamma, unchanged since; else None."""
    hit = _recalled(t)
    return None if hit is None or hit[2] is None or hit[3] is not gamma else (hit[2], hit[0])


_ALIGN = 8  # the kernel's 16-byte rows of 16-bit elements


# ------------------------------------------------------------------------------------------------ functional pieces
def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float) -> Tensor:
    """Llama's RMSNorm (``LlamaRMSNorm``): statistics in fp32, normalised value rounded to x's dtype, then
    ``weight *``. The stock math, used by the unfused paths and where the norm is not fused."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight * y


def norm_eps(norm: nn.Module, default: Optional[float] = None) -> Optional[float]:
    """A stock RMSNorm's epsilon (``variance_epsilon`` as Llama's, or ``eps``), else ``default``."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else default


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the GEMMs run in: autocast's when it is on for x's device, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _check_aligned(owner: str, **sizes: int) -> None:
    for name, size in sizes.items():
        if size % _ALIGN:
            raise ValueError(f"{owner}: {name} = {size} must be a multiple of {_ALIGN} (CODA's GEMMs read and write "
                             "16-byte rows)")


# ------------------------------------------------------------------------------------------------ layout plumbing
class _StockLayout(nn.Module):
    """A module whose parameters live in CODA's layout but whose ``state_dict`` is in the stock layout.

    Subclasses implement ``_to_stock(local) -> dict`` (this module's keys without prefix, in CODA's layout ->
    stock keys, in stock order) and ``_from_stock(local) -> dict`` (the inverse; given only the keys present, it
    converts what it can and leaves the rest)."""

    def __init__(self):
        super().__init__()
        self._register_state_dict_hook(_save_stock)
        self._register_load_state_dict_pre_hook(_load_stock, with_module=True)

    def _to_stock(self, local: dict) -> dict:
        raise NotImplementedError

    def _from_stock(self, local: dict) -> dict:
        raise NotImplementedError


def _save_stock(module, state_dict, prefix, local_metadata):
    # runs after the module's own tensors and its children's were written: they are the last keys with the prefix,
    # so popping them and writing the stock keys keeps the order of the whole dict
    keys = [k for k in state_dict if k.startswith(prefix)]
    local = {k[len(prefix):]: state_dict.pop(k) for k in keys}
    for k, v in module._to_stock(local).items():
        state_dict[prefix + k] = v


def _load_stock(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    keys = [k for k in state_dict if k.startswith(prefix)]
    local = {k[len(prefix):]: state_dict.pop(k) for k in keys}
    for k, v in module._from_stock(local).items():
        state_dict[prefix + k] = v


class DeferredRMSNorm(nn.Module):
    """An RMSNorm whose normalisation is applied by the fused module that consumes its output: ``forward`` is the
    identity. It keeps ``weight`` (H,) and ``variance_epsilon`` where the stock norm was (same checkpoint key)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, weight: Optional[nn.Parameter] = None,
                 device=None, dtype=None):
        super().__init__()
        self.weight = weight if weight is not None else nn.Parameter(torch.ones(hidden_size, device=device,
                                                                                 dtype=dtype))
        self.variance_epsilon = float(eps)

    @classmethod
    def from_norm(cls, norm: nn.Module) -> "DeferredRMSNorm":
        """Shares ``norm.weight`` (the same Parameter: no copy, optimizer state and ties stay valid)."""
        return cls(norm.weight.shape[0], norm_eps(norm, 1e-6), weight=norm.weight)

    def forward(self, x: Tensor) -> Tensor:
        return x

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, applied by the next fused module"


class _NormConsumer(_StockLayout):
    """Owns a :class:`DeferredRMSNorm` (``self.norm``, in its state dict) or uses one registered elsewhere in the
    model (``norm=`` a module: not registered here, so its key stays where the stock norm was), or none
    (``norm=False``)."""

    def _set_norm(self, norm, hidden_size: int, eps: float, device, dtype) -> None:
        self._shared_norm = ()
        if norm is None:
            self.norm = DeferredRMSNorm(hidden_size, eps, device=device, dtype=dtype)
        elif norm is False:
            self.norm = None
        else:
            self.norm = None
            self._shared_norm = (norm,)  # a tuple: nn.Module does not register it as a child

    @property
    def norm_module(self) -> Optional[nn.Module]:
        return self._shared_norm[0] if self._shared_norm else self.norm

    @property
    def norm_weight(self) -> Optional[Tensor]:
        m = self.norm_module
        return None if m is None else m.weight

    @property
    def eps(self) -> float:
        m = self.norm_module
        return 1e-6 if m is None else m.variance_epsilon


# ------------------------------------------------------------------------------------------------ modules
class RMSNormLinear(_NormConsumer):
    """``RMSNorm(x [+ residual]) @ W.T`` for one or more projections sharing the norm, via
    ``coda.ops.rmsnorm_linear`` (one GEMM for all of them).

    ``out_features``: an int (one projection, stock keys ``norm.weight``, ``weight``) or a sequence with ``names``
    (e.g. ``(q, k, v)`` sizes and ``("q_proj", "k_proj", "v_proj")``: stock keys ``norm.weight`` and
    ``<name>.weight``; internally one concatenated ``weight``). ``norm``: None (own), a norm module registered
    elsewhere, or False (no norm: a plain linear).

    ``forward(x, residual=None)`` returns y (a tuple of one tensor per name when ``names`` is given); with a residual,
    also ``h = x + residual`` last (the residual stream for the next block)."""

    def __init__(self, in_features: int, out_features: Union[int, Sequence[int]], eps: float = 1e-6, *,
                 names: Optional[Sequence[str]] = None, norm=None, device=None, dtype=None):
        super().__init__()
        sizes = [out_features] if isinstance(out_features, int) else [int(n) for n in out_features]
        if names is not None and len(names) != len(sizes):
            raise ValueError(f"RMSNormLinear: names {tuple(names)} must give one name per projection {sizes}")
        if names is None and len(sizes) != 1:
            raise ValueError("RMSNormLinear: several projections need names (their stock state-dict keys)")
        _check_aligned("RMSNormLinear", in_features=in_features, **{f"out_features[{i}]": n
                                                                    for i, n in enumerate(sizes)})
        self.in_features, self.sizes, self.names = in_features, sizes, None if names is None else tuple(names)
        self.weight = nn.Parameter(torch.empty(sum(sizes), in_features, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)
        self._set_norm(norm, in_features, eps, device, dtype)

    @classmethod
    def from_modules(cls, norm: Optional[nn.Module], *linears: nn.Linear, names: Optional[Sequence[str]] = None,
                     share_norm: bool = False) -> "RMSNormLinear":
        """From a stock RMSNorm (or None) and bias-free ``nn.Linear`` s (weights copied once, concatenated)."""
        if any(lin.bias is not None for lin in linears):
            raise ValueError("RMSNormLinear.from_modules: projections with a bias are not supported")
        w0 = linears[0].weight
        eps = norm_eps(norm, 1e-6) if norm is not None else 1e-6
        deferred = DeferredRMSNorm.from_norm(norm) if share_norm and norm is not None else None
        out = cls(w0.shape[1], [lin.weight.shape[0] for lin in linears] if names else w0.shape[0], eps,
                  names=names, norm=deferred if share_norm else (False if norm is None else None),
                  device=w0.device, dtype=w0.dtype)
        with torch.no_grad():
            out.weight.copy_(torch.cat([lin.weight for lin in linears]))
            if out.norm is not None:
                out.norm.weight.copy_(norm.weight)
        return out

    def forward(self, x: Tensor, residual: Optional[Tensor] = None):
        dtype = _compute_dtype(x)
        gamma = self.norm_weight
        if dtype in _FUSED_DTYPES and gamma is not None:
            res = None if residual is None else residual.to(dtype)
            out = ops.rmsnorm_linear(x.to(dtype), gamma, self.weight.to(dtype), self.eps, residual=res)
            y, h = out if residual is not None else (out, None)
        else:
            h = x if residual is None else x + residual
            y = F.linear(h if gamma is None else rms_norm(h, gamma, self.eps), self.weight)
        ys = y.split(self.sizes, -1) if self.names is not None else y
        if residual is None:
            return ys
        return (*ys, h) if self.names is not None else (ys, h)

    def _to_stock(self, local):
        w = local.pop("weight")
        out = {k: local.pop(k) for k in list(local) if k.startswith("norm.")}
        if self.names is None:
            out["weight"] = w
        else:
            out.update({f"{n}.weight": p for n, p in zip(self.names, w.split(self.sizes))})
        return {**out, **local}

    def _from_stock(self, local):
        if self.names is not None and all(f"{n}.weight" in local for n in self.names):
            local["weight"] = torch.cat([local.pop(f"{n}.weight") for n in self.names])
        return local

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.sizes}, names={self.names}"


class SwiGLUMLP(_NormConsumer):
    """``[x +] down(silu(gate(n)) * up(n))`` with ``n = RMSNorm(x)``: Llama's post-attention norm + ``LlamaMLP``.

    Fused: norm + gate/up + SwiGLU are one GEMM and the down projection (+ x) a second (``coda.ops.mlp``; its
    backward forms dacc in the GEMM of da = dy W_down); without a norm, or with a ``down_proj`` that has a bias or
    is not a plain ``nn.Linear``: :func:`rmsnorm_swiglu` / ``linear_swiglu``, then ``down_proj`` and torch's add.
    ``add_residual``: add x to the output (True) or return the MLP output only (False, the
    drop-in for ``LlamaMLP`` inside a decoder layer that adds the residual itself). Parameters: ``weight_gu``
    (2I, H) interleaved, ``down_proj`` (an ``nn.Linear``), the norm (see :class:`_NormConsumer`). Stock keys:
    ``norm.weight`` (own norm only), ``gate_proj.weight``, ``up_proj.weight``, ``down_proj.weight``."""

    inductor_under_compile = "mlp" in INDUCTOR_UNDER_COMPILE

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float = 1e-6, *, add_residual: bool = True,
                 norm=None, device=None, dtype=None):
        super().__init__()
        _check_aligned("SwiGLUMLP", hidden_size=hidden_size, intermediate_size=intermediate_size)
        self.hidden_size, self.intermediate_size, self.add_residual = hidden_size, intermediate_size, add_residual
        self.weight_gu = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.weight_gu, a=5 ** 0.5)
        self._set_norm(norm, hidden_size, eps, device, dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, device=device, dtype=dtype)

    @classmethod
    def from_stock(cls, mlp: nn.Module, norm=None, *, add_residual: bool = False, share: bool = True,
                   eps: float = 1e-6) -> "SwiGLUMLP":
        """From a ``LlamaMLP``-like module (``gate_proj``, ``up_proj``, ``down_proj``, no biases). gate/up are
        interleaved once; ``down_proj`` is the same module (``share=True``) or a copy. ``norm``: a norm module to
        share (e.g. a :class:`DeferredRMSNorm`), None for an own norm (initialised to ones), or False."""
        g, u, d = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj
        out = cls(g.shape[1], g.shape[0], eps, add_residual=add_residual, norm=norm, device="meta", dtype=g.dtype)
        with torch.no_grad():
            out.weight_gu = nn.Parameter(ops.interleave_gate_up(g, u), requires_grad=g.requires_grad)
        if out.norm is not None:
            out.norm = DeferredRMSNorm(g.shape[1], eps, device=g.device, dtype=g.dtype)
        out.down_proj = d if share else nn.Linear(d.in_features, d.out_features, bias=False, device=g.device,
                                                  dtype=g.dtype).requires_grad_(d.weight.requires_grad)
        if not share:
            with torch.no_grad():
                out.down_proj.weight.copy_(d.weight)
        return out

    def gate_up(self) -> tuple[Tensor, Tensor]:
        """(w_gate, w_up) views of ``weight_gu`` (the stock weights)."""
        return ops.deinterleave_gate_up(self.weight_gu)

    def forward(self, x: Tensor, normed: Optional[tuple] = None, sumsq_out: Optional[list] = None) -> Tensor:
        """``normed``: (x * gamma, x's rows' sums of squares) formed by x's producer (coda.fuse's layer forward
        passes what FusedAttention's o_proj epilogue emitted), else looked up (``recall_normed``) or computed.
        ``sumsq_out`` (under torch.compile, from coda.fuse's layer forward): a list to which (the output, its rows'
        sums of squares from the down projection's epilogue) is appended for the next layer's norm."""
        dtype, gamma = _compute_dtype(x), self.norm_weight
        if dtype in _FUSED_DTYPES and compiling() and self.inductor_under_compile:
            n = x if gamma is None else rms_norm(x, gamma, self.eps)
            y = F.linear(n.to(dtype), self.weight_gu.to(dtype))  # interleaved (gate, up) columns
            a = F.silu(y[..., 0::2]) * y[..., 1::2]
        elif dtype in _FUSED_DTYPES and gamma is not None and type(self.down_proj) is nn.Linear \
                and self.down_proj.bias is None:  # norm + gate/up + SwiGLU + down [+ x]: ops.mlp, 2 GEMMs, whose
            # backward writes dacc from da's GEMM (the SwiGLU backward as its 1 -> 2 epilogue: da never stored)
            args = (x.to(dtype), gamma, _cast(self.weight_gu, dtype), _cast(self.down_proj.weight, dtype), self.eps)
            if normed is None or x.dtype != dtype:  # x * gamma and r's sums from x's producer
                # (FusedAttention.emit_next_norm), else the gate/up GEMM's own pre-pass
                normed = recall_normed(x, gamma) if x.dtype == dtype else None
            if self.add_residual and SUMSQ_CHAIN and (sumsq_out is not None or not compiling()):  # the next
                # block's norm takes r from the down projection's epilogue (the rows' sums of squares of the stream
                # it writes): through sumsq_out (coda.fuse's layer forward), else the side table (recall_sumsq)
                y, ss = ops.mlp(*args, residual=True, return_sumsq=True, normed=normed)
                if sumsq_out is None:
                    return remember_sumsq(y, ss)
                sumsq_out.clear()  # one entry at most, whatever ran before (a layer run twice: recomputation)
                sumsq_out.append((y, ss))
                return y
            return ops.mlp(*args, residual=self.add_residual, normed=normed)
        elif dtype in _FUSED_DTYPES:
            n = x.to(dtype)
            if gamma is None:
                a = ops.linear_swiglu(n, self.weight_gu.to(dtype))
            else:
                a = rmsnorm_swiglu(n, gamma, self.weight_gu.to(dtype), self.eps)
        else:
            n = x if gamma is None else rms_norm(x, gamma, self.eps)
            w_gate, w_up = self.gate_up()
            a = F.silu(F.linear(n, w_gate)) * F.linear(n, w_up)
        y = self.down_proj(a)
        return x + y if self.add_residual else y

    def _to_stock(self, local):
        w_gate, w_up = ops.deinterleave_gate_up(local.pop("weight_gu"))
        out = {k: local.pop(k) for k in list(local) if k.startswith("norm.")}
        out.update({"gate_proj.weight": w_gate.contiguous(), "up_proj.weight": w_up.contiguous()})
        return {**out, **local}

    def _from_stock(self, local):
        if "gate_proj.weight" in local and "up_proj.weight" in local:
            local["weight_gu"] = ops.interleave_gate_up(local.pop("gate_proj.weight"), local.pop("up_proj.weight"))
        return local

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"add_residual={self.add_residual}, weight_gu interleaved (gate, up, ...)")


class LMHeadCrossEntropy(_NormConsumer):
    """Final RMSNorm + LM head (+ cross entropy): ``forward(x, target)`` returns the loss
    (``coda.ops.linear_cross_entropy`` on the normed x: logits never stored), ``forward(x)`` the logits
    (``coda.ops.rmsnorm_linear``). ``weight`` (V, H) is in the stock layout (``nn.Linear``); pass ``weight=`` to
    share a Parameter (tied embeddings). Loss options as ``coda.ops.linear_cross_entropy``; the loss is float32.
    ``check_targets`` defaults to "async" here: the target range is asserted on the device, so the check does not
    make a training step wait on the host (as ``F.cross_entropy`` on CUDA); pass True for the op's ValueError (one
    device sync). The fast mode's exp-stored phases still read one flag per logits chunk on the host (their range
    check, ``ops/cross_entropy_fast.py``), behind an event queued before the chunk's dX GEMM, so the GPU keeps
    running while the host waits; ``CODA_CE_EXP=0`` avoids it."""

    def __init__(self, hidden_size: int, vocab_size: int, eps: float = 1e-6, *, norm=None,
                 weight: Optional[nn.Parameter] = None, ignore_index: int = -100, label_smoothing: float = 0.0,
                 z_loss: float = 0.0, softcap: Optional[float] = None, check_targets="async", device=None,
                 dtype=None):
        super().__init__()
        _check_aligned("LMHeadCrossEntropy", hidden_size=hidden_size)
        check_softcap("LMHeadCrossEntropy", softcap)
        check_targets_option("LMHeadCrossEntropy", check_targets)
        self.check_targets = check_targets
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.ignore_index, self.label_smoothing, self.z_loss = ignore_index, label_smoothing, z_loss
        self.softcap = softcap
        if weight is None:
            weight = nn.Parameter(torch.empty(vocab_size, hidden_size, device=device, dtype=dtype))
            nn.init.kaiming_uniform_(weight, a=5 ** 0.5)
        self.weight = weight
        self._set_norm(norm, hidden_size, eps, device, dtype)

    @classmethod
    def from_linear(cls, lm_head: nn.Linear, norm=None, **loss_options) -> "LMHeadCrossEntropy":
        """Shares ``lm_head.weight`` (same Parameter: ties to the embedding stay). ``norm`` as in the constructor."""
        if lm_head.bias is not None:
            raise ValueError("LMHeadCrossEntropy.from_linear: an LM head with a bias is not supported")
        w = lm_head.weight
        return cls(w.shape[1], w.shape[0], norm=norm, weight=w, device=w.device, dtype=w.dtype, **loss_options)

    def _normed(self, x: Tensor, fused: bool = False) -> Tensor:
        """The norm of x (none without a norm weight): ``coda.ops.rmsnorm`` where the loss is fused (16-bit x,
        rows of a multiple of 8: its K = 0 passes instead of torch's fp32 chain), else the stock math."""
        gamma = self.norm_weight
        if gamma is None:
            return x
        if fused and x.dtype in ops._common.IN_DTYPES and x.shape[-1] % _ALIGN == 0 and x.dtype == _compute_dtype(x):
            return ops.rmsnorm(x, gamma, self.eps, sumsq=recall_sumsq(x))  # r from the last layer's epilogue
        return rms_norm(x, gamma, self.eps)

    def forward(self, x: Tensor, target: Optional[Tensor] = None, reduction: str = "mean") -> Tensor:
        dtype, gamma = _compute_dtype(x), self.norm_weight
        fused = dtype in _FUSED_DTYPES
        if target is None:  # logits (capped like the loss's, with a softcap)
            if fused and gamma is not None and self.vocab_size % _ALIGN == 0:
                logits = ops.rmsnorm_linear(x.to(dtype), gamma, self.weight.to(dtype), self.eps)
            else:
                logits = F.linear(self._normed(x), self.weight)
            return logits if self.softcap is None else self.softcap * torch.tanh(logits / self.softcap)
        n = self._normed(x, fused)
        if fused:
            return ops.linear_cross_entropy(n.to(dtype), _cast(self.weight, dtype), target, self.ignore_index,
                                            reduction, self.label_smoothing, self.z_loss,
                                            check_targets=self.check_targets, softcap=self.softcap)
        logits = F.linear(n, self.weight).flatten(0, -2)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 (fp64 stays)
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        t = target.flatten()
        row = F.cross_entropy(logits, t, ignore_index=self.ignore_index, reduction="none",
                              label_smoothing=self.label_smoothing)
        if self.z_loss:
            row = row + torch.where(t != self.ignore_index, self.z_loss * logits.logsumexp(-1).pow(2), 0.0)
        if reduction == "none":
            return row.reshape(target.shape)
        return row.sum() if reduction == "sum" else row.sum() / (t != self.ignore_index).sum()

    def _to_stock(self, local):
        return local  # already the stock layout

    def _from_stock(self, local):
        return local

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, ignore_index={self.ignore_index}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}"
                + (f", softcap={self.softcap}" if self.softcap is not None else ""))
