"""GemmConfig(epi_wg=True) on the GPU: the epilogue warps' results against the default kernel's and the float64
reference, on ragged shapes, outputs poisoned with NaN first (every element must be written)."""
import pytest
import torch

import coda
from coda.config import GemmConfig

pytestmark = pytest.mark.gpu


@coda.epilogue
def radial(acc, gamma: coda.VecN, r: coda.VecM, inv_h: coda.Scalar, h: coda.TileMN):
    return {"out": acc * gamma - r * r * r * inv_h * h, "aux": acc * r}


@pytest.mark.parametrize("shape", [(1000, 776, 520), (2048, 2048, 1024), (333, 264, 64)])
@pytest.mark.parametrize("tile_n", [256, 128])
@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("tile_k", [64, 32])
def test_epilogue_warps_match(shape, tile_n, cluster_m, tile_k):
    torch.manual_seed(0)
    M, N, K = shape
    bf = dict(device="cuda", dtype=torch.bfloat16)
    a, b = torch.randn(M, K, **bf), torch.randn(N, K, **bf)
    ops = dict(gamma=torch.rand(N, device="cuda") + 0.5, r=torch.rand(M, device="cuda") + 0.5, inv_h=0.37,
               h=torch.randn(M, N, **bf))
    cfg = GemmConfig(tile_n=tile_n, cluster_m=cluster_m, epi_wg=True, tile_k=tile_k)
    out = torch.full((M, N), float("nan"), **bf)
    got = coda.gemm(a, b, epilogue=radial, out=out, config=cfg, **ops)
    plain = coda.gemm(a, b, config=cfg)  # the identity epilogue through the epilogue warps
    torch.cuda.synchronize()
    assert torch.equal(plain, coda.gemm(a, b, config=GemmConfig(tile_n=tile_n, cluster_m=cluster_m)))
    ref = coda.reference.gemm_wide(a.double(), b.double(), epilogue=radial, **{k: (v.double() if torch.is_tensor(v)
                                                                             else v) for k, v in ops.items()})
    base = coda.gemm(a, b, epilogue=radial, config=GemmConfig(tile_n=tile_n, cluster_m=cluster_m), **ops)
    for k in ("out", "aux"):
        assert not got[k].isnan().any(), k
        err = ((got[k].double() - ref[k]).norm() / ref[k].norm()).item()
        err_base = ((base[k].double() - ref[k]).norm() / ref[k].norm()).item()
        assert err <= 2 * err_base + 4e-3, (k, err, err_base)  # the staged accumulator is rounded to bf16


def test_adamw_in_place_through_the_epilogue_warps():
    """Three TileMN operands, eight Scalars and two in-place outputs (coda.optim's update) on 128 x 128 tiles."""
    from coda.epilogues.adamw import HYPER, adamw
    torch.manual_seed(1)
    N, K, T = 1536, 1032, 1024
    bf = dict(device="cuda", dtype=torch.bfloat16)
    dy, x = torch.randn(T, N, **bf), torch.randn(T, K, **bf)
    h = torch.tensor([0.9, 0.1, 0.95, 0.05, 1.2, 1e-8, 1e-3, 1.0], device="cuda").unsqueeze(1).repeat(1, 4)
    hyper = {n: h[i, :1] for i, n in enumerate(HYPER)}
    p0, m0, v0 = torch.randn(N, K, **bf), torch.randn(N, K, **bf) * 0.1, torch.rand(N, K, **bf) * 0.01
    outs = []
    for cfg in (GemmConfig(tile_n=128, epi_wg=True), GemmConfig(tile_n=128),
                GemmConfig(tile_n=256, cluster_m=2, epi_wg=True, tile_k=32)):
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        coda.gemm(dy.t(), x.t(), epilogue=adamw, out=p, config=cfg, p=p, m=m, v=v, **hyper)
        outs.append((p, m, v))
    torch.cuda.synchronize()
    for run in (outs[0], outs[2]):
        for got, want in zip(run, outs[1]):
            assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


def test_fused_da_and_ce_forward_through_the_epilogue_warps():
    """A 1 -> 2 epilogue with a per-row reduction (the SwiGLU backward fused into da, ops.mlp.dacc_on_da) and a
    reductions-only one (the cross entropy's logsumexp and target logit): against the default kernel."""
    from coda.epilogues.cross_entropy import ce_forward
    from coda.ops.mlp import dacc_on_da
    torch.manual_seed(2)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    M, H, I = 1000, 512, 776
    dy, wd = torch.randn(M, H, **bf), torch.randn(H, I, **bf)
    ops = dict(r=torch.rand(M, device="cuda") + 0.5, _preact_even=torch.randn(M, I, **bf),
               _preact_odd=torch.randn(M, I, **bf))
    prog = dacc_on_da((("out",), ("r",), False))
    got = coda.gemm(dy, wd.t(), epilogue=prog, config=GemmConfig(tile_n=128, epi_wg=True), **ops)
    want = coda.gemm(dy, wd.t(), epilogue=prog, config=GemmConfig(tile_n=128), **ops)
    for k in want:
        assert torch.isfinite(got[k]).all(), k
        assert ((got[k].float() - want[k].float()).norm() / want[k].float().norm()).item() < 1e-2, k
    x, w = torch.randn(M, H, **bf), torch.randn(3000, H, **bf)
    t = torch.randint(0, 3000, (M,), device="cuda").float()
    got = coda.gemm(x, w, epilogue=ce_forward, config=GemmConfig(epi_wg=True), t=t)
    want = coda.gemm(x, w, epilogue=ce_forward, config=GemmConfig(), t=t)
    for k in want:
        assert (got[k] - want[k]).abs().max().item() < 0.05 * want[k].abs().max().item() + 0.05, k


@pytest.mark.parametrize("name", ["swiglu_preact", "rotate"])
def test_pairs_through_the_epilogue_warps(name):
    """Column-pair epilogues: SwiGLU with its pre-activation stores ("half": N/2 outputs, two extra ones) and a 2 -> 2
    rotation ("full"), against the default kernel."""
    from coda.autodiff import with_preact
    from coda.ops.mlp import rms_swiglu
    from hook_epilogues import rotate
    torch.manual_seed(3)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    M, N, K = 1000, 1552, 512
    a, b = torch.randn(M, K, **bf), torch.randn(N, K, **bf)
    if name == "rotate":
        epi, ops = rotate, dict(c=torch.rand(M, N // 2, **bf), s=torch.rand(M, N // 2, **bf))
    else:
        epi, ops = with_preact(rms_swiglu), dict(r=torch.rand(M, device="cuda") + 0.5)
    got = coda.gemm(a, b, epilogue=epi, config=GemmConfig(tile_n=128, epi_wg=True), **ops)
    want = coda.gemm(a, b, epilogue=epi, config=GemmConfig(tile_n=128), **ops)
    got, want = (x if isinstance(x, dict) else {"out": x} for x in (got, want))
    for k in want:
        assert torch.isfinite(got[k]).all(), k
        assert ((got[k].float() - want[k].float()).norm() / want[k].float().norm()).item() < 1e-2, k


def test_column_sums_through_the_epilogue_warps():
    """Per-column sums (the folded weight's dW GEMM: dW = acc gamma, dgamma = sum_n acc w) on transposed views,
    against the default kernel."""
    from coda.ops.mlp import fold_grads
    torch.manual_seed(4)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    T, N, K = 1000, 1552, 520
    dacc, x = torch.randn(T, N, **bf), torch.randn(T, K, **bf)
    ops = dict(gamma=torch.rand(K, device="cuda") + 0.5, w=torch.randn(N, K, **bf))
    got = coda.gemm(dacc.t(), x.t(), epilogue=fold_grads, config=GemmConfig(tile_n=128, epi_wg=True), **ops)
    want = coda.gemm(dacc.t(), x.t(), epilogue=fold_grads, config=GemmConfig(tile_n=128), **ops)
    for k in want:
        assert torch.isfinite(got[k]).all(), k
        assert ((got[k].float() - want[k].float()).norm() / want[k].float().norm()).item() < 1e-2, k


@coda.epilogue
def col_sum(acc):
    return {"out": acc, "cs": coda.reduce_m(acc * acc)}


def test_column_partials_stay_in_bounds(monkeypatch):
    """The epilogue warps' per-column partials: every entry written, nothing outside the buffer, equal to the
    default kernel's. 13 M-tiles of 128 rows under 2 x 1 clusters: the 14th is padding, whose sums the epilogue
    warps write too (they landed past the buffer until session 29: now the buffer has its slots, and they are not
    finished). Guard zones of NaN around the buffer catch stray writes."""
    import math
    import sys
    G = sys.modules["coda.gemm"]
    guard, bufs = 1 << 14, []

    def guarded(shape, device):
        n = math.prod(shape)
        big = torch.full((2 * guard + n,), math.nan, dtype=torch.float32, device=device)
        bufs.append((big, n))
        return big[guard:guard + n].view(shape)

    torch.manual_seed(5)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    M, N, K = 1552, 520, 264
    a, b = torch.randn(M, K, **bf), torch.randn(N, K, **bf)
    want = coda.gemm(a, b, epilogue=col_sum, config=GemmConfig(tile_n=128))
    monkeypatch.setattr(G, "_new_partial", guarded)
    got = coda.gemm(a, b, epilogue=col_sum, config=GemmConfig(tile_n=128, cluster_m=2, epi_wg=True))
    torch.cuda.synchronize()
    assert len(bufs) == 1
    big, n = bufs[0]
    assert torch.isnan(big[:guard]).all() and torch.isnan(big[guard + n:]).all(), "write outside the partials"
    assert not torch.isnan(big[guard:guard + n]).any(), "partial entry never written"
    ref = (a.double() @ b.double().T).pow(2).sum(0)
    for x in (got["cs"], want["cs"]):
        assert ((x.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert ((got["cs"] - want["cs"]).norm() / want["cs"].norm()).item() < 1e-3


def _shipped_case(name, M, N, K, a_major, b_major):
    """(a, b, operands, epilogue) of a library epilogue that a shipped entry runs in the epilogue warps, at a ragged
    (M, N, K) with the entry's operand layouts."""
    from coda.autodiff import with_preact
    from coda.epilogues.cross_entropy import accumulate
    from coda.ops.mlp import fold_grads, rms_radial_residual, rms_swiglu
    bf = dict(device="cuda", dtype=torch.bfloat16)
    a = torch.randn(M, K, **bf) if a_major == "k" else torch.randn(K, M, **bf).t()
    b = torch.randn(N, K, **bf) if b_major == "k" else torch.randn(K, N, **bf).t()
    vec = lambda n: torch.rand(n, device="cuda") + 0.5  # noqa: E731
    tile = lambda: torch.randn(M, N, **bf)  # noqa: E731
    cases = {
        "rms_swiglu_preact": (with_preact(rms_swiglu), lambda: dict(r=vec(M))),
        "accumulate": (accumulate, lambda: dict(prev=tile())),
        "rms_radial_residual": (rms_radial_residual, lambda: dict(gamma=vec(N), r=vec(M), dr=torch.randn(
            M, device="cuda"), inv_h=1.0 / N, h=tile(), dres=tile())),
        "fold_grads": (fold_grads, lambda: dict(gamma=vec(N), w=tile())),
    }
    epi, ops = cases[name]
    return a, b, ops(), epi


def test_shipped_epilogue_warp_entries_match_the_default_kernel(monkeypatch):
    """Every shipped entry that runs a library epilogue in the epilogue warps, under its own config (clusters,
    static schedule) and operand layouts at a ragged shape: outputs poisoned with NaN, all written, equal to the
    default kernel's within the staged accumulator's bf16 rounding, and within 2x its error against float64."""
    import json

    from coda.autotune import space
    from coda.runtime.shipped import SHIPPED_DIR
    empty = torch.empty

    def poisoned(*args, **kw):  # every float buffer CODA allocates starts as NaN: each element must be written
        t = empty(*args, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.manual_seed(6)
    seen = set()
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        for e in json.loads(path.read_text())["entries"].values():
            if not e["config"].get("epi_wg"):
                continue
            p, name = e["problem"], e["epilogue"]["name"]
            cfg = space.config_from_dict(e["config"])
            M, N, K = 1000 + 8 * (p["M"] % 7), 1552, 520  # not multiples of the 128 x 256 tile
            a, b, ops, epi = _shipped_case(name, M, N, K, p["a_major"], p["b_major"])
            monkeypatch.setattr(torch, "empty", poisoned)
            got = coda.gemm(a, b, epilogue=epi, config=cfg, **ops)
            torch.cuda.synchronize()
            monkeypatch.setattr(torch, "empty", empty)
            want = coda.gemm(a, b, epilogue=epi, config=GemmConfig(), **ops)
            wide = {k: (v.double() if torch.is_tensor(v) else v) for k, v in ops.items()}
            ref = coda.reference.gemm_wide(a.double(), b.double(), epilogue=epi, **wide)
            got, want, ref = (x if isinstance(x, dict) else {"out": x} for x in (got, want, ref))
            for k in want:
                assert torch.isfinite(got[k]).all(), (path.name, name, k)
                err = ((got[k].double() - ref[k].double()).norm() / ref[k].double().norm()).item()
                base = ((want[k].double() - ref[k].double()).norm() / ref[k].double().norm()).item()
                assert err <= 2 * base + 4e-3, (path.name, name, k, err, base)
            seen.add(name)
    assert seen >= {"rms_swiglu_preact", "accumulate", "rms_radial_residual", "fold_grads"}, seen
