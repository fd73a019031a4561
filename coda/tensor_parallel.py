"""``coda.tensor_parallel``: Megatron-style tensor parallelism of a :func:`coda.fuse`\\ d Llama-style model (issue 32).

Import it explicitly (``import coda.tensor_parallel``). :func:`parallelize` (model, tp) swaps, in place, each fused
block for a rank-local module that holds plain local shards of its weights and runs explicit collectives
(``torch.distributed._functional_collectives``) in ``torch.autograd.Function`` s (so it works under gloo on CPU as
under NCCL, eager and under ``torch.compile``; no DTensor):

- :class:`TPAttention` (a :class:`coda.nn_attention.FusedAttention`): rank r of tp keeps the query heads
  [r Hq/tp, (r+1) Hq/tp) and the key/value heads [r Hkv/tp, (r+1) Hkv/tp) (grouped-query heads stay with their
  queries), i.e. column-parallel QKV (Qwen2's q/k/v biases split with their rows), and the matching input columns
  of ``o_proj`` (row-parallel O);
- :class:`TPSwiGLUMLP` (a :class:`coda.nn.SwiGLUMLP`): the intermediate pairs [r I/tp, (r+1) I/tp) of the
  interleaved gate/up weight (whole (gate_j, up_j) row pairs: each rank's SwiGLU pairs stay in its own GEMM) and
  those input columns of ``down_proj`` (row-parallel down);
- :class:`VocabParallelLMHead` (a :class:`coda.nn.LMHeadCrossEntropy`): the vocabulary rows [r V/tp, (r+1) V/tp) of
  the LM head; the loss is :func:`coda.distributed.vocab_parallel_cross_entropy`.

The embedding and every norm weight stay replicated. Every rank of the group must feed the same batch.

The phases of one decoder layer (x: the residual stream, M x H, replicated; f = identity forward / all-reduce
backward, g = all-reduce forward / identity backward, Megatron's names):

1. Attention in, f(x), f(gamma): the column-parallel QKV GEMM of the rank reads the whole replicated x, so the
   input norm's row scale r = rsqrt(mean(x^2) + eps) is formed from the full row on every rank (the same value:
   no collective); gamma, the row scale and RoPE are column-local epilogue work (a head's rotation pairs lie in one
   rank's columns): ONE GEMM with the single-process epilogue on the rank's (Hq + 2 Hkv) d / tp columns. SDPA on
   the local heads.
2. Row-parallel O: o_r W_o[:, cols_r]^T is a partial sum P_r (M x H). g: P = all_reduce_sum(P_r), then h = x + P.
3. MLP in, f(h), f(gamma'): the gate/up GEMM reads the whole h (r' from the full row again), the SwiGLU pairs
   epilogue on the rank's 2 I / tp interleaved columns; row-parallel down gives a partial sum D_r; g:
   out = h + all_reduce_sum(D_r).
4. LM head: the final norm on the replicated x in torch, then the vocab-parallel cross entropy (one all-gather of
   2 M + 2 floats in forward, one all-reduce of M x H in backward: its own f).

How the fusion boundary moves. In one process the residual adds live in GEMM epilogues: o_proj's epilogue adds x
(``ops.linear_residual``; its backward hands the residual gradient to the QKV dX epilogue) and the down
projection's adds h (``ops.mlp(residual=True)``); the next norm's sum of squares is formed by the consumer from the
finished row. Under tp a row-parallel GEMM's output is a partial sum: adding the residual in its epilogue would add
it tp times, and a sum of squares over a partial row is meaningless. So the O and down GEMMs run with a plain
epilogue (the TP modules' ``add_residual`` is False), the residual add is a torch add *after* the all-reduce (the
decoder layer adds x, as it does for an attention without ``add_residual``; ``TPSwiGLUMLP`` adds h itself),
and the next norm's r is formed by the next column-parallel GEMM from the all-reduced (replicated) row, exactly as
the single-process consumer forms it. Everything column-local stays fused: norm scale + gamma + RoPE in the QKV
epilogue, norm scale + SwiGLU in the gate/up epilogue, and their backward epilogues (the norm's radial term in the
dX GEMM: it is linear in the upstream gradient, so the ranks' dX partials sum to the full dX in f's backward).

Collectives per decoder layer: forward 2 all-reduces of M x H (after O and after down); backward 2 all-reduces of
M x H (the dX of f(x) and f(h)) and 2 of H (the two norm weights' gradients, which are partial sums per rank).
They sum in ``reduce_dtype`` (default float32: a bf16 partial is cast up, summed in fp32 and cast back once to the
compute dtype, at twice the bytes of a bf16 all-reduce; None: in the compute dtype, as Megatron; float64 stays
float64).

Sequence parallelism (``parallelize(..., sequence_parallel=True)``; Megatron-SP, torchtitan's SequenceParallel).
Between the blocks the hidden states (B, T, H) are sharded along the sequence: rank r keeps positions
[r T/tp, (r+1) T/tp) of every sequence, (B, T/tp, H), i.e. M/tp of the M = B T tokens (torchtitan's Shard(1);
Megatron's split of s in its (s, b, h) layout). T must be divisible by tp (no padding): otherwise the first
decoder layer raises a ValueError naming the sequence length, on every rank (each feeds the same batch) and before
any collective of that forward. Sharding the flattened rows instead (only M divisible) would need (B, T) carried
to every gather (attention needs the full sequences): a side channel this design avoids. Per block f becomes an
all-gather of the rows along T (backward: a reduce-scatter of the ranks' partial dX, summed in ``reduce_dtype``)
and g a reduce-scatter of the partial sums (backward: an all-gather of the gradient); the residual add runs on the
local (B, T/tp, H) shard. Where the fusion boundary moves: only the residual add, which was already outside the
row-parallel epilogue under tp, now runs on the shard after the reduce-scatter. The next norm's row scale r is
*not* computed on the shard: the consumer column-parallel GEMM forms it from the gathered rows, exactly as
without SP (the simpler of the two correct choices: all-gathering r with the rows would need a second gather, or a
packed one, and a GEMM variant that takes r instead of forming it, for M floats saved per norm). So gamma feeds
column-local work on all M rows, and its gradient is a partial sum over the *column* shards, all-reduced by f as
without SP (Megatron all-reduces its SP norm weights because there the norm runs on the row shard). The ends:
a forward pre-hook on the first decoder layer splits its input (the embedding output, replicated; backward: an
all-gather, so the embedding's gradient is complete on every rank), and one on the final norm (``model.norm``, the
fused LM head's DeferredRMSNorm) all-gathers the rows before it: the backbone returns the replicated (B, T, H),
and the LM head, logits and vocab-parallel loss run unchanged (the head's dX is already complete and the same on
every rank, so the gather's backward just keeps this rank's slice: no collective). The scatter sits at the first
layer rather than on the embedding so that a Hugging Face backbone derives positions and masks from the full
sequence. Every decoder layer's attention and MLP must be fused (a stock block would see a shard).

Collectives per decoder layer with SP: forward 2 all-gathers of M x H (before QKV, before gate/up) and
2 reduce-scatters of M x H (after O, after down), the same bytes as the 2 all-reduces; backward the conjugates,
2 all-gathers (the gradients of the reduce-scatters) and 2 reduce-scatters (dX of the gathers), plus the same 2
all-reduces of H (gamma). Once per forward: the final gather (M x H forward) and the embedding's (M x H backward).
Activation memory per rank: the residual stream and its adds are (B, T/tp, H); the column-parallel GEMMs still
save their gathered M x H input for dW, as without SP (Megatron saves the shard and gathers it again in backward;
that needs the fused ops to save a shard: not done), so the stored activations per layer are those of tp without
SP: the 2 gathered M x H inputs (QKV, gate/up) plus the rank's column shards (q, k, v, the attention output, the
gate/up and SwiGLU intermediates: 1/tp of one process's). What SP divides by tp here is the transient residual
stream (block outputs, residual adds: M H / tp instead of M H) and the elementwise work on it.

Gradients: sharded weights get the gradient of their shard; the norm weights get the full gradient through f's
all-reduce; the embedding (and the final norm) get the full gradient on every rank without a collective, because
the residual stream's gradient is already complete on every rank. A data-parallel dimension on top (DDP / FSDP2
over another group) reduces those as usual. Checkpoints: ``state_dict()`` of a parallelized model returns the
*full* stock layout by stock name (the TP modules' stock-layout hooks all-gather their shards: every rank must call
it), and ``load_state_dict`` takes a full stock checkpoint and keeps this rank's shard; :func:`stock_grads` /
:func:`stock_state_dict` spell that out. ``coda.unfuse`` does not apply to a parallelized model.

torch.compile: a parallelized model compiles as one graph (no graph break in a forward + loss, counted by dynamo's
``counters["graph_break"]`` and the graphs handed to the backend). The collectives are functional collectives
(out-of-place, traced into the graph) inside the autograd Functions; the residual flags are fixed at construction
(parallelize's first version switched ``add_residual`` off and on around the rank-local call, and read the norm
weight through ``property.fget``: 17 graph breaks, 18 graphs, by ``torch._dynamo.explain``); and while dynamo
traces, the loss is :class:`VocabParallelLMHead`'s torch form of the vocab-parallel cross entropy (this shard's
logits stored; ``inductor_under_compile = False`` restores coda.distributed's op, which dynamo splits into 10
graphs at its host-side layout / target checks and CODA's reference GEMMs). Checked on CPU (2 ranks, gloo,
float32, tests/test_tensor_parallel.py): with backend "aot_eager" the loss, every gathered gradient and the logits
equal the eager tp run's to 1e-5 relative (loss and gradients with either LM head path), with sequence parallelism
as well (one graph too: the hooks and the SP collectives trace); the default inductor
backend gives the same (by hand: within 5e-7) but takes ~50 s to compile forward + backward on 2 CPU cores, so the
test uses aot_eager. A target outside [0, V) fails the traced loss's ``torch._assert_async`` (RuntimeError; by hand).
Not checked under compile: bfloat16, NCCL on GPUs, the Hugging Face model.
"""
from __future__ import annotations

import types
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn

import coda.nn as _nn
from coda.nn import LMHeadCrossEntropy, SwiGLUMLP, _compute_dtype
from coda.nn_attention import FusedAttention

__all__ = ["parallelize", "stock_grads", "stock_state_dict", "TPAttention", "TPSwiGLUMLP", "VocabParallelLMHead",
           "copy_to_tp", "reduce_from_tp"]

ENTRY = "coda.tensor_parallel.parallelize"
ALIGN = 8  # CODA's GEMMs read and write 16-byte rows: every local width a multiple of 8
SEQ_DIM = 1  # sequence parallelism shards the hidden states (B, T, H) along T


# ------------------------------------------------------------------------------------------------ collectives
def _sum_dtype(t: Tensor, reduce_dtype) -> torch.dtype:
    return t.dtype if reduce_dtype is None else torch.promote_types(t.dtype, reduce_dtype)


def _all_reduce(t: Tensor, group, reduce_dtype) -> Tensor:
    """sum over the group, accumulated in promote(t.dtype, reduce_dtype) (t.dtype when None), returned in t.dtype;
    a new tensor (t is left as it is). A functional collective: torch.compile traces it into the graph."""
    dt = _sum_dtype(t, reduce_dtype)
    out = funcol.all_reduce(t.to(dt).contiguous(), "sum", _pg(group))
    return out.to(t.dtype) if dt != t.dtype else funcol.wait_tensor(out)


def _reduce_scatter(t: Tensor, group, reduce_dtype, dim: int) -> Tensor:
    """This rank's 1/tp slice along ``dim`` of the sum over the group (summed as :func:`_all_reduce`)."""
    dt = _sum_dtype(t, reduce_dtype)
    out = funcol.wait_tensor(_reduce_scatter_single(t.to(dt).contiguous(), "sum", dim % t.dim(), _pg(group)))
    return out.to(t.dtype)


def _all_gather(t: Tensor, group, dim: int) -> Tensor:
    """Every rank's ``t`` concatenated along ``dim`` in rank order (exact: nothing is summed)."""
    return funcol.wait_tensor(_all_gather_single(t.contiguous(), dim % t.dim(), _pg(group)))


def _my_slice(t: Tensor, rank: int, size: int, dim: int) -> Tensor:
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n)


# the newer names first
_all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter_single = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _pg(group):
    """The process group a functional collective takes (None: the default group)."""
    return dist.group.WORLD if group is None else group


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward (the input of a column-parallel region)."""

    @staticmethod
    def forward(ctx, x, group, reduce_dtype):
        ctx.group, ctx.reduce_dtype = group, reduce_dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, ctx.reduce_dtype), None, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (the partial sums of a row-parallel GEMM), identity backward."""

    @staticmethod
    def forward(ctx, x, group, reduce_dtype):
        return _all_reduce(x, group, reduce_dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherSlices(torch.autograd.Function):
    """All-gather of equal shards along ``dim`` forward; this rank's slice of the gradient backward (for a gathered
    tensor whose gradient is complete and the same on every rank: every rank computes the same thing from it)."""

    @staticmethod
    def forward(ctx, x, group, rank, dim):
        ctx.start, ctx.n, ctx.dim = rank * x.shape[dim], x.shape[dim], dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.start, ctx.n), None, None, None


class _GatherSequence(torch.autograd.Function):
    """Sequence parallelism's entry to a column-parallel region (Megatron's all-gather / reduce-scatter pair):
    the rows all-gathered along ``dim`` forward; backward, the ranks' partial input gradients reduce-scattered
    (summed in ``reduce_dtype`` at least, as f's all-reduce), each rank keeping its rows."""

    @staticmethod
    def forward(ctx, x, group, reduce_dtype, dim):
        ctx.group, ctx.reduce_dtype, ctx.dim = group, reduce_dtype, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.reduce_dtype, ctx.dim), None, None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """Sequence parallelism's exit of a row-parallel region: the partial sums reduce-scattered along ``dim``
    forward (each rank keeps its rows of the sum); the gradient all-gathered backward."""

    @staticmethod
    def forward(ctx, x, group, reduce_dtype, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, reduce_dtype, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim), None, None, None


class _SplitSequence(torch.autograd.Function):
    """A replicated tensor -> this rank's slice along ``dim`` (no collective); backward, the slices' gradients
    all-gathered, so the replicated input (the embedding output) gets its complete gradient on every rank."""

    @staticmethod
    def forward(ctx, x, group, rank, size, dim):
        ctx.group, ctx.dim = group, dim
        return _my_slice(x, rank, size, dim).clone()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim), None, None, None, None


def copy_to_tp(x: Tensor, group=None, reduce_dtype: Optional[torch.dtype] = torch.float32) -> Tensor:
    """Identity; in backward the gradient is summed over ``group`` (see the module docstring)."""
    return _CopyToTP.apply(x, group, reduce_dtype)


def reduce_from_tp(x: Tensor, group=None, reduce_dtype: Optional[torch.dtype] = torch.float32) -> Tensor:
    """The sum of x over ``group`` (in ``reduce_dtype`` at least, returned in x's dtype); identity backward."""
    return _ReduceFromTP.apply(x, group, reduce_dtype)


def _gather(t: Tensor, group) -> list:
    """Every rank's ``t`` (same shape on all ranks), in rank order."""
    t = t.detach().contiguous()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return out


# ------------------------------------------------------------------------------------------------ rank-local modules
class _TPBlock:
    """Shared by the column- then row-parallel blocks: forward = [x +] g(local_forward(f(x))), gamma through f;
    with ``sequence_parallel``, x is this rank's row shard, f is the all-gather of the rows (reduce-scatter
    backward) and g the reduce-scatter of the partial sums (all-gather backward).

    ``add_residual`` is False: the rank-local forward's output is a partial sum, and its epilogue must not add x
    (it would be added tp times). ``residual_after_reduce``: whether forward adds x after the reduction instead.
    All fixed at construction (nothing is toggled during forward, which torch.compile traces)."""
    tp_group = None
    tp_rank, tp_size = 0, 1
    reduce_dtype: Optional[torch.dtype] = torch.float32
    add_residual = False
    residual_after_reduce = False
    sequence_parallel = False

    def _setup(self, fused, group, reduce_dtype, residual_after_reduce: bool, sequence_parallel: bool) -> None:
        self.tp_group, self.reduce_dtype = group, reduce_dtype
        self.tp_rank, self.tp_size = dist.get_rank(group), dist.get_world_size(group)
        self.norm, self._shared_norm = fused.norm, fused._shared_norm  # the norm where the fused module had it
        self.add_residual, self.residual_after_reduce = False, bool(residual_after_reduce)
        self.sequence_parallel = bool(sequence_parallel)

    def _enter(self, x: Tensor) -> Tensor:
        if self.sequence_parallel:
            return _GatherSequence.apply(x, self.tp_group, self.reduce_dtype, SEQ_DIM)
        return copy_to_tp(x, self.tp_group, self.reduce_dtype)

    def _leave(self, out: Tensor) -> Tensor:
        if self.sequence_parallel:
            return _ReduceScatterSequence.apply(out, self.tp_group, self.reduce_dtype, SEQ_DIM)
        return reduce_from_tp(out, self.tp_group, self.reduce_dtype)

    @property
    def norm_weight(self) -> Optional[Tensor]:
        # replicated gamma feeds column-local work: each rank's gradient of it is a partial sum (f sums them)
        m = self.norm_module  # (as _NormConsumer.norm_weight; dynamo does not trace a super() property)
        w = None if m is None else m.weight
        return None if w is None else copy_to_tp(w, self.tp_group, self.reduce_dtype)

    def _tp_forward(self, local_forward, args, kwargs):
        if args:
            x, args = args[0], (self._enter(args[0]), *args[1:])
        else:
            x = kwargs["hidden_states"]
            kwargs = {**kwargs, "hidden_states": self._enter(x)}
        out = local_forward(self, *args, **kwargs)  # add_residual is False: a partial sum, no x in its epilogue
        rest = None
        if isinstance(out, tuple):
            out, rest = out[0], out[1:]
        out = self._leave(out)
        if self.residual_after_reduce:  # the residual add, moved out of the epilogue to after the reduction
            out = x + out
        return out if rest is None else (out, *rest)

    def _gathered(self, local: dict, key: str, dim: int) -> None:
        if key in local:
            local[key] = torch.cat(_gather(local[key], self.tp_group), dim)

    def _shard(self, local: dict, key: str, dim: int, full: int) -> None:
        if key in local and local[key].shape[dim] == full:
            n = full // self.tp_size
            local[key] = local[key].narrow(dim, self.tp_rank * n, n)


def _local_param(p: Tensor, piece: Tensor) -> nn.Parameter:
    return nn.Parameter(piece.detach().clone(), requires_grad=p.requires_grad)


def _local_linear(lin: nn.Linear, cols: slice) -> nn.Linear:
    """A bias-free ``nn.Linear`` of the input columns ``cols`` of ``lin`` (a row-parallel shard)."""
    w = lin.weight
    out = nn.Linear(cols.stop - cols.start, w.shape[0], bias=False, device="meta", dtype=w.dtype)
    out.weight = _local_param(w, w[:, cols])
    return out


class TPAttention(_TPBlock, FusedAttention):
    """A :class:`coda.nn_attention.FusedAttention` over this rank's heads: column-parallel norm + QKV + RoPE (one
    GEMM), SDPA on the local heads, row-parallel ``o_proj`` whose partial sums are all-reduced before the residual
    add. ``n_heads`` / ``n_kv`` are the local counts; ``state_dict()`` gathers the full stock weights."""

    @classmethod
    def from_fused(cls, fused: FusedAttention, group, reduce_dtype, sequence_parallel=False) -> "TPAttention":
        tp, r, d = dist.get_world_size(group), dist.get_rank(group), fused.head_dim
        hq, hk = fused.n_heads // tp, fused.n_kv // tp
        inv_freq = fused.freqs.view(-1, d // 2)[0]
        w = fused.weight_qkv
        out = cls(fused.hidden_size, hq, hk, d, inv_freq, fused.eps, hf_signature=fused.hf_signature,
                  device="meta", dtype=w.dtype)
        # the decoder layer reads add_residual (False here) and adds x itself (coda.fuse's patched layer forward)
        out._setup(fused, group, reduce_dtype, False, sequence_parallel)
        out.full_heads = (fused.n_heads, fused.n_kv)
        out.weight_qkv = _local_param(w, out._local_qkv(w, fused.n_heads, fused.n_kv))
        if fused.bias_qkv is not None:  # Qwen2: column-parallel, the bias splits as the weight's rows
            out.bias_qkv = _local_param(fused.bias_qkv, out._local_qkv(fused.bias_qkv, fused.n_heads, fused.n_kv))
        out.o_proj = _local_linear(fused.o_proj, slice(r * hq * d, (r + 1) * hq * d))
        out.layer_idx = fused.layer_idx
        return out

    def forward(self, *args, **kwargs):
        return self._tp_forward(FusedAttention.forward, args, kwargs)

    def _full(self):
        return types.SimpleNamespace(n_heads=self.full_heads[0], n_kv=self.full_heads[1], head_dim=self.head_dim)

    def _local_qkv(self, t: Tensor, n_heads: int, n_kv: int) -> Tensor:
        """This rank's rows of a full weight_qkv / bias_qkv (``n_heads`` / ``n_kv``: the full counts)."""
        d = self.head_dim
        return torch.cat([p.chunk(self.tp_size)[self.tp_rank] for p in t.split([n_heads * d, n_kv * d, n_kv * d])])

    def _to_stock(self, local):
        d = self.head_dim
        for key in ("weight_qkv", "bias_qkv"):
            if key in local:
                parts = [t.split([self.n_heads * d, self.n_kv * d, self.n_kv * d])
                         for t in _gather(local[key], self.tp_group)]
                local[key] = torch.cat([torch.cat(p) for p in zip(*parts)])
        self._gathered(local, "o_proj.weight", 1)
        return FusedAttention._to_stock(self._full(), local)

    def _from_stock(self, local):
        local = FusedAttention._from_stock(self, local)  # full q, k, v -> the full weight_qkv / bias_qkv
        full = self._full()
        for key in ("weight_qkv", "bias_qkv"):
            if key in local and local[key].shape[0] == (full.n_heads + 2 * full.n_kv) * self.head_dim:
                local[key] = self._local_qkv(local[key], full.n_heads, full.n_kv)
        self._shard(local, "o_proj.weight", 1, full.n_heads * self.head_dim)
        return local

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp rank {self.tp_rank} of {self.tp_size} (local heads)"


class TPSwiGLUMLP(_TPBlock, SwiGLUMLP):
    """A :class:`coda.nn.SwiGLUMLP` over this rank's intermediate pairs: column-parallel norm + gate/up + SwiGLU
    (whole interleaved pairs), row-parallel ``down_proj`` whose partial sums are all-reduced before the residual
    add. ``intermediate_size`` is the local one; ``state_dict()`` gathers the full stock weights."""

    @classmethod
    def from_fused(cls, fused: SwiGLUMLP, group, reduce_dtype, sequence_parallel=False) -> "TPSwiGLUMLP":
        tp, r = dist.get_world_size(group), dist.get_rank(group)
        n = fused.intermediate_size // tp
        w = fused.weight_gu
        out = cls(fused.hidden_size, n, fused.eps, add_residual=False, norm=False, device="meta", dtype=w.dtype)
        # the patched layer returns mlp(h) and relies on the MLP to add h: after the reduction here
        out._setup(fused, group, reduce_dtype, fused.add_residual, sequence_parallel)
        out.full_intermediate = fused.intermediate_size
        out.weight_gu = _local_param(w, w[2 * r * n:2 * (r + 1) * n])  # rows (gate_j, up_j) for j of this rank
        out.down_proj = _local_linear(fused.down_proj, slice(r * n, (r + 1) * n))
        return out

    def forward(self, x: Tensor) -> Tensor:
        return self._tp_forward(SwiGLUMLP.forward, (x,), {})

    def _to_stock(self, local):
        self._gathered(local, "weight_gu", 0)  # rank blocks of whole pairs: the concatenation is the full layout
        self._gathered(local, "down_proj.weight", 1)
        return SwiGLUMLP._to_stock(self, local)

    def _from_stock(self, local):
        local = SwiGLUMLP._from_stock(self, local)
        self._shard(local, "weight_gu", 0, 2 * self.full_intermediate)
        self._shard(local, "down_proj.weight", 1, self.full_intermediate)
        return local


class VocabParallelLMHead(LMHeadCrossEntropy):
    """The final norm + LM head + loss with this rank's vocabulary rows [vocab_start, vocab_start + V / tp):
    ``forward(x, target)`` is :func:`coda.distributed.vocab_parallel_cross_entropy` of the normed x (the norm in
    torch on the replicated x); ``forward(x)`` the full logits (the local GEMM, then an all-gather of the columns).
    ``vocab_size`` is the full V; ``state_dict()`` gathers the full weight.

    ``inductor_under_compile`` (class attribute, default True): while torch.compile traces, the loss is the same
    vocab-parallel cross entropy written in torch ops that dynamo traces (:meth:`_traced_loss`: this shard's
    M x V / tp logits are stored), so the model stays one graph; coda.distributed's op (logits never stored) is an
    autograd Function with host-side checks and CODA's GEMMs inside, which dynamo splits (10 graphs here)."""

    inductor_under_compile = True

    @classmethod
    def from_fused(cls, head: LMHeadCrossEntropy, group, reduce_dtype) -> "VocabParallelLMHead":
        tp, r = dist.get_world_size(group), dist.get_rank(group)
        V, w = head.vocab_size, head.weight
        rows = V // tp
        out = cls(head.hidden_size, rows, head.eps, norm=False, weight=_local_param(w, w[r * rows:(r + 1) * rows]),
                  ignore_index=head.ignore_index, softcap=head.softcap, check_targets=head.check_targets)
        out.norm, out._shared_norm = head.norm, head._shared_norm
        out.vocab_size, out.vocab_start = V, r * rows
        out.tp_group, out.reduce_dtype, out.tp_rank, out.tp_size = group, reduce_dtype, r, tp
        return out

    def forward(self, x: Tensor, target: Optional[Tensor] = None, reduction: str = "mean") -> Tensor:
        from coda.distributed import vocab_parallel_cross_entropy
        n = self._normed(x)  # replicated; its gradient is complete (the CE / f all-reduce dn), so are gamma's and x's
        if target is None:
            return _GatherSlices.apply(self._local_logits(n), self.tp_group, self.tp_rank, -1)
        dtype = _compute_dtype(x)
        if _nn.compiling() and self.inductor_under_compile:
            return self._traced_loss(n.to(dtype), target, reduction)
        return vocab_parallel_cross_entropy(n.to(dtype), self.weight.to(dtype), target, self.tp_group,
                                            self.ignore_index, reduction, self.vocab_start,
                                            check_targets=self.check_targets is not False, softcap=self.softcap)

    def _local_logits(self, n: Tensor) -> Tensor:
        """This shard's (soft-capped) logits of f(n): their gradient with respect to n is summed over the ranks."""
        z = F.linear(copy_to_tp(n, self.tp_group, self.reduce_dtype), self.weight.to(n.dtype))
        return z if self.softcap is None else self.softcap * torch.tanh(z / self.softcap)

    def _traced_loss(self, n: Tensor, target: Tensor, reduction: str) -> Tensor:
        """The vocab-parallel cross entropy in traceable torch ops (under torch.compile): per row this shard's
        lse_r (fp32 at least) and z_t (0 where the target is another shard's), all-gathered (2 M floats per rank;
        backward: this rank's columns), then lse = logsumexp_r lse_r, z_t = sum_r, and the loss as the op's
        ``finish_loss``. Targets outside [0, V) fail a ``torch._assert_async`` (unless check_targets is False)."""
        from coda.ops.cross_entropy import finish_loss
        z = self._local_logits(n).flatten(0, -2)
        z = z.to(torch.promote_types(z.dtype, torch.float32))
        t = target.reshape(-1)
        valid = t != self.ignore_index
        col = t - self.vocab_start
        mine = valid & (col >= 0) & (col < z.shape[-1])
        zt = torch.where(mine, z.gather(-1, col.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1), 0.0)
        stats = _GatherSlices.apply(torch.stack((z.logsumexp(-1), zt), -1), self.tp_group, self.tp_rank, -1)
        stats = stats.unflatten(-1, (self.tp_size, 2))  # (M, tp, (lse_r, zt_r)) in rank order: the same on all ranks
        if self.check_targets is not False:
            torch._assert_async(((t >= 0) & (t < self.vocab_size) | ~valid).all(),
                                f"{ENTRY}: target values must be in [0, {self.vocab_size}) or equal ignore_index")
        loss = finish_loss(stats[..., 0].logsumexp(-1), {"zt": stats[..., 1].sum(-1)}, valid, self.vocab_size,
                           reduction, 0.0, 0.0)
        return loss.reshape(target.shape) if reduction == "none" else loss

    def _to_stock(self, local):
        if "weight" in local:
            local["weight"] = torch.cat(_gather(local["weight"], self.tp_group), 0)
        return local

    def _from_stock(self, local):
        if "weight" in local and local["weight"].shape[0] == self.vocab_size:
            local["weight"] = local["weight"][self.vocab_start:self.vocab_start + self.weight.shape[0]]
        return local

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, rows [{self.vocab_start}, {self.vocab_start + self.weight.shape[0]}) "
                f"(tp rank {self.tp_rank} of {self.tp_size})")


class _SequenceShards:
    """Sequence parallelism's two ends, as forward pre-hooks: ``scatter`` on the first decoder layer (its input, the
    embedding output, replicated, (B, T, H) -> this rank's (B, T / tp, H); the ValueError for T not divisible by
    tp, on every rank, before any collective) and ``gather`` on the final norm (the shards back to the replicated
    (B, T, H) for the LM head; backward: this rank's slice of the complete gradient)."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def scatter(self, layer, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        T = x.shape[SEQ_DIM]
        if T % self.size:
            raise ValueError(f"{ENTRY}(sequence_parallel=True): the input's sequence length {T} (hidden states "
                             f"{tuple(x.shape)}) must be divisible by the tp size {self.size}: each rank keeps "
                             f"T / {self.size} positions of every sequence")
        x = _SplitSequence.apply(x, self.group, self.rank, self.size, SEQ_DIM)
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    def gather(self, norm, args):
        return (_GatherSlices.apply(args[0], self.group, self.rank, SEQ_DIM), *args[1:])


# ------------------------------------------------------------------------------------------------ entry points
def _group_of(tp):
    """A process group from ``tp``: None (the default group), a ProcessGroup or a 1-D DeviceMesh."""
    if tp is None or isinstance(tp, dist.ProcessGroup):
        return tp
    if hasattr(tp, "get_group") and hasattr(tp, "ndim"):
        if tp.ndim != 1:
            raise ValueError(f"{ENTRY}: tp must be a 1-D DeviceMesh (e.g. mesh['tp']), got {tp.ndim} dimensions")
        return tp.get_group()
    raise TypeError(f"{ENTRY}: tp must be a ProcessGroup, a 1-D DeviceMesh or None, got {type(tp).__name__}")


def _plain_linear(lin) -> bool:
    return type(lin) is nn.Linear and lin.bias is None


def _sequence_anchors(model: nn.Module, bad: list):
    """(the first decoder layer, the final norm): where sequence parallelism scatters the rows of the hidden states
    and gathers them back; appends to ``bad`` why the model has none (every layer's attention and MLP must be
    fused: a stock block would see a row shard; the final norm: the fused LM head's shared DeferredRMSNorm)."""
    from coda.fuse import LAYER_CLASSES
    layers = [(n, m) for n, m in model.named_modules() if type(m).__name__ in LAYER_CLASSES]
    for n, m in layers:
        if not isinstance(getattr(m, "self_attn", None), FusedAttention) or \
                not isinstance(getattr(m, "mlp", None), SwiGLUMLP):
            bad.append(f"{n}: sequence_parallel needs a fused attention and a fused MLP in every decoder layer")
    head = getattr(model, "lm_head", None)
    norm = head.norm_module if isinstance(head, LMHeadCrossEntropy) else None
    if not isinstance(head, LMHeadCrossEntropy) or head.norm is not None or \
            not any(m is norm for m in model.modules()):
        bad.append("lm_head: sequence_parallel needs the fused LM head reading the model's final norm")
    if not layers:
        bad.append("sequence_parallel needs Llama-style decoder layers (none found)")
    return (layers[0][1] if layers else None), norm


def _check(model: nn.Module, tp: int, sequence_parallel: bool = False):
    """Every reason ``model`` cannot be split over tp ranks, as a ValueError, before any collective (every rank
    holds the same model, so every rank raises). Returns the sequence-parallel anchors (or None)."""
    if not getattr(model, "_coda_fused", False):
        raise ValueError(f"{ENTRY}: model must be coda.fuse'd first (coda.fuse(model), then parallelize)")
    if getattr(model, "_coda_tp", None) is not None:
        raise ValueError(f"{ENTRY}: model is already parallelized")
    bad = []
    for name, m in model.named_modules():
        if isinstance(m, FusedAttention):
            d = m.head_dim
            if m.n_heads % tp or m.n_kv % tp:
                bad.append(f"{name}: num_attention_heads {m.n_heads} and num_key_value_heads {m.n_kv} must both be "
                           f"divisible by the tp size {tp}")
            elif (m.n_heads // tp * d) % ALIGN or (m.n_kv // tp * d) % ALIGN:
                bad.append(f"{name}: the local q / kv widths {m.n_heads // tp * d} / {m.n_kv // tp * d} must be "
                           f"multiples of {ALIGN}")
            if m.q_norm is not None:
                bad.append(f"{name}: QK-norm (Qwen3) is not supported under tensor parallelism yet")
            if not _plain_linear(m.o_proj):
                bad.append(f"{name}.o_proj: needs a bias-free nn.Linear")
        elif isinstance(m, SwiGLUMLP):
            n = m.intermediate_size
            if n % tp or (n // tp) % ALIGN:
                bad.append(f"{name}: intermediate_size {n} must split into tp = {tp} parts that are multiples of "
                           f"{ALIGN}")
            if not _plain_linear(m.down_proj):
                bad.append(f"{name}.down_proj: needs a bias-free nn.Linear")
        elif isinstance(m, LMHeadCrossEntropy):
            if m.vocab_size % tp:
                bad.append(f"{name}: vocab_size {m.vocab_size} must be divisible by the tp size {tp}")
            if m.label_smoothing or m.z_loss:
                bad.append(f"{name}: label smoothing / z-loss are not supported by the vocab-parallel cross entropy")
            if any(p is m.weight for o in model.modules() if o is not m for p in o.parameters(recurse=False)):
                bad.append(f"{name}: a weight tied to the embedding (a vocab-parallel embedding is not implemented)")
    anchors = _sequence_anchors(model, bad) if sequence_parallel else None
    if bad:
        raise ValueError(f"{ENTRY}: the argument tp (a process group of {tp} ranks) does not split the model: "
                         + "; ".join(bad))
    return anchors


def parallelize(model: nn.Module, tp=None, *, reduce_dtype: Optional[torch.dtype] = torch.float32,
                sequence_parallel: bool = False) -> nn.Module:
    """Split a :func:`coda.fuse`\\ d model over the ranks of ``tp`` (a ProcessGroup, a 1-D DeviceMesh, or None for
    the default group), in place; returns ``model``. See the module docstring for what is sharded and the
    collectives. Checks first (``ValueError`` naming the blocks that do not split over the group's size: heads, kv
    heads, intermediate size, vocabulary; before any collective). ``reduce_dtype``: the dtype the partial sums and
    the input gradients are summed in (at least; default float32, None: the compute dtype). Every rank must call it
    on the same model (the same weights) and afterwards feed the same batch. Create the optimizer afterwards: the
    sharded weights are new Parameters (an optimizer holding a replaced one raises at ``step()``).
    ``sequence_parallel``: shard the hidden states between the blocks along the sequence (module docstring,
    "Sequence parallelism"); every forward's sequence length must then be divisible by the group's size."""
    if not dist.is_initialized():
        raise RuntimeError(f"{ENTRY}: torch.distributed is not initialized (call init_process_group first)")
    group = _group_of(tp)
    size = dist.get_world_size(group)
    anchors = _check(model, size, sequence_parallel)
    from coda.fuse import _replaced
    for name, m in list(model.named_modules()):
        for attr, child in list(m.named_children()):
            kind = (TPAttention if isinstance(child, FusedAttention) else TPSwiGLUMLP if isinstance(child, SwiGLUMLP)
                    else VocabParallelLMHead if isinstance(child, LMHeadCrossEntropy) else None)
            if kind is None or isinstance(child, (TPAttention, TPSwiGLUMLP, VocabParallelLMHead)):
                continue
            local = (kind.from_fused(child, group, reduce_dtype) if kind is VocabParallelLMHead
                     else kind.from_fused(child, group, reduce_dtype, sequence_parallel))
            full = f"{name}.{attr}" if name else attr
            for pname, p in child.named_parameters(recurse=True):
                if not any(p is q for q in local.parameters()):  # the shards are new: the full weights go
                    _replaced(p, f"{full}.{pname}")
            setattr(m, attr, local)
    if sequence_parallel:
        shards = _SequenceShards(group, dist.get_rank(group), size)
        first, final_norm = anchors
        model._coda_sp_hooks = (first.register_forward_pre_hook(shards.scatter, with_kwargs=True),
                                final_norm.register_forward_pre_hook(shards.gather))
    model._coda_tp, model._coda_sp = group, bool(sequence_parallel)
    return model


def stock_grads(model: nn.Module) -> dict:
    """Every gradient of a parallelized model by stock name, full and in the stock layout (the shards all-gathered;
    the same dict on every rank). A collective: every rank must call it."""
    from coda.fuse import stock_grads as _stock_grads
    return _stock_grads(model)


def stock_state_dict(model: nn.Module) -> dict:
    """The full state dict of a parallelized model by stock name and in the stock layout (what a stock model loads
    with ``load_state_dict``); the same on every rank. A collective: every rank must call it. (``state_dict()``
    itself returns the same.)"""
    return model.state_dict()
