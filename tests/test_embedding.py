"""CPU (CI): ``coda.kernels.embedding_adamw`` and ``coda.ops.embedding`` -- the kernel compiles for sm_90a with
16-byte accesses and no spills, its launch plan reproduces the DSL's marshalling, the token segments, the torch
reference against torch's AdamW on the dense embedding gradient (float64), the op's forward / gradient / in-backward
update under ``coda.optim.AdamW`` against ``F.embedding`` + ``torch.optim.AdamW``, bad arguments refused by name
(nothing modified), ``coda.fuse`` patching the input embedding, and opcheck of the two custom ops. The kernel
against the reference on the GPU: tests/test_embedding_gpu.py."""
import copy
import os
import re
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import coda
import coda.ops
from coda.epilogues.adamw import HYPER
from coda.kernels import embedding_adamw as ea
from coda.ops import embedding
from test_ce_grad import needs_cutlass, sm90a_ptx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from llama_model import LlamaConfig, LlamaForCausalLM  # noqa: E402

KW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _hyper(t, lr=1e-2, b1=0.9, b2=0.95, eps=1e-8, wd=0.1, dtype=torch.float64):
    """The kernel's (8,) hyper-parameters (``epilogues.adamw.HYPER``'s order) of AdamW step ``t``."""
    vals = [b1, 1 - b1, b2, 1 - b2, 1 / (1 - b2 ** t) ** 0.5, eps, lr / (1 - b1 ** t), 1 - lr * wd]
    return torch.tensor(vals, dtype=dtype)


def _ids(T, V, g, pad=None):
    """T token ids in [0, V) with many repeats (a few hot rows), the padding row among them; rows left unused."""
    ids = torch.randint(0, V // 2, (T,), generator=g)  # the upper half of the rows is never used
    ids[: T // 3] = torch.randint(0, 3, (T // 3,), generator=g)  # hot rows
    if pad is not None:
        ids[1::7] = pad
    return ids[torch.randperm(T, generator=g)]


# ------------------------------------------------------------------------------------------------ compile
@needs_cutlass
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiles_for_sm90a_with_vector_accesses(dtype):
    text, out = sm90a_ptx(ea.compile_kernel, dtype)
    # 16-byte loads of the dy rows and of p, m, v (and the hyper-parameters); p, m, v stored as 16-byte vectors,
    # nothing else stored
    assert len(re.findall(r"ld\.global[.a-z0-9]*\.v4", text)) >= 4
    assert len(re.findall(r"st\.global[.a-z0-9]*\.v4", text)) == 3
    assert len(re.findall(r"st\.global", text)) == 3
    assert not re.findall(r"\b(?:ld|st)\.local", text)
    if out is not None:
        assert "0 bytes spill stores" in out and int(re.search(r"Used (\d+) registers", out).group(1)) <= 64


@needs_cutlass
def test_launch_plan_matches_the_dsl_marshalling():
    """The argument order (stream fourth, tensors otherwise) and the launcher's from_dlpack alignments and leading
    dims (``_launcher.layout``) are what coda._launch.Plan reproduces: a plan is built from a real call's arguments
    without PlanError (one descriptor per tensor)."""
    from coda import _launch
    for T, V, H in ((37, 50, 24), (1, 3, 8)):
        ids = torch.randint(0, V, (T,))
        perm, start = ea.segments(ids, V)
        bf = dict(dtype=torch.bfloat16)
        views = [torch.randn(T, H, **bf), perm, start, torch.randn(V, H, **bf), torch.randn(V, H, **bf),
                 torch.rand(V, H, **bf), _hyper(1, dtype=torch.float32)]
        assert [v.dtype for v in views[1:3]] == [torch.int32, torch.int32] and start.shape == (V + 1,)
        args = ea._launcher.cute_args(views, 0)
        fn = ea.compile_kernel(torch.bfloat16, fake=False, args=args)
        plan = _launch.Plan(fn, args, views, 0)
        assert len(plan.descs) == 7


# ------------------------------------------------------------------------------------------------ host side
@pytest.mark.parametrize("pad", [None, 4])
def test_segments_group_the_tokens_by_row(pad):
    g = torch.Generator().manual_seed(1)
    V, T = 40, 203
    ids = _ids(T, V, g, pad)
    for ids_in in (ids, ids.int()):
        perm, start = ea.segments(ids_in, V, pad)
        assert perm.dtype == start.dtype == torch.int32 and perm.shape == (T,) and start.shape == (V + 1,)
        assert sorted(perm.tolist()) == list(range(T))  # a permutation
        key = torch.where(ids == pad, V, ids) if pad is not None else ids
        assert (key[perm.long()].diff() >= 0).all()  # sorts the ids (padding tokens last)
        assert start[0] == 0 and (start.diff() >= 0).all()
        for v in range(V):
            seg = set(perm[start[v]:start[v + 1]].tolist())
            want = set() if v == pad else set((ids == v).nonzero().flatten().tolist())
            assert seg == want, v
        n_pad = int((ids == pad).sum()) if pad is not None else 0
        assert int(start[V]) == T - n_pad  # the padding tokens are in no segment
        if pad is not None:
            assert n_pad > 0 and set(perm[start[V]:].tolist()) == set((ids == pad).nonzero().flatten().tolist())


def _torch_step(dy, ids, p, m, v, t, pad):
    """torch.optim.AdamW (float64, single-tensor) on a Parameter whose .grad is the dense embedding gradient: the
    rows' token gradients summed, the padding row zero; its state (step t - 1, m, v) given."""
    w = torch.nn.Parameter(p.clone())
    w.grad = torch.zeros_like(p).index_add_(0, ids.long(), dy)
    if pad is not None:
        w.grad[pad] = 0
    opt = torch.optim.AdamW([w], foreach=False, **KW)
    opt.state[w] = {"step": torch.tensor(float(t - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    opt.step()
    return w.detach(), opt.state[w]["exp_avg"], opt.state[w]["exp_avg_sq"]


@pytest.mark.parametrize("pad", [None, 5])
@pytest.mark.parametrize("entry", ["reference", "embedding_adamw"])
def test_reference_is_torch_adamw_on_the_dense_gradient(entry, pad):
    """p, m, v updated in place (float64): every row, the unused ones (zero gradient: decay, moments decayed) and
    the padding row included, equals torch's AdamW on the dense gradient; repeated ids summed."""
    g = torch.Generator().manual_seed(2)
    V, H, T, t = 37, 24, 150, 3
    f64 = dict(dtype=torch.float64)
    ids = _ids(T, V, g, pad)
    dy = torch.randn(T, H, generator=g, **f64)
    p = torch.randn(V, H, generator=g, **f64)
    m = torch.randn(V, H, generator=g, **f64) * 0.1
    v = torch.rand(V, H, generator=g, **f64) * 0.01 + 1e-3
    assert HYPER == ("b1", "b1c", "b2", "b2c", "c2", "eps", "step_size", "decay") and ea.N_HYPER == 8
    want = _torch_step(dy, ids, p, m, v, t, pad)
    ptrs = [x.data_ptr() for x in (p, m, v)]
    if entry == "reference":
        ea._reference(dy, ids, p, m, v, _hyper(t), pad)
    else:
        assert ea.embedding_adamw(dy, ids, p, m, v, _hyper(t), padding_idx=pad) is None
    assert [x.data_ptr() for x in (p, m, v)] == ptrs
    for name, got, ref in zip("pmv", (p, m, v), want):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14, msg=name)
    unused = torch.ones(V, dtype=torch.bool)
    unused[ids] = False
    assert unused.any() and (torch.bincount(ids, minlength=V) > 1).any()  # untouched rows and repeated ids


# ------------------------------------------------------------------------------------------------ the op
@pytest.mark.parametrize("pad", [None, 3, -2])
def test_forward_is_f_embedding_and_gradient_is_torch(pad):
    g = torch.Generator().manual_seed(3)
    V, H = 11, 16
    ids = torch.randint(0, V, (2, 7), generator=g)
    ids[0, :3] = 3
    ids[1, 5] = V - 2
    w = torch.randn(V, H, generator=g).requires_grad_()
    w2 = w.detach().clone().requires_grad_()
    y = embedding(ids, w, pad)
    assert torch.equal(y, F.embedding(ids, w2, pad)) and y.shape == (2, 7, H)
    assert torch.equal(embedding(ids.int(), w, pad), y)
    dy = torch.randn(2, 7, H, generator=g)
    y.backward(dy)
    F.embedding(ids, w2, pad).backward(dy)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-6, atol=1e-6)
    if pad is not None:
        assert not w.grad[pad % V].any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("pad", [None, 3])
def test_in_backward_update_matches_torch_adamw(dtype, pad):
    """Under coda.optim.AdamW the backward updates the weight in place (no .grad; it has moved when backward
    returns); three steps equal torch.optim.AdamW on F.embedding's gradient. float64: coda.optim hands the update
    float32 hyper-parameters (as every in-backward update; also tests/test_optim.py), so float64 agrees to their
    rounding (~1e-7 relative), not to float64's."""
    g = torch.Generator().manual_seed(4)
    V, H = 11, 16
    w = torch.nn.Parameter(torch.randn(V, H, generator=g, dtype=dtype))
    w2 = torch.nn.Parameter(w.detach().clone())
    opt, opt2 = coda.optim.AdamW([w], **KW), torch.optim.AdamW([w2], **KW)
    for step in range(3):
        ids = torch.randint(0, V, (2, 7), generator=g)
        ids[0, :3] = 5
        ids[1, 0] = 3
        dy = torch.randn(2, 7, H, generator=g, dtype=dtype)
        before = w.detach().clone()
        embedding(ids, w, pad).backward(dy)
        assert w.grad is None and not torch.equal(w.detach(), before)
        moved = w.detach().clone()
        opt.step()
        opt.zero_grad()
        assert torch.equal(w.detach(), moved)  # step() only counts it
        F.embedding(ids, w2, pad).backward(dy)
        opt2.step()
        opt2.zero_grad()
        tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(w, w2, **tol)
    st, st2 = opt.state_dict()["state"][0], opt2.state_dict()["state"][0]
    assert float(st["step"]) == float(st2["step"]) == 3.0
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(st["exp_avg"], st2["exp_avg"], **tol)
    torch.testing.assert_close(st["exp_avg_sq"], st2["exp_avg_sq"], **tol)


def test_argument_errors_name_the_argument_and_modify_nothing():
    g = torch.Generator().manual_seed(5)
    V, H = 9, 8
    w = torch.randn(V, H, generator=g).requires_grad_()
    ids = torch.randint(0, V, (2, 5), generator=g)
    w0 = w.detach().clone()
    with pytest.raises(TypeError, match="ids"):
        embedding(ids.float(), w)
    with pytest.raises(TypeError, match="ids"):
        embedding(ids.tolist(), w)
    with pytest.raises(ValueError, match="weight"):
        embedding(ids, w[0])
    for bad in (V, -V - 1, True, 1.0):
        with pytest.raises(ValueError, match="padding_idx"):
            embedding(ids, w, bad)
    assert torch.equal(w.detach(), w0) and w.grad is None

    T = 6
    dy, i1 = torch.randn(T, H, generator=g), torch.randint(0, V, (T,), generator=g)
    p, m = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.1
    v = torch.rand(V, H, generator=g) * 0.01 + 1e-3
    snap = [x.clone() for x in (p, m, v)]
    h = _hyper(1, dtype=torch.float32)
    for kwargs, err, what in ((dict(m=m[:, :4]), ValueError, "m must"), (dict(m=m.t().contiguous().t()),
                                                                          ValueError, "m must"),
                              (dict(v=v.double()), ValueError, "v must"), (dict(hyper=h[:7]), ValueError, "hyper"),
                              (dict(hyper=h.double()), ValueError, "hyper"), (dict(ids=i1.float()), ValueError, "ids"),
                              (dict(dy=dy[:, :4]), ValueError, "dy"), (dict(hyper=h.tolist()), TypeError, "hyper")):
        a = {**dict(dy=dy, ids=i1, p=p, m=m, v=v, hyper=h), **kwargs}
        with pytest.raises(err, match=what):
            ea.embedding_adamw(a["dy"], a["ids"], a["p"], a["m"], a["v"], a["hyper"])
    with pytest.raises(ValueError, match="m must"):
        ea.embedding_adamw(dy, i1, p, torch.randn(V + 1, H), v, h)
    for x, x0 in zip((p, m, v), snap):
        assert torch.equal(x, x0)


# ------------------------------------------------------------------------------------------------ coda.fuse
def _example(tie=False):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, tie_word_embeddings=tie)).to(torch.bfloat16)


def _fused(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return coda.fuse(model, **kw)


def test_fuse_patches_the_input_embedding():
    stock = _example()
    model = _fused(copy.deepcopy(stock))
    emb = model.model.embed_tokens
    assert "forward" in emb.__dict__ and type(emb) is torch.nn.Embedding  # an instance attribute, same module
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(6))
    assert torch.equal(emb(ids), stock.model.embed_tokens(ids))
    # under coda.optim.AdamW the embedding is updated in its backward: no .grad, moved when backward returns
    opt = coda.optim.AdamW(model.parameters(), **KW)  # noqa: F841 (held: it registered the weights)
    before = emb.weight.detach().clone()
    loss = model(ids, labels=ids)
    loss.backward()
    assert torch.isfinite(loss) and emb.weight.grad is None and not torch.equal(emb.weight.detach(), before)
    opt.step()
    assert opt.state[emb.weight]["step"] == 1
    coda.unfuse(model)
    assert "forward" not in emb.__dict__
    off = _fused(copy.deepcopy(stock), embedding=False)
    assert getattr(off, "_coda_fused", False) and "forward" not in off.model.embed_tokens.__dict__


def test_tied_embedding_gets_its_gradient():
    """A tied input embedding / LM head is never updated in backward (its gradient has two parts): the shared
    weight gets a .grad and step() moves it."""
    model = _fused(_example(tie=True))
    w = model.model.embed_tokens.weight
    assert model.lm_head.weight is w and "forward" in model.model.embed_tokens.__dict__
    opt = coda.optim.AdamW(model.parameters(), **KW)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(7))
    before = w.detach().clone()
    loss = model(ids, labels=ids)
    loss.backward()
    assert torch.isfinite(loss) and w.grad is not None and torch.equal(w.detach(), before)
    opt.step()
    assert not torch.equal(w.detach(), before)


def test_tied_embedding_with_the_lm_head_left_stock():
    """A weight shared with an unfused module is never updated in backward (its gradient has two parts)."""
    model = _fused(_example(tie=True), lm_head=False)
    w = model.model.embed_tokens.weight
    opt = coda.optim.AdamW(model.parameters(), **KW)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(8))
    before = w.detach().clone()
    model(ids, labels=ids).backward()
    opt.step()
    assert w.grad is not None and not torch.equal(w.detach(), before)


# ------------------------------------------------------------------------------------------------ torch.library
@pytest.mark.parametrize("pad", [None, 2])
def test_opcheck(pad):
    g = torch.Generator().manual_seed(9)
    V, H = 10, 8
    w = torch.randn(V, H, generator=g).requires_grad_()
    ids = torch.randint(0, V, (3, 4), generator=g)
    torch.library.opcheck(torch.ops.coda.embedding.default, (w, ids, pad))
    dy = torch.randn(3, 4, H, generator=g)
    for need in (True, False):
        torch.library.opcheck(torch.ops.coda.embedding_backward.default, (dy, ids, w.detach(), pad, need))
