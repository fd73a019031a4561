"""sched="dynamic" on the GPU: the tile counter hands out every tile exactly once, resets itself after every launch,
and is separate per stream. A dynamic launch computes each tile exactly as the static one of the same tile config
does (same k order), so results are compared bitwise."""
import dataclasses
import importlib

import pytest
import torch

import coda
import coda.ops
from coda.config import GemmConfig
from coda.epilogues.cross_entropy import ce_forward

pytestmark = pytest.mark.gpu

DYN = GemmConfig(tile_m=128, tile_n=256, cluster_m=1, cluster_n=1, sched="dynamic")
STATIC = GemmConfig(tile_m=128, tile_n=256, cluster_m=1, cluster_n=1)
CLUSTERS = [(1, 1), (2, 1), (1, 2)]


def _inputs(M, N, K, L=None, dtype=torch.bfloat16):
    lead = (L,) if L else ()
    return (torch.randn(*lead, M, K, device="cuda", dtype=dtype),
            torch.randn(*lead, N, K, device="cuda", dtype=dtype) / 16)


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("M,N,K,L", [(8191, 4104, 72, None), (1, 200, 4104, None), (127, 8, 8, None),
                                     (1000, 776, 520, 3), (4096, 8192, 1024, None)])
def test_dynamic_equals_static_bitwise_and_writes_everything(M, N, K, L, cluster):
    a, b = _inputs(M, N, K, L)
    static = GemmConfig(cluster_m=cluster[0], cluster_n=cluster[1])
    ref = coda.gemm(a, b, config=static)
    for _ in range(3):  # the counter must come back to zero after each launch
        out = torch.full_like(ref, float("nan"))
        coda.gemm(a, b, out=out, config=dataclasses.replace(static, sched="dynamic"))
        torch.cuda.synchronize()
        assert not torch.isnan(out).any()
        assert torch.equal(out, ref)
    exact = torch.matmul(a.double(), b.double().transpose(-1, -2))
    assert ((ref.double() - exact).norm() / exact.norm()).item() < 1e-2


def test_counter_is_zero_after_each_launch():
    a, b = _inputs(2048, 4096, 256)
    coda.gemm(a, b, config=DYN)
    torch.cuda.synchronize()
    counters = [c for (dev, _), c in importlib.import_module("coda.gemm")._counters.items() if dev == a.device.index]
    assert counters and all(torch.equal(c.cpu(), torch.zeros(2, dtype=torch.int32)) for c in counters)


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_reductions_epilogue_dynamic_equals_static(cluster):
    a, b = _inputs(1000, 32000, 512)
    t = torch.randint(0, 32000, (1000,), device="cuda").float()
    static = GemmConfig(cluster_m=cluster[0], cluster_n=cluster[1])
    ref = coda.gemm(a, b, epilogue=ce_forward, config=static, t=t)
    got = coda.gemm(a, b, epilogue=ce_forward, config=dataclasses.replace(static, sched="dynamic"), t=t)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_two_streams_use_two_counters():
    a, b = _inputs(4096, 8192, 512)
    ref = coda.gemm(a, b, config=STATIC)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    outs = [torch.full_like(ref, float("nan")) for _ in range(8)]
    torch.cuda.synchronize()
    for i, o in enumerate(outs):  # launches alternate between the streams and may overlap
        with torch.cuda.stream(s1 if i % 2 else s2):
            coda.gemm(a, b, out=o, config=DYN)
    torch.cuda.synchronize()
    for o in outs:
        assert torch.equal(o, ref)


def test_graphs_captured_on_one_stream_replay_concurrently():
    """Two graphs captured on torch.cuda.graph's shared capture stream, replayed at the same time on two streams:
    each captured launch has its own tile counter. With one counter per capture stream (the code before this
    test) the two launches (64 CTAs each, running side by side) drew tiles from one counter, so each left some of
    its tiles unwritten."""
    ins = [_inputs(1024, 2048, 4096) for _ in range(2)]
    refs = [coda.gemm(a, b, config=STATIC) for a, b in ins]
    outs = [torch.empty_like(r) for r in refs]
    for (a, b), o in zip(ins, outs):
        coda.gemm(a, b, out=o, config=DYN)  # compile outside the capture
    torch.cuda.synchronize()
    graphs = [torch.cuda.CUDAGraph() for _ in ins]
    for g, (a, b), o in zip(graphs, ins, outs):
        with torch.cuda.graph(g):
            coda.gemm(a, b, out=o, config=DYN)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for _ in range(20):
        for o in outs:
            o.fill_(float("nan"))
        torch.cuda.synchronize()
        for g, st in zip(graphs, streams):
            with torch.cuda.stream(st):
                g.replay()
        torch.cuda.synchronize()
        for o, r in zip(outs, refs):
            assert torch.equal(o, r)


def test_captured_launches_take_pool_counters_and_no_memset():
    """A dynamic launch captured into a CUDA graph takes its own pair of the pool allocated outside captures
    (``coda.gemm.GRAPH_COUNTERS``; the kernel leaves it at zero): two captured launches, two distinct pairs of the
    pool, the graph replays correctly and runs no fill kernel."""
    gemm_mod = importlib.import_module("coda.gemm")
    a, b = _inputs(1024, 2048, 512)
    ref = coda.gemm(a, b, config=STATIC)
    outs = [torch.empty_like(ref) for _ in range(2)]
    coda.gemm(a, b, out=outs[0], config=DYN)  # compile (and make the pool) outside the capture
    torch.cuda.synchronize()
    pool, before = gemm_mod._graph_pools[a.device.index]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for o in outs:
            coda.gemm(a, b, out=o, config=DYN)
    assert gemm_mod._graph_pools[a.device.index][1] == before + 2
    for _ in range(3):
        for o in outs:
            o.fill_(float("nan"))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            g.replay()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert sum("cutlass" in n for n in names) == 2, names  # the profiler sees the graph's kernels
        assert not [n for n in names if "Fill" in n or "Memset" in n], names
        assert all(torch.equal(o, ref) for o in outs)
    slot = gemm_mod.COUNTER_SLOT
    assert torch.equal(pool[slot * before:slot * (before + 2)].cpu(), torch.zeros(2 * slot, dtype=torch.int32))


def test_first_call_inside_a_capture_takes_an_aligned_counter():
    """A dynamic launch whose first call is inside a capture (no launch plan yet: its arguments go through the
    DSL's marshalling, which requires 16-byte aligned pointers) on an odd pair of the counter pool (session 48's
    fused + graph step failed there): captured, replayed, equal to the static schedule's result."""
    gemm_mod = importlib.import_module("coda.gemm")
    a, b = _inputs(1024, 2048, 520)  # (a shape no other test launches: no plan)
    ref = coda.gemm(a, b, config=STATIC)
    coda.gemm(*_inputs(256, 256, 64), config=DYN)  # the pool exists (made outside any capture)
    torch.cuda.synchronize()
    out = torch.full_like(ref, float("nan"))
    g = torch.cuda.CUDAGraph()
    pool = gemm_mod._graph_pools[a.device.index]
    with torch.cuda.graph(g):
        if pool[1] % 2 == 0:
            gemm_mod._tile_counter(a.device)  # take one pair: the launch's is an odd one
        coda.gemm(a, b, out=out, config=DYN)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_cuda_graph_replay(cluster):
    a, b = _inputs(2048, 4096, 512)
    static = GemmConfig(cluster_m=cluster[0], cluster_n=cluster[1])
    graph_replays_equal(a, b, dataclasses.replace(static, sched="dynamic"), coda.gemm(a, b, config=static))


def graph_replays_equal(a, b, cfg, ref):
    """coda.gemm(a, b, config=cfg) captured in a CUDA graph (compiled and run on a side stream first) writes ``ref``
    bitwise on each of three replays into a NaN-poisoned output."""
    out = torch.empty_like(ref)
    coda.gemm(a, b, out=out, config=cfg)  # compile outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        coda.gemm(a, b, out=out, config=cfg)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        coda.gemm(a, b, out=out, config=cfg)
    for _ in range(3):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)


def test_default_config_is_dynamic_and_runs_in_reduce_overhead_cudagraph_trees():
    """The heuristic default of a large problem is the dynamic schedule (here the mlp's gate/up GEMM, 2304 x 4096 x
    256); under torch.compile(mode="reduce-overhead") its counter is made during the warm-up / recording, and every
    replay on fresh data writes every element and equals eager bitwise (outputs poisoned between steps)."""
    from coda.config import default_config
    M, H, I = 2304, 256, 2048
    assert default_config(M, 2 * I, H).sched == "dynamic"
    compiled = torch.compile(coda.ops.mlp, mode="reduce-overhead")
    nw = 1 + torch.randn(H, device="cuda", dtype=torch.bfloat16) / 5
    wgu = torch.randn(2 * I, H, device="cuda", dtype=torch.bfloat16) / 16
    wdn = torch.randn(H, I, device="cuda", dtype=torch.bfloat16) / 45
    for _ in range(4):
        x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
        y = compiled(x, nw, wgu, wdn)
        assert not y.isnan().any()
        assert torch.equal(y, coda.ops.mlp(x, nw, wgu, wdn))
        y.fill_(float("nan"))
