"""The ``near`` tuning level (coda.autotune.space.neighbours / combine, tuner.tune(level="near")): the heuristic's
config one knob away, then the improving knobs combined. CPU tests with the GPU parts of the tuner replaced; one GPU
test tunes a fused problem for real."""
import dataclasses
import importlib

import pytest
import torch

from coda.autotune import space
from coda.config import default_config
from coda.kernels.epilogue import IDENTITY

gemm_mod = importlib.import_module("coda.gemm")
BF16 = torch.bfloat16


def test_near_level_neighbours_and_combination():
    d = default_config(8192, 16384, 2048)
    near = space.neighbours(d)
    assert d not in near and len(near) == len(set(near))
    diffs = []
    for c in near:  # each neighbour differs from d within exactly one knob group (the first that covers it)
        changed = {f for g in space.KNOBS for f in g if getattr(c, f) != getattr(d, f)}
        groups = [g for g in space.KNOBS if changed <= set(g)]
        assert changed and groups, (c, changed)
        diffs.append(groups[0])
        if c.pingpong:
            assert c.sched == "static"
    assert set(diffs) == set(space.KNOBS)
    assert {c.epi_n for c in near} >= {16, 64} and any(c.sched != d.sched for c in near)
    kept, pruned = space.near_candidates(None, "bfloat16", "bfloat16", 8192, 16384, 1, [d] + near)
    assert d in kept and all(reason for _, reason in pruned)
    assert all(not c.problems() for c in kept)
    # the improving knobs together; the first config wins a knob group; nothing new -> None
    a = dataclasses.replace(d, sched="static")
    b = dataclasses.replace(d, epi_n=16)
    c = dataclasses.replace(d, epi_n=64)
    assert space.combine(d, [a, b, c]) == dataclasses.replace(d, sched="static", epi_n=16)
    assert space.combine(d, [a]) is None and space.combine(d, []) is None


@pytest.mark.parametrize("epi_name", ["identity", "swiglu"])
def test_near_level_times_the_neighbours_then_their_combination(monkeypatch, epi_name):
    """tuner.tune(level="near") on the CPU with the GPU parts replaced: the heuristic's config first, every valid
    neighbour once, then the combination of the improving knobs; the winner is the fastest after the runoff. The
    output handed to coda.gemm has the epilogue's width (N/2 for SwiGLU's pairs: before session 21 it had N, and
    every config of a pairs epilogue failed)."""
    from coda.autotune import tuner
    from coda.epilogues.gated import swiglu
    epi = IDENTITY if epi_name == "identity" else swiglu
    d = default_config(8192, 16384, 2048)
    fast = {dataclasses.replace(d, sched="static"): 0.9, dataclasses.replace(d, epi_n=16): 0.95}
    combo = dataclasses.replace(d, sched="static", epi_n=16)
    fast[combo] = 0.8
    timed = []

    def fake_gemm(*args, config=None, out=None, **kw):
        assert out.shape == (8192, 16384 // 2 if epi is swiglu else 16384)
        timed.append(config)
        return None

    monkeypatch.setattr(gemm_mod, "gemm", fake_gemm)  # coda.gemm resolves to it at each call
    monkeypatch.setattr(tuner, "bench", lambda fn, rep_ms=None: (fn(), fast.get(timed[-1], 1.0))[1])
    monkeypatch.setattr("coda._device.require_hopper", lambda *a, **k: None)
    monkeypatch.setattr(tuner.torch.cuda, "get_device_properties", lambda dev: type("P", (), {"L2_cache_size": 1})())
    monkeypatch.setattr(tuner.torch.cuda, "mem_get_info", lambda dev: (1 << 40, 1 << 40))
    monkeypatch.setattr(tuner.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr("coda.autotune.heuristic", lambda prob: d)
    a, b = torch.randn(8192, 2048, dtype=BF16, device="meta"), torch.randn(16384, 2048, dtype=BF16, device="meta")
    monkeypatch.setattr(tuner, "rotating_copies", lambda t, n: [t])
    res = tuner.tune(a, b, epi, level="near", check=False, progress=False)
    assert all(r.status == "ok" for r in res.rows), [r.status for r in res.rows]
    firsts = list(dict.fromkeys(r.config for r in res.rows))
    assert firsts[0] == d and firsts[-1] == combo
    assert set(firsts[1:-1]) == set(space.near_candidates(epi, "bfloat16", "bfloat16", 8192, 16384, 1,
                                                          space.neighbours(d))[0])
    assert res.best == combo and res.default == d and res.level == "near"


@pytest.mark.gpu
def test_gpu_near_level_tunes_a_fused_problem(cache):
    from coda.autotune import tuner
    from coda.epilogues.scale_bias import ScaleBiasSumsq  # VecM + VecN operands and a row reduction
    a, b = torch.randn(3000, 1024, device="cuda", dtype=BF16), torch.randn(2056, 1024, device="cuda", dtype=BF16)
    ops = dict(scale=torch.rand(3000, device="cuda") + 0.5, bias=torch.randn(2056, device="cuda"))
    res = tuner.tune(a, b, ScaleBiasSumsq(), BF16, ops, level="near", progress=False)
    bad = [(r.config.name, r.status) for r in res.rows if not r.status.startswith("ok")]
    assert not bad, bad  # every neighbour ran and matched the reference
    assert res.best_ms is not None and len(res.rows) >= 5
