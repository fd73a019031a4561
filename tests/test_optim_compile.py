"""coda.optim.AdamW under torch.compile: the backward of ops.mlp (and ops.embedding, the cross entropy's fast mode)
updates the weights in place through its update twin (``coda::mlp_backward_update``, ``ops._builder``), in one
graph, as the eager path does (CPU reference path; the GPU run is in tests/test_optim_gpu.py)."""
import copy

import pytest
import torch

import coda
import coda.nn_attention
import coda.optim
from test_fuse_families import fp32_ops  # noqa: F401 (fixture)

KW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _mlp():
    torch.manual_seed(0)
    return coda.nn.SwiGLUMLP(64, 128, add_residual=True)


def _loss(model, s):
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(100 + s))
    return model(x.requires_grad_()).square().mean()


def _reference(model, steps, lrs):
    opt = torch.optim.AdamW(model.parameters(), **KW)
    for s in range(steps):
        opt.param_groups[0]["lr"] = lrs[s]
        _loss(model, s).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def test_compiled_mlp_updates_its_weights_in_backward(fp32_ops):
    """Three compiled steps (fullgraph, a learning rate that changes every step) against torch.optim.AdamW on the
    eager model: the same weights and state; the MLP's weights get no .grad (updated inside the backward), the norm
    weight does; one graph, no recompilation."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    a = _mlp()
    b = copy.deepcopy(a)
    lrs = [1e-2, 5e-3, 2e-2]
    opt_b = _reference(b, 3, lrs)
    opt_a = coda.optim.AdamW(a.parameters(), **KW)
    f = torch.compile(a, fullgraph=True)
    for s in range(3):
        opt_a.param_groups[0]["lr"] = lrs[s]
        before = a.weight_gu.detach().clone()
        _loss(f, s).backward()
        assert a.weight_gu.grad is None and a.down_proj.weight.grad is None and a.norm.weight.grad is not None
        assert not torch.equal(a.weight_gu, before)  # moved inside backward
        opt_a.step()
        opt_a.zero_grad(set_to_none=True)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa, pb, rtol=2e-5, atol=2e-6, msg=n)
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    for k in sb:
        assert float(sa[k]["step"]) == float(sb[k]["step"]) == 3.0
        torch.testing.assert_close(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"], rtol=1e-4, atol=1e-9)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_compiled_graph_without_the_optimizer_fills_grad(fp32_ops):
    """A graph compiled while a coda.optim.AdamW held the weights, run after that optimizer is gone: no optimizer
    takes the update, so the gradients land in .grad (and a torch optimizer steps them)."""
    torch._dynamo.reset()
    a = _mlp()
    b = copy.deepcopy(a)
    opt = coda.optim.AdamW(a.parameters(), **KW)
    f = torch.compile(a, fullgraph=True)
    _loss(f, 0).backward()  # compiled with the update twin, which ran
    opt.step()
    opt.zero_grad(set_to_none=True)
    _reference(b, 1, [KW["lr"]])
    del opt
    _loss(f, 1).backward()
    _loss(b, 1).backward()
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert pa.grad is not None, n
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_second_compiled_backward_without_step_raises(fp32_ops):
    torch._dynamo.reset()
    a = _mlp()
    opt = coda.optim.AdamW(a.parameters(), **KW)  # noqa: F841 (held)
    f = torch.compile(a, fullgraph=True)
    _loss(f, 0).backward()
    with pytest.raises(RuntimeError, match="twice without optimizer.step"):
        _loss(f, 1).backward()


@pytest.mark.parametrize("attention", ["inductor", "fused"])
def test_compiled_fused_llama_trains_as_torch_adamw(fp32_ops, monkeypatch, attention):
    """A fused tiny Llama, compiled, three steps of coda.optim.AdamW against torch.optim.AdamW on the same model
    compiled (so both run the same compiled forward and backward math): every parameter agrees; the MLP weights, the
    input embedding and the LM head were updated in backward (no .grad), with the attention block fused under
    compile (``FusedAttention.inductor_under_compile = False``) its QKV and O weights too, the rest by step()."""
    from test_optim import _models, _train
    monkeypatch.setattr(coda.nn_attention.FusedAttention, "inductor_under_compile", attention == "inductor")
    torch._dynamo.reset()
    a, b = _models()
    opt_a, opt_b = coda.optim.AdamW(a.parameters(), **KW), torch.optim.AdamW(b.parameters(), **KW)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (2, 24), generator=g) for _ in range(3)]
    _train(torch.compile(b), opt_b, batches)
    f = torch.compile(a, fullgraph=True)  # one graph: a break would split the optimizer token's uses (session 43)
    import coda.ops.cross_entropy as ce
    deferred, real = [], ce._update_in_backward
    monkeypatch.setattr(ce, "_update_in_backward", lambda w, dw, g, dz, x: deferred.append(dz.numel() > 0) or
                        real(w, dw, g, dz, x))
    f(batches[0], labels=batches[0]).loss.backward()
    assert deferred == [True]  # the LM head's dW GEMM ran in the backward with the update in its epilogue
    no_grad = {n for n, p in a.named_parameters() if p.grad is None}
    updated = (".mlp.weight_gu", ".mlp.down_proj", "embed_tokens", "lm_head")
    updated += (".self_attn.weight_qkv", ".self_attn.o_proj") if attention == "fused" else ()
    assert no_grad == {n for n, _ in a.named_parameters() if any(k in n for k in updated)}
    opt_a.step()
    opt_a.zero_grad(set_to_none=True)
    _train(f, opt_a, batches[1:])
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa, pb, rtol=2e-5, atol=2e-6, msg=n)


def test_compiled_fused_llama_with_a_graph_break_trains_as_without(fp32_ops):
    """A graph break between two decoder layers (a forward hook): each graph's backward updates its weights in place
    and bumps only their own tokens (one per weight), never one that an earlier graph saved for its backward (with
    one token per optimizer that raised "modified by an inplace operation"); the weights equal the one-graph run's."""
    from test_optim import _models, _train
    runs = []
    for brk in (False, True):
        torch._dynamo.reset()
        a, _ = _models()
        assert len(a.model.layers) >= 2
        if brk:
            a.model.layers[0].register_forward_hook(lambda *_: torch._dynamo.graph_break())
        opt = coda.optim.AdamW(a.parameters(), **KW)
        g = torch.Generator().manual_seed(1)
        _train(torch.compile(a), opt, [torch.randint(0, 128, (2, 24), generator=g) for _ in range(2)])
        runs.append(dict(a.named_parameters()))
    for n, p in runs[0].items():
        torch.testing.assert_close(runs[1][n], p, rtol=2e-5, atol=2e-6, msg=n)


def test_every_op_is_an_explicit_inductor_fallback(fp32_ops):
    """Under torch.compile the ops' fake implementations make every CODA op an explicit inductor fallback with the
    layout constraint inductor's implicit path would give it (``ops._common.inductor_fallbacks``): torch 2.11's
    implicit path formats the whole upstream IR into an unused log string, which made the first compiled step of a
    fused model with the attention fused under compile grow faster than quadratically with its depth (8 layers of
    a tiny Llama on the CPU: 107 s before, 19 s after; session 42)."""
    import torch._inductor.lowering as low
    from torch._library.utils import get_layout_constraint_tag

    from coda.ops import _common
    torch._dynamo.reset()
    m = _mlp()
    torch.compile(m, fullgraph=True)(torch.randn(2, 8, 64, requires_grad=True)).sum().backward()
    assert set(_common._fallbacks) == set(_common._impls) and len(_common._impls) > 20
    for name in _common._impls:
        op = getattr(torch.ops.coda, name).default
        assert op in low.lowerings, name
        want = low.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        assert low.maybe_layout_constraints(op) is want, name


def test_compile_caches_are_tagged_with_codas_sources(fp32_ops, monkeypatch):
    """Tracing a CODA op adds CODA's version and source hash to torch.compile's cache key tag (appended to the
    user's own), once: a compiled graph cached by another CODA is not served (``ops._common.tag_compile_caches``)."""
    from coda.ops import _common
    from coda.ops._common import package_source_hash
    monkeypatch.setattr(_common, "_tag", [])
    monkeypatch.setattr(torch.compiler.config, "cache_key_tag", "mine")
    torch._dynamo.reset()
    m = _mlp()
    torch.compile(m)(torch.randn(2, 8, 64))
    tag = torch.compiler.config.cache_key_tag
    assert tag.startswith("mine+coda-") and package_source_hash()[:16] in tag and _common._tag == [tag[5:]]
    _common.tag_compile_caches()
    assert torch.compiler.config.cache_key_tag == tag
    assert len(package_source_hash()) == 64


def test_compiled_layers_hand_the_sums_of_squares_on(fp32_ops, monkeypatch):
    """Under torch.compile (fullgraph) each decoder layer's down projection hands its output's rows' sums of squares
    to the next layer's QKV GEMM (coda.fuse's per-layer list; the eager side table records nothing while tracing):
    every layer but the first gets them, the lists are empty after the call (nothing kept, no recompile on the
    next step), and the loss equals the run in which every layer reduces its input itself."""
    from test_optim import _models
    monkeypatch.setattr(coda.nn_attention.FusedAttention, "inductor_under_compile", False)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    losses, real = [], coda.ops.rmsnorm_linear_rope_qkv
    for chain in (True, False):
        torch._dynamo.reset()
        a, _ = _models()
        layers = a.model.layers
        assert len(layers) >= 2 and all(isinstance(l.self_attn, coda.nn_attention.FusedAttention) for l in layers)
        if not chain:
            for l in layers:
                l.__dict__.pop("_coda_sumsq_in", None)
                l.__dict__.pop("_coda_sumsq_out", None)
        seen = []

        def spy(*args, sumsq=None, **kw):
            seen.append(sumsq is not None)
            return real(*args, sumsq=sumsq, **kw)
        monkeypatch.setattr(coda.ops, "rmsnorm_linear_rope_qkv", spy)
        f = torch.compile(a, fullgraph=True)
        torch._dynamo.utils.counters.clear()
        losses.append(f(ids, labels=ids).loss)
        assert seen == ([False] + [True] * (len(layers) - 1) if chain else [False] * len(layers))
        assert all(not getattr(l, "_coda_sumsq_in", []) for l in layers)
        seen.clear()  # (dynamo guards on the spy's list being empty)
        f(ids, labels=ids)  # the layers' lists held nothing between calls: no guard changed
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
