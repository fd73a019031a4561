"""The step benchmark's presets (``coda.bench.step.PRESETS``) beyond Llama (issue 31): Qwen2 (q/k/v biases) and
Qwen3 (head_dim, QK-norm) shapes in ``examples/llama_model.py`` and in the step's FLOPs; CPU only. The fused model
(``coda.fuse``, the ops path on the CPU reference GEMM in float32) matches the stock one; with its default flags the
example model is the Llama one it was (same parameters, same order, same values for the same seed)."""
import copy
import warnings

import pytest
import torch

import coda
from coda.bench import step as S
from coda.bench import step_report as SR
from coda.nn_attention import FusedAttention
from test_fuse_families import _matches_stock, _spread, fp32_ops  # noqa: F401 (a fixture)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "tiny-qwen3"])
def test_tiny_presets_fuse_and_match_stock(fp32_ops, preset):  # noqa: F811
    cfg = S.PRESETS[preset]
    torch.manual_seed(0)
    stock = S.build_model(cfg, 16)[0]
    _spread(stock)  # norm weights off ones, biases off zeros: one applied in the wrong place would show
    attn = stock.model.layers[0].self_attn
    assert (attn.q_proj.bias is not None) == bool(cfg.get("qkv_bias")) and attn.o_proj.bias is None
    assert hasattr(attn, "q_norm") == bool(cfg.get("qk_norm"))
    d = cfg.get("head_dim") or cfg["hidden"] // cfg["heads"]
    assert attn.q_proj.out_features == attn.o_proj.in_features == cfg["heads"] * d
    fused = copy.deepcopy(stock)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        coda.fuse(fused)
    msgs = [str(w.message) for w in caught if "coda.fuse" in str(w.message)]
    assert not msgs, msgs
    for layer in fused.model.layers:
        a = layer.self_attn
        assert isinstance(a, FusedAttention) and a.head_dim == d
        assert (a.bias_qkv is not None) == bool(cfg.get("qkv_bias"))
        assert (a.q_norm is not None) == bool(cfg.get("qk_norm"))
    assert list(fused.state_dict()) == list(stock.state_dict())
    _matches_stock(stock, fused)

def test_head_dim_preset_shapes_and_flops_by_hand():
    cfg = S.PRESETS["qwen3-32b-1l"]
    h, i, v, d = 5120, 25600, 151936, 128
    q, kv = 64 * d, 8 * d
    assert q == 8192
    assert SR.linear_shapes(cfg) == [(h, q, 1), (h, kv, 1), (h, kv, 1), (q, h, 1), (h, i, 1), (h, i, 1), (i, h, 1),
                                     (h, v, 1)]
    params = h * q + 2 * h * kv + q * h + 3 * h * i + h * v
    f = SR.step_flops(cfg, 2, 4096)
    assert f["gemm"] == 6 * 2 * 4096 * params
    assert f["attention"] == 3 * 1 * 2 * (2 * 2 * 64 * 4096 ** 2 * d) // 2
    assert f["total"] == f["gemm"] + f["attention"]
    # a preset without head_dim: hidden // heads, as before (q and o square)
    assert SR.linear_shapes(S.PRESETS["qwen2.5-7b-2l"])[:4] == [(3584, 3584, 2), (3584, 512, 2), (3584, 512, 2),
                                                                (3584, 3584, 2)]


def test_every_preset_has_the_keys_and_whole_heads():
    for name, cfg in S.PRESETS.items():
        assert {"hidden", "intermediate", "layers", "heads", "kv_heads", "vocab"} <= cfg.keys(), name
        assert set(cfg) <= {"hidden", "intermediate", "layers", "heads", "kv_heads", "vocab", "head_dim", "qkv_bias",
                            "qk_norm"}, name
        assert cfg["heads"] % cfg["kv_heads"] == 0 and (cfg.get("head_dim") or cfg["hidden"] % cfg["heads"] == 0)


# the Llama model's parameters before issue 31's flags: names in creation order, and a digest of their values for
# torch.manual_seed(0) and LlamaConfig() (sum over tensors of (index + 1) * sum(t * linspace(1, 2)), float64)
LLAMA_KEYS = ["model.embed_tokens.weight"] + [
    f"model.layers.{n}.{k}" for n in range(2) for k in
    [f"self_attn.{p}_proj.weight" for p in "qkvo"] + [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    + ["input_layernorm.weight", "post_attention_layernorm.weight"]] + ["model.norm.weight", "lm_head.weight"]
LLAMA_DIGEST = 7069.393118211199


def test_llama_default_flags_keep_the_llama_model():
    mod = S._model_module()
    torch.manual_seed(0)
    model = mod.LlamaForCausalLM(mod.LlamaConfig())
    sd = model.state_dict()
    assert list(sd) == LLAMA_KEYS == [n for n, _ in model.named_parameters()]
    digest = sum((i + 1) * (t.double().flatten() * torch.linspace(1, 2, t.numel(), dtype=torch.float64)).sum().item()
                 for i, t in enumerate(sd.values()))
    assert digest == pytest.approx(LLAMA_DIGEST, rel=1e-12, abs=0)
    d = 64 // 4
    assert torch.equal(model.model.inv_freq, 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    assert not any(hasattr(layer.self_attn, "q_norm") for layer in model.model.layers)


def test_transformers_fallback_builds_the_family(monkeypatch):
    """Without examples/llama_model.py: Hugging Face's Llama, Qwen2 (q/k/v biases, none on o_proj) or Qwen3."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(S, "_model_module", lambda: None)
    for preset, cls in (("tiny", "LlamaForCausalLM"), ("tiny-qwen2", "Qwen2ForCausalLM"),
                        ("tiny-qwen3", "Qwen3ForCausalLM")):
        model = S.build_model(S.PRESETS[preset], 16)[0]
        attn = model.model.layers[0].self_attn
        assert type(model).__name__ == cls and attn.o_proj.bias is None
        assert (attn.q_proj.bias is not None) == (preset == "tiny-qwen2")
        assert attn.q_proj.out_features == (128 if preset == "tiny-qwen3" else 64)


def test_llama_70b_tp8_preset_is_one_rank_of_the_70b_model():
    """Llama-3-70B (H 8192, I 28672, 64 / 8 heads of 128, V 128256) split 8 ways: one rank's projections."""
    full = dict(hidden=8192, intermediate=28672, heads=64, kv_heads=8, head_dim=128, vocab=128256)
    cfg = S.PRESETS["llama-70b-tp8-2l"]
    assert cfg["hidden"] == full["hidden"] and cfg["head_dim"] == full["head_dim"]
    for k in ("intermediate", "heads", "kv_heads", "vocab"):
        assert cfg[k] * 8 == full[k], k
    q, kv, h, i = 8 * 128, 1 * 128, 8192, 3584
    assert SR.linear_shapes(cfg) == [(h, q, 2), (h, kv, 2), (h, kv, 2), (q, h, 2), (h, i, 2), (h, i, 2), (i, h, 2),
                                     (h, 16032, 1)]
