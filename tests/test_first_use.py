"""What a new user trips on (issue 26), on the CPU: lazy subpackages, the distribution name, coda.fuse on models it
does not handle and with a stale optimizer, coda.ops.linear's arguments (out_dtype, names, save_preact, float64
for gradcheck), autocast on the reference path, and linear_rope's position values."""
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import coda

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from llama_model import LlamaConfig, LlamaForCausalLM  # noqa: E402


def _fresh(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that finds the same ``coda`` as this one (this process's sys.path)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT / "tests", env=env,
                          capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------------------------------------ import coda
def test_ops_and_autotune_are_attributes_after_import_coda():
    proc = _fresh("""
        import sys
        import coda
        assert "torch" not in sys.modules, "import coda must stay cheap"
        import torch
        y = coda.ops.linear(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8, 8, dtype=torch.bfloat16))
        assert y.shape == (2, 8) and float(y[0, 0]) == 8.0
        assert callable(coda.autotune.clear) and coda.autotune.__name__ == "coda.autotune"
        assert {"ops", "autotune"} <= set(dir(coda))
        print("ok")
        """)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


# ------------------------------------------------------------------------------------------------ packaging
def test_distribution_name_is_ours_and_readme_says_so():
    text = (ROOT / "pyproject.toml").read_text()
    name = next(line.split("=", 1)[1].strip().strip('"') for line in text.splitlines() if line.startswith("name"))
    assert name != "coda-kernels", "coda-kernels on the package index is another project (also imported as coda)"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"pip install {name}" in readme or f"`{name}`" in readme
    assert "coda-kernels" in readme and "side by side" in readme  # the clash is documented


def test_readme_explains_cpu_torch_and_the_quick_test_run():
    readme = (ROOT / "README.md").read_text()
    assert "download.pytorch.org/whl/cpu" in readme
    assert 'pytest -m "not slow"' in readme
    assert "pip install -e '.[test]' && pytest" in readme  # the full run (.ci/run) is still the documented one
    assert '"slow:' in (ROOT / "pyproject.toml").read_text()


def test_generated_epilogue_compile_tests_are_marked_slow():
    import test_dsl
    for name in ("test_generated_epilogue_compiles_for_sm90", "test_generated_pair_tile_gradients_compile_for_sm90"):
        marks = getattr(getattr(test_dsl, name), "pytestmark", [])
        assert any(m.name == "slow" for m in marks), name


# ------------------------------------------------------------------------------------------------ coda.fuse
def _tiny_hf(kind: str):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    if kind == "GPT2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128,
                                                                    n_positions=64, bos_token_id=0, eos_token_id=0))
    cfg = getattr(transformers, f"{kind}Config")(**common)
    return getattr(transformers, f"{kind}ForCausalLM")(cfg)


@pytest.mark.parametrize("kind", ["Gemma", "GPT2"])  # Mistral / Qwen2 / Qwen3 fuse: tests/test_fuse_families.py
def test_fuse_warns_on_models_it_cannot_handle_and_does_not_mark_them(kind):
    model = _tiny_hf(kind)
    before = {n: p for n, p in model.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert coda.fuse(model) is model
    msgs = [str(w.message) for w in caught if "coda.fuse" in str(w.message)]
    assert any("layers.0.mlp" in m or "h.0.mlp" in m for m in msgs), msgs  # names what was left stock
    assert any("lm_head left stock" in m for m in msgs), msgs
    assert any("nothing fused" in m for m in msgs), msgs
    assert not getattr(model, "_coda_fused", False)
    assert {n: p for n, p in model.named_parameters()} == before  # untouched


def test_fuse_partial_model_warns_about_the_head():
    model = LlamaForCausalLM(LlamaConfig())
    model.model.norm = nn.LayerNorm(64)  # a final norm fuse does not know: the MLPs fuse, the head stays
    with pytest.warns(UserWarning, match="lm_head left stock"):
        coda.fuse(model)
    assert model._coda_fused and isinstance(model.lm_head, nn.Linear)


def test_optimizer_created_before_fuse_fails_loudly():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig()).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    coda.fuse(model)
    ids = torch.randint(0, 512, (2, 16))
    model(ids, labels=ids).backward()
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.(mlp\.gate_proj|self_attn\.q_proj)\.weight.*after coda\.fuse"):
        opt.step()
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)  # created afterwards: trains the fused MLP
    w = model.model.layers[0].mlp.weight_gu.detach().clone()
    fresh.step()
    assert not torch.equal(model.model.layers[0].mlp.weight_gu, w)


def test_optimizer_created_before_unfuse_fails_loudly():
    model = coda.fuse(LlamaForCausalLM(LlamaConfig()))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    coda.unfuse(model)
    with pytest.raises(RuntimeError, match=r"(mlp\.weight_gu|self_attn\.weight_qkv)"):
        opt.step()
    torch.optim.SGD(model.parameters(), lr=1e-3).step()


# ------------------------------------------------------------------------------------------------ coda.ops.linear
def _xw(dtype=torch.bfloat16, M=4, N=16, K=32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype))


def test_linear_out_dtype():
    x, w = _xw()
    y = coda.ops.linear(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x.float() @ w.float().T)
    assert coda.ops.linear(x, w).dtype == torch.bfloat16
    x.requires_grad_(), w.requires_grad_()
    coda.ops.linear(x, w, out_dtype=torch.float32).sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="out_dtype"):
        coda.ops.linear(x, w, out_dtype=torch.int32)


@pytest.mark.parametrize("case,exc,match", [
    ("dtype", TypeError, r"^linear: x and weight must have the same dtype; got x bfloat16 and weight float16"),
    ("K", ValueError, r"^linear: x/weight: rows must be 16-byte aligned"),
    ("N", ValueError, r"^linear: weight: N=6 \(weight\.shape\[0\]\)"),
    ("stride", ValueError, r"^linear: x: the column stride"),
])
def test_linear_errors_name_x_and_weight(case, exc, match):
    x, w = _xw()
    args = {"dtype": (x, w.half()), "K": (x[:, :12], w[:, :12]), "N": (x, w[:6]),
            "stride": (torch.randn(32, 4).bfloat16().t(), w)}[case]
    with pytest.raises(exc, match=match) as e:
        coda.ops.linear(*args)
    assert " a:" not in str(e.value) and " b:" not in str(e.value) and "a and b" not in str(e.value)


@pytest.mark.parametrize("value", ["no", 1, None])
def test_linear_save_preact_must_be_bool(value):
    x, w = _xw()
    with pytest.raises(TypeError, match="save_preact must be True or False"):
        coda.ops.linear(x, w, save_preact=value)


@coda.epilogue
def _custom(acc, bias: coda.VecN, r: coda.VecM, s: coda.Scalar, res: coda.TileMN):
    y = coda.gelu(acc + bias) * r * s + res
    return {"out": y, "ss": coda.reduce_n(y * y), "lse": coda.reduce_n(acc, "logsumexp")}


@pytest.mark.parametrize("save_preact", [False, True])
def test_gradcheck_custom_epilogue_in_float64(save_preact):
    g = torch.Generator().manual_seed(0)
    M, N, K = 3, 8, 16
    ts = [torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
          for shape in ((M, K), (N, K), (N,), (M,), (1,), (M, N))]

    def f(x, w, bias, r, s, res):
        out = coda.ops.linear(x, w, epilogue=_custom, save_preact=save_preact, bias=bias, r=r, s=s, res=res)
        assert out["out"].dtype == torch.float64
        return out["out"], out["ss"], out["lse"]
    assert torch.autograd.gradcheck(f, ts)


def test_float32_inputs_on_cpu():
    x, w = _xw(torch.float32)
    torch.testing.assert_close(coda.ops.linear(x, w), x @ w.T)
    with pytest.raises(TypeError, match="x and weight must have the same dtype"):
        coda.ops.linear(x, w.double())


# ------------------------------------------------------------------------------------------------ autocast
def test_reference_path_ignores_cpu_autocast():
    x, w = _xw(torch.float32, M=8, N=16, K=64)
    xb, wb = x.bfloat16(), w.bfloat16()
    want = coda.reference.gemm(xb, wb, out_dtype=torch.float32)
    want_linear = coda.ops.linear(x, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = coda.reference.gemm(xb, wb, out_dtype=torch.float32)
        got_linear = coda.ops.linear(x, w)
    assert torch.equal(got, want)
    assert got_linear.dtype == torch.float32 and torch.equal(got_linear, want_linear)


def test_cross_entropy_loss_stays_float32_under_autocast():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 32, generator=g).bfloat16()
    w = torch.randn(64, 32, generator=g).bfloat16()
    t = torch.randint(0, 64, (6,), generator=g)
    want = coda.ops.linear_cross_entropy(x, w, t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = coda.ops.linear_cross_entropy(x, w, t)
    assert got.dtype == torch.float32 and torch.equal(got, want)


# ------------------------------------------------------------------------------------------------ linear_rope
@pytest.mark.parametrize("pos", [torch.tensor([0.0, 1.5, 2.0]), torch.tensor([0, 1, 2 ** 24]),
                                 torch.tensor([0.0, float("nan"), 1.0]), torch.tensor([0.0, 2.0 ** 25, 1.0]),
                                 torch.tensor([0, -1, 2], dtype=torch.int32)],
                         ids=["fraction", "2^24", "nan", "2^25", "negative"])
def test_linear_rope_refuses_bad_positions(pos):
    x, w = _xw(M=3, N=16, K=16)
    freqs = torch.rand(8)
    with pytest.raises(ValueError, match=r"^linear_rope: positions must be integers in \[0, 2\^24\)"):
        coda.ops.linear_rope(x, w, pos, freqs)
    assert coda.ops.linear_rope(x, w, torch.tensor([0, 1, 2 ** 24 - 1]), freqs).shape == (3, 16)
    coda.ops.linear_rope(x, w, pos, freqs, check_positions=False)  # the documented opt-out
