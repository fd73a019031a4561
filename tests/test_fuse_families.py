"""coda.fuse on the Llama-style families of Hugging Face transformers (Mistral, Qwen2, Qwen3; CPU, tiny models): the
MLPs and the LM head fuse in each, the attention where ``attention_fusable`` allows (Qwen2's q/k/v biases
included; not an o_proj bias), and the fused model's loss and
gradients (by stock name) equal the stock model's. The coda.ops path runs on the CPU reference GEMM in float32 (the
ops' 16-bit dtype gates opened, as tests/test_nn.py's float32 ops-path test does)."""
import copy
import warnings

import pytest
import torch

import coda
import coda.nn
from coda.nn_attention import FusedAttention
from test_first_use import _tiny_hf


def open_fp32_gates(set_attr=setattr):
    """The ops' 16-bit dtype gates opened to float32 (``set_attr``: ``monkeypatch.setattr`` in a test, the plain
    setattr in a spawned worker that exits after): the fused paths then run on the CPU reference GEMM in float32."""
    import coda._validate
    import coda.nn_attention
    import coda.ops.cross_entropy as ce
    import coda.ops.gated as gated
    import sys
    rl = sys.modules["coda.ops.rmsnorm_linear"]  # the module (coda.ops.rmsnorm_linear is also the function)
    f32 = (torch.bfloat16, torch.float16, torch.float32)
    set_attr(coda._validate, "IN_DTYPES", f32)
    set_attr(gated, "_IN_DTYPES", f32)
    set_attr(rl, "_IN_DTYPES", f32)
    set_attr(coda.nn, "_FUSED_DTYPES", f32)
    if hasattr(coda.nn_attention, "_FUSED_DTYPES"):
        set_attr(coda.nn_attention, "_FUSED_DTYPES", f32)
    check = ce._check
    set_attr(ce, "_check", lambda x, w, *a: check(x.to(torch.bfloat16), w.to(torch.bfloat16), *a))


@pytest.fixture
def fp32_ops(monkeypatch):
    open_fp32_gates(monkeypatch.setattr)


def _fuse(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        coda.fuse(model)
    return [str(w.message) for w in caught if "coda.fuse" in str(w.message)]


@pytest.mark.parametrize("kind,attention", [("Mistral", True), ("Qwen2", True), ("Qwen3", True)])
def test_family_fuses_and_matches_stock(fp32_ops, monkeypatch, kind, attention):
    torch.manual_seed(0)
    stock = _tiny_hf(kind).float()
    if kind == "Mistral":
        stock.config.sliding_window = None  # a full-attention Mistral: its attention fuses too
    _spread(stock)
    fused = copy.deepcopy(stock)
    msgs = _fuse(fused)
    assert fused._coda_fused
    layers = fused.model.layers
    assert all(isinstance(layer.mlp, coda.nn.SwiGLUMLP) for layer in layers)
    assert all(isinstance(layer.self_attn, FusedAttention) == attention for layer in layers)
    # the second residual add runs in the MLP's down projection (the layer's forward patched)
    assert all(layer.mlp.add_residual and "forward" in vars(layer) for layer in layers)
    assert isinstance(fused.lm_head, coda.nn.LMHeadCrossEntropy)
    assert not any("attention block(s) left stock" in m for m in msgs), msgs
    calls = []  # Qwen3's head norms, Qwen2's biases in the QKV GEMMs' epilogues and the backward pass (issue 30)
    for name, family in (("rmsnorm_linear_rope_qknorm_qkv", "Qwen3"), ("rmsnorm_linear_rope_bias_qkv", "Qwen2")):
        op = getattr(coda.ops, name)
        monkeypatch.setattr(coda.ops, name, lambda *a, _op=op, _f=family, **k: calls.append(_f) or _op(*a, **k))
    _matches_stock(stock, fused)
    assert calls == ([kind] * len(layers) if kind in ("Qwen2", "Qwen3") else [])


def _matches_stock(stock, fused, labels=None):
    """One forward + backward of both on the same batch: the loss to 1e-5, every gradient (by stock name) to 1e-4;
    returns the stock loss."""
    if labels is None:
        labels = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    loss = lambda out: out.loss if hasattr(out, "loss") else out  # noqa: E731 (Hugging Face's output, or a loss)
    ls = loss(stock(labels, labels=labels))
    ls.backward()
    lf = loss(fused(labels, labels=labels))
    lf.backward()
    assert abs(ls.item() - lf.item()) <= 1e-5 * abs(ls.item()), (ls.item(), lf.item())
    gs = {n: p.grad for n, p in stock.named_parameters() if p.grad is not None}
    gf = coda.stock_grads(fused)
    assert gs.keys() == gf.keys()
    for k in gs:
        err = ((gf[k].double() - gs[k].double()).norm() / gs[k].double().norm()).item()
        assert err <= 1e-4, (k, err)
    return ls.item()


def _spread(model):
    """Norm weights away from ones and biases away from zeros (Hugging Face's init): a weight or bias applied in
    the wrong order would show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)


def test_qwen2_biases_round_trip():
    """Qwen2's q/k/v biases: the fused state dict has the stock keys and values, a stock checkpoint loads into the
    fused model (same loss), stock_grads names the bias gradients, and unfuse puts the current biases back."""
    torch.manual_seed(0)
    stock = _tiny_hf("Qwen2").float()
    _spread(stock)
    fused = copy.deepcopy(stock)
    _fuse(fused)
    attn = fused.model.layers[0].self_attn
    assert isinstance(attn, FusedAttention) and attn.bias_qkv is not None and "q/k/v biases" in repr(attn)
    sd_stock, sd_fused = stock.state_dict(), fused.state_dict()
    assert list(sd_fused) == list(sd_stock)
    assert all(torch.equal(sd_fused[k], sd_stock[k]) for k in sd_stock)
    labels = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    other = _tiny_hf("Qwen2").float()  # another init: its checkpoint replaces every fused value
    _spread(other)
    fused.load_state_dict(other.state_dict())
    with torch.no_grad():
        lo, lf = other(labels, labels=labels).loss, fused(labels, labels=labels)
    lf = lf.loss if hasattr(lf, "loss") else lf
    assert abs(lo.item() - lf.item()) <= 1e-5 * abs(lo.item())
    lf = fused(labels, labels=labels)
    (lf.loss if hasattr(lf, "loss") else lf).backward()
    grads = coda.stock_grads(fused)
    assert all(f"model.layers.{i}.self_attn.{n}_proj.bias" in grads for i in range(2) for n in "qkv")
    with torch.no_grad():
        attn.bias_qkv.add_(1.0)  # a trained bias: unfuse keeps it
    want = [b.clone() for b in attn.qkv_biases()]
    coda.unfuse(fused)
    back = fused.model.layers[0].self_attn
    assert not isinstance(back, FusedAttention)
    for n, w in zip("qkv", want):
        assert torch.equal(getattr(back, f"{n}_proj").bias, w)


def test_an_o_proj_bias_stays_stock():
    model = _tiny_hf("Qwen2")
    for layer in model.model.layers:
        o = layer.self_attn.o_proj
        o.bias = torch.nn.Parameter(torch.zeros(o.out_features))
    msgs = _fuse(model)
    assert model._coda_fused  # the MLPs and the head
    assert all(not isinstance(layer.self_attn, FusedAttention) for layer in model.model.layers)
    assert any("o_proj bias" in m for m in msgs), msgs


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_mistral_sliding_window_attention_fuses_and_matches_stock(fp32_ops, impl):
    """A sliding window shorter than the sequence: Hugging Face's decoder hands the attention a mask that holds the
    window (sdpa: bool, eager: additive), which FusedAttention passes to SDPA as it is; loss and gradients equal
    the stock model's at T = 24 > window 16."""
    torch.manual_seed(0)
    stock = _tiny_hf("Mistral").float()
    stock.config.sliding_window = 16  # < max_position_embeddings = 64
    stock.config._attn_implementation = impl
    _spread(stock)
    fused = copy.deepcopy(stock)
    msgs = _fuse(fused)
    assert all(isinstance(layer.self_attn, FusedAttention) for layer in fused.model.layers), msgs
    labels = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    full = copy.deepcopy(stock)  # the window matters here: without it the loss differs
    full.config.sliding_window = None
    with torch.no_grad():
        lw = full(labels, labels=labels).loss.item()
    assert abs(lw - _matches_stock(stock, fused, labels)) > 1e-4


def test_sliding_window_without_a_windowed_mask_stays_stock():
    """An attention implementation that does not put the window into the mask (e.g. flash attention, which takes
    it as an argument): that attention stays stock, named, with the reason; the MLPs and the head fuse."""
    model = _tiny_hf("Mistral")
    model.config.sliding_window = 16
    object.__setattr__(model.config, "_attn_implementation_internal", "flash_attention_2")
    assert model.config._attn_implementation == "flash_attention_2"
    msgs = _fuse(model)
    assert model._coda_fused
    assert all(not isinstance(layer.self_attn, FusedAttention) for layer in model.model.layers)
    assert all(isinstance(layer.mlp, coda.nn.SwiGLUMLP) for layer in model.model.layers)
    assert any("sliding-window attention (window 16)" in m and "flash_attention_2" in m for m in msgs), msgs


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["Mistral", "Mistral+window", "Qwen2", "Qwen3"])
def test_family_fused_step_on_gpu(kind):
    """One bf16 training step of the fused tiny model on the Hopper GPU (the CuTeDSL kernels): loss and every
    gradient (by stock name) within 2x of stock bf16's error against the stock model in float64, plus a floor."""
    torch.manual_seed(0)
    base = _tiny_hf(kind.split("+")[0])
    if kind.startswith("Mistral"):  # a full-attention Mistral, or a window of 16 < T = 40 (in the sdpa mask)
        base.config.sliding_window = 16 if kind.endswith("+window") else None
    _spread(base)
    ref = copy.deepcopy(base).double().cuda()
    stock = copy.deepcopy(base).to("cuda", torch.bfloat16)
    fused = copy.deepcopy(stock)
    _fuse(fused)
    assert fused._coda_fused and isinstance(fused.lm_head, coda.nn.LMHeadCrossEntropy)
    labels = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(2)).cuda()

    def step(m):
        out = m(labels, labels=labels)
        loss = out.loss if hasattr(out, "loss") else out
        loss.backward()
        grads = coda.stock_grads(m) if getattr(m, "_coda_fused", False) else {
            n: p.grad for n, p in m.named_parameters() if p.grad is not None}
        return loss.detach().double(), grads

    (lr, gr), (ls, gs), (lf, gf) = step(ref), step(stock), step(fused)
    assert torch.isfinite(lf) and abs(lf - lr) <= 2 * abs(ls - lr) + 2e-2 * abs(lr), (lf, ls, lr)
    assert gr.keys() == gf.keys()
    for k in gr:
        def err(g):
            return ((g.double() - gr[k]).norm() / gr[k].norm().clamp_min(1e-30)).item()
        assert err(gf[k]) <= 2 * err(gs[k]) + 2e-2, (k, err(gf[k]), err(gs[k]))


def test_unfuse_restores_the_stock_layer_forward():
    """unfuse removes what fuse set on each decoder layer: the patched forward and the lists through which a
    layer hands its output's sums of squares to the next one under torch.compile (every layer after the first)."""
    model = _tiny_hf("Qwen2")
    _fuse(model)
    layers = model.model.layers
    assert len(layers) >= 2 and all("forward" in vars(layer) for layer in layers)
    assert all(vars(a)["_coda_sumsq_out"] is vars(b)["_coda_sumsq_in"] for a, b in zip(layers, layers[1:]))
    coda.unfuse(model)
    assert all(not {"forward", "_coda_sumsq_in", "_coda_sumsq_out"} & set(vars(layer)) for layer in layers)


@pytest.mark.parametrize("kind", ["Mistral", "Qwen2", "Qwen3"])
def test_generation_with_cache_matches_stock(kind):
    """Greedy generation with the key/value cache (transformers 5 passes it as ``cache``) through the fused
    attention and the patched decoder layers: the tokens of a greedy loop over the stock model's full forward
    (no cache; stock ``generate`` is not the reference: on these tiny random models transformers 5.24's own
    ``generate`` already disagrees with its forward's argmax)."""
    torch.manual_seed(0)
    stock = _tiny_hf(kind).float().eval()
    stock.config.sliding_window = None
    _spread(stock)  # Qwen2: biases away from zero
    fused = copy.deepcopy(stock)
    _fuse(fused)
    assert isinstance(fused.model.layers[0].self_attn, FusedAttention)
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(3))
    want = ids
    with torch.no_grad():
        for _ in range(6):
            want = torch.cat((want, stock(want).logits[:, -1:].argmax(-1)), 1)
        got = fused.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(want, got), (want, got)

