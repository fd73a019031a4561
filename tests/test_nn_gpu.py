"""coda.fuse on a Hopper GPU (the fused kernels): the example model's loss and every parameter gradient against the
stock bf16 model and a float64 reference (2x rule, plus a small floor), and the stock state dict kept bitwise.
Skipped without an sm_90 GPU (tests/conftest.py)."""
import copy
import os
import sys

import pytest
import torch

import coda
from coda import ops

pytestmark = pytest.mark.gpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from llama_model import LlamaConfig, LlamaForCausalLM  # noqa: E402


def _model(dtype):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).to("cuda", dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
    return model


def _grads(model):
    out = {}
    for n, p in model.named_parameters():
        if n.endswith("weight_gu"):
            out[n[:-9] + "gate_proj.weight"], out[n[:-9] + "up_proj.weight"] = ops.deinterleave_gate_up(p.grad)
        else:
            out[n] = p.grad
    return out


def test_fuse_matches_stock_on_cuda():
    stock, ref = _model(torch.bfloat16), _model(torch.float64)
    fused = copy.deepcopy(stock)
    sd = stock.state_dict()
    coda.fuse(fused)
    sd_f = fused.state_dict()
    assert list(sd_f) == list(sd) and all(torch.equal(sd_f[k], sd[k]) for k in sd)
    ids = torch.randint(0, 1000, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    losses = {}
    for key, m in (("stock", stock), ("fused", fused), ("ref", ref)):
        losses[key] = m(ids, labels=ids)
        losses[key].backward()
    e_f, e_s = (abs(losses[k].item() - losses["ref"].item()) for k in ("fused", "stock"))
    assert e_f <= 2 * e_s + 2e-3
    gs, gf, gr = _grads(stock), _grads(fused), _grads(ref)
    for k in gs:
        err = lambda g: (g.double() - gr[k]).abs().max().item()  # noqa: E731
        assert err(gf[k]) <= 2 * err(gs[k]) + 2e-2 * gr[k].abs().max().item(), k
    torch.testing.assert_close(fused(ids).float(), stock(ids).float(), rtol=0.05, atol=0.02)
