"""CPU: the operand-kind objects (``coda/kernels/operand_kinds.py``) give what the if/else chains over the kind
strings gave: shapes, messages, kernel arguments, staged shared memory, reduction partials."""
import types

import pytest
import torch

import coda
from coda.config import GemmConfig, all_configs
from coda.gemm import epilogue_tensors
from coda.kernels.epilogue import KINDS, Epilogue, Operand, Reduction, staged_operands, staged_smem_bytes
from coda.kernels.operand_kinds import AXIS_OF, KIND_OF, PER_COL, PER_ROW, SCALAR, TILE, VEC_M, VEC_N


def test_one_object_per_declared_kind():
    assert KINDS == ("vec_m", "vec_n", "scalar", "tile")
    assert [KIND_OF[k] for k in KINDS] == [VEC_M, VEC_N, SCALAR, TILE]
    assert {k.label for k in KIND_OF.values()} == {"VecM", "VecN", "Scalar", "TileMN"}
    for ann in (coda.VecM, coda.VecN, coda.Scalar, coda.TileMN):  # the DSL annotation names its kind object
        assert KIND_OF[ann.kind].label == ann.__name__
    op = Operand("x", "tile")
    assert op.kind == "tile" and op.spec is TILE  # the declaration stays the string (compile keys, o.kind tests)
    assert Reduction("r", "m").spec is PER_COL and AXIS_OF["n"] is PER_ROW


@pytest.mark.parametrize("batch", [(), (3,)])
def test_shapes(batch):
    assert VEC_M.shape(batch, 5, 8) == (*batch, 5)
    assert VEC_N.shape(batch, 5, 8) == (8,)
    assert TILE.shape(batch, 5, 8) == (*batch, 5, 8)


class _All(Epilogue):
    name = "all_kinds"
    operands = (Operand("b", "vec_n"), Operand("r", "vec_m"), Operand("s", "scalar"), Operand("t", "tile"))
    reductions = (Reduction("cs", "m"), Reduction("ss", "n"))


class _Pairs(_All):
    name = "all_kinds_pairs"
    pair_mode = "half"


def test_messages_name_the_kind():
    epi, L, M, N = _All(), None, 4, 8
    good = dict(b=torch.zeros(N), r=torch.zeros(M), s=1.0, t=torch.zeros(M, N))
    epi.check_operands(good, L, M, N, torch.device("cpu"))
    with pytest.raises(TypeError, match=r"operand 'r' \(vec_m\): expected a torch tensor, got float"):
        epi.check_operands({**good, "r": 1.0}, L, M, N, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"operand 't' \(TileMN\): expected shape \(4, 8\), got \(4, 7\)"):
        epi.check_operands({**good, "t": torch.zeros(M, 7)}, L, M, N, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"operand 's' \(Scalar\): expected 1 element, got shape \(2,\)"):
        epi.check_operands({**good, "s": torch.zeros(2)}, L, M, N, torch.device("cpu"))
    with pytest.raises(TypeError, match=r"operand 's' \(Scalar\): expected a Python number"):
        epi.check_operands({**good, "s": True}, L, M, N, torch.device("cpu"))


@pytest.mark.parametrize("epi", [_All(), _Pairs()], ids=["plain", "pairs"])
def test_kernel_arguments(epi):
    """epilogue_tensors: each kind's argument and mode order, the partial buffers' shapes."""
    cfg = GemmConfig()
    L, M, N = 2, 5, 8
    cols = epi.operand_cols(N)
    ops = dict(b=torch.randn(cols), r=torch.randn(L, M), s=torch.tensor([2.5]), t=torch.randn(L, M, cols))
    prob = types.SimpleNamespace(N=N, M=M, L=L)
    out3 = torch.empty(L, M, epi.out_cols(N))
    args, _, partials = epilogue_tensors(epi, prob, ops, out3, cfg)
    (b, lb), (r, lr), (s, ls), (t, lt) = args[:4]
    assert b is ops["b"] and lb == 0
    assert r.shape == (M, L) and r.data_ptr() == ops["r"].data_ptr() and torch.equal(r, ops["r"].T) and lr == 0
    assert s.dtype == torch.float32 and s.shape == (1,) and s.item() == 2.5 and ls == 0
    assert t.shape == (M, cols, L) and torch.equal(t, ops["t"].permute(1, 2, 0)) and lt == 1
    assert [x.by_view for x in (VEC_N, VEC_M, SCALAR, TILE)] == [True, True, False, True]
    assert SCALAR.host_arg(3, L, M, N, torch.device("cpu"))[0].tolist() == [3.0]
    tiles_n, tiles_m = -(-N // cfg.tile_n), -(-M // cfg.tile_m) * cfg.warps_per_tile
    assert partials["ss"][0].shape == (L, tiles_n, M)
    assert partials["cs"][0].shape == (L, tiles_m, cols)


def test_staged_shared_memory_as_before():
    """staged_operands / staged_smem_bytes: the per-kind chain they replaced (VecN tile_n, tile_n / 2 for pairs;
    VecM tile_m; fp32; TileMN rings tile_m x epi_n (epi_n / 2) x ring x element size, plus 8-byte mbarriers)."""
    for cfg in all_configs():
        for epi in (_All(), _Pairs()):
            pair = bool(epi.pair_mode)
            want = [(0, cfg.tile_n // 2 if pair else cfg.tile_n), (1, cfg.tile_m)]
            assert staged_operands(epi, cfg) == want
            for ring, tile_bytes in ((2, []), (4, [2]), (8, [2, 4])):
                cols = cfg.epi_n // 2 if pair else cfg.epi_n
                n = 4 * sum(v for _, v in want)
                n += sum(cfg.tile_m * cols * ring * b for b in tile_bytes) + (8 * ring if tile_bytes else 0)
                assert staged_smem_bytes(epi, cfg, tile_bytes, ring) == n * (2 if cfg.pingpong else 1)
        assert SCALAR.staged_values(cfg, False) == TILE.staged_values(cfg, False) == 0


def test_reference_forms():
    acc = torch.zeros(2, 3, 4)
    assert VEC_M.reference(torch.ones(2, 3), acc).shape == (2, 3, 1)
    assert VEC_N.reference(torch.ones(4, dtype=torch.bfloat16), acc).dtype == torch.float32
    assert SCALAR.reference(2, acc).shape == ()
    assert TILE.reference(torch.ones(2, 3, 4), acc).shape == (2, 3, 4)
