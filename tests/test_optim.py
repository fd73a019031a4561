"""coda.optim.AdamW: the optimizer step in the dW GEMM's epilogue (CPU reference path; the GPU kernels in
tests/test_optim_gpu.py)."""
import copy

import pytest
import torch

import coda
import coda.ops._common as common
from coda.epilogues.adamw import HYPER, adamw, adamw_fold, adamw_scaled, adamw_times
from coda.reference import gemm as ref_gemm
from test_fuse_families import _fuse, fp32_ops  # noqa: F401 (fixture)
from test_first_use import _tiny_hf

IN_BWD = ("mlp.weight_gu", "mlp.down_proj.weight", "self_attn.weight_qkv", "self_attn.o_proj.weight", "lm_head.weight",
          "embed_tokens.weight")


def _hyper(t=3, lr=1e-2, b1=0.9, b2=0.95, eps=1e-8, wd=0.1):
    vals = [b1, 1 - b1, b2, 1 - b2, 1 / (1 - b2 ** t) ** 0.5, eps, lr / (1 - b1 ** t), 1 - lr * wd]
    return dict(zip(HYPER, [torch.tensor(v, dtype=torch.float64) for v in vals]))


def _torch_adamw(g, p, m, v, t=3, lr=1e-2, b1=0.9, b2=0.95, eps=1e-8, wd=0.1):
    """torch's single-tensor AdamW step in float64: (p, m, v) after it."""
    p, m, v = p.double().clone(), m.double().clone(), v.double().clone()
    p.mul_(1 - lr * wd)
    m.lerp_(g.double(), 1 - b1)
    v.mul_(b2).addcmul_(g.double(), g.double(), value=1 - b2)
    denom = (v.sqrt() / (1 - b2 ** t) ** 0.5).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
    return p, m, v


@pytest.mark.parametrize("kind", ["plain", "fold", "scaled", "times"])
def test_epilogues_are_torch_adamw(kind):
    """Each program writes p, m, v in place (out=p, m and v in-place outputs) and equals torch's AdamW step on the
    gradient it forms (float64 reference; fresh random data)."""
    torch.manual_seed(0)
    M, N, K = 40, 24, 16
    a, b = torch.randn(M, K, dtype=torch.float64), torch.randn(N, K, dtype=torch.float64)
    p, m = torch.randn(M, N, dtype=torch.float64), torch.randn(M, N, dtype=torch.float64) * 0.1
    v = torch.rand(M, N, dtype=torch.float64) * 0.01
    gamma, t, s = torch.rand(N, dtype=torch.float64) + 0.5, torch.randn(M, N, dtype=torch.float64), 0.37
    g = {"plain": a @ b.T, "fold": (a @ b.T) * gamma, "scaled": t * s, "times": (a @ b.T) * s}[kind]
    want = _torch_adamw(g, p, m, v)
    ops = dict(p=p, m=m, v=v, **_hyper())
    if kind == "plain":
        res = common.gemm_for(p.device)(a, b, epilogue=adamw, out=p, **ops)
    elif kind == "fold":
        res = common.gemm_for(p.device)(a, b, epilogue=adamw_fold, out=p, gamma=gamma, **ops)
    elif kind == "times":
        res = common.gemm_for(p.device)(a, b, epilogue=adamw_times, out=p, s=s, **ops)
    else:
        res = common.gemm_for(p.device)(a[:, :0], b[:, :0], epilogue=adamw_scaled, out=p, t=t, s=s, **ops)
    assert res["out"] is p and res["m"] is m and res["v"] is v  # in place
    for got, ref in zip((p, m, v), want):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)
    if kind == "fold":
        assert res["dgamma"].shape[-1] == N


def test_inplace_output_rules():
    @coda.epilogue
    def upd(acc, q: coda.TileMN, s: coda.Scalar):
        return {"out": acc, "q": q + s * acc}
    assert upd.inplace == ("q",)
    a, b = torch.randn(8, 8, dtype=torch.bfloat16), torch.randn(16, 8, dtype=torch.bfloat16)
    q = torch.randn(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'q'.*share memory with 'out'"):
        ref_gemm(a, b, epilogue=upd, out=q.view(8, 16)[:, :], q=q, s=1.0)
    with pytest.raises(ValueError, match="must not share memory"):
        ref_gemm(a, b, epilogue=upd, q=torch.randn(1, 16, dtype=torch.bfloat16).expand(8, 16), s=1.0)
    with pytest.raises(TypeError, match="'q': updated in place, so it must have the output's dtype bfloat16"):
        ref_gemm(a, b, epilogue=upd, q=q.float(), s=1.0)
    with pytest.raises(coda.EpilogueError, match="only a TileMN operand"):
        @coda.epilogue
        def bad(acc, s: coda.VecN):
            return {"out": acc, "s": acc}


def _models(kind="Llama", tie=False):
    torch.manual_seed(0)
    stock = _tiny_hf(kind).float()
    stock.config.tie_word_embeddings = tie
    if not tie:
        stock.lm_head.weight = torch.nn.Parameter(stock.lm_head.weight.detach().clone())
    else:
        stock.lm_head.weight = stock.model.embed_tokens.weight
    fused = copy.deepcopy(stock)
    _fuse(fused)
    return fused, copy.deepcopy(fused)


def _train(model, opt, batches):
    for ids in batches:
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_in_backward_training_matches_torch_adamw(fp32_ops):
    """Three steps of a fused tiny Llama: coda.optim.AdamW (weights updated inside their dW GEMMs) against
    torch.optim.AdamW on the same fused model (gradients, then the optimizer): every parameter agrees, the in-backward
    ones have no .grad after backward and have already moved when backward returns."""
    a, b = _models()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt_a, opt_b = coda.optim.AdamW(a.parameters(), **kw), torch.optim.AdamW(b.parameters(), **kw)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (2, 24), generator=g) for _ in range(3)]
    _train(b, opt_b, batches)
    before = {n: p.detach().clone() for n, p in a.named_parameters()}
    a(batches[0], labels=batches[0]).loss.backward()
    moved = {n for n, p in a.named_parameters() if not torch.equal(p, before[n])}
    no_grad = {n for n, p in a.named_parameters() if p.grad is None}
    assert moved == no_grad and moved, (moved, no_grad)
    assert all(any(k in n for k in IN_BWD) for n in moved), moved
    assert all("norm" in n for n, p in a.named_parameters() if p.grad is not None)  # (the norm weights only)
    opt_a.step()
    opt_a.zero_grad(set_to_none=True)
    _train(a, opt_a, batches[1:])
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa, pb, rtol=2e-5, atol=2e-6, msg=n)
    sa, sb = opt_a.state_dict(), opt_b.state_dict()  # torch's state layout: loads into torch.optim.AdamW
    assert sa["state"].keys() == sb["state"].keys()
    for k in sb["state"]:
        assert float(sa["state"][k]["step"]) == float(sb["state"][k]["step"]) == 3.0
        torch.testing.assert_close(sa["state"][k]["exp_avg"], sb["state"][k]["exp_avg"], rtol=1e-4, atol=1e-7)


def test_dispatcher_path_returns_gradients(fp32_ops, monkeypatch):
    """Through the dispatcher outside a graph (``EAGER_FUNCTIONS=False``; under torch.compile the ops' update twins
    run instead: tests/test_optim_compile.py) the ops return gradients and step() updates the weights: the same
    parameters as in-backward updates."""
    a, b = _models()
    kw = dict(lr=1e-2, weight_decay=0.0)
    opt_a = coda.optim.AdamW(a.parameters(), **kw)
    opt_b = coda.optim.AdamW(b.parameters(), **kw)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    _train(a, opt_a, [ids, ids])
    monkeypatch.setattr(common, "EAGER_FUNCTIONS", False)
    b(ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in b.parameters())
    opt_b.step()
    opt_b.zero_grad(set_to_none=True)
    monkeypatch.setattr(common, "EAGER_FUNCTIONS", True)
    _train(b, opt_b, [ids])  # then in backward again: the step counts agree
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa, pb, rtol=2e-5, atol=2e-6, msg=n)


def test_second_backward_without_step_raises(fp32_ops):
    a, _ = _models()
    opt = coda.optim.AdamW(a.parameters(), lr=1e-3)  # noqa: F841 (held: a dropped optimizer does nothing)
    ids = torch.randint(0, 128, (2, 16))
    a(ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match="twice without optimizer.step"):
        a(ids, labels=ids).loss.backward()


def test_tied_lm_head_is_not_updated_in_backward(fp32_ops):
    a, b = _models(tie=True)
    assert a.lm_head.weight is a.model.embed_tokens.weight
    opt_a = coda.optim.AdamW(a.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    a(ids, labels=ids).loss.backward()
    assert a.lm_head.weight.grad is not None  # both parts of its gradient, through autograd
    opt_a.step()
    _train(b, opt_b, [ids])
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa, pb, rtol=2e-5, atol=2e-6, msg=n)


def test_in_backward_false_is_torch_adamw(fp32_ops):
    a, b = _models()
    opt_a = coda.optim.AdamW(a.parameters(), lr=1e-2, in_backward=False)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    _train(a, opt_a, [ids])
    _train(b, opt_b, [ids])
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_bad_arguments():
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="amsgrad"):
        coda.optim.AdamW([p], amsgrad=True)
    with pytest.raises(TypeError, match="lr must be a float"):
        coda.optim.AdamW([p], lr=torch.tensor(1e-3))
    with pytest.raises(TypeError, match="in_backward must be True or False"):
        coda.optim.AdamW([p], in_backward="yes")
    coda.optim.AdamW([p], capturable=True)  # in backward too (a CUDA graph of the step: test_graphs_gpu.py)


def test_update_config_by_tile_count():
    """The dW GEMMs with the update: in the epilogue warps when 128 x 256 tiles make two waves or more, else (and
    for a K = 0 pass) cooperative tiles with every warp on the epilogue: 128 x 192 where they fill the waves as
    well as 128 x 128 (qkv: 264 tiles, two full waves of 132 SMs), else 128 x 128."""
    from coda.optim import update_config
    assert update_config(mn=(16384, 2048)).epi_wg and update_config(mn=(2048, 8192)).epi_wg  # 1024, 512 tiles
    small = update_config(k_zero=True)
    assert (small.tile_m, small.tile_n, small.sched, small.epi_wg) == (128, 128, "dynamic", False)
    for mn in ((2048, 2048), (100, 100), (4096, 2048)):  # 128 x 256: 128, 1, 256 tiles; 128 x 192 fills less
        assert update_config(mn=mn) == small, mn
    qkv = update_config(mn=(3072, 2048))
    assert (qkv.tile_m, qkv.tile_n, qkv.sched, qkv.epi_wg) == (128, 192, "static", False) and not qkv.problems()
    assert update_config(mn=(3072, 2048), sm_count=78).epi_wg  # 192 tiles >= two waves of 78 SMs
    assert update_config() == update_config(mn=None) and update_config().epi_wg


@pytest.mark.parametrize("t", [1, 2, 7, 1000])
def test_capturable_hyper_parameters_from_the_device_step(t):
    """capturable=True: the update's step-dependent terms come from the device step count (no host read) and
    equal the host path's to float32 rounding; the step-independent rows are the same tensor values."""
    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = coda.optim.AdamW([p], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, capturable=True)
    group = opt.param_groups[0]
    dev = opt._hyper_on_device(0, group, torch.tensor(float(t - 1)), p.device)
    host = opt._hyper_tensor(0, group, t, p.device)
    torch.testing.assert_close(dev, host, rtol=2e-6, atol=0)
    assert opt._hyper_on_device(0, group, torch.tensor(0.0), p.device) is dev  # once per group and step


@pytest.mark.parametrize("name", ["adamw", "adamw_fold", "adamw_scaled", "adamw_times"])
def test_adamw_epilogues_compile_for_sm90(name):
    """The four programs under coda.optim's config (the dW GEMMs read MN-major operands; the K = 0 pass K-major
    zeros) compile for sm_90a on this CPU: WGMMA issued, no register spills."""
    pytest.importorskip("cutlass")
    from coda.check import compile_variant
    from coda.epilogues import adamw as A
    from coda.optim import update_config
    k_zero = name == "adamw_scaled"
    majors = ("k", "k") if k_zero else ("mn", "mn")
    row = compile_variant(update_config(k_zero), getattr(A, name), majors=majors)
    assert row["config"].endswith("_ewg") != k_zero  # the dW GEMMs: the epilogue warps
    assert row["ok"], row


def test_kernel_names_carry_the_epilogue():
    """GemmSm90's str goes into CuTeDSL's kernel name (mangling strips '.'), so the step report can tell the
    optimizer's K = 0 pass from the dW GEMMs that carry the update."""
    pytest.importorskip("cutlass")
    from coda.bench.step_report import classify
    from coda.kernels.gemm_sm90 import GemmSm90
    from coda.optim import update_config
    names = {n: "kernel_cutlass_kernel_" + str(GemmSm90(update_config(), e)).replace(".", "") + "_tensorptrbf16"
             for n, e in (("scaled", adamw_scaled), ("fold", adamw_fold), ("plain", adamw), ("times", adamw_times))}
    assert all(f"GemmSm90_adamw" in v for v in names.values())
    assert [classify(names[k]) for k in ("scaled", "fold", "plain", "times")] == ["optimizer", "gemm", "gemm", "gemm"]


def test_bench_optim_config_fields():
    from coda.bench.optim import parse
    cfg = parse("128,128,coop,2,dynamic,32,-")
    assert (cfg.tile_m, cfg.tile_n, cfg.pingpong, cfg.cluster_m, cfg.sched, cfg.epi_n, cfg.stages) == \
        (128, 128, False, 2, "dynamic", 32, None)


@pytest.mark.parametrize("M,budget,defer_budget,epilogue,opts", [
    (40, None, None, "adamw_times", {}),  # all rows fit DEFER_BUDGET: dW's GEMM runs in the backward with the update
    (40, None, None, "adamw_times", dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0, reduction="sum")),
    (40, 8 * 96 * 2, None, "adamw_scaled", {}),  # an explicit budget of 8 rows: chunks, then the K = 0 update pass
    (40, None, 0, "adamw_scaled", {}),    # deferral off
    (37, None, None, "adamw_scaled", {}),  # M % 8 != 0: dz^T is not a kernel operand (dW on torch.matmul)
])
def test_fast_cross_entropy_defers_dw_into_the_update(fp32_ops, monkeypatch, M, budget, defer_budget, epilogue,
                                                      opts):
    """Under coda.optim the fast cross entropy keeps the whole logits gradient dz (when it fits DEFER_BUDGET) and
    the backward runs dW = dz^T x once, with the AdamW step on g dW in its epilogue (adamw_times); otherwise dW is
    formed in the forward and updated by the K = 0 pass (adamw_scaled). Either way the weight and its moments equal
    torch's AdamW on the fast mode's own gradient; where the backward's update declines, the deferred GEMM forms
    the gradient instead."""
    import coda.ops.cross_entropy as ce
    from coda.ops import linear_cross_entropy as lce
    if defer_budget is not None:
        monkeypatch.setattr(ce, "DEFER_BUDGET", defer_budget)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    V, H = 96, 16
    x = torch.randn(M, H, generator=g)
    w0 = torch.randn(V, H, generator=g) / 4
    t = torch.randint(0, V, (M,), generator=g)
    t[3] = -100
    up = 1.0 + torch.rand((), generator=g).item()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    wb = torch.nn.Parameter(w0.clone())
    (lce(x, wb, t, mode="fast", memory_budget=budget, **opts) * up).backward()
    grad = wb.grad.clone()
    opt_b = torch.optim.AdamW([wb], **kw)
    opt_b.step()
    used = []
    real = ce.update_in_backward
    monkeypatch.setattr(ce, "update_in_backward", lambda *a, **k: used.append(a[4].name) or real(*a, **k))
    wa = torch.nn.Parameter(w0.clone())
    opt_a = coda.optim.AdamW([wa], **kw)
    (lce(x, wa, t, mode="fast", memory_budget=budget, **opts) * up).backward()
    assert wa.grad is None and used == [epilogue]
    opt_a.step()
    torch.testing.assert_close(wa, wb, rtol=1e-5, atol=1e-6)
    for k in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(opt_a.state[wa][k], opt_b.state[wb][k], rtol=1e-5, atol=1e-9)
    monkeypatch.setattr(ce, "_update_in_backward", lambda *a: False)  # declined: the gradient instead
    wc = torch.nn.Parameter(w0.clone())
    opt_c = coda.optim.AdamW([wc], **kw)  # noqa: F841 (held: registers wc)
    (lce(x, wc, t, mode="fast", memory_budget=budget, **opts) * up).backward()
    torch.testing.assert_close(wc.grad, grad, rtol=1e-5, atol=1e-7)
