"""coda.nn modules and coda.fuse on CPU (the ops' torch reference path): forward/backward of each module against
the unfused stock modules (2x rule: the bf16 module's error against a float64 reference is at most twice plain
torch bf16's), float64 fallback, stock state-dict round trips, fuse/unfuse on examples/llama_model.py (and on
Hugging Face LlamaForCausalLM when transformers is installed), the training example as a smoke test."""
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import coda
from coda import ops
from coda.nn import LMHeadCrossEntropy, RMSNormLinear, SwiGLUMLP, rms_norm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from llama_model import LlamaConfig, LlamaForCausalLM, LlamaMLP, LlamaRMSNorm  # noqa: E402

EPS = 1e-6


def _err(a, ref):
    return (a.double() - ref.double()).abs().max().item()


def _two_x(name, got, torch_bf16, ref):
    e, e_torch = _err(got, ref), _err(torch_bf16, ref)
    assert e <= 2 * e_torch + 1e-6 * ref.abs().max().item(), f"{name}: coda {e:.3g} vs torch bf16 {e_torch:.3g}"


def _leaves(*ts, dtype):
    return [t.detach().to(dtype).requires_grad_() for t in ts]


def _grads(ts):
    return [t.grad for t in ts]


# ------------------------------------------------------------------------------------------------ stock references
def _stock_mlp(x, gamma, w_gate, w_up, w_down, residual):
    n = rms_norm(x, gamma, EPS)
    y = F.linear(F.silu(F.linear(n, w_gate)) * F.linear(n, w_up), w_down)
    return x + y if residual else y


def _randn(*shape, scale=1.0, g):
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


@pytest.mark.parametrize("add_residual", [True, False])
def test_swiglu_mlp_matches_stock(add_residual):
    g = torch.Generator().manual_seed(0)
    H, I = 64, 96
    x, gamma = _randn(3, 16, H, g=g), 1 + _randn(H, scale=0.2, g=g)
    wg, wu, wd = _randn(I, H, scale=H ** -0.5, g=g), _randn(I, H, scale=H ** -0.5, g=g), _randn(H, I, scale=I ** -.5,
                                                                                                g=g)
    dy = _randn(3, 16, H, g=g)
    runs = {}
    for key, dtype in (("ref", torch.float64), ("torch", torch.bfloat16)):
        leaves = _leaves(x, gamma, wg, wu, wd, dtype=dtype)
        y = _stock_mlp(*leaves, add_residual)
        y.backward(dy.to(dtype))
        runs[key] = (y, *_grads(leaves))
    mod = SwiGLUMLP(H, I, EPS, add_residual=add_residual, dtype=torch.bfloat16)
    mod.load_state_dict({"norm.weight": gamma, "gate_proj.weight": wg, "up_proj.weight": wu,
                         "down_proj.weight": wd})
    xb = x.detach().bfloat16().requires_grad_()
    y = mod(xb)
    y.backward(dy.bfloat16())
    dwg, dwu = ops.deinterleave_gate_up(mod.weight_gu.grad)
    got = (y, xb.grad, mod.norm.weight.grad, dwg, dwu, mod.down_proj.weight.grad)
    for name, a, t, r in zip("y dx dgamma dw_gate dw_up dw_down".split(), got, runs["torch"], runs["ref"]):
        _two_x(name, a, t, r)


def test_rmsnorm_linear_matches_stock():
    g = torch.Generator().manual_seed(1)
    H, sizes, names = 64, [64, 32, 32], ("q_proj", "k_proj", "v_proj")
    x, res, gamma = _randn(4, 8, H, g=g), _randn(4, 8, H, g=g), 1 + _randn(H, scale=0.2, g=g)
    ws = [_randn(n, H, scale=H ** -0.5, g=g) for n in sizes]
    dys = [_randn(4, 8, n, g=g) for n in sizes]
    dh = _randn(4, 8, H, g=g)
    runs = {}
    for key, dtype in (("ref", torch.float64), ("torch", torch.bfloat16)):
        leaves = _leaves(x, res, gamma, *ws, dtype=dtype)
        h = leaves[0] + leaves[1]
        n = rms_norm(h, leaves[2], EPS)
        outs = [F.linear(n, w) for w in leaves[3:]]
        torch.autograd.backward([*outs, h], [d.to(dtype) for d in (*dys, dh)])
        runs[key] = (*outs, h, *_grads(leaves))
    mod = RMSNormLinear(H, sizes, EPS, names=names, dtype=torch.bfloat16)
    mod.load_state_dict({"norm.weight": gamma, **{f"{n}.weight": w for n, w in zip(names, ws)}})
    xb, rb = _leaves(x, res, dtype=torch.bfloat16)
    *outs, h = mod(xb, residual=rb)
    torch.autograd.backward([*outs, h], [d.bfloat16() for d in (*dys, dh)])
    got = (*outs, h, xb.grad, rb.grad, mod.norm.weight.grad, *mod.weight.grad.split(sizes))
    for i, (a, t, r) in enumerate(zip(got, runs["torch"], runs["ref"])):
        _two_x(f"output/grad {i}", a, t, r)


@pytest.mark.parametrize("smoothing,z_loss", [(0.0, 0.0), (0.1, 1e-3)])
def test_lm_head_cross_entropy_matches_stock(smoothing, z_loss):
    g = torch.Generator().manual_seed(2)
    H, V = 64, 300  # V not a multiple of 8: the op's tail path
    x, gamma, w = _randn(2, 24, H, g=g), 1 + _randn(H, scale=0.2, g=g), _randn(V, H, scale=H ** -0.5, g=g)
    target = torch.randint(0, V, (2, 24), generator=g)
    target[0, :5] = -100
    runs = {}
    for key, dtype in (("ref", torch.float64), ("torch", torch.bfloat16)):
        leaves = _leaves(x, gamma, w, dtype=dtype)
        logits = F.linear(rms_norm(leaves[0], leaves[1], EPS), leaves[2]).flatten(0, 1)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        t = target.flatten()
        row = F.cross_entropy(logits, t, reduction="none", label_smoothing=smoothing)
        row = row + torch.where(t != -100, z_loss * logits.logsumexp(-1) ** 2, 0.0)
        loss = row.sum() / (t != -100).sum()
        loss.backward()
        runs[key] = (loss, *_grads(leaves))
    mod = LMHeadCrossEntropy(H, V, EPS, label_smoothing=smoothing, z_loss=z_loss, dtype=torch.bfloat16)
    mod.load_state_dict({"norm.weight": gamma, "weight": w})
    xb = x.detach().bfloat16().requires_grad_()
    loss = mod(xb, target)
    loss.backward()
    for name, a, t, r in zip("loss dx dgamma dw".split(), (loss, xb.grad, mod.norm.weight.grad, mod.weight.grad),
                             runs["torch"], runs["ref"]):
        _two_x(name, a, t, r)
    # the target check: "async" (the default) is the host check on CPU tensors, False skips it, others are refused
    bad = target.clone()
    bad[0, 1] = V
    with pytest.raises(ValueError, match=f"found {V} at"):
        mod(xb, bad)
    mod.check_targets = False
    assert torch.isfinite(mod(xb, bad))
    with pytest.raises(TypeError, match="check_targets must be True, False or"):
        LMHeadCrossEntropy(H, V, EPS, check_targets="yes")
    # float64 module (plain torch path) equals the reference
    mod64 = LMHeadCrossEntropy(H, V, EPS, label_smoothing=smoothing, z_loss=z_loss, dtype=torch.float64)
    mod64.load_state_dict({"norm.weight": gamma, "weight": w})
    torch.testing.assert_close(mod64(x, target), runs["ref"][0].double(), rtol=1e-10, atol=1e-10)


def test_float64_fallback_is_the_stock_math():
    g = torch.Generator().manual_seed(3)
    H, I = 32, 48
    mod = SwiGLUMLP(H, I, EPS, dtype=torch.float64)
    x = _randn(5, H, g=g)
    wg, wu = mod.gate_up()
    want = _stock_mlp(x, mod.norm.weight, wg, wu, mod.down_proj.weight, True)
    torch.testing.assert_close(mod(x), want, rtol=1e-12, atol=1e-12)
    lin = RMSNormLinear(H, 24, EPS, dtype=torch.float64)
    torch.testing.assert_close(lin(x), F.linear(rms_norm(x, lin.norm.weight, EPS), lin.weight))


# ------------------------------------------------------------------------------------------------ state dicts
def test_state_dict_stock_layout_round_trip():
    torch.manual_seed(0)
    norm, mlp = LlamaRMSNorm(64), LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=96))
    stock = {"norm.weight": norm.weight.detach() + 0.5, **mlp.state_dict()}
    mod = SwiGLUMLP(64, 96)
    mod.load_state_dict(stock)
    assert torch.equal(mod.weight_gu[0::2], stock["gate_proj.weight"])
    sd = mod.state_dict()
    assert list(sd) == ["norm.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    assert all(torch.equal(sd[k], stock[k]) for k in stock)
    mod2 = SwiGLUMLP(64, 96)
    mod2.load_state_dict(sd)
    assert torch.equal(mod2.weight_gu, mod.weight_gu)
    with pytest.raises(RuntimeError, match="gate_proj"):  # a partial stock dict is reported, not half-loaded
        mod2.load_state_dict({k: v for k, v in sd.items() if k != "up_proj.weight"})
    lin = RMSNormLinear(64, [64, 32], names=("q_proj", "kv_proj"))
    sd = lin.state_dict()
    assert list(sd) == ["norm.weight", "q_proj.weight", "kv_proj.weight"]
    assert [tuple(v.shape) for v in sd.values()] == [(64,), (64, 64), (32, 64)]
    lin2 = RMSNormLinear(64, [64, 32], names=("q_proj", "kv_proj"))
    lin2.load_state_dict(sd)
    assert torch.equal(lin2.weight, lin.weight)


def _example(dtype=torch.bfloat16, tie=False, device="cpu", **sizes):
    """The example model with non-trivial norm weights (tests/test_nn_gpu.py uses it too)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(**{"vocab_size": 200, **sizes}, tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg).to(device, dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
    return model


def _stock_grads(model):
    """Parameter gradients by stock name (fused parameters split back into the stock ones)."""
    return coda.stock_grads(model)


@pytest.mark.parametrize("tie", [False, True])
def test_fuse_example_model(tie):
    stock = _example(tie=tie)
    ref = _example(torch.float64, tie=tie)
    fused = copy.deepcopy(stock)
    sd = stock.state_dict()
    coda.fuse(fused)
    assert isinstance(fused.model.layers[0].mlp, SwiGLUMLP) and isinstance(fused.lm_head, LMHeadCrossEntropy)
    assert (fused.lm_head.weight is fused.model.embed_tokens.weight) == tie
    sd_f = fused.state_dict()
    assert list(sd_f) == list(sd) and all(torch.equal(sd_f[k], sd[k]) for k in sd)  # bitwise, same order
    ids = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(5))
    ids[1, :3] = 7
    losses = {}
    for key, m in (("stock", stock), ("fused", fused), ("ref", ref)):
        losses[key] = m(ids, labels=ids)
        losses[key].backward()
    assert abs(losses["fused"].item() - losses["ref"].item()) <= 2 * abs(losses["stock"].item() - losses["ref"].item()) + 2e-3
    gs, gf, gr = _stock_grads(stock), _stock_grads(fused), _stock_grads(ref)
    assert gs.keys() == gf.keys()
    for k in gs:
        scale = gr[k].abs().max().item()
        assert _err(gf[k], gr[k]) <= 2 * _err(gs[k], gr[k]) + 2e-2 * scale, k
    # logits (no labels): the stock path through the fused lm_head (deferred final norm, rmsnorm_linear)
    torch.testing.assert_close(fused(ids).float(), stock(ids).float(), rtol=0.05, atol=0.02)
    # load a stock checkpoint into the fused model; unfuse restores the stock modules and values
    fused.load_state_dict(sd)
    assert all(torch.equal(fused.state_dict()[k], sd[k]) for k in sd)
    coda.unfuse(fused)
    assert type(fused.model.layers[0].mlp).__name__ == "LlamaMLP" and "forward" not in fused.__dict__
    sd_u = fused.state_dict()
    assert list(sd_u) == list(sd) and all(torch.equal(sd_u[k], sd[k]) for k in sd)
    assert torch.equal(fused(ids), stock(ids))


def test_fuse_skips_unsupported_and_is_idempotent():
    model = _example()
    model.model.layers[0].mlp.gate_proj = nn.Linear(64, 176, bias=True).bfloat16()
    with pytest.warns(UserWarning, match="layers.0.mlp left stock"):
        coda.fuse(model)
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert isinstance(model.model.layers[1].mlp, SwiGLUMLP)
    assert coda.fuse(model) is model


def test_fuse_huggingface_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    stock = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for n, p in stock.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
    fused = copy.deepcopy(stock)
    coda.fuse(fused)
    assert isinstance(fused.model.layers[1].mlp, SwiGLUMLP) and isinstance(fused.lm_head, LMHeadCrossEntropy)
    sd, sd_f = stock.state_dict(), fused.state_dict()
    assert list(sd_f) == list(sd) and all(torch.equal(sd_f[k], sd[k]) for k in sd)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    out_s, out_f = stock(input_ids=ids, labels=ids), fused(input_ids=ids, labels=ids)
    assert out_f.logits is None
    assert abs(out_f.loss.item() - out_s.loss.item()) < 2e-2
    out_s.loss.backward()
    out_f.loss.backward()
    gs, gf = _stock_grads(stock), _stock_grads(fused)
    for k in gs:
        torch.testing.assert_close(gf[k].float(), gs[k].float(), rtol=0.1, atol=0.05 * gs[k].abs().max().item())
    n = 30  # num_items_in_batch: sum / n, as Hugging Face's loss
    l_s = stock(input_ids=ids, labels=ids, num_items_in_batch=n).loss
    l_f = fused(input_ids=ids, labels=ids, num_items_in_batch=n).loss
    assert abs(l_f.item() - l_s.item()) < 2e-2 * abs(l_s.item())
    torch.testing.assert_close(fused(input_ids=ids).logits.float(), stock(input_ids=ids).logits.float(), rtol=0.05,
                               atol=0.02)


def test_fuse_is_callable_after_importing_the_submodule():
    import coda.fuse as fuse_module  # the import system sets coda.fuse to the module
    assert callable(coda.fuse) and callable(fuse_module)
    model = coda.fuse(_example())
    assert isinstance(model.lm_head, LMHeadCrossEntropy)


def test_train_example_runs():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "llama_train.py"), "--steps", "3",
                          "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "stock" in out.stdout and "fused" in out.stdout and "tokens/s" in out.stdout


def test_train_example_runs_with_coda_optim_under_compile():
    """--coda-optim --compile --compile-fused: the fused model, compiled, trains with coda.optim.AdamW (the
    compiled backward's update twins) and its loss falls like the stock model's."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "llama_train.py"), "--steps", "6",
                          "--log-every", "5", "--device", "cpu", "--coda-optim", "--compile", "--compile-fused"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    final = {ln.split()[0]: float(ln.split()[1]) for ln in out.stdout.splitlines()
             if ln.startswith(("stock+compile", "fused+compile"))}
    first = float(next(ln for ln in out.stdout.splitlines() if "[fused] step     0" in ln).split()[-1])
    # an update that never ran would leave the fused loss at its start (stock: -0.11 over these steps)
    assert final["fused+compile"] < first - 0.05 and abs(final["fused+compile"] - final["stock+compile"]) < 0.02, \
        out.stdout


def test_train_example_grad_check():
    """--grad-check (one batch, gradients vs the float64 stock model): the fused bf16 error is the stock bf16 one."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "llama_train.py"), "--grad-check",
                          "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    stock, fused = map(float, next(ln for ln in out.stdout.splitlines() if ln.startswith("max")).split()[1:])
    assert 0 < stock < 3e-2 and fused <= 2 * stock, out.stdout


# ------------------------------------------------------------------------------------------------ training equivalence
def _train_pair(dtype, steps, *, tie=False, weight_decay=0.0, lr=1e-3):
    """Stock and coda.fuse'd copies of one model (the example's AdamW), trained on the same batches: per-step losses,
    the step-0 gradients by stock name, and both final state dicts."""
    stock = _example(dtype, tie=tie, vocab_size=256)
    fused = coda.fuse(copy.deepcopy(stock))
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 256, (4, 32), generator=g) for _ in range(8)]
    data[1][0, :5] = -100  # ignored labels (and ids: clamp the inputs only)
    opts = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=weight_decay) for m in (stock, fused)]
    losses, grads0 = ([], []), None
    for step in range(steps):
        labels = data[step % len(data)]
        ids = labels.clamp_min(0)
        for i, (m, opt) in enumerate(zip((stock, fused), opts)):
            loss = m(ids, labels=labels)
            loss.backward()
            losses[i].append(loss.item())
        if step == 0:
            grads0 = _stock_grads(stock), _stock_grads(fused)
            grads0 = tuple({k: v.clone() for k, v in gr.items()} for gr in grads0)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return losses, grads0, stock.state_dict(), fused.state_dict()


@pytest.mark.parametrize("tie,weight_decay", [(False, 0.0), (True, 0.0), (False, 0.1)])
def test_fuse_trains_like_stock_float64(tie, weight_decay):
    """The optimizer sees the same parameters (gamma shared, gate/up only interleaved: AdamW is elementwise) with the
    same gradients, so in float64 stock and fused follow one trajectory: step-0 gradients and 30 AdamW steps of
    losses agree to ~1e-12 (measured 1e-15), and so do the final weights (stock layout)."""
    (ls, lf), (gs, gf), sd_s, sd_f = _train_pair(torch.float64, 30, tie=tie, weight_decay=weight_decay)
    assert gs.keys() == gf.keys()
    for k in gs:
        assert _err(gf[k], gs[k]) <= 1e-12 * gs[k].abs().max().item(), k
    for step, (a, b) in enumerate(zip(ls, lf)):
        assert abs(a - b) <= 1e-10, f"step {step}: stock {a!r} fused {b!r}"
    assert ls[-1] < ls[0] - 0.1  # it trained
    assert list(sd_s) == list(sd_f)
    for k in sd_s:
        assert _err(sd_f[k], sd_s[k]) <= 1e-10, k


def test_fuse_ops_path_trains_like_stock_float32(monkeypatch):
    """The same through the coda.ops path (mlp: gamma folded per call, the radial-term autograd step, the SwiGLU
    backward in da's GEMM; linear_cross_entropy): the ops are 16-bit only, so their dtype gates are opened to float32 here and the CPU
    reference GEMM (fp32 math) runs them. Stock fp32 vs fused fp32 then agree to fp32 rounding (measured: step-0
    gradients 5e-7 relative, losses 5e-7 over 50 steps) -- a missing or extra gradient term would be O(1)."""
    import coda._validate
    import coda.nn
    import coda.ops.cross_entropy as ce
    import coda.ops.gated as gated

    f32 = (torch.bfloat16, torch.float16, torch.float32)
    monkeypatch.setattr(coda._validate, "IN_DTYPES", f32)
    monkeypatch.setattr(gated, "_IN_DTYPES", f32)
    monkeypatch.setattr(coda.nn, "_FUSED_DTYPES", f32)
    check = ce._check
    monkeypatch.setattr(ce, "_check", lambda x, w, *a: check(x.to(torch.bfloat16), w.to(torch.bfloat16), *a))
    calls = {"mlp": 0, "linear_cross_entropy": 0}

    def counted(name, fn):
        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapper
    monkeypatch.setattr(coda.ops, "mlp", counted("mlp", coda.ops.mlp))
    monkeypatch.setattr(coda.ops, "linear_cross_entropy", counted("linear_cross_entropy", ops.linear_cross_entropy))
    steps = 20
    (ls, lf), (gs, gf), sd_s, sd_f = _train_pair(torch.float32, steps)
    assert calls == {"mlp": 2 * steps, "linear_cross_entropy": steps}  # the ops ran, not plain torch
    for k in gs:
        rel = ((gf[k].double() - gs[k].double()).norm() / gs[k].double().norm()).item()
        assert rel <= 1e-5, f"{k}: relative gradient difference {rel:.2e}"
    for step, (a, b) in enumerate(zip(ls, lf)):
        assert abs(a - b) <= 1e-5, f"step {step}: stock {a!r} fused {b!r}"
    for k in sd_s:
        assert _err(sd_f[k], sd_s[k]) <= 1e-4, k


def test_swiglu_under_compile_with_inductor_flag(monkeypatch):
    """SwiGLUMLP.inductor_under_compile (off by default): while torch.compile traces, the stock math on the
    interleaved weight (same result) instead of the fused op."""
    torch.manual_seed(0)
    mlp = SwiGLUMLP(64, 176, add_residual=False).to(torch.bfloat16)
    with torch.no_grad():
        mlp.norm.weight.add_(0.1 * torch.randn(64))
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    fused = mlp(x)
    monkeypatch.setattr(__import__("coda.nn").nn, "compiling", lambda: True)
    assert torch.equal(mlp(x), fused) or not SwiGLUMLP.inductor_under_compile
    monkeypatch.setattr(SwiGLUMLP, "inductor_under_compile", True)
    import coda.nn
    monkeypatch.setattr(coda.nn, "rmsnorm_swiglu", lambda *a, **k: pytest.fail("the fused op ran under compile"))
    inductor = mlp(x)
    assert ((inductor.float() - fused.float()).norm() / fused.float().norm()).item() < 2e-2


def test_lm_head_softcap():
    """LMHeadCrossEntropy(softcap=c): the bf16 module (coda.ops.linear_cross_entropy with softcap) within 2x the
    error of torch in bf16 against float64 torch of the capped logits; the logits output is capped too; a bad
    softcap is refused."""
    g = torch.Generator().manual_seed(5)
    H, V, cap = 32, 72, 2.0
    x, gamma = _randn(4, 64, H, g=g), 1 + _randn(H, g=g) / 5  # 256 rows: the loss's rounding errors average out
    w, target = _randn(V, H, g=g) * 0.5, torch.randint(0, V, (4, 64), generator=g)

    def stock(dtype):
        xs, ws = _leaves(x, w, dtype=dtype)
        logits = F.linear(rms_norm(xs, gamma.to(dtype), EPS), ws).flatten(0, 1)
        logits = cap * torch.tanh(logits / cap)  # in the model's dtype, as a Gemma 2 model caps them
        loss = F.cross_entropy(logits.to(torch.promote_types(dtype, torch.float32)), target.flatten())
        loss.backward()
        return loss, xs.grad, ws.grad

    ref, theirs = stock(torch.float64), stock(torch.bfloat16)
    mod = LMHeadCrossEntropy(H, V, EPS, softcap=cap, dtype=torch.bfloat16)
    mod.load_state_dict({"norm.weight": gamma, "weight": w})
    xb = x.detach().bfloat16().requires_grad_()
    loss = mod(xb, target)
    loss.backward()
    # the loss is one number: torch's bf16 error can cancel by chance, so its floor is the bf16 rounding of the
    # logits averaged over the rows (2^-8 |loss| / sqrt(rows)); the gradients take the 2x rule as they are
    e, e_torch = _err(loss, ref[0]), _err(theirs[0], ref[0])
    assert e <= 2 * e_torch + 2 ** -8 * ref[0].abs().item() / target.numel() ** 0.5, ("loss", e, e_torch)
    for name, a, t, r in zip(("dx", "dw"), (xb.grad, mod.weight.grad), theirs[1:], ref[1:]):
        _two_x(name, a, t, r)
    assert mod(xb.detach()).abs().max() <= cap and "softcap=2.0" in repr(mod)
    with pytest.raises(ValueError, match="softcap"):
        LMHeadCrossEntropy(H, V, EPS, softcap=0.0)


def test_fused_layers_hand_the_streams_sumsq_on(monkeypatch):
    """coda.fuse'd layers chain the RMSNorm statistics: each fused MLP's down projection emits the rows' sums of
    squares of the stream it writes and the next layer's QKV GEMM (the last one's: the LM head's final norm) takes
    r from them (issue 30), the first layer reduces its input itself; the loss is the same as without the chain. A recorded sum is dropped when its
    tensor changes in place."""
    recall = coda.nn.recall_sumsq
    model = coda.fuse(_example(num_hidden_layers=3))
    ids = torch.randint(0, 200, (2, 96), generator=torch.Generator().manual_seed(1))  # M 192 > N 128: folded W
    real, seen = ops.rmsnorm_linear_rope_qkv, []

    def spy(x, *args, sumsq=None, **kwargs):
        seen.append(None if sumsq is None else (sumsq.clone(), x.detach().double().pow(2).sum(-1)))
        return real(x, *args, sumsq=sumsq, **kwargs)

    real_norm = ops.rmsnorm

    def spy_norm(x, *args, sumsq=None, **kwargs):  # the final norm (LMHeadCrossEntropy)
        seen.append(None if sumsq is None else (sumsq.clone(), x.detach().double().pow(2).sum(-1)))
        return real_norm(x, *args, sumsq=sumsq, **kwargs)

    monkeypatch.setattr(ops, "rmsnorm_linear_rope_qkv", spy)
    monkeypatch.setattr(ops, "rmsnorm", spy_norm)
    loss = model(ids, labels=ids)
    assert len(seen) == 4 and seen[0] is None and all(s is not None for s in seen[1:])
    for got, want in seen[1:]:
        assert got.shape == want.shape and ((got.double() - want).abs().max() / want.max()).item() < 1e-6
    monkeypatch.setattr(coda.nn, "SUMSQ_CHAIN", False)  # CODA_SUMSQ_CHAIN=0: every block reduces its input
    seen.clear()
    assert loss.item() == pytest.approx(model(ids, labels=ids).item(), rel=1e-3)
    assert len(seen) == 4 and all(s is None for s in seen)
    t = torch.ones(3, 4)
    assert coda.nn.remember_sumsq(t, torch.full((3,), 4.0)) is t
    assert torch.equal(recall(t), torch.full((3,), 4.0))
    t.add_(1)
    assert recall(t) is None and recall(torch.ones(3, 4)) is None


def test_o_projection_hands_the_mlp_its_normed_input(monkeypatch):
    """FusedAttention.emit_next_norm: inside coda.fuse's layers the output projection's epilogue also forms h *
    gamma of the MLP's norm and h's sums of squares, and the MLP's gate/up GEMM takes them (no scale_sumsq pass);
    loss and gradients as without; on by default, CODA_O_NORM_CHAIN=0 turns it off."""
    import os
    from coda.nn_attention import FusedAttention
    assert FusedAttention.emit_next_norm is (os.environ.get("CODA_O_NORM_CHAIN", "1") == "1")
    ids = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(2))  # M 80 <= 2I: scale_sumsq
    results = []
    for on in (False, True):
        monkeypatch.setattr(FusedAttention, "emit_next_norm", on)
        model = coda.fuse(_example(num_hidden_layers=2))
        real, seen = ops.mlp, []

        def spy(*args, normed=None, **kwargs):
            seen.append(normed)
            return real(*args, normed=normed, **kwargs)

        monkeypatch.setattr(ops, "mlp", spy)
        loss = model(ids, labels=ids)
        loss.backward()
        monkeypatch.setattr(ops, "mlp", real)
        assert len(seen) == 2 and all((s is not None) == on for s in seen)
        results.append((loss.detach(), _stock_grads(model)))
    assert results[1][0].item() == pytest.approx(results[0][0].item(), rel=1e-3)
    for k, g in results[0][1].items():
        assert _err(results[1][1][k], g) <= 2e-2 * g.abs().max().item() + 1e-3, k
