"""coda.precompile on the GPU (issue 31): from an empty kernel cache, a dry run of a fused tiny Llama's training
step (coda.optim.AdamW updating the fused weights inside the backward) compiles every kernel in worker processes;
the real first step then compiles nothing in this process (every kernel comes from the disk cache) and trains
exactly as the same model without the dry run (the kernels are deterministic; the dry run left no gradient, no
optimizer bookkeeping and no RNG draw behind)."""
import copy
import importlib

import pytest
import torch

import coda
import coda.optim
from coda.runtime import compile_cache
from test_first_use import _tiny_hf

pytestmark = pytest.mark.gpu
gemm_mod = importlib.import_module("coda.gemm")
ce_grad = importlib.import_module("coda.kernels.ce_grad")
rope_grad = importlib.import_module("coda.kernels.rope_grad")
embedding_adamw = importlib.import_module("coda.kernels.embedding_adamw")


def _forget_compiled():
    for d in (gemm_mod._cache, gemm_mod._plans, ce_grad._compiled, rope_grad._launcher.compiled,
              rope_grad._launcher.plans, embedding_adamw._launcher.compiled, embedding_adamw._launcher.plans,
              compile_cache._modules):
        d.clear()


def test_precompile_then_the_first_step_compiles_nothing(cache, monkeypatch):
    monkeypatch.delenv("CODA_COMPILE_WORKERS", raising=False)
    monkeypatch.delenv("CODA_COMPILE_CACHE", raising=False)
    torch.manual_seed(0)
    stock = _tiny_hf("Llama")
    stock.config.tie_word_embeddings = False
    stock.lm_head.weight = torch.nn.Parameter(stock.lm_head.weight.detach().clone())
    a = copy.deepcopy(stock).to("cuda", torch.bfloat16)
    coda.fuse(a)
    b = copy.deepcopy(a)
    kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    opt_a, opt_b = coda.optim.AdamW(a.parameters(), **kw), coda.optim.AdamW(b.parameters(), **kw)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (2, 64), generator=g).cuda() for _ in range(2)]
    _forget_compiled()  # every kernel of the step is new to this process and to the (empty) disk cache

    s = coda.precompile(lambda ids: a(ids, labels=ids).loss.backward(), batches[0], workers=2)
    assert s.found > 10 and s.failed == 0 and s.compiled == s.found and s.workers == 2, str(s)
    assert s.kinds.get("gemm", 0) > 10 and s.kinds.get("rope_grad", 0) >= 1, s.kinds
    assert s.kinds.get("embedding_adamw", 0) == 1, s.kinds  # the embedding's backward + update (coda.optim)
    assert all(p.grad is None for p in a.parameters()) and not opt_a._done and not opt_a.state
    assert not gemm_mod._cache and not gemm_mod._plans

    hows = []
    real = compile_cache.cached

    def counted(key, build):
        fn, how = real(key, build)
        hows.append(how)
        return fn, how
    monkeypatch.setattr(compile_cache, "cached", counted)
    for step, ids in enumerate(batches):
        losses = []
        for model, opt in ((a, opt_a), (b, opt_b)):
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if step == 0 and model is a:  # a's first real step: everything loaded, nothing compiled
                assert hows and set(hows) == {"disk"}, hows
                assert len(hows) == s.found, (len(hows), str(s))
        assert losses[0] == losses[1], (step, losses)
    assert set(hows) == {"disk"}
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
