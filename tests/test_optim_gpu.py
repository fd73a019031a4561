"""coda.optim.AdamW on the GPU: the AdamW epilogues of the dW GEMMs (in-place p, m, v) against float64 torch AdamW,
and a fused tiny Llama trained with the in-backward update against the same model with torch's fused AdamW."""
import copy

import pytest
import torch

import coda
from coda.epilogues.adamw import HYPER, adamw, adamw_fold, adamw_scaled, adamw_times
from test_first_use import _tiny_hf
from test_optim import _torch_adamw

pytestmark = pytest.mark.gpu


def _hyper(t, lr=1e-2, b1=0.9, b2=0.95, eps=1e-8, wd=0.1):
    vals = [b1, 1 - b1, b2, 1 - b2, 1 / (1 - b2 ** t) ** 0.5, eps, lr / (1 - b1 ** t), 1 - lr * wd]
    h = torch.tensor(vals, device="cuda").unsqueeze(1).repeat(1, 4)  # 16-byte aligned rows, as coda.optim's
    return {name: h[i, :1] for i, name in enumerate(HYPER)}


def _err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("kind", ["plain", "fold", "scaled", "times"])
@pytest.mark.parametrize("shape", [(1000, 776, 520), (2048, 4096, 1024)])
def test_adamw_epilogue_matches_float64(kind, shape):
    """dW = dy^T x on transposed views (as the ops call it), the update in its epilogue: p, m, v written in place,
    every element (compared everywhere), within 2x the error of torch's path (the gradient rounded to bf16, then
    AdamW in fp32 math on the bf16 tensors) against float64, plus a floor."""
    _check_adamw_epilogue(kind, shape)


@pytest.mark.parametrize("kind", ["plain", "fold"])
@pytest.mark.parametrize("shape", [(3072, 2048, 520), (2048, 2048, 264)])
def test_update_config_few_tiles_matches_float64(kind, shape):
    """The few-tile dW GEMMs under the config coda.optim gives them (``update_config``: the QKV weight's 128 x 192
    static tiles, the O projection's 128 x 128 dynamic ones), ragged token counts."""
    from coda.optim import update_config
    cfg = update_config(False, shape[:2])
    assert (cfg.tile_n, cfg.sched) == ((192, "static") if shape[0] == 3072 else (128, "dynamic"))
    _check_adamw_epilogue(kind, shape, cfg)


def _check_adamw_epilogue(kind, shape, config=None):
    torch.manual_seed(0)
    N, K, T = shape  # weight N x K, T tokens
    bf = dict(device="cuda", dtype=torch.bfloat16)
    dy, x = torch.randn(T, N, **bf), torch.randn(T, K, **bf)
    p = torch.randn(N, K, **bf)
    m = (torch.randn(N, K, device="cuda") * 0.1).to(torch.bfloat16)
    v = (torch.rand(N, K, device="cuda") * 0.01).to(torch.bfloat16)
    gamma, tt, s = torch.rand(K, device="cuda") + 0.5, torch.randn(N, K, **bf), 0.37
    t = 3
    g64 = {"plain": dy.double().T @ x.double(), "fold": (dy.double().T @ x.double()) * gamma.double(),
           "scaled": tt.double() * s, "times": (dy.double().T @ x.double()) * s}[kind]
    ref = _torch_adamw(g64, p, m, v, t=t)
    # torch's path: the gradient stored in bf16, then AdamW in fp32 math, each tensor stored in its dtype
    pt, mt, vt = (w.to(d) for w, d in zip(_torch_adamw(g64.to(torch.bfloat16).float(), p.float(), m.float(),
                                                       v.float(), t=t), (p.dtype, m.dtype, v.dtype)))
    ops = dict(p=p, m=m, v=v, **_hyper(t))
    gemm = coda.gemm
    if kind == "plain":
        res = gemm(dy.t(), x.t(), epilogue=adamw, out=p, config=config, **ops)
    elif kind == "fold":
        res = gemm(dy.t(), x.t(), epilogue=adamw_fold, out=p, gamma=gamma, config=config, **ops)
        assert res["dgamma"].shape[-1] == K and torch.isfinite(res["dgamma"]).all()
    elif kind == "times":  # in the epilogue warps, as coda.optim runs the fast cross entropy's deferred dW
        from coda.config import epi_wg_config
        res = gemm(dy.t(), x.t(), epilogue=adamw_times, out=p, s=s, config=epi_wg_config(), **ops)
    else:
        z = torch.zeros(N, 0, **bf)
        res = gemm(z, torch.zeros(K, 0, **bf), epilogue=adamw_scaled, out=p, t=tt, s=s, **ops)
    torch.cuda.synchronize()
    assert res["out"] is p and res["m"] is m and res["v"] is v
    for name, got, theirs, want in zip("pmv", (p, m, v), (pt, mt, vt), ref):
        assert torch.isfinite(got).all(), name
        ours, torch_err = _err(got, want), _err(theirs, want)
        assert ours <= 2 * torch_err + 1e-6, (name, ours, torch_err)


def test_fold_dgamma_uses_the_weight_before_its_update():
    torch.manual_seed(1)
    N, K, T = 512, 264, 1000
    bf = dict(device="cuda", dtype=torch.bfloat16)
    dy, x, p = torch.randn(T, N, **bf), torch.randn(T, K, **bf), torch.randn(N, K, **bf)
    m, v = torch.zeros(N, K, **bf), torch.zeros(N, K, **bf)
    gamma = torch.rand(K, device="cuda") + 0.5
    want = ((dy.double().T @ x.double()) * p.double()).sum(0)
    res = coda.gemm(dy.t(), x.t(), epilogue=adamw_fold, out=p, gamma=gamma, p=p, m=m, v=v, **_hyper(1))
    got = res["dgamma"].reshape(-1).double()
    assert _err(got, want) < 1e-2


@pytest.mark.parametrize("in_backward", [True, False])
def test_fused_llama_trains_like_torch_adamw(in_backward):
    """A fused tiny Llama in bf16, three steps: coda.optim.AdamW (fused=True; every fused weight updated inside its
    dW GEMM, the LM head in its cross entropy's backward pass; in_backward=False: torch's step) and
    torch.optim.AdamW(fused=True) on the same fused model, each against the stock model trained in float64:
    every parameter's error within 2x torch's, plus a floor."""
    _train_against_float64(in_backward, compiled=False)


@pytest.mark.parametrize("attention", ["inductor", "fused"])
def test_compiled_fused_llama_trains_like_torch_adamw(monkeypatch, attention):
    """The same under torch.compile (both fused models compiled): the MLP's weights are updated inside their dW
    GEMMs by ops.mlp's update twin, the input embedding by ops.embedding's, the LM head in the cross entropy's
    backward (no .grad); with the attention block's fused GEMMs kept under compile (``attention="fused"``,
    CODA_INDUCTOR_UNDER_COMPILE=none) its QKV and O weights by their ops' twins too, else by step(); within 2x
    torch's error."""
    import coda.nn_attention
    monkeypatch.setattr(coda.nn_attention.FusedAttention, "inductor_under_compile", attention == "inductor")
    torch._dynamo.reset()
    _train_against_float64(True, compiled=True, attention_in_backward=attention == "fused")


def _train_against_float64(in_backward, compiled, attention_in_backward=None):
    attention_in_backward = in_backward if attention_in_backward is None else attention_in_backward
    torch.manual_seed(0)
    stock = _tiny_hf("Llama")
    stock.config.tie_word_embeddings = False
    stock.lm_head.weight = torch.nn.Parameter(stock.lm_head.weight.detach().clone())
    ref = copy.deepcopy(stock).double().cuda()
    a = copy.deepcopy(stock).to("cuda", torch.bfloat16)
    coda.fuse(a)
    b = copy.deepcopy(a)
    kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    opts = [coda.optim.AdamW(a.parameters(), fused=True, in_backward=in_backward, **kw),
            torch.optim.AdamW(b.parameters(), fused=True, **kw),
            torch.optim.AdamW(ref.parameters(), **kw)]
    run_a, run_b = (torch.compile(a), torch.compile(b)) if compiled else (a, b)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 64), generator=g).cuda()
        for model, run, opt in zip((a, b, ref), (run_a, run_b, ref), opts):
            run(ids, labels=ids).loss.backward()
            if model is a:  # updated in backward (no .grad), or by step()
                assert (a.model.layers[0].mlp.weight_gu.grad is None) == in_backward
                assert (a.model.layers[0].mlp.down_proj.weight.grad is None) == in_backward
                assert (a.lm_head.weight.grad is None) == in_backward
                assert (a.model.embed_tokens.weight.grad is None) == in_backward
                attn = a.model.layers[0].self_attn
                assert (attn.weight_qkv.grad is None) == attention_in_backward
                assert (attn.o_proj.weight.grad is None) == attention_in_backward
            opt.step()
            opt.zero_grad(set_to_none=True)
    sa, sb = coda.unfuse(a).state_dict(), coda.unfuse(b).state_dict()
    for k, want in ref.state_dict().items():
        if not want.is_floating_point():
            continue
        ea, eb = _err(sa[k], want), _err(sb[k], want)
        assert ea <= 2 * eb + 1e-4, (k, ea, eb)


def test_misaligned_scalar_view_is_named():
    h = torch.ones(8, device="cuda")
    p = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    ops = dict(p=p, m=torch.zeros_like(p), v=torch.zeros_like(p), **{n: h[i] for i, n in enumerate(HYPER)})
    with pytest.raises(ValueError, match="'b1c' \\(Scalar\\): .*16-byte aligned"):
        coda.gemm(torch.randn_like(p), torch.randn_like(p), epilogue=adamw, out=p, **ops)


def test_step_pass_of_a_large_matrix_matches_float64():
    """step()'s K = 0 update pass (kernel_step) on an embedding-shaped bf16 matrix with a stored gradient, 3 steps:
    p, m, v within 2x the error of torch's AdamW on the same bf16 tensors against float64; a small matrix and a
    vector beside it take torch's step bit for bit."""
    torch.manual_seed(2)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    shapes = [(32000 + 8, 1024), (64, 64), (512,)]
    init = [torch.randn(s, **bf) for s in shapes]
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    opt, topt = coda.optim.AdamW(ours, kernel_step=True, **hp), torch.optim.AdamW(theirs, **hp)
    p, m = init[0].double(), torch.zeros(shapes[0], device="cuda", dtype=torch.float64)
    v = torch.zeros_like(m)
    for t in range(1, 4):
        grads = [torch.randn(s, **bf) for s in shapes]
        for a, b, g in zip(ours, theirs, grads):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        topt.step()
        p, m, v = _torch_adamw(grads[0].double(), p, m, v, t=t, lr=1e-2, b1=0.9, b2=0.95, eps=1e-8, wd=0.1)
    torch.cuda.synchronize()
    for got, theirs_t, want in ((ours[0], theirs[0], p), (opt.state[ours[0]]["exp_avg"],
                                                          topt.state[theirs[0]]["exp_avg"], m),
                                (opt.state[ours[0]]["exp_avg_sq"], topt.state[theirs[0]]["exp_avg_sq"], v)):
        assert torch.isfinite(got).all()
        assert _err(got, want) <= 2 * _err(theirs_t, want) + 1e-6
    for a, b in zip(ours[1:], theirs[1:]):
        assert torch.equal(a, b)


def test_fast_cross_entropy_deferred_update_matches_float64(monkeypatch):
    """The fast cross entropy under coda.optim (bf16, 1016 tokens, V 4000): dW's GEMM runs in the backward with the
    AdamW step in its epilogue (adamw_times, checked); the weight and moments after one step within 2x the error of
    torch's bf16 path (logits, fp32 cross entropy, torch's fused AdamW) against float64, every element finite."""
    import torch.nn.functional as F
    import coda.ops.cross_entropy as ce
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    M, V, H = 1016, 4000, 264
    x = torch.randn(M, H, device="cuda").to(torch.bfloat16)
    w0 = (torch.randn(V, H, device="cuda") / H ** 0.5 * 3).to(torch.bfloat16)
    t = torch.randint(0, V, (M,), device="cuda")
    t[::7] = -100
    kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    used = []
    real = ce.update_in_backward
    monkeypatch.setattr(ce, "update_in_backward", lambda *a, **k: used.append(a[4].name) or real(*a, **k))
    wa = torch.nn.Parameter(w0.clone())
    opt_a = coda.optim.AdamW([wa], fused=True, **kw)
    coda.ops.linear_cross_entropy(x, wa, t).backward()
    assert used == ["adamw_times"] and wa.grad is None
    opt_a.step()
    results = {}
    for name, dtype in (("torch", torch.bfloat16), ("ref", torch.float64)):
        w = torch.nn.Parameter(w0.to(dtype))
        F.cross_entropy((x.to(dtype) @ w.t()).double(), t, ignore_index=-100).backward()
        opt = torch.optim.AdamW([w], fused=dtype == torch.bfloat16, **kw)
        opt.step()
        results[name] = (w.detach(), opt.state[w]["exp_avg"], opt.state[w]["exp_avg_sq"])
    ours = (wa.detach(), opt_a.state[wa]["exp_avg"], opt_a.state[wa]["exp_avg_sq"])
    p0 = w0.double()
    for i, name in enumerate("pmv"):
        got, theirs, want = ours[i], results["torch"][i], results["ref"][i]
        assert torch.isfinite(got).all(), name
        if name == "p":  # the step itself (p's bf16 rounding is the same on both sides)
            got, theirs, want = got.double() - p0, theirs.double() - p0, want - p0
        e_ours, e_torch = _err(got, want), _err(theirs, want)
        assert e_ours <= 2 * e_torch + 1e-3, (name, e_ours, e_torch)


def test_fast_cross_entropy_deferred_memory():
    """The deferral's documented trade: between forward and backward the fast CE holds the whole logits gradient
    (M x V in x's dtype) and dx, and no V x H dW is ever allocated (the update runs in the dW GEMM's epilogue)."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    M, V, H = 4096, 32000, 1024
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter((torch.randn(V, H, device="cuda") / H ** 0.5).to(torch.bfloat16))
    t = torch.randint(0, V, (M,), device="cuda")
    opt = coda.optim.AdamW([w], lr=1e-3, fused=True)
    for step in range(2):  # the first creates the moments
        x.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = coda.ops.linear_cross_entropy(x, w, t)
        held = torch.cuda.memory_allocated() - base
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        opt.step()
        dz, dx, dw = M * V * 2, M * H * 2, V * H * 2
        assert w.grad is None and x.grad is not None
        if step:
            assert dz <= held <= dz + dx + (4 << 20), (held, dz, dx)
            assert peak <= dz + dx + dw // 2, (peak, dz, dx, dw)  # no V x H gradient beside them
