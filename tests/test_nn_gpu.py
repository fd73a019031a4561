"""coda.fuse on a Hopper GPU (the fused kernels): the example model's loss and every parameter gradient against the
stock bf16 model and a float64 reference (2x rule, plus a small floor), and the stock state dict kept bitwise.
Skipped without an sm_90 GPU (tests/conftest.py)."""
import copy
import os
import sys

import pytest
import torch

import coda

pytestmark = pytest.mark.gpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_nn import _example, _stock_grads  # noqa: E402

SIZES = dict(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def _model(dtype):
    return _example(dtype, device="cuda", **SIZES)


@pytest.mark.parametrize("o_norm", [False, True])
def test_fuse_matches_stock_on_cuda(o_norm, monkeypatch):
    """(8 x 128 tokens: the QKV GEMM folds gamma into its weight and takes r from the down projection's sums of
    squares; o_norm: FusedAttention.emit_next_norm, the MLP's h * gamma from the output projection's epilogue)"""
    from coda.nn_attention import FusedAttention
    monkeypatch.setattr(FusedAttention, "emit_next_norm", o_norm)
    stock, ref = _model(torch.bfloat16), _model(torch.float64)
    fused = copy.deepcopy(stock)
    sd = stock.state_dict()
    coda.fuse(fused)
    sd_f = fused.state_dict()
    assert list(sd_f) == list(sd) and all(torch.equal(sd_f[k], sd[k]) for k in sd)
    ids = torch.randint(0, 1000, (8, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    losses = {}
    for key, m in (("stock", stock), ("fused", fused), ("ref", ref)):
        losses[key] = m(ids, labels=ids)
        losses[key].backward()
    e_f, e_s = (abs(losses[k].item() - losses["ref"].item()) for k in ("fused", "stock"))
    assert e_f <= 2 * e_s + 2e-3
    gs, gf, gr = _stock_grads(stock), _stock_grads(fused), _stock_grads(ref)
    for k in gs:
        err = lambda g: (g.double() - gr[k]).abs().max().item()  # noqa: E731
        assert err(gf[k]) <= 2 * err(gs[k]) + 2e-2 * gr[k].abs().max().item(), k
    torch.testing.assert_close(fused(ids).float(), stock(ids).float(), rtol=0.05, atol=0.02)


def test_fused_training_step_never_synchronizes(monkeypatch):
    """A fused forward + backward queues its kernels without waiting on the GPU (torch's sync debug mode raises on
    a synchronizing call): the LM head's target check is a device-side assert ("async"), so the host keeps running
    ahead of the GPU in a training loop. The cross entropy's exp-stored phases read one range flag per logits chunk
    on the host (``ops/cross_entropy_fast.py``), from pinned memory behind an event queued before the chunk's dX
    GEMM: an event wait, not a stream synchronisation -- exactly one here (one chunk); ``CODA_CE_EXP=0``: none."""
    import warnings

    from coda.ops import cross_entropy_fast as fast
    waits, real = [], fast._flag_wait
    monkeypatch.setattr(fast, "_flag_wait", lambda ok: waits.append(ok) or real(ok))
    fused = _model(torch.bfloat16)
    coda.fuse(fused)
    assert fused.lm_head.check_targets == "async"
    ids = torch.randint(0, 1000, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    for exp in ("1", "0"):
        monkeypatch.setenv("CODA_CE_EXP", exp)
        fused(ids, labels=ids).backward()  # compiles and loads the kernels first
        torch.cuda.synchronize()
        waits.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                loss = fused(ids, labels=ids)
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
        assert syncs == [], (exp, [str(w.message) for w in syncs])
        assert len(waits) == (1 if exp == "1" else 0), exp
        assert torch.isfinite(loss).item()
