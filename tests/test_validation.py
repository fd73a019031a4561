"""CPU tests of the argument checks shared by coda.gemm and coda.reference.gemm, and of the reference's numerics."""
import re

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import coda.reference
from coda.kernels.epilogue import Epilogue, Operand
from coda._validate import GemmProblem, check_gemm_args

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def rand(*shape, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _check(a, b, out=None, out_dtype=None):
    return check_gemm_args(a, b, out=out, out_dtype=out_dtype)


def _ref(a, b, out=None, out_dtype=None):
    return coda.reference.gemm(a, b, out=out, out_dtype=out_dtype)


ENTRIES = pytest.mark.parametrize("entry", [_check, _ref], ids=["check_gemm_args", "reference.gemm"])


def raises(exc, *names):
    """pytest.raises for ``exc`` whose message names every argument in ``names`` (as ``a:``, ``b ``, ...)."""
    pattern = "".join(rf"(?=.*\b{re.escape(n)}\b)" for n in names)
    return pytest.raises(exc, match=re.compile(pattern, re.S))


# ---------------------------------------------------------------- valid problems


def test_problem_2d():
    p = check_gemm_args(rand(4, 16), rand(24, 16))
    assert p == GemmProblem(L=None, M=4, N=24, K=16, in_dtype=BF16, out_dtype=BF16, batched=False,
                            device=torch.device("cpu"))
    assert p.out_shape == (4, 24) and not p.empty_result and not p.zero_k and not p.b_broadcast


def test_problem_batched_and_broadcast():
    p = check_gemm_args(rand(3, 4, 16, dtype=FP16), rand(3, 8, 16, dtype=FP16), out_dtype=FP32)
    assert (p.L, p.M, p.N, p.K, p.batched, p.b_broadcast) == (3, 4, 8, 16, True, False)
    assert p.out_dtype == FP32 and p.in_dtype == FP16 and p.out_shape == (3, 4, 8)
    p = check_gemm_args(rand(3, 4, 16), rand(8, 16))
    assert p.b_broadcast and p.batched and p.out_shape == (3, 4, 8)


def test_out_dtype_defaults():
    a, b = rand(4, 16), rand(8, 16)
    assert check_gemm_args(a, b).out_dtype == BF16
    assert check_gemm_args(a, b, out=torch.empty(4, 8, dtype=FP32)).out_dtype == FP32
    assert check_gemm_args(a, b, out=torch.empty(4, 8, dtype=FP16), out_dtype=FP16).out_dtype == FP16


def test_frozen():
    p = check_gemm_args(rand(4, 16), rand(8, 16))
    with pytest.raises(Exception):
        p.M = 5


def test_size_one_dims_ignore_strides():
    # torch gives size-1 dims arbitrary strides even for tensors it calls contiguous; they address nothing.
    a = rand(16, 1).T  # shape (1, 16), strides (1, 1)
    assert a.is_contiguous()
    b = rand(1, 8, 16).expand(1, 8, 16)
    p = check_gemm_args(a.unsqueeze(0).as_strided((1, 1, 16), (3, 5, 1)), b)
    assert p.M == 1 and p.L == 1


def test_padded_rows_accepted():
    base = rand(4, 24)
    a = base[:, :16]  # row stride 24 elements = 48 bytes
    assert check_gemm_args(a, rand(8, 16)).K == 16
    torch.testing.assert_close(coda.reference.gemm(a, rand(8, 16)), coda.reference.gemm(a.contiguous(), rand(8, 16)))


# ---------------------------------------------------------------- zero-size dims


@ENTRIES
@pytest.mark.parametrize("shape_a,shape_b", [((0, 16), (8, 16)), ((4, 16), (0, 16)), ((0, 4, 16), (0, 8, 16)),
                                             ((2, 0, 16), (8, 16))])
def test_empty_result(entry, shape_a, shape_b):
    res = entry(rand(*shape_a), rand(*shape_b))
    expected = (shape_a[:-1] + shape_b[-2:-1]) if len(shape_a) == 2 else (shape_a[0], shape_a[1], shape_b[-2])
    if isinstance(res, GemmProblem):
        assert res.empty_result and not res.zero_k and res.out_shape == expected
    else:
        assert res.shape == expected and res.dtype == BF16


@pytest.mark.parametrize("out_dtype", [BF16, FP16, FP32])
def test_zero_k(out_dtype):
    a, b = rand(4, 0), rand(8, 0)
    p = check_gemm_args(a, b, out_dtype=out_dtype)
    assert p.zero_k and not p.empty_result and p.K == 0
    out = torch.full((4, 8), 7.0, dtype=out_dtype)
    assert coda.reference.gemm(a, b, out=out) is out
    assert torch.equal(out, torch.zeros(4, 8, dtype=out_dtype))
    res = coda.reference.gemm(rand(2, 4, 0), rand(2, 8, 0), out_dtype=out_dtype)
    assert res.shape == (2, 4, 8) and res.dtype == out_dtype and not res.any()


# ---------------------------------------------------------------- types, ranks, dtypes


@ENTRIES
def test_not_tensors(entry):
    with raises(TypeError, "a"):
        entry([[1.0] * 16] * 4, rand(8, 16))
    with raises(TypeError, "b"):
        entry(rand(4, 16), 3.0)
    with raises(TypeError, "out"):
        entry(rand(4, 16), rand(8, 16), out="nope")


@ENTRIES
@pytest.mark.parametrize("shape_a,shape_b,name", [
    ((16,), (8, 16), "a"), ((2, 2, 4, 16), (8, 16), "a"), ((4, 16), (16,), "b"), ((4, 16), (2, 8, 16), "b"),
    ((4, 16), (1, 1, 8, 16), "b"),
])
def test_bad_rank(entry, shape_a, shape_b, name):
    with raises(ValueError, name):
        entry(rand(*shape_a), rand(*shape_b))


@ENTRIES
@pytest.mark.parametrize("dtype_a,dtype_b,names", [
    (FP32, FP32, ["a"]), (BF16, FP32, ["b"]), (torch.int8, BF16, ["a"]), (BF16, FP16, ["a", "b"]),
    (FP16, BF16, ["a", "b"]), (torch.float8_e4m3fn, torch.float8_e4m3fn, ["a"]),
])
def test_bad_input_dtype(entry, dtype_a, dtype_b, names):
    with raises(TypeError, *names) as info:
        entry(torch.zeros(4, 16, dtype=dtype_a), torch.zeros(8, 16, dtype=dtype_b))
    assert "got" in str(info.value)


@ENTRIES
@pytest.mark.parametrize("out_dtype", [torch.float64, torch.int32, torch.float8_e4m3fn, "bf16"])
def test_bad_out_dtype(entry, out_dtype):
    with raises(TypeError, "out_dtype"):
        entry(rand(4, 16), rand(8, 16), out_dtype=out_dtype)


@ENTRIES
def test_out_dtype_mismatch(entry):
    out = torch.empty(4, 8, dtype=FP32)
    with raises(TypeError, "out", "out_dtype"):
        entry(rand(4, 16), rand(8, 16), out=out, out_dtype=BF16)
    with raises(TypeError, "out"):
        entry(rand(4, 16), rand(8, 16), out=torch.empty(4, 8, dtype=torch.float64))


# ---------------------------------------------------------------- shapes


@ENTRIES
def test_k_mismatch_names_both_shapes(entry):
    with raises(ValueError, "a", "b") as info:
        entry(rand(4, 16), rand(8, 24))
    assert "(4, 16)" in str(info.value) and "(8, 24)" in str(info.value)


@ENTRIES
def test_batch_mismatch(entry):
    with raises(ValueError, "b") as info:
        entry(rand(3, 4, 16), rand(2, 8, 16))
    assert "L=3" in str(info.value) and "L=2" in str(info.value)


@ENTRIES
@pytest.mark.parametrize("K", [4, 12, 20, 1])
def test_k_alignment(entry, K):
    with pytest.raises(ValueError, match=re.escape(
            f"rows must be 16-byte aligned: K={K} (need K % 8 == 0 for bf16/fp16)")):
        entry(rand(4, K), rand(8, K))


@ENTRIES
@pytest.mark.parametrize("N,out_dtype,ok", [
    (12, BF16, False), (12, FP16, False), (12, FP32, True), (6, FP32, False), (8, BF16, True), (4, FP32, True),
    (1, FP32, False),
])
def test_n_alignment(entry, N, out_dtype, ok):
    a, b = rand(4, 16), rand(N, 16)
    if ok:
        entry(a, b, out_dtype=out_dtype)
        return
    with raises(ValueError, "b", f"N={N}") as info:
        entry(a, b, out_dtype=out_dtype)
    assert f"N % {16 // torch.empty((), dtype=out_dtype).element_size()} == 0" in str(info.value)


# ---------------------------------------------------------------- devices


@ENTRIES
def test_device_mismatch(entry):
    with raises(ValueError, "a", "b") as info:
        entry(rand(4, 16), torch.empty(8, 16, dtype=BF16, device="meta"))
    assert "meta" in str(info.value) and "cpu" in str(info.value)
    with raises(ValueError, "out"):
        entry(rand(4, 16), rand(8, 16), out=torch.empty(4, 8, dtype=BF16, device="meta"))


# ---------------------------------------------------------------- strides and alignment


def _bad_layouts():
    # every bad view has 8 rows, so as b it also gives a valid N
    yield "transposed, column stride 24 bytes", rand(16, 12)[:, :8].T  # (8, 16), strides (1, 12): MN-major, bad
    yield "row stride 40 bytes", rand(8, 20)[:, :16]
    yield "data pointer 2 bytes off", rand(8, 32)[:, 1:17]
    yield "batch stride 136 bytes", rand(140).as_strided((2, 8, 8), (68, 8, 1))
    yield "last-dim stride 2", rand(8, 32)[:, ::2]


@ENTRIES
@pytest.mark.parametrize("which", ["a", "b"])
@pytest.mark.parametrize("label,bad", list(_bad_layouts()), ids=[l for l, _ in _bad_layouts()])
def test_bad_layout(entry, which, label, bad):
    K = bad.shape[-1]
    a = bad if which == "a" else rand(*bad.shape[:-2], 4, K)
    b = bad if which == "b" else rand(*bad.shape[:-2], 8, K)
    with raises(ValueError, which) as info:
        entry(a, b)
    msg = str(info.value)
    assert ".contiguous()" in msg and "never copies" in msg
    if "pointer" not in label:
        assert str(tuple(bad.stride())) in msg


def test_mn_major_views_accepted():
    """Transposed views (M / N contiguous, 16-byte aligned columns) are MN-major operands, read without a copy."""
    a, b = rand(24, 16), rand(40, 16)
    want = coda.reference.gemm(a, b).float()
    for aa, bb in ((a.T.contiguous().T, b), (a, b.T.contiguous().T), (a.T.contiguous().T, b.T.contiguous().T)):
        assert aa.stride() != a.stride() or bb.stride() != b.stride()
        torch.testing.assert_close(coda.reference.gemm(aa, bb).float(), want)
    prob = check_gemm_args(a.T.contiguous().T, b)
    assert (prob.a_major, prob.b_major) == ("mn", "k")


def test_mn_major_batched_a_with_shared_weight_rejected():
    a = rand(2, 16, 24).transpose(-1, -2)  # (2, 24, 16), M contiguous
    with raises(ValueError, "a") as info:
        check_gemm_args(a, rand(8, 16))
    assert "MN-major" in str(info.value)


# ---------------------------------------------------------------- out


@ENTRIES
@pytest.mark.parametrize("shape", [(4, 4), (8, 4), (1, 4, 8), (4, 8, 1)])
def test_out_shape(entry, shape):
    with raises(ValueError, "out") as info:
        entry(rand(4, 16), rand(8, 16), out=torch.empty(*shape, dtype=BF16))
    assert "(4, 8)" in str(info.value)


@ENTRIES
def test_out_bad_layout(entry):
    a, b = rand(4, 16), rand(8, 16)
    with raises(ValueError, "out"):
        entry(a, b, out=torch.empty(8, 4, dtype=BF16).T)
    with raises(ValueError, "out"):
        entry(a, b, out=torch.empty(4, 12, dtype=BF16)[:, :8])  # 24-byte rows
    with raises(ValueError, "out"):
        entry(a, b, out=torch.empty(4, 16, dtype=BF16)[:, 1:9])  # misaligned pointer
    with raises(ValueError, "out") as info:
        entry(a, b, out=torch.empty(1, 8, dtype=BF16).expand(4, 8).as_strided((4, 8), (0, 1)))
    assert "overlap" in str(info.value)


@ENTRIES
def test_out_overlaps_inputs(entry):
    storage = torch.zeros(64, 16, dtype=BF16)
    a, b = storage[:8], storage[8:16]
    with raises(ValueError, "out", "a"):
        entry(a, b, out=storage[4:12, :8])
    with raises(ValueError, "out", "b"):
        entry(a, b, out=storage[8:16, :8])
    entry(a, b, out=storage[16:24, :8])  # disjoint rows of the same storage are fine


def _sentinel(shape, dtype):
    return torch.full(shape, -12345.0 if dtype == FP32 else -123.0, dtype=dtype)


@pytest.mark.parametrize("case", ["k_mismatch", "dtype", "out_dtype", "n_align", "layout", "overlap_shape"])
def test_out_untouched_after_failure(case):
    a, b = rand(4, 16), rand(8, 16)
    out = _sentinel((4, 8), BF16)
    kwargs = {}
    if case == "k_mismatch":
        b = rand(8, 24)
    elif case == "dtype":
        b = rand(8, 16, dtype=FP16)
    elif case == "out_dtype":
        kwargs["out_dtype"] = FP32
    elif case == "n_align":
        b, out = rand(6, 16), _sentinel((4, 6), BF16)
    elif case == "layout":
        a = rand(16, 4).T
    elif case == "overlap_shape":
        out = _sentinel((4, 16), BF16)
        a = out
        out = out[:, :8]
    before = out.clone()
    with pytest.raises((TypeError, ValueError)):
        coda.reference.gemm(a, b, out=out, **kwargs)
    assert torch.equal(out, before)


# ---------------------------------------------------------------- hypothesis: random (mostly bad) problems

SMALL = st.integers(0, 3)
DTYPES = st.sampled_from([BF16, FP16, FP32, torch.int8])


@st.composite
def problems(draw):
    batched = draw(st.booleans())
    L = draw(SMALL) if batched else None
    M, N = draw(st.integers(0, 5)), draw(st.sampled_from([0, 2, 4, 6, 8, 12, 16]))
    K = draw(st.sampled_from([0, 4, 8, 8, 12, 16, 16]))
    Kb = draw(st.sampled_from([K, K, K, K, K + 8, K + 4]))
    Lb = draw(st.sampled_from([L, L, L, None] + ([L + 1] if batched else [])))
    da = draw(st.sampled_from([BF16, BF16, FP16, FP16, FP32, torch.int8]))
    db = draw(st.sampled_from([da, da, da, da, da, draw(DTYPES)]))
    out_dtype = draw(st.sampled_from([None, None, BF16, FP16, FP32, FP32, torch.float64]))
    pad_a, pad_b = draw(st.sampled_from([0, 0, 0, 8, 3])), draw(st.sampled_from([0, 0, 0, 8, 2]))
    off_a = draw(st.sampled_from([0, 0, 0, 0, 1]))
    return dict(L=L, M=M, N=N, K=K, Kb=Kb, Lb=Lb, da=da, db=db, out_dtype=out_dtype, pad_a=pad_a, pad_b=pad_b,
                off_a=off_a)


def _make(lead, rows, cols, pad, off, dtype):
    """A (lead.., rows, cols) view into a buffer with ``pad`` extra columns per row, starting ``off`` elements in."""
    full = torch.randn(*lead, rows, cols + pad + off).to(dtype) if dtype != torch.int8 else \
        torch.randint(-3, 3, (*lead, rows, cols + pad + off), dtype=dtype)
    return full[..., off:off + cols]


def _expected_error(p, a, b):
    """The error class an independent reading of the rules predicts, or None for a valid problem."""
    if p["da"] not in (BF16, FP16) or p["db"] not in (BF16, FP16) or p["da"] != p["db"] \
            or p["out_dtype"] == torch.float64:
        return TypeError
    if p["L"] is not None and p["Lb"] is not None and p["Lb"] != p["L"]:
        return ValueError
    if p["K"] != p["Kb"] or p["K"] % 8:
        return ValueError
    out_es = {None: 2, BF16: 2, FP16: 2, FP32: 4}[p["out_dtype"]]
    if (p["N"] * out_es) % 16:
        return ValueError
    for t, pad, off in ((a, p["pad_a"], p["off_a"]), (b, p["pad_b"], 0)):
        if t.numel() == 0:
            continue
        row_ok = t.shape[-2] == 1 or ((p["K"] + pad + off) * 2) % 16 == 0
        batch_ok = t.dim() == 2 or t.shape[0] == 1 or (t.stride(0) * 2) % 16 == 0
        if not (row_ok and batch_ok and off == 0):
            return ValueError
    return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_random_problems(p):
    lead_a = () if p["L"] is None else (p["L"],)
    lead_b = () if p["Lb"] is None else (p["Lb"],)
    a = _make(lead_a, p["M"], p["K"], p["pad_a"], p["off_a"], p["da"])
    b = _make(lead_b, p["N"], p["Kb"], p["pad_b"], 0, p["db"])
    if p["L"] is None and p["Lb"] is not None:
        with raises(ValueError, "b"):
            coda.reference.gemm(a, b, out_dtype=p["out_dtype"])
        return
    expected = _expected_error(p, a, b)
    event("valid" if expected is None else f"invalid: {expected.__name__}")
    if expected is None:
        problem = check_gemm_args(a, b, out_dtype=p["out_dtype"])
        res = coda.reference.gemm(a, b, out_dtype=p["out_dtype"])
        assert res.shape == problem.out_shape and res.dtype == problem.out_dtype
        want = torch.matmul(a.double(), b.double().transpose(-1, -2)).to(problem.out_dtype)
        torch.testing.assert_close(res, want, rtol=1e-2, atol=1e-2)
        assert problem.empty_result == (res.numel() == 0)
        assert problem.zero_k == (p["K"] == 0 and res.numel() > 0)
    else:
        for entry in (_check, _ref):
            with pytest.raises(expected, match=r"\b(a|b|out_dtype|a and b|a/b)\b"):
                entry(a, b, out_dtype=p["out_dtype"])


# ---------------------------------------------------------------- reference numerics


def _rel_err(x, ref64):
    return ((x.double() - ref64).norm() / ref64.norm().clamp_min(1e-300)).item()


SHAPES = [((7, 32), (16, 32)), ((64, 64), (48, 64)), ((1, 8), (8, 8)), ((3, 5, 40), (3, 24, 40)),
          ((2, 9, 16), (32, 16)), ((33, 128), (40, 128))]


@pytest.mark.parametrize("in_dtype", [BF16, FP16])
@pytest.mark.parametrize("out_dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("shape_a,shape_b", SHAPES)
def test_reference_accuracy(in_dtype, out_dtype, shape_a, shape_b):
    a, b = rand(*shape_a, dtype=in_dtype, seed=1), rand(*shape_b, dtype=in_dtype, seed=2)
    ref64 = torch.matmul(a.double(), b.double().transpose(-1, -2))
    res = coda.reference.gemm(a, b, out_dtype=out_dtype)
    assert res.dtype == out_dtype and res.shape == ref64.shape
    # Baseline: torch's own matmul with the operands in the output dtype (exact casts for these inputs, except
    # bf16 <- fp16, which only makes the baseline worse).
    same = torch.matmul(a.to(out_dtype), b.to(out_dtype).transpose(-1, -2))
    assert _rel_err(res, ref64) <= 2 * _rel_err(same, ref64) + 1e-6
    out = torch.empty(ref64.shape, dtype=out_dtype)
    assert coda.reference.gemm(a, b, out=out) is out
    assert torch.equal(out, res)


class _BiasRelu(Epilogue):
    name = "bias_relu"
    operands = (Operand("bias", "vec_n"),)

    def reference(self, acc, *, bias):
        return torch.relu(acc + bias.float())


def test_reference_epilogue():
    a, b, bias = rand(4, 16), rand(8, 16), rand(8)
    res = coda.reference.gemm(a, b, epilogue=_BiasRelu(), bias=bias, out_dtype=FP32)
    want = torch.relu(a.float() @ b.float().T + bias.float())
    torch.testing.assert_close(res, want)
    zk = coda.reference.gemm(rand(4, 0), rand(8, 0), epilogue=_BiasRelu(), bias=bias, out_dtype=FP32)
    torch.testing.assert_close(zk, torch.relu(bias.float()).expand(4, 8))


def test_reference_operands_without_epilogue():
    with pytest.raises(TypeError, match="epilogue"):
        coda.reference.gemm(rand(4, 16), rand(8, 16), bias=rand(8))


def test_add_to_output_alias_allowed_only_exactly():
    """A TileMN operand that is exactly out (add-to-output) is allowed; any other overlap with out is not."""
    class _Add(Epilogue):
        name = "add_prev"
        operands = (Operand("prev", "tile"),)

        def reference(self, acc, *, prev):
            return acc + prev.float()

    a, b = rand(4, 16), rand(8, 16)
    out = torch.randn(4, 8, dtype=FP32)
    want = a.float() @ b.float().T + out
    got = coda.reference.gemm(a, b, epilogue=_Add(), prev=out, out=out)
    torch.testing.assert_close(got, want)
    big = torch.zeros(5, 8, dtype=FP32)
    with raises(ValueError, "out") as info:
        coda.reference.gemm(a, b, epilogue=_Add(), prev=big[1:], out=big[:4])
    assert "exactly out" in str(info.value)


def test_tile_operands_choose_tma_or_element_loads_in_the_compile_key():
    """A TileMN operand is TMA-loaded only when its address and strides are 16-byte aligned; the choice is part of
    the compile key (so an unaligned view never reuses the TMA kernel)."""
    from coda.config import GemmConfig
    from coda.gemm import _kernel_views, tma_aligned
    from coda._validate import check_gemm_args

    @coda.epilogue
    def res_add(acc, res: coda.TileMN):
        return acc + res

    a, b = torch.randn(16, 32, dtype=torch.bfloat16), torch.randn(24, 32, dtype=torch.bfloat16)
    big = torch.randn(17, 25, dtype=torch.bfloat16)
    assert tma_aligned(torch.randn(16, 24)) and not tma_aligned(big[1:, 1:]) and not tma_aligned(big[:16, :24])
    keys = []
    for res in (torch.randn(16, 24, dtype=torch.bfloat16), big[:16, :24]):
        prob = check_gemm_args(a, b)
        keys.append(_kernel_views(prob, res_add, GemmConfig(), a, b, None, {"res": res})[1])
    assert keys[0][-1][-1] == ("tile_aligned", (True,)) and keys[1][-1][-1] == ("tile_aligned", (False,))


def test_tile_tma_plan_falls_back_when_the_rings_do_not_fit():
    """Rings of TMA-loaded TileMN operands never push the mainloop below min(3, its stages without them): the
    operands that do not fit (or are not aligned) are read element by element."""
    from coda.config import GemmConfig
    from coda.kernels.epilogue import Epilogue, Operand, tile_tma_plan

    class Tiles(Epilogue):
        operands = tuple(Operand(f"t{i}", "tile") for i in range(4))
    pp = GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=1)
    flags, extra = tile_tma_plan(Tiles(), pp, [True] * 4, [4] * 4, [2])
    assert flags[0] and not all(flags) and pp.derive_stages([2], extra_smem=extra) >= 3
    flags, _ = tile_tma_plan(Tiles(), GemmConfig(), [True, False, True, True], [2] * 4, [2])
    assert flags[:2] == (True, False)


def test_misaligned_operand_pointer_is_a_clear_error():
    """An operand view starting mid-row (address not 16-byte aligned) is named in a ValueError before any launch
    (it was a RuntimeError from inside the DSL's argument marshalling on the GPU)."""
    @coda.epilogue
    def bias_add(acc, bias: coda.VecN):
        return acc + bias

    a, b = torch.randn(16, 32, dtype=torch.bfloat16), torch.randn(24, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"operand 'bias': the data pointer must be 16-byte aligned"):
        coda.reference.gemm(a, b, epilogue=bias_add, bias=torch.randn(25)[1:])
