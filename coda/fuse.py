"""``coda.fuse(model)``: swap, in place, the fusable parts of a stock Llama-style model for ``coda.nn`` modules.

What is swapped (duck-typed on class names, so it works on Hugging Face ``LlamaForCausalLM`` and on
``examples/llama_model.py`` alike):

- every ``LlamaDecoderLayer``'s ``post_attention_layernorm`` (``LlamaRMSNorm``) + ``mlp`` (``LlamaMLP``: gate, up,
  down, no biases, SiLU): the norm becomes a :class:`coda.nn.DeferredRMSNorm` (identity, keeps the same weight
  Parameter) and the MLP a :class:`coda.nn.SwiGLUMLP` (norm + gate/up + SwiGLU in one GEMM, down projection shared
  with the stock module); the layer's ``forward`` is patched (an instance attribute) so that the MLP adds the
  residual in its down projection's epilogue (``add_residual=True``; its backward adds the residual gradient in the
  dX GEMM's epilogue) -- and so does a fused attention block the first one (``FusedAttention.add_residual``: o_proj's
  epilogue adds x, the QKV dX GEMM's adds its gradient); a Hugging Face layer of transformers < 5 keeps its forward
  and the MLP ``add_residual=False``;
- every ``LlamaDecoderLayer``'s ``input_layernorm`` + ``self_attn`` (``LlamaAttention``: no biases, the model's RoPE
  ``inv_freq`` buffer; a per-head RMSNorm on q and k as Qwen3's is kept, applied between the GEMM and RoPE): the
  norm becomes a ``DeferredRMSNorm`` and the attention a
  :class:`coda.nn_attention.FusedAttention` (norm + QKV + RoPE in one GEMM, SDPA with grouped-query heads as they
  are, ``o_proj`` shared);
- the input embedding (``model.model.embed_tokens``, a plain ``nn.Embedding``; ``embedding=False``: not): its
  ``forward`` is patched to ``coda.ops.embedding`` (torch's lookup; under ``coda.optim.AdamW`` its backward updates
  the weight in place, one pass, instead of forming the V x H gradient);
- the final norm (``model.norm``) + ``lm_head`` + loss of the top module (it has ``lm_head`` and ``model.norm``): the
  norm becomes a ``DeferredRMSNorm``, ``lm_head`` a :class:`coda.nn.LMHeadCrossEntropy` (same weight Parameter, so
  tied embeddings stay tied), and the top module's ``forward`` is patched (an instance attribute): with ``labels``
  it runs the backbone and ``linear_cross_entropy`` (Hugging Face's causal-LM loss: labels shifted by one,
  ignore_index -100, ``num_items_in_batch`` -> sum / n) and returns no logits; without labels it is the stock
  forward (``lm_head`` applies the deferred norm, so the logits are the stock ones).

Weights are converted once: gate/up are interleaved into a new Parameter and the stock gate/up Parameters are
released (create the optimizer after ``fuse``: an optimizer that still holds a replaced Parameter raises a
RuntimeError naming it at its next ``step()``, through a global optimizer step pre-hook, instead of silently
leaving the MLP untrained). All other Parameters are the same objects. ``state_dict()`` keeps
the stock keys, order and values (``coda.nn``'s state-dict hooks), and ``load_state_dict`` accepts stock
checkpoints. Note: after fusing, the backbone's last hidden state is the one before the final norm.

Mistral, Qwen2 and Qwen3 models (Hugging Face classes ``Mistral*``, ``Qwen2*``, ``Qwen3*``) fuse the same way: their
decoder layers are Llama's; their attention blocks fuse where ``attention_fusable`` allows (a Mistral sliding
window only where Hugging Face puts it into the attention mask: ``sdpa`` and ``eager``; Qwen2's q/k/v biases and
Qwen3's QK-norm run inside the QKV GEMMs' epilogues and the backward's un-rotation pass, see
``coda.nn.FusedAttention``). Models it does not recognise (Gemma, GPT-2, ...: any other decoder
layer, any other final norm) are left stock with a warning naming what was not fused; a model in which nothing was
fused is not marked fused.

``coda.unfuse(model)`` puts the stock modules back (gate/up de-interleaved into fresh Parameters).
"""
from __future__ import annotations

import inspect
import types
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn

import coda.nn as _nn
from coda.nn import DeferredRMSNorm, LMHeadCrossEntropy, SwiGLUMLP
from coda.nn_attention import FusedAttention, attention_fusable, find_inv_freq

__all__ = ["fuse", "unfuse", "stock_grads"]

# Llama and the families whose decoder layer is Llama's (pre-norm RMSNorm, SwiGLU MLP without biases, RoPE
# attention): the MLP and the LM head fuse in each; the attention where attention_fusable allows (a block that
# does not stays stock, with the reason; Mistral's sliding window comes in the mask, Qwen2's q/k/v biases and
# Qwen3's QK-norm are kept inside FusedAttention)
_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")
LAYER_CLASSES = {f"{f}DecoderLayer" for f in _FAMILIES}
MLP_CLASSES = {f"{f}MLP" for f in _FAMILIES}
NORM_CLASSES = {f"{f}RMSNorm" for f in _FAMILIES}
ATTENTION_CLASSES = {f"{f}Attention" for f in _FAMILIES}


def _cls(m) -> str:
    return type(m).__name__


def _silu_mlp(mlp: nn.Module) -> bool:
    act = getattr(mlp, "act_fn", None)
    act_ok = act is None or "silu" in _cls(act).lower() or act is F.silu
    config = getattr(mlp, "config", None)
    if config is not None and getattr(config, "hidden_act", "silu") != "silu":
        act_ok = False
    lins = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return act_ok and all(isinstance(lin, nn.Linear) and lin.bias is None for lin in lins)


def _aligned(*sizes: int) -> bool:
    return all(s % 8 == 0 for s in sizes)


def _names(names: list) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def fuse(model: nn.Module, *, mlp: bool = True, attention: bool = True, lm_head: bool = True,
         embedding: bool = True) -> nn.Module:
    """Swap the RMSNorm + MLP of every decoder layer and the final norm + LM head + loss (see the module docstring).
    In place; returns ``model``. Layers that do not match (other classes, activation, biases, sizes not multiples
    of 8) are left stock with a warning naming them; when nothing matched, the model is not marked fused. Fusing
    twice is a no-op."""
    if getattr(model, "_coda_fused", False):
        return model
    fused_any, unknown = False, {}  # unknown: class name -> names of decoder layers fuse does not recognise
    if mlp:
        for name, layer in model.named_modules():
            norm, m = getattr(layer, "post_attention_layernorm", None), getattr(layer, "mlp", None)
            if _cls(layer) not in LAYER_CLASSES or _cls(norm) not in NORM_CLASSES or _cls(m) not in MLP_CLASSES:
                if isinstance(m, nn.Module) and not isinstance(m, SwiGLUMLP):  # a decoder layer of another kind
                    unknown.setdefault(f"{_cls(layer)} ({_cls(m)})", []).append(f"{name}.mlp")
                continue
            if not _silu_mlp(m) or not _aligned(*m.gate_proj.weight.shape):
                warnings.warn(f"coda.fuse: {name}.mlp left stock (needs SiLU, no biases, sizes multiples of 8)")
                continue
            deferred = DeferredRMSNorm.from_norm(norm)
            fused = SwiGLUMLP.from_stock(m, norm=deferred, add_residual=False)
            _replaced(m.gate_proj.weight, f"{name}.mlp.gate_proj.weight")
            _replaced(m.up_proj.weight, f"{name}.mlp.up_proj.weight")
            m.gate_proj.weight = None  # released: the interleaved copy is the Parameter now (unfuse restores)
            m.up_proj.weight = None
            fused._coda_stock = (m, norm)
            layer.post_attention_layernorm, layer.mlp = deferred, fused
            fused_any = True
    for what, names in unknown.items():
        warnings.warn(f"coda.fuse: {len(names)} MLP(s) left stock: {_names(names)} (in {what} layers; coda.fuse "
                      "fuses the MLP of Llama-style decoder layers: Llama, Mistral, Qwen2, Qwen3)")
    if attention:
        fused_any |= _fuse_attention(model)
    _fuse_residuals(model)
    if lm_head:
        fused_any |= _fuse_head(model)
    if not fused_any:
        warnings.warn(f"coda.fuse: nothing fused in {_cls(model)}; the model is left stock and not marked fused "
                      "(coda.fuse knows Llama-style models: Hugging Face LlamaForCausalLM, examples/llama_model.py)")
        return model
    if embedding:
        _fuse_embedding(model)
    model._coda_fused = True
    return model


def stock_grads(model: nn.Module, full=None) -> dict:
    """Every parameter's gradient by its stock name and in the stock layout (a fused module's parameters split back
    as its state dict does: weight_gu into gate/up, weight_qkv into q/k/v); parameters without a gradient are left
    out. For comparing a fused model's gradients with a stock model's. ``full``: applied to each gradient first
    (``coda.distributed`` gathers FSDP2's sharded gradients with it)."""
    from coda.nn import _StockLayout
    grads = {n: (p.grad if full is None else full(p.grad)) for n, p in model.named_parameters()
             if p.grad is not None}
    for prefix, m in model.named_modules():
        if isinstance(m, _StockLayout):
            pre = prefix + "."
            local = {k[len(pre):]: grads.pop(k) for k in list(grads) if k.startswith(pre)}
            grads.update({pre + k: v for k, v in m._to_stock(local).items()})
    return grads


def _fuse_attention(model: nn.Module) -> bool:
    """Fuse every decoder layer's input norm + attention (:class:`coda.nn_attention.FusedAttention`); whether any
    was (a warning names the layers left stock and why)."""
    inv, done, stock = find_inv_freq(model), False, []
    for name, layer in model.named_modules():
        attn, norm = getattr(layer, "self_attn", None), getattr(layer, "input_layernorm", None)
        if _cls(layer) not in LAYER_CLASSES or _cls(attn) not in ATTENTION_CLASSES or _cls(norm) not in NORM_CLASSES:
            continue
        why = attention_fusable(attn) or (None if inv is not None else
                                          "no single RoPE inv_freq buffer (or a RoPE that scales cos/sin)")
        if why:
            stock.append(f"{name}.self_attn ({why})")
            continue
        deferred = DeferredRMSNorm.from_norm(norm)
        fused = FusedAttention.from_stock(attn, inv, deferred)
        for p in ("q_proj", "k_proj", "v_proj"):  # released: weight_qkv is the Parameter now (unfuse restores)
            _replaced(getattr(attn, p).weight, f"{name}.self_attn.{p}.weight")
            getattr(attn, p).weight = None
        fused._coda_stock = (attn, norm)
        layer.self_attn, layer.input_layernorm = fused, deferred
        done = True
    if stock:
        warnings.warn(f"coda.fuse: {len(stock)} attention block(s) left stock: {_names(stock)}")
    return done


def _fuse_head(model: nn.Module) -> bool:
    """Fuse the final norm + LM head + loss; whether it did (a warning says why not where there is an LM head)."""
    head, backbone = getattr(model, "lm_head", None), getattr(model, "model", None)
    norm = getattr(backbone, "norm", None)
    if head is None or isinstance(head, LMHeadCrossEntropy):
        return False
    if not isinstance(head, nn.Linear) or _cls(norm) not in NORM_CLASSES:
        warnings.warn(f"coda.fuse: lm_head left stock: {_cls(model)} has lm_head {_cls(head)} and final norm "
                      f"model.norm {_cls(norm) if norm is not None else 'missing'}; coda.fuse needs an nn.Linear "
                      "lm_head after an RMSNorm model.norm of Llama, Mistral, Qwen2 or Qwen3")
        return False
    if head.bias is not None or not _aligned(head.weight.shape[1]):
        warnings.warn("coda.fuse: lm_head left stock (needs no bias, hidden size a multiple of 8)")
        return False
    if any(p is head.weight for m in model.modules() if m is not head for p in m.parameters(recurse=False)):
        # tied to the input embedding: its gradient has two parts, so coda.optim never updates it in backward
        head.weight._coda_no_in_backward = True
    deferred = DeferredRMSNorm.from_norm(norm)
    fused = LMHeadCrossEntropy.from_linear(head, norm=deferred)
    fused._coda_stock = (head, norm)
    backbone.norm, model.lm_head = deferred, fused
    model.forward = types.MethodType(_causal_lm_forward, model)
    return True


def _fuse_embedding(model: nn.Module) -> None:
    """The input embedding (``model.model.embed_tokens``, a plain ``nn.Embedding``) through
    ``coda.ops.embedding``: its forward patched (an instance attribute); the lookup is torch's, the backward under
    ``coda.optim.AdamW`` updates the weight in place in one pass (``coda.kernels.embedding_adamw``)."""
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if type(emb) is not nn.Embedding or emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
        return
    if any(p is emb.weight for m in model.modules() if m is not emb for p in m.parameters(recurse=False)):
        # shared (a tied LM head, fused or not): its gradient has two parts, so coda.optim never updates it in backward
        emb.weight._coda_no_in_backward = True
    emb.forward = types.MethodType(_embedding_forward, emb)


def _embedding_forward(self, ids):
    from coda.ops import embedding
    return embedding(ids, self.weight, self.padding_idx)


def _fuse_residuals(model: nn.Module) -> None:
    """Move each decoder layer's second residual add (h + mlp(h)) into the fused MLP (``add_residual``: the down
    projection's epilogue adds h, its dX GEMM's epilogue adds the residual gradient) by patching the layer's
    ``forward`` (an instance attribute). Only layers whose stock forward is known to return the hidden state as a
    tensor: examples/llama_model.py's and Hugging Face's with a ``-> torch.Tensor`` annotation (transformers 5)."""
    patched = []
    for layer in model.modules():
        m = getattr(layer, "mlp", None)
        if _cls(layer) not in LAYER_CLASSES or not isinstance(m, SwiGLUMLP) or not hasattr(m, "_coda_stock"):
            continue
        stock = type(layer).forward
        if stock.__module__.startswith("transformers") and \
                inspect.signature(stock).return_annotation is not torch.Tensor:
            continue  # an older transformers layer (returns a tuple): the stock forward adds the residual
        m.add_residual = True
        if isinstance(getattr(layer, "self_attn", None), FusedAttention):
            layer.self_attn.add_residual = True
        layer.forward = types.MethodType(_residual_layer_forward, layer)
        patched.append(layer)
    # under torch.compile (where the eager side table of recall_sumsq records nothing) the down projection's sums of
    # squares reach the next layer's QKV GEMM through a list shared by the two layers, filled and emptied within the
    # traced region (empty between calls: no guard changes, no recompiles)
    for prev, nxt in zip(patched, patched[1:]):
        if isinstance(getattr(nxt, "self_attn", None), FusedAttention):
            prev._coda_sumsq_out = nxt._coda_sumsq_in = []


def _residual_layer_forward(self, *args, **kwargs):
    """A Llama decoder layer, x + attn(norm(x)) = h, then the fused MLP's h + mlp(norm(h)) (see _fuse_residuals).
    Arguments as the stock layer's: examples/llama_model.py's (x, cos, sin) are passed on positionally, Hugging
    Face's (hidden_states, attention_mask=..., position_ids=..., ...) by keyword, as its forward does."""
    if args:
        x, rest = args[0], args[1:]
    else:
        x, rest = kwargs.pop("hidden_states"), ()
    n = self.input_layernorm(x)
    box = getattr(self, "_coda_sumsq_in", None)
    if box is not None and len(box) == 1:  # (the previous layer's output, its rows' sums of squares): this layer's
        # norm takes r from them (len, not bool: torch 2.11's dynamo breaks the graph on bool(list))
        prev, ss = box.pop()
        if prev is x and n is x and type(self.self_attn).forward is FusedAttention.forward:
            kwargs = {**kwargs, "input_sumsq": ss}
    normed = []  # o_proj's epilogue also forms the MLP's h * gamma and h's sums of squares (FusedAttention)
    if getattr(self.self_attn, "emit_next_norm", False) and getattr(self.self_attn, "add_residual", False) and \
            getattr(self.mlp, "norm_weight", None) is not None and isinstance(self.mlp, SwiGLUMLP):
        kwargs = {**kwargs, "next_norm_weight": self.mlp.norm_weight, "next_norm_out": normed}
    a = self.self_attn(n, *rest, **kwargs) if rest else self.self_attn(hidden_states=n, **kwargs)
    a = a[0] if isinstance(a, tuple) else a
    h = a if getattr(self.self_attn, "add_residual", False) else x + a  # FusedAttention adds x itself
    m = self.post_attention_layernorm(h)
    kw = {"normed": normed[0]} if normed and m is h else {}
    if _nn.compiling() and getattr(self, "_coda_sumsq_out", None) is not None and \
            type(self.mlp).forward is SwiGLUMLP.forward:  # (not a subclass with its own forward: tensor parallel)
        kw["sumsq_out"] = self._coda_sumsq_out  # (this layer's output, its sums of squares) for the next layer
    return self.mlp(m, **kw)


def _causal_lm_forward(self, *args, labels=None, **kwargs):
    """The fused top-level forward (see the module docstring)."""
    if labels is None:
        return type(self).forward(self, *args, **kwargs)
    num_items = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    kwargs.pop("logits_to_keep", None)
    out = self.model(*args, **kwargs)
    hidden = out if isinstance(out, torch.Tensor) else out[0]
    head = self.lm_head
    if shift_labels is None:  # tokens < n predict n; the last position has no target
        shift_labels = F.pad(labels, (0, 1), value=head.ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    if num_items is None:
        loss = head(hidden, shift_labels)
    else:
        loss = head(hidden, shift_labels, reduction="sum") / num_items
    if isinstance(out, torch.Tensor):  # a plain model: forward(ids, labels) returns the loss
        return loss
    from transformers.modeling_outputs import CausalLMOutputWithPast
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=getattr(out, "past_key_values", None),
                                  hidden_states=getattr(out, "hidden_states", None),
                                  attentions=getattr(out, "attentions", None))


def unfuse(model: nn.Module) -> nn.Module:
    """Undo :func:`fuse` in place (current weights kept: gate/up de-interleaved into new Parameters)."""
    if not getattr(model, "_coda_fused", False):
        return model
    for name, layer in model.named_modules():
        fused = getattr(layer, "mlp", None)
        if isinstance(fused, SwiGLUMLP) and hasattr(fused, "_coda_stock"):
            m, norm = fused._coda_stock
            _replaced(fused.weight_gu, f"{name}.mlp.weight_gu")
            w_gate, w_up = fused.gate_up()
            rg = fused.weight_gu.requires_grad
            m.gate_proj.weight = nn.Parameter(w_gate.detach().clone(), requires_grad=rg)
            m.up_proj.weight = nn.Parameter(w_up.detach().clone(), requires_grad=rg)
            m.down_proj = fused.down_proj
            layer.mlp, layer.post_attention_layernorm = m, norm
            for attr in ("forward", "_coda_sumsq_in", "_coda_sumsq_out"):  # the stock forward (adds the residual)
                layer.__dict__.pop(attr, None)
    for name, layer in model.named_modules():
        fused = getattr(layer, "self_attn", None)
        if isinstance(fused, FusedAttention) and hasattr(fused, "_coda_stock"):
            attn, norm = fused._coda_stock
            _replaced(fused.weight_qkv, f"{name}.self_attn.weight_qkv")
            rg = fused.weight_qkv.requires_grad
            for p, w in zip(("q_proj", "k_proj", "v_proj"), fused.qkv_weights()):
                getattr(attn, p).weight = nn.Parameter(w.detach().clone(), requires_grad=rg)
            if fused.bias_qkv is not None:  # Qwen2
                _replaced(fused.bias_qkv, f"{name}.self_attn.bias_qkv")
                rb = fused.bias_qkv.requires_grad
                for p, b in zip(("q_proj", "k_proj", "v_proj"), fused.qkv_biases()):
                    getattr(attn, p).bias = nn.Parameter(b.detach().clone(), requires_grad=rb)
            attn.o_proj = fused.o_proj
            layer.self_attn, layer.input_layernorm = attn, norm
    head = getattr(model, "lm_head", None)
    if isinstance(head, LMHeadCrossEntropy) and hasattr(head, "_coda_stock"):
        lin, norm = head._coda_stock
        lin.weight = head.weight
        model.lm_head, model.model.norm = lin, norm
        model.__dict__.pop("forward", None)
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if isinstance(emb, nn.Module):
        emb.__dict__.pop("forward", None)
    model._coda_fused = False
    return model


# ------------------------------------------------------------------------------------------------ stale optimizers
# Parameters that fuse / unfuse replaced: id -> (weak reference, name). An optimizer created before fuse keeps the
# stock gate/up Parameters alive and would step them while the model trains others; the global step pre-hook below
# makes its next step() a RuntimeError naming them. Entries go when the Parameter does (nothing else holds it).
_REPLACED: dict = {}
_generation = 0  # bumped at every replacement: an optimizer already checked is checked again only then
_hook_handle = None


def _replaced(param: nn.Parameter, name: str) -> None:
    global _generation, _hook_handle
    key = id(param)
    _REPLACED[key] = (weakref.ref(param, lambda _, key=key: _REPLACED.pop(key, None)), name)
    _generation += 1
    if _hook_handle is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _hook_handle = register_optimizer_step_pre_hook(_check_optimizer)


def _check_optimizer(optimizer, args, kwargs) -> None:
    """Global ``Optimizer.step`` pre-hook: a RuntimeError if ``optimizer`` holds a Parameter that coda.fuse (or
    unfuse) replaced. Cheap: an optimizer is scanned again only after a new replacement or a new parameter group."""
    if not _REPLACED:
        return
    stamp = (_generation, len(optimizer.param_groups))
    if getattr(optimizer, "_coda_fuse_checked", None) == stamp:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _REPLACED.get(id(p))
            if entry is not None and entry[0]() is p:
                raise RuntimeError(
                    f"coda.fuse: this {type(optimizer).__name__} holds {entry[1]}, a Parameter that coda.fuse (or "
                    "coda.unfuse) replaced: the model no longer uses it, so stepping would silently stop training "
                    "it. Create the optimizer after coda.fuse(model) / coda.unfuse(model) (e.g. "
                    f"{type(optimizer).__name__}(model.parameters(), ...)).")
    try:
        optimizer._coda_fuse_checked = stamp
    except AttributeError:
        pass


class _CallableModule(types.ModuleType):
    """``coda.fuse`` names both this submodule and its function: once ``import coda.fuse`` has run, the import
    system sets the attribute ``coda.fuse`` to the module (as for ``coda.gemm``). Making the module callable keeps
    ``coda.fuse(model)`` working either way."""

    def __call__(self, model: nn.Module, **kwargs) -> nn.Module:
        return fuse(model, **kwargs)


import sys  # noqa: E402

sys.modules[__name__].__class__ = _CallableModule
