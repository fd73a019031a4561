"""coda.distributed on the CPU (CI): 2 processes (torch.multiprocessing, gloo, file init), the reference path.

- vocab_parallel_cross_entropy on 2 ranks vs float64 torch (float64 inputs: to 1e-7; bf16: the 2x rule against
  torch in bf16) and vs the single-process coda.ops.linear_cross_entropy(mode="lean") (bf16: the loss and the dW
  shards bitwise, dX within the bf16 rounding of the two partial sums); ignored rows; an uneven split with a shard
  of 99 rows (not a multiple of 8); bad targets and bad shard layouts raise on every rank (no hang).
- FSDP2 (fully_shard, gloo, CPU) and DDP over the coda.fuse'd tiny Llama in float32: loss and gradients (by stock
  name) match a single-process run of the same global batch (float32 runs the fused modules' plain-torch math;
  FSDP2 with a bf16 MixedPrecisionPolicy runs coda.ops' reference path: the 2x rule vs a single-process bf16
  run); after one SGD step a torch.distributed.checkpoint save of the stock-layout state dict loads into a stock
  model (no process group), so does the full state dict gathered on rank 0, and the checkpoint loads back into
  the sharded fused model.
"""
import copy
import math
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
from coda.ops.cross_entropy_fast import EXP_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cross_entropy_ref import rel, run, torch_loss  # noqa: E402
from dist_harness import WORLD, spawn  # noqa: E402



# ------------------------------------------------------------------------------------------------ harness
def _spawn(fn, *args):
    spawn(fn, *args, backend="gloo")


# ------------------------------------------------------------------------------------------------ vocab-parallel CE
def _ce_problem(M, V, H, dtype, seed=0, ignored=(1, 5)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) / math.sqrt(H) * 3).to(dtype)
    t = torch.randint(0, V, (M,), generator=g)
    for i in ignored:
        t[i] = -100
    return x, w, t


def _vp_run(x, w, t, up, lo, hi, **kw):
    """(loss, dx, dw shard) of the vocab-parallel CE on this rank's rows [lo, hi)."""
    import coda.distributed as cd

    def fn(xs, ws, tt, **k):
        return cd.vocab_parallel_cross_entropy(xs, ws, tt, vocab_start=lo, **k)
    return run(fn, x, w[lo:hi], t, up, **kw)


CE_CASES = [  # (M, V, H, split): the even split (default vocab_start), an uneven one (a 99-row shard), tiny
    (24, 256, 40, None), (24, 203, 40, 104), (13, 37, 16, 16)]


def _ce_worker(rank, dtype):
    import coda.ops
    for M, V, H, split in CE_CASES:
        split = V // 2 if split is None else split
        lo, hi = (0, split) if rank == 0 else (split, V)
        x, w, t = _ce_problem(M, V, H, dtype)
        for reduction in ("mean", "sum", "none"):
            up = (torch.randn(M, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
                  if reduction == "none" else torch.tensor(1.5, dtype=torch.float64))
            kw = dict(reduction=reduction)
            ours = _vp_run(x, w, t, up, lo, hi, chunk_size=16, mode="lean", **kw)
            want = run(torch_loss, x.double(), w.double(), t, up, **kw)
            want = (want[0], want[1], want[2][lo:hi])
            case = (M, V, H, split, reduction, rank)
            assert ours[0].shape == want[0].shape and ours[1].shape == x.shape and ours[2].shape == (hi - lo, H)
            if reduction == "none":
                assert torch.all(ours[0][t == -100] == 0), case
            if dtype == torch.float64:
                for name, a, b in zip(("loss", "dx", "dw"), ours, want):
                    assert a.dtype == torch.float64 and rel(a, b) <= 1e-7, (name, rel(a, b), case)
                continue
            theirs = run(torch_loss, x, w, t, up, **kw)
            theirs = (theirs[0], theirs[1], theirs[2][lo:hi])
            assert ours[0].dtype == torch.float32
            for name, a, b, c in zip(("loss", "dx", "dw"), ours, want, theirs):
                assert rel(a, b) <= 2 * rel(c, b) + 1e-4, (name, rel(a, b), rel(c, b), case)
            # the single-process lean op: the same epilogue programs; the loss and dW shards differ only by the
            # order of the fp32 logsumexp over the shards; dX also by the bf16 rounding of the two ranks' partial
            # sums before the all-reduce
            lean = run(coda.ops.linear_cross_entropy, x, w, t, up, mode="lean", chunk_size=16, **kw)
            assert rel(ours[0], lean[0]) <= 1e-6, ("loss vs lean", rel(ours[0], lean[0]), case)
            assert rel(ours[2], lean[2][lo:hi]) <= 1e-6, ("dw vs lean", rel(ours[2], lean[2][lo:hi]), case)
            assert rel(ours[1], lean[1]) <= 2 ** -7, ("dx vs lean", rel(ours[1], lean[1]), case)
    # every row ignored: loss NaN under "mean" (as torch), gradients zero
    x, w, t = _ce_problem(8, 64, 16, dtype, ignored=range(8))
    for mode in ("lean", "fast"):
        loss, dx, dw = _vp_run(x, w, t, torch.tensor(1.0, dtype=torch.float64), 32 * rank, 32 * rank + 32,
                               mode=mode)
        assert torch.isnan(loss) and not dx.any() and not dw.any(), mode


def _ce_fast_worker(rank):
    """The fast mode (gradients in the forward, one all-gather per row chunk) on 2 ranks, bf16: the 2x rule vs
    float64 torch, and vs the single-process fast op with the same chunk rows (the loss to 1e-6: the same stored
    logits, another order of the fp32 logsumexp; dX and the dW shard within bf16 rounding); one chunk or several
    (budget of 8 rows of the widest shard), an uneven split with a 99-row shard, softcap, ignored rows; "auto"
    takes it, reduction "none" takes the lean mode."""
    import coda.ops
    import coda.ops.cross_entropy as ce_op
    calls = []
    real = ce_op.forward_with_grads
    ce_op.forward_with_grads = lambda *a, **k: calls.append(k.get("combine") is not None) or real(*a, **k)
    for M, V, H, split in [(24, 256, 40, None), (24, 203, 40, 104), (40, 96, 16, None)]:
        split = V // 2 if split is None else split
        lo, hi = (0, split) if rank == 0 else (split, V)
        x, w, t = _ce_problem(M, V, H, torch.bfloat16)
        widest = max(split, V - split) // 8 * 8
        for budget in (None, 8 * widest * 2):
            for reduction, softcap in (("mean", None), ("sum", None), ("mean", 2.0)):
                up = torch.tensor(1.5, dtype=torch.float64)
                kw = dict(reduction=reduction, softcap=softcap)
                calls.clear()  # auto takes the fast mode; below MIN_ROWS rows a chunk only when asked
                ours = _vp_run(x, w, t, up, lo, hi, memory_budget=budget, mode="fast" if budget else "auto", **kw)
                assert calls == [True], calls
                case = (M, V, H, split, budget, reduction, softcap, rank)
                want = run(torch_loss, x.double(), w.double(), t, up, **kw)
                theirs = run(torch_loss, x, w, t, up, **kw)
                for name, a, b, c in zip(("loss", "dx", "dw"), ours, want, theirs):
                    b, c = (b[lo:hi], c[lo:hi]) if name == "dw" else (b, c)
                    assert rel(a, b) <= 2 * rel(c, b) + 1e-4, (name, rel(a, b), rel(c, b), case)
                rows = None if budget is None else budget // (widest * 2)
                os.environ[EXP_ENV] = "0"  # one process as the shards run it: the stored logits (no exp-stored path)
                try:
                    one = run(coda.ops.linear_cross_entropy, x, w, t, up, mode="fast",
                              memory_budget=None if rows is None else rows * (V // 8 * 8) * 2, **kw)
                finally:
                    del os.environ[EXP_ENV]
                assert rel(ours[0], one[0]) <= 1e-6, ("loss vs one process", rel(ours[0], one[0]), case)
                assert rel(ours[1], one[1]) <= 2 ** -7, ("dx vs one process", rel(ours[1], one[1]), case)
                assert rel(ours[2], one[2][lo:hi]) <= 2 ** -7, ("dw vs one process", case)
    calls.clear()
    x, w, t = _ce_problem(24, 256, 40, torch.bfloat16)
    _vp_run(x, w, t, torch.randn(24, dtype=torch.float64), 128 * rank, 128 * rank + 128, reduction="none",
            mode="fast")
    assert calls == []  # reduction "none": the lean mode (the upstream gradient is a vector)


def _ce_errors_worker(rank):
    import coda.distributed as cd
    x, w, t = _ce_problem(8, 64, 16, torch.bfloat16)
    shard = w[32 * rank:32 * rank + 32]
    bad = t.clone()
    bad[3] = 64  # past V: every rank sees it after the gather and raises
    with pytest.raises(ValueError, match="target values must be in"):
        cd.vocab_parallel_cross_entropy(x, shard, bad)
    with pytest.raises(ValueError, match="tile"):  # both ranks claim [0, 32)
        cd.vocab_parallel_cross_entropy(x, shard, t, vocab_start=0)
    with pytest.raises(TypeError, match="weight"):
        cd.vocab_parallel_cross_entropy(x, shard.float(), t)
    with pytest.raises(ValueError, match="reduction"):
        cd.vocab_parallel_cross_entropy(x, shard, t, reduction="max")
    with pytest.raises(ValueError, match="softcap"):
        cd.vocab_parallel_cross_entropy(x, shard, t, softcap=-1.0)
    with pytest.raises(ValueError, match="mode"):
        cd.vocab_parallel_cross_entropy(x, shard, t, mode="quick")
    with pytest.raises(ValueError, match="memory_budget"):
        cd.vocab_parallel_cross_entropy(x, shard, t, memory_budget=0)
    xs, ws = x.clone().requires_grad_(), shard.clone().requires_grad_()
    with pytest.raises(ValueError, match="target values must be in"):  # the fast mode checks as well
        cd.vocab_parallel_cross_entropy(xs, ws, bad, mode="fast")
    loss = cd.vocab_parallel_cross_entropy(x, shard, t)  # the group still works after the errors
    assert torch.isfinite(loss)


def _ce_softcap_worker(rank, dtype):
    """softcap: the vocab-parallel loss of capped logits vs float64 torch (float64: to 1e-7; bf16: the 2x rule) and,
    in bf16, vs the single-process lean op with the same cap (loss and dW shards to 1e-6)."""
    import coda.ops
    M, V, H, split = 24, 203, 40, 104
    lo, hi = (0, split) if rank == 0 else (split, V)
    x, w, t = _ce_problem(M, V, H, dtype)
    up = torch.tensor(1.5, dtype=torch.float64)
    kw = dict(reduction="mean", softcap=2.0)
    ours = _vp_run(x, w, t, up, lo, hi, chunk_size=16, mode="lean", **kw)
    want = run(torch_loss, x.double(), w.double(), t, up, **kw)
    want = (want[0], want[1], want[2][lo:hi])
    if dtype == torch.float64:
        for name, a, b in zip(("loss", "dx", "dw"), ours, want):
            assert rel(a, b) <= 1e-7, (name, rel(a, b), rank)
        return
    theirs = run(torch_loss, x, w, t, up, **kw)
    theirs = (theirs[0], theirs[1], theirs[2][lo:hi])
    for name, a, b, c in zip(("loss", "dx", "dw"), ours, want, theirs):
        assert rel(a, b) <= 2 * rel(c, b) + 1e-4, (name, rel(a, b), rel(c, b), rank)
    lean = run(coda.ops.linear_cross_entropy, x, w, t, up, mode="lean", chunk_size=16, **kw)
    assert rel(ours[0], lean[0]) <= 1e-6 and rel(ours[2], lean[2][lo:hi]) <= 1e-6, rank


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_vocab_parallel_ce(dtype):
    _spawn(_ce_worker, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_vocab_parallel_ce_softcap(dtype):
    _spawn(_ce_softcap_worker, dtype)


def test_vocab_parallel_ce_fast_mode():
    _spawn(_ce_fast_worker)


def test_vocab_parallel_ce_errors():
    _spawn(_ce_errors_worker)


def test_vocab_parallel_ce_needs_init():
    import coda.distributed as cd
    x, w, t = _ce_problem(8, 64, 16, torch.bfloat16)
    with pytest.raises(RuntimeError, match="not initialized"):
        cd.vocab_parallel_cross_entropy(x, w, t)


# ------------------------------------------------------------------------------------------------ FSDP2 / DDP
CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2)
LR = 0.1


def _stock_model():
    from llama_model import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG))
    with torch.no_grad():  # non-trivial norm weights
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
    return model


def _batch():
    ids = torch.randint(0, CFG["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(1))
    return ids  # rank r takes rows [2r, 2r + 2): the same number of (shifted) labels per rank


def _close(a, b, what):
    err = (a - b).abs().max().item()
    assert err <= 1e-5 + 1e-4 * b.abs().max().item(), (what, err, b.abs().max().item())


def _fsdp_worker(rank, d):
    import coda
    import coda.distributed as cd
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    stock = _stock_model()
    stock.load_state_dict(torch.load(os.path.join(d, "init.pt")))
    ref = torch.load(os.path.join(d, "ref.pt"))  # the single-process run: loss, stock grads, stepped state dict
    ids = _batch()[2 * rank:2 * rank + 2]

    # DDP over the fused model
    ddp = DDP(coda.fuse(copy.deepcopy(stock)))
    loss = ddp(ids, labels=ids)
    loss.backward()
    dist.all_reduce(loss)
    _close(loss.detach() / WORLD, ref["loss"], "ddp loss")
    grads = coda.stock_grads(ddp.module)
    assert grads.keys() == ref["grads"].keys()
    for k, g in grads.items():
        _close(g, ref["grads"][k], f"ddp {k}")

    # FSDP2 over the fused model: each decoder layer, then the root
    model = coda.fuse(copy.deepcopy(stock))
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss = model(ids, labels=ids)
    loss.backward()
    dist.all_reduce(loss)
    _close(loss.detach() / WORLD, ref["loss"], "fsdp loss")
    grads = cd.stock_grads(model)  # gathered DTensor gradients, by stock name
    assert grads.keys() == ref["grads"].keys()
    for k, g in grads.items():
        _close(g, ref["grads"][k], f"fsdp {k}")
    opt.step()

    # FSDP2 with bf16 compute (MixedPrecisionPolicy, fp32 gradient reduction): the fused modules run coda.ops (the
    # CPU reference of the kernels); loss and gradients vs the float32 run: at most 2x the error of the
    # single-process fused model run in bf16 on the global batch, plus a floor
    from torch.distributed.fsdp import MixedPrecisionPolicy
    mixed = coda.fuse(copy.deepcopy(stock))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in mixed.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(mixed, mesh=mesh, mp_policy=policy)
    loss = mixed(ids, labels=ids)
    loss.backward()
    dist.all_reduce(loss)
    loss = loss.detach().float() / WORLD
    assert abs(loss - ref["loss"]) <= 2 * abs(ref["loss_bf16"] - ref["loss"]) + 1e-3, (loss, ref["loss_bf16"])
    for k, g in cd.stock_grads(mixed).items():
        want, single = ref["grads"][k], ref["grads_bf16"][k].float()
        assert rel(g, want) <= 2 * rel(single, want) + 1e-3, (k, rel(g, want), rel(single, want))

    # checkpoints: the stock-layout sharded state dict via DCP, and the full one gathered on rank 0
    sd = cd.stock_state_dict(model)
    assert list(sd) == list(stock.state_dict())
    dcp.save(sd, checkpoint_id=os.path.join(d, "dcp"))
    full = cd.stock_state_dict(model, full=True)
    if rank == 0:
        torch.save(full, os.path.join(d, "full.pt"))
    # ... and back into the sharded fused model (after spoiling its weights)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    sd = cd.stock_state_dict(model)
    dcp.load(sd, checkpoint_id=os.path.join(d, "dcp"))
    with cd.dtensor_stock_layout(model):
        model.load_state_dict(sd)
    for n, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), before[n]), n


def test_fsdp2_and_ddp_fused_llama():
    import coda
    import torch.distributed.checkpoint as dcp
    stock = _stock_model()
    with tempfile.TemporaryDirectory() as d:
        torch.save(stock.state_dict(), os.path.join(d, "init.pt"))
        fused = coda.fuse(copy.deepcopy(stock))  # the single-process run of the global batch
        ids = _batch()
        loss = fused(ids, labels=ids)
        loss.backward()
        torch.optim.SGD(fused.parameters(), lr=LR).step()
        half = coda.fuse(copy.deepcopy(stock).to(torch.bfloat16))  # the same in bf16: the 2x rule's yardstick
        loss_bf16 = half(ids, labels=ids)
        loss_bf16.backward()
        torch.save({"loss": loss.detach(), "grads": coda.stock_grads(fused), "loss_bf16": loss_bf16.detach().float(),
                    "grads_bf16": coda.stock_grads(half)}, os.path.join(d, "ref.pt"))
        want = fused.state_dict()
        _spawn(_fsdp_worker, d)
        for source in ("dcp", "full"):
            fresh = _stock_model()
            sd = fresh.state_dict()
            if source == "dcp":
                dcp.load(sd, checkpoint_id=os.path.join(d, "dcp"))  # no process group: one process reads it all
            else:
                sd = torch.load(os.path.join(d, "full.pt"))
            fresh.load_state_dict(sd)
            got = fresh.state_dict()
            assert list(got) == list(want)
            for k in want:
                _close(got[k], want[k], f"{source} {k}")
