"""Hypothesis fuzz of the public entry points' argument checks (issue 7), CPU only.

Every case starts from a random *valid* problem (K-major or MN-major views, padded rows, batched, broadcast weight,
optional ``out=`` and a fused ``@coda.epilogue`` with every operand kind) and applies at most one mutation. For a
mutated call, ``coda.reference.gemm`` and ``coda.gemm`` must raise the same error class with the same message,
which names the argument and shows what was found; ``coda.gemm`` must raise it *before* the "needs a Hopper GPU"
error (this machine has none); and no tensor of the call (``out`` included) may change. Unmutated calls must reach
the architecture check in ``coda.gemm`` and match a float64 product in ``coda.reference.gemm``.

The tests at the end pin library bugs found while writing this file (now fixed).
"""
import dataclasses
import importlib
import re
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import coda
import coda.reference
from coda._validate import check_gemm_args
from coda.config import GemmConfig
from coda.kernels.epilogue import MAX_EPI_TENSORS, Epilogue, Operand

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
HOPPER = r"needs a Hopper \(sm_90\) GPU"


@coda.epilogue
def fuzz_epi(acc, bias: coda.VecN, rs: coda.VecM, res: coda.TileMN, s: coda.Scalar):
    y = (acc * s + bias) * rs + res
    return {"out": y, "ss": coda.reduce_n(y * y)}


def fuzz_epi64(acc, bias, rs, res, s):
    """float64 truth of :func:`fuzz_epi`."""
    y = (acc * s + bias.double()) * rs.double().unsqueeze(-1) + res.double()
    return {"out": y, "ss": (y * y).sum(-1)}


def _ceil8(x):
    return -(-x // 8) * 8


def _operand(g, lead, rows, K, major, pad, dtype):
    """A valid (*lead, rows, K) view: K contiguous ("k", rows padded by ``pad``) or rows contiguous ("mn", a
    transposed view whose columns start 16-byte aligned)."""
    if major == "k":
        return torch.randn(*lead, rows, K + pad, generator=g).to(dtype)[..., :K]
    return torch.randn(*lead, K, _ceil8(rows) + pad, generator=g).to(dtype)[..., :rows].transpose(-1, -2)


@dataclasses.dataclass
class Problem:
    L: Optional[int]
    M: int
    N: int
    K: int
    dtype: torch.dtype
    broadcast: bool
    majors: tuple
    out_dtype: Optional[torch.dtype]  # the out_dtype argument
    a: torch.Tensor
    b: torch.Tensor
    out: Optional[torch.Tensor]
    epilogue: Optional[Epilogue]
    operands: dict

    @property
    def lead(self):
        return () if self.L is None else (self.L,)

    @property
    def res_dtype(self):
        """The dtype the result gets."""
        return self.out.dtype if self.out is not None else (self.out_dtype or self.dtype)

    @property
    def out_shape(self):
        return (*self.lead, self.M, self.N)

    def kwargs(self):
        kw = dict(out=self.out, out_dtype=self.out_dtype)
        if self.epilogue is not None:
            kw["epilogue"] = self.epilogue
        kw.update(self.operands)
        return kw

    def tensors(self):
        ts = [self.a, self.b, self.out, *self.operands.values()]
        return [t for t in ts if isinstance(t, torch.Tensor) and t.device.type == "cpu"]


def fuzz_operands(g, lead, M, N, dtype):
    return dict(bias=torch.randn(N, generator=g), rs=torch.rand(*lead, M, generator=g) + 0.5,
                res=torch.randn(*lead, M, N, generator=g).to(dtype), s=0.75)


@st.composite
def problems(draw, empty_ok=True):
    """A random valid problem (sizes may be zero when ``empty_ok``)."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    L = draw(st.sampled_from([None, None, 1, 2] + ([0] if empty_ok else [])))
    lo = 0 if empty_ok else 1
    M = draw(st.integers(lo, 9))
    N = draw(st.sampled_from(([0] if empty_ok else []) + [8, 16, 24]))
    K = draw(st.sampled_from(([0] if empty_ok else []) + [8, 16, 32]))
    dtype = draw(st.sampled_from([BF16, FP16]))
    broadcast = L is not None and draw(st.booleans())
    a_major, b_major = draw(st.sampled_from(["k", "mn"])), draw(st.sampled_from(["k", "mn"]))
    if broadcast and (L or 0) > 1 and M > 1:
        a_major = "k"  # an MN-major batched a cannot fold its batch into M (documented error)
    lead = () if L is None else (L,)
    a = _operand(g, lead, M, K, a_major, draw(st.sampled_from([0, 8])), dtype)
    b = _operand(g, () if broadcast else lead, N, K, b_major, draw(st.sampled_from([0, 8])), dtype)
    out_dtype = draw(st.sampled_from([None, BF16, FP16, FP32]))
    out = None
    if draw(st.booleans()):
        od = out_dtype or dtype
        out = torch.full((*lead, M, N), -77.0, dtype=od)
        if draw(st.booleans()):
            out_dtype = None  # out's dtype decides
    with_epi = draw(st.booleans())
    ops = fuzz_operands(g, lead, M, N, dtype) if with_epi else {}
    return Problem(L, M, N, K, dtype, broadcast, (a_major, b_major), out_dtype, a, b, out,
                   fuzz_epi if with_epi else None, ops)


def snapshot(p: Problem):
    return [(t, t.clone()) for t in p.tensors()]


def _bytes(t):
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def assert_untouched(snap):
    for t, before in snap:
        assert t.dtype == before.dtype and t.shape == before.shape
        assert torch.equal(_bytes(t), _bytes(before)), \
            "a failed call modified a tensor of the call"


# ------------------------------------------------------------------------------------------- mutations
# Each mutation returns (problem, exception class, regex the message must match). The regex checks that the message
# names the argument (as its prefix or quoted) and shows the actual value; ``same_message`` False where the two
# entry points are allowed to word it differently.


def _rebuild(p: Problem, g, **changes):
    """``p`` with a and b rebuilt for new sizes (same layouts)."""
    L, M, N, K = (changes.get(k, getattr(p, k)) for k in ("L", "M", "N", "K"))
    Lb = changes.get("Lb", L)
    lead = () if L is None else (L,)
    a = _operand(g, lead, M, K, p.majors[0], 0, p.dtype)
    b = _operand(g, () if p.broadcast else (() if Lb is None else (Lb,)), N, K, p.majors[1], 0, p.dtype)
    return dataclasses.replace(p, a=a, b=b)


def _misaligned(t, g, offset):
    """``t``'s shape and strides at a storage offset of ``offset`` elements (a data pointer off by 2*offset bytes)."""
    span = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
    base = torch.randn(span + 8, generator=g).to(t.dtype)
    return base.as_strided(t.shape, t.stride(), storage_offset=offset)


def _bad_layout(draw, g, t):
    """A view with t's shape that the kernel cannot read, and whether the message shows its strides."""
    *lead, rows, K = t.shape
    kinds = ["stride2", "offset", "mn_colpad"] + (["rowpad"] if rows > 1 else []) + \
        (["batchpad"] if lead and lead[0] > 1 else [])
    kind = draw(st.sampled_from(kinds))
    event(f"layout: {kind}")
    if kind == "stride2":
        bad = torch.randn(*lead, rows, 2 * K, generator=g).to(t.dtype)[..., ::2]
    elif kind == "offset":
        return _misaligned(t.contiguous(), g, draw(st.integers(1, 7))), False
    elif kind == "mn_colpad":  # M/N-contiguous, but a column stride of 8 bytes past a multiple of 16
        bad = torch.randn(*lead, K, _ceil8(rows) + 4, generator=g).to(t.dtype)[..., :rows].transpose(-1, -2)
    elif kind == "rowpad":  # K-contiguous rows 8 bytes past a multiple of 16 apart
        bad = torch.randn(*lead, rows, K + 4, generator=g).to(t.dtype)[..., :K]
    else:  # batch stride 8 bytes past a multiple of 16
        bad = torch.randn(lead[0] * (rows * K + 4), generator=g).to(t.dtype).as_strided(
            t.shape, (rows * K + 4, K, 1))
    return bad, True


def _rank4(t):
    return t.reshape(*(1,) * (4 - t.dim()), *t.shape)


def _shape_re(shape):
    return re.escape(str(tuple(shape)))


def mutate(draw, p: Problem):
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    names = ["a_rank", "b_rank", "a_not_tensor", "out_not_tensor", "a_dtype", "b_dtype", "out_dtype_bad",
             "out_bad_dtype", "device_a", "device_b", "device_out", "k_mismatch", "k_align", "n_align", "layout_a",
             "layout_b", "out_shape", "out_misaligned", "out_alias_a", "out_alias_b", "epi_shape", "epi_names",
             "epi_dtype", "epi_device", "epi_scalar", "epi_noncontig", "operands_without_epilogue"]
    if p.L is None:
        names.append("b3_a2")
    elif not p.broadcast:
        names.append("l_mismatch")
    if p.out is not None:
        names.append("out_dtype_mismatch")
    if p.M > 1:
        names += ["out_transposed", "out_internal_overlap"]
    kind = draw(st.sampled_from(names))
    event(kind)
    lead, M, N, K = p.lead, p.M, p.N, p.K
    od = p.res_dtype
    same = True
    if kind.startswith("epi_") and p.epilogue is None:
        p = dataclasses.replace(p, epilogue=fuzz_epi, operands=fuzz_operands(g, lead, M, N, p.dtype))

    if kind == "a_rank":
        a = p.a.reshape(-1) if draw(st.booleans()) else _rank4(p.a)
        return dataclasses.replace(p, a=a), ValueError, rf"^a: .*got {a.dim()}-D shape {_shape_re(a.shape)}"
    if kind == "b_rank":
        b = p.b.reshape(-1) if draw(st.booleans()) else _rank4(p.b)
        return dataclasses.replace(p, b=b), ValueError, rf"^b: .*got {b.dim()}-D"
    if kind == "b3_a2":
        return dataclasses.replace(p, b=p.b.unsqueeze(0)), ValueError, r"^b: a 3-D .*needs a 3-D"
    if kind == "a_not_tensor":
        return dataclasses.replace(p, a=p.a.float().tolist()), TypeError, r"^a: expected a torch\.Tensor; got list"
    if kind == "out_not_tensor":
        bad = draw(st.sampled_from(["out", 3.0, [1.0]]))
        return dataclasses.replace(p, out=bad), TypeError, rf"^out: .*got {type(bad).__name__}"
    if kind == "a_dtype":
        dt = draw(st.sampled_from([FP32, torch.float64, torch.int8, torch.int32, torch.float8_e4m3fn]))
        return (dataclasses.replace(p, a=p.a.to(dt)), TypeError,
                rf"^a: expected dtype bfloat16 or float16; got {str(dt)[6:]}")
    if kind == "b_dtype":
        dt = draw(st.sampled_from([FP32, torch.int8, FP16 if p.dtype == BF16 else BF16]))
        rx = rf"^b: .*got {str(dt)[6:]}" if dt in (FP32, torch.int8) else \
            rf"^a and b must have the same dtype; got a {str(p.dtype)[6:]} and b {str(dt)[6:]}"
        return dataclasses.replace(p, b=p.b.to(dt)), TypeError, rx
    if kind == "out_dtype_bad":
        bad = draw(st.sampled_from([torch.float64, torch.int32, torch.float8_e4m3fn, "bfloat16"]))
        return dataclasses.replace(p, out_dtype=bad), TypeError, rf"^out_dtype: .*got {re.escape(repr(bad))}"
    if kind == "out_bad_dtype":
        out = torch.zeros(p.out_shape, dtype=draw(st.sampled_from([torch.float64, torch.int32])))
        return dataclasses.replace(p, out=out, out_dtype=None), TypeError, rf"^out: .*got {str(out.dtype)[6:]}"
    if kind == "out_dtype_mismatch":
        other = draw(st.sampled_from([d for d in (BF16, FP16, FP32) if d != p.out.dtype]))
        return (dataclasses.replace(p, out_dtype=other), TypeError,
                rf"^out: dtype {str(p.out.dtype)[6:]} does not match out_dtype={str(other)[6:]}")
    if kind in ("device_a", "device_b"):
        which = kind[-1]
        t = torch.empty(getattr(p, which).shape, dtype=p.dtype, device="meta")
        return dataclasses.replace(p, **{which: t}), ValueError, r"^a and b must be on the same device; got .*meta"
    if kind == "device_out":
        out = torch.empty(p.out_shape, dtype=od, device="meta")
        return dataclasses.replace(p, out=out), ValueError, r"^out: must be on the operands' device cpu; got meta"
    if kind == "k_mismatch":
        q = dataclasses.replace(p, b=_rebuild(p, g, K=K + 8).b)
        return q, ValueError, rf"^a and b must have the same K.*{_shape_re(q.a.shape)}.*{_shape_re(q.b.shape)}"
    if kind == "l_mismatch":
        q = dataclasses.replace(p, b=_rebuild(p, g, Lb=p.L + 1).b)
        return q, ValueError, rf"^b: batch size L must match a's.*L={p.L}\).*L={p.L + 1}\)"
    if kind == "k_align":
        K2 = draw(st.sampled_from([1, 4, 12, 20]))
        return _rebuild(p, g, K=K2), ValueError, rf"^a/b: rows must be 16-byte aligned: K={K2} "
    if kind == "n_align":
        step = 16 // torch.empty((), dtype=od).element_size()
        N2 = N + draw(st.sampled_from([r for r in range(1, 8) if r % step]))
        return dataclasses.replace(p, b=_rebuild(p, g, N=N2).b), ValueError, rf"^b: N={N2} \(b\.shape\[-2\]\)"
    if kind in ("layout_a", "layout_b"):
        which = kind[-1]
        bad, shows_strides = _bad_layout(draw, g, getattr(p, which))
        rx = rf"^{which}: .*never copies.*\.contiguous\(\)"
        if shows_strides:
            rx = rf"^{which}: .*{re.escape(str(tuple(bad.stride())))}" + rx[len(which) + 3:]
        return dataclasses.replace(p, **{which: bad}), ValueError, rx
    if kind == "out_shape":
        shapes = [(*lead, M + 1, N), (*lead, M, N + 8), (2, M, N) if not lead else (M, N), (*lead, N, M, 1)]
        shape = draw(st.sampled_from(shapes))
        out = torch.zeros(shape, dtype=od)
        return (dataclasses.replace(p, out=out), ValueError,
                rf"^out: expected shape {_shape_re(p.out_shape)}; got {_shape_re(shape)}")
    if kind == "out_misaligned":
        out = _misaligned(torch.zeros(p.out_shape, dtype=od), g, draw(st.integers(1, 3)))
        return dataclasses.replace(p, out=out), ValueError, r"^out: the data pointer must be 16-byte aligned"
    if kind == "out_transposed":  # (M, N) with M contiguous: the kernel stores rows
        out = torch.zeros(*lead, N, M, dtype=od).transpose(-1, -2)
        return dataclasses.replace(p, out=out), ValueError, r"^out: the last dim \(N\) must be contiguous"
    if kind == "out_internal_overlap":
        base = torch.zeros(max(p.L or 1, 1) * N, dtype=od)
        out = base.as_strided(p.out_shape, (N, 0, 1) if lead else (0, 1))
        return dataclasses.replace(p, out=out), ValueError, r"^out: elements overlap in memory"
    if kind in ("out_alias_a", "out_alias_b"):
        which = kind[-1]
        t = getattr(p, which)
        n_t, n_o = t.numel(), M * N * max(p.L or 1, 1)
        buf = torch.randn(n_t + n_o + 64, generator=g).to(p.dtype)
        shift = 8 * draw(st.integers(0, (n_t - 1) // 8))  # starts inside t: they overlap
        q = dataclasses.replace(p, out_dtype=None, **{which: buf[:n_t].view(t.shape),
                                                       "out": buf[shift:shift + n_o].view(p.out_shape)})
        return q, ValueError, rf"^out: must not share memory with {which} "
    if kind == "operands_without_epilogue":
        q = dataclasses.replace(p, epilogue=None, operands={"bias": torch.randn(N, generator=g)})
        return q, TypeError, r"'bias'\]"  # the two entries word it differently (both name the operand)

    # ---- epilogue operands (the fuzz epilogue declares bias: VecN, rs: VecM, res: TileMN, s: Scalar)
    ops = dict(p.operands)
    name = draw(st.sampled_from(["bias", "rs", "res"]))
    if kind == "epi_shape":
        want = {"bias": (N,), "rs": (*lead, M), "res": (*lead, M, N)}[name]
        bad = {"bias": [(N + 1,), (N - 1,), (1,), (1, N)],
               "rs": [(*lead, M + 1), (M,) if lead else (1, M), (*lead, M, 1)],
               "res": [(*lead, M, N + 8), (*lead, N + 1, M), (M, N) if lead else (1, M, N)]}[name]
        shape = draw(st.sampled_from(bad))
        ops[name] = torch.randn(shape, generator=g)
        rx = rf"^operand '{name}' \((VecN|VecM|TileMN)\): expected shape {_shape_re(want)}, got {_shape_re(shape)}"
        return dataclasses.replace(p, operands=ops), ValueError, rx
    if kind == "epi_names":
        if draw(st.booleans()):
            gone = draw(st.sampled_from(sorted(ops)))
            del ops[gone]
            rx = rf"^epilogue 'fuzz_epi': missing operands \['{gone}'\], unexpected \[\]"
        else:
            ops["bogus"] = torch.zeros(N)
            rx = r"^epilogue 'fuzz_epi': missing operands \[\], unexpected \['bogus'\]"
        return dataclasses.replace(p, operands=ops), TypeError, rx
    if kind == "epi_dtype":
        dt = draw(st.sampled_from([torch.float64, torch.int32, torch.int64, torch.bool, torch.int8]))
        ops[name] = ops[name].to(dt)
        return dataclasses.replace(p, operands=ops), TypeError, rf"^operand '{name}': expected dtype .*got {dt}"
    if kind == "epi_device":
        if draw(st.booleans()):
            name = "s"
            ops["s"] = torch.tensor(0.5, device="meta")
        else:
            ops[name] = torch.empty(ops[name].shape, dtype=ops[name].dtype, device="meta")
        return dataclasses.replace(p, operands=ops), ValueError, rf"^operand '{name}': on meta, expected cpu"
    if kind == "epi_scalar":
        bad = draw(st.sampled_from(["0.5", True, None, [0.5], torch.ones(2)]))
        ops["s"] = bad
        if isinstance(bad, torch.Tensor):
            return dataclasses.replace(p, operands=ops), ValueError, r"^operand 's' \(Scalar\): expected 1 element"
        return (dataclasses.replace(p, operands=ops), TypeError,
                rf"^operand 's' \(Scalar\): expected a Python number .*got {type(bad).__name__}")
    if kind == "epi_noncontig":
        if name == "rs" and M < 2:
            name = "bias"
        v = ops[name]
        ops[name] = torch.randn(*v.shape[:-1], 2 * v.shape[-1], generator=g).to(v.dtype)[..., ::2]
        return (dataclasses.replace(p, operands=ops), ValueError,
                rf"^operand '{name}': the last dim must be contiguous .*\.contiguous\(\)")
    raise AssertionError(kind)


@st.composite
def bad_calls(draw):
    p = draw(problems(empty_ok=False))
    q, exc, rx = mutate(draw, p)
    return q, exc, rx


def _call(entry, p: Problem):
    return entry(p.a, p.b, **p.kwargs())


# ------------------------------------------------------------------------------------------- the fuzz tests


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad_calls())
def test_bad_call_names_argument_before_arch_check(case):
    p, exc, rx = case
    snap = snapshot(p)
    with pytest.raises(exc) as ref_info:
        _call(coda.reference.gemm, p)
    msg = str(ref_info.value)
    assert re.search(rx, msg, re.S), f"reference.gemm message {msg!r} does not match {rx!r}"
    # coda.gemm: the same argument error, before the Hopper check (which this CPU-only machine would fail)
    with pytest.raises(exc) as gemm_info:
        _call(coda.gemm, p)
    gmsg = str(gemm_info.value)
    assert not re.search(HOPPER, gmsg)
    if rx == r"'bias'\]":
        assert re.search(rx, gmsg)
    else:
        assert gmsg == msg, "coda.gemm and coda.reference.gemm word the same error differently"
    assert_untouched(snap)


def _expected64(p: Problem):
    acc = torch.matmul(p.a.double(), p.b.double().transpose(-1, -2))
    if p.epilogue is None:
        return {"out": acc}
    return fuzz_epi64(acc, **p.operands)


def _close(got, want):
    # bf16 tolerance (the coarsest of the output dtypes; fp32 sums of K <= 32 exact bf16 products)
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_valid_call_matches_float64_and_reaches_arch_check(p):
    event(f"majors {p.majors}, L={p.L}, broadcast={p.broadcast}, epilogue={p.epilogue is not None}")
    prob = check_gemm_args(p.a, p.b, out=p.out, out_dtype=p.out_dtype)
    assert prob.out_shape == p.out_shape and prob.out_dtype == p.res_dtype and prob.b_broadcast == p.broadcast
    for t, major, rows in ((p.a, prob.a_major, p.M), (p.b, prob.b_major, p.N)):
        if t.numel() and rows > 1 and p.K > 1:
            assert major == ("mn" if t.stride(-1) != 1 else "k")
    # coda.gemm on this CPU-only machine: every argument check passes, then the architecture check fails, and the
    # failed call touches nothing
    snap = snapshot(p)
    with pytest.raises(RuntimeError, match=HOPPER + ".*found CPU tensors"):
        _call(coda.gemm, p)
    assert_untouched(snap)

    res = _call(coda.reference.gemm, p)
    want = _expected64(p)
    got = res if isinstance(res, dict) else {"out": res}
    assert sorted(got) == sorted(want)
    if p.out is not None:
        assert got["out"] is p.out
    assert got["out"].shape == p.out_shape and got["out"].dtype == p.res_dtype
    for k in want:
        _close(got[k], want[k])


# ------------------------------------------------------------------------------------------- devices, ordering


def test_meta_device_valid_call():
    """Device checks compare devices only: a valid call on 'meta' reaches the architecture check in coda.gemm and
    gives a meta result of the right shape in the reference."""
    a = torch.empty(2, 5, 16, dtype=BF16, device="meta")
    b = torch.empty(24, 16, dtype=BF16, device="meta")
    with pytest.raises(RuntimeError, match=HOPPER + ".*found meta tensors"):
        coda.gemm(a, b)
    r = coda.reference.gemm(a, b, out_dtype=FP32)
    assert r.device.type == "meta" and r.shape == (2, 5, 24) and r.dtype == FP32


def test_several_errors_report_the_first_rule():
    """Ranks, then dtypes, then devices, then shapes, then layouts, then out, then epilogue operands."""
    a = torch.zeros(4, 12, dtype=FP32)  # bad dtype and misaligned K
    b = torch.zeros(8, 16, dtype=BF16, device="meta")  # other device, K mismatch
    for entry in (coda.gemm, coda.reference.gemm):
        with pytest.raises(TypeError, match="^a: expected dtype"):
            entry(a, b)
        with pytest.raises(ValueError, match="^a and b must be on the same device"):
            entry(a.to(BF16), b)
        with pytest.raises(ValueError, match="^a and b must have the same K"):
            entry(a.to(BF16), torch.zeros(8, 16, dtype=BF16), out=torch.zeros(3, 3, dtype=BF16))


# ------------------------------------------------------------------------------------------- zero-size dims


def _zero_case(which, batched):
    g = torch.Generator().manual_seed(3)
    L, M, N, K = (2 if batched else None), 5, 16, 24
    if which == "M":
        M = 0
    elif which == "N":
        N = 0
    elif which == "K":
        K = 0
    elif which == "L":
        L = 0
    lead = () if L is None else (L,)
    a = torch.randn(*lead, M, K, generator=g).to(BF16)
    b = torch.randn(*lead, N, K, generator=g).to(BF16)
    return lead, M, N, K, a, b, fuzz_operands(g, lead, M, N, BF16)


ZERO = pytest.mark.parametrize("which,batched", [("M", False), ("M", True), ("N", False), ("N", True),
                                                 ("K", False), ("K", True), ("L", True)])


@ZERO
@pytest.mark.parametrize("out_dtype", [BF16, FP32])
def test_zero_size_plain(which, batched, out_dtype):
    """Documented: M == 0, N == 0 or L == 0 gives an empty result; K == 0 gives zeros. coda.gemm accepts the
    arguments (it fails only at the architecture check here)."""
    lead, M, N, K, a, b, _ = _zero_case(which, batched)
    with pytest.raises(RuntimeError, match=HOPPER):
        coda.gemm(a, b, out_dtype=out_dtype)
    res = coda.reference.gemm(a, b, out_dtype=out_dtype)
    assert res.shape == (*lead, M, N) and res.dtype == out_dtype
    out = torch.full((*lead, M, N), 5.0, dtype=out_dtype)
    assert coda.reference.gemm(a, b, out=out) is out
    if which == "K":
        assert res.numel() > 0 and not res.any() and not out.any()
    else:
        assert res.numel() == 0


@ZERO
def test_zero_size_epilogue(which, batched):
    """With an epilogue: K == 0 applies it to an all-zero accumulator; an empty result still returns every
    reduction, a row reduction over N == 0 columns being the sum's identity (0)."""
    lead, M, N, K, a, b, ops = _zero_case(which, batched)
    res = coda.reference.gemm(a, b, epilogue=fuzz_epi, out_dtype=FP32, **ops)
    want = fuzz_epi64(torch.zeros(*lead, M, N, dtype=torch.float64), **ops)
    assert sorted(res) == ["out", "ss"]
    assert res["out"].shape == (*lead, M, N) and res["ss"].shape == (*lead, M)
    for k in want:
        _close(res[k], want[k])
    if which == "N":
        assert res["ss"].numel() > 0 and not res["ss"].any()


# ------------------------------------------------------------------------- bugs found while writing this file (fixed)

G = importlib.import_module("coda.gemm")


@coda.epilogue
def colsum_epi(acc):
    return {"out": acc, "cs": coda.reduce_m(acc)}


@pytest.mark.parametrize("entry", [coda.gemm, coda.reference.gemm], ids=["gemm", "reference"])
def test_broadcast_weight_with_column_reduction_rejected_first(entry):
    a, b = torch.randn(2, 4, 16).to(BF16), torch.randn(8, 16).to(BF16)
    with pytest.raises(ValueError, match=r"\bb\b.*shared by every batch"):
        entry(a, b, epilogue=colsum_epi)


class _ManyScalars(Epilogue):
    name = "fuzz_many_scalars"
    operands = tuple(Operand(f"x{i}", "scalar") for i in range(MAX_EPI_TENSORS + 1))

    def reference(self, acc, **ops):
        return {"out": acc}


@pytest.mark.parametrize("entry", [coda.gemm, coda.reference.gemm], ids=["gemm", "reference"])
def test_too_many_epilogue_tensors_rejected_first(entry):
    ops = {f"x{i}": 1.0 for i in range(MAX_EPI_TENSORS + 1)}
    with pytest.raises(ValueError, match="at most"):
        entry(torch.randn(4, 16).to(BF16), torch.randn(8, 16).to(BF16), epilogue=_ManyScalars(), **ops)


@pytest.mark.parametrize("config", [GemmConfig(tile_m=96), "fast", {"tile_m": 128}], ids=["invalid", "str", "dict"])
def test_bad_config_rejected_before_arch_check(config):
    with pytest.raises((TypeError, ValueError), match="(?i)config"):
        coda.gemm(torch.randn(4, 16).to(BF16), torch.randn(8, 16).to(BF16), config=config)


def test_invalid_config_is_invalid():
    with pytest.raises(ValueError):
        GemmConfig(tile_m=96).validate()


def test_reference_rejects_non_epilogue_like_gemm():
    a, b = torch.randn(4, 16).to(BF16), torch.randn(8, 16).to(BF16)
    with pytest.raises(TypeError, match="^epilogue"):
        coda.gemm(a, b, epilogue=lambda acc: acc)
    with pytest.raises(TypeError, match="epilogue"):
        coda.reference.gemm(a, b, epilogue=lambda acc: acc)


@pytest.mark.parametrize("entry", [coda.gemm, coda.reference.gemm], ids=["gemm", "reference"])
def test_out_aliasing_an_epilogue_operand_rejected(entry):
    M, N = 4, 16
    out = torch.zeros(M, N, dtype=FP32)
    ops = fuzz_operands(torch.Generator().manual_seed(0), (), M, N, BF16)
    ops["bias"] = out[0]
    with pytest.raises(ValueError, match=r"^out: .*bias"):
        entry(torch.randn(M, 16).to(BF16), torch.randn(N, 16).to(BF16), epilogue=fuzz_epi, out=out, **ops)


@coda.epilogue
def rowmax_epi(acc):
    return {"out": acc, "mx": coda.reduce_n(acc, "max"), "lse": coda.reduce_n(acc, "logsumexp")}


def test_zero_n_row_max_is_identity():
    res = coda.reference.gemm(torch.randn(3, 16).to(BF16), torch.randn(0, 16).to(BF16), epilogue=rowmax_epi)
    assert res["mx"].shape == (3,) and torch.isneginf(res["mx"]).all() and torch.isneginf(res["lse"]).all()


@pytest.mark.parametrize("shape", [(0, 8), (4, 0)], ids=["M0", "N0"])
def test_empty_result_keeps_epilogue_results(shape, monkeypatch):
    # The empty-result path allocates and launches nothing: with the architecture check stubbed out it runs on CPU.
    monkeypatch.setattr(G._device, "require_hopper", lambda *a, **k: None)
    monkeypatch.setenv("CODA_AUTOTUNE", "0")
    M, N = shape
    a, b = torch.randn(M, 16).to(BF16), torch.randn(N, 16).to(BF16)
    ops = fuzz_operands(torch.Generator().manual_seed(0), (), M, N, BF16)
    got = coda.gemm(a, b, epilogue=fuzz_epi, **ops)
    want = coda.reference.gemm(a, b, epilogue=fuzz_epi, **ops)
    assert sorted(got) == sorted(want)
    assert all(got[k].shape == want[k].shape for k in want)
