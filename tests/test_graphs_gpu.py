"""CUDA graphs: coda.gemm and the coda.ops forward + backward passes can be captured in a ``torch.cuda.CUDAGraph``
and replayed on new data (the launches use the current stream, build no host-side state that a replay would miss,
and never synchronize). Each case captures once, then for fresh inputs copied into the static tensors poisons the
static outputs with NaN, replays, and requires every output to equal an eager call on the same inputs bitwise (the
kernels are deterministic). linear_cross_entropy is captured with ``check_targets="async"`` (the default True reads
the check's result on the host, which a capture does not allow), and with ``CODA_CE_EXP=0``: its eager fast mode
otherwise takes the exp-stored phases, whose range flag is read on the host, so a capture runs the stored-logits
phases -- the same loss and gradients to rounding, not bitwise (``ops/cross_entropy_fast.py``). The warm-up calls run before the capture, on a
side stream, as torch documents: the first call of a shape compiles or loads its kernels and may grow CODA's cached
zero buffer for K = 0 launches. torch.compile(mode="reduce-overhead") (CUDA-graph trees) is covered by the last
test."""
import pytest
import torch

import coda
import coda.ops

pytestmark = pytest.mark.gpu
DEV, BF = "cuda", torch.bfloat16
M, H, N, I, V = 520, 256, 392, 344, 1000  # ragged against the tiles


@coda.epilogue
def bias_gelu(acc, bias: coda.VecN):
    return coda.gelu(acc + bias)


def _inputs(g):
    """Fresh random inputs (the same names every time; the leaves that get gradients first)."""
    r = lambda *s, scale=1.0: (torch.randn(*s, device=DEV, generator=g) * scale).to(BF)  # noqa: E731
    return dict(x=r(M, H), nw=1 + r(H, scale=0.2), w=r(N, H, scale=H ** -0.5), wgu=r(2 * I, H, scale=H ** -0.5),
                wdn=r(H, I, scale=I ** -0.5), wv=r(V, H, scale=H ** -0.5), res=r(M, H), bias=r(N),
                dy=r(M, N), dh=r(M, H), t=torch.randint(0, V, (M,), device=DEV, generator=g))


def _grads(out, leaves, dys):
    outs = out if isinstance(out, tuple) else (out,)
    return (*outs, *torch.autograd.grad(outs, leaves, dys))


CASES = {
    "gemm+bias_gelu": lambda i: (coda.gemm(i["x"], i["w"], epilogue=bias_gelu, bias=i["bias"]),),
    "rmsnorm_linear+residual": lambda i: _grads(
        coda.ops.rmsnorm_linear(i["x"], i["nw"], i["w"], 1e-6, residual=i["res"]),
        [i["x"], i["nw"], i["w"], i["res"]], (i["dy"], i["dh"])),
    "mlp": lambda i: _grads(coda.ops.mlp(i["x"], i["nw"], i["wgu"], i["wdn"]),
                            [i["x"], i["nw"], i["wgu"], i["wdn"]], (i["dh"],)),
    "linear_cross_entropy": lambda i: _grads(
        coda.ops.linear_cross_entropy(i["x"], i["wv"], i["t"], check_targets="async"), [i["x"], i["wv"]],
        (torch.ones((), device=DEV),)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_capture_and_replay_matches_eager(case, monkeypatch):
    monkeypatch.setenv("CODA_CE_EXP", "0")  # (eager and the capture on the same phases: the module docstring)
    fn = CASES[case]
    g = torch.Generator(device=DEV).manual_seed(7)
    static = _inputs(g)
    for k in ("x", "nw", "w", "wgu", "wdn", "wv", "res"):
        static[k].requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: compiles / loads the kernels, fills the caches
        for _ in range(2):
            fn(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn(static)
    for _ in range(2):
        fresh = _inputs(g)
        with torch.no_grad():
            for k, v in fresh.items():
                static[k].copy_(v)
            for o in outs:
                o.fill_(float("nan"))
        graph.replay()
        want = fn({k: (v.clone().requires_grad_() if static[k].requires_grad else v) for k, v in fresh.items()})
        torch.cuda.synchronize()
        assert len(outs) == len(want)
        for j, (o, e) in enumerate(zip(outs, want)):
            assert not torch.isnan(o).any(), f"{case}: output {j} not written by the replay"
            assert torch.equal(o, e), f"{case}: output {j} differs from eager"


def test_reduce_overhead_compile_runs_the_ops_in_cudagraph_trees():
    """torch.compile(mode="reduce-overhead") records the ops into CUDA-graph trees: its warm-up runs them with the
    graph's private memory pool active and refuses any tensor that outlives the call in that pool (CODA's cached
    zero buffer for K = 0 launches is allocated outside it: M here is larger than in the other cases, so the buffer
    grows inside the warm-up; a helper thread allocates it, outside the pool). The compiled graph holds only the op
    (a loss reduction compiled by inductor rounds differently from eager), so over three steps on fresh data the
    output and the gradients equal eager ones bitwise; the replayed outputs are poisoned between steps."""
    g = torch.Generator(device=DEV).manual_seed(9)
    m = 2 * M + 8
    r = lambda *s, scale=1.0: (torch.randn(*s, device=DEV, generator=g) * scale).to(BF)  # noqa: E731
    leaves = [r(m, H), 1 + r(H, scale=0.2), r(2 * I, H, scale=H ** -0.5), r(H, I, scale=I ** -0.5)]

    def step(x, nw, wgu, wdn):
        return coda.ops.mlp(x, nw, wgu, wdn)

    compiled = torch.compile(step, mode="reduce-overhead")
    for _ in range(3):
        dy = r(m, H)
        outs = []
        for fn in (compiled, step):
            ls = [t.detach().clone().requires_grad_() for t in leaves]
            y = fn(*ls)
            y.backward(dy)
            outs.append([y.detach().clone(), *(t.grad.clone() for t in ls)])
            y.detach().fill_(float("nan"))  # the next replay must write every element again
            for t in ls:
                t.grad.fill_(float("nan"))
        for a, b in zip(*outs):
            assert not a.isnan().any()
            assert torch.equal(a, b)
        leaves[0] = r(m, H)


def test_whole_fused_training_step_in_one_graph(monkeypatch):
    """A fused tiny Llama's whole training step -- forward, backward with the in-backward AdamW updates of
    coda.optim.AdamW(capturable=True), step() for the embedding and norms -- captured in one CUDA graph after two
    eager steps and replayed on fresh batches, against the same model trained eagerly with the same optimizer: the
    step count advances on the device at each replay (the bias corrections), so the weights agree after five steps
    (math attention: deterministic) and moved far more than the tolerance."""
    import copy
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from test_first_use import _tiny_hf
    monkeypatch.setenv("CODA_CE_EXP", "0")  # (eager and the capture on the same phases: the module docstring)
    torch.manual_seed(0)
    stock = _tiny_hf("Llama")
    stock.config.tie_word_embeddings = False
    stock.lm_head.weight = torch.nn.Parameter(stock.lm_head.weight.detach().clone())
    a = copy.deepcopy(stock).to(DEV, BF)
    coda.fuse(a)
    b = copy.deepcopy(a)
    init = {n: p.detach().clone() for n, p in a.named_parameters()}
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True, capturable=True)
    oa, ob = coda.optim.AdamW(a.parameters(), **kw), coda.optim.AdamW(b.parameters(), **kw)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (2, 64), generator=g).to(DEV) for _ in range(5)]
    static = batches[0].clone()

    def step(model, opt, ids):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss

    graph, losses = torch.cuda.CUDAGraph(), []
    with sdpa_kernel(SDPBackend.MATH):
        for i, ids in enumerate(batches):
            static.copy_(ids)
            if i < 2:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    la = step(a, oa, static).detach().clone()
                    oa.zero_grad(set_to_none=True)
                torch.cuda.current_stream().wait_stream(side)
            else:
                if i == 2:
                    with torch.cuda.graph(graph):
                        captured = step(a, oa, static)
                graph.replay()
                la = captured.detach().clone()
            lb = step(b, ob, ids).detach()
            ob.zero_grad(set_to_none=True)
            losses.append((la, lb))
    torch.cuda.synchronize()
    for la, lb in losses:
        torch.testing.assert_close(la, lb, rtol=1e-3, atol=1e-3)
    moved = 0.0
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-2, atol=2e-3, msg=n)
        moved = max(moved, (pa.float() - init[n].float()).abs().max().item())
    assert moved > 2e-2
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert all(float(sa[k]["step"]) == float(sb[k]["step"]) == 5.0 for k in sb)
