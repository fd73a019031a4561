"""In-kernel split-K (``GemmConfig.splits``, coda/kernels/split_k.py) on the CPU: the config's rules, the units'
k-ranges, that the persistent schedule's waits cannot deadlock, the host's buffers, bad input, and the sm_90a
build. The kernel's results are checked on the GPU (tests/test_split_k_gpu.py)."""
import importlib
import itertools

import pytest
import torch

import coda
from coda.config import SPLITS, GemmConfig
from coda.kernels import split_k
from coda.runtime import rules

gemm_module = importlib.import_module("coda.gemm")  # (coda.gemm the attribute is the function)


def test_config_rules_and_name():
    assert GemmConfig(splits=4).name.endswith("_sk4") and "_sk" not in GemmConfig().name
    assert GemmConfig(cluster_m=1, splits=8).problems() == []
    for bad in (dict(splits=5), dict(splits=0)):
        assert any("splits must be one of" in p for p in GemmConfig(**bad).problems())
    for other in (dict(pingpong=True, tile_m=128, tile_n=128), dict(sched="dynamic"), dict(epi_wg=True),
                  dict(l2_prefetch=8)):
        assert any("splits > 1 is built for" in p for p in GemmConfig(splits=2, **other).problems()), other
    # stored entries: splits left out at 1 (entries read as before), kept otherwise; the stored form round-trips
    assert "splits" not in rules.config_to_dict(GemmConfig())
    d = rules.config_to_dict(GemmConfig(cluster_m=1, splits=6))
    assert d["splits"] == 6 and rules.config_problem(d) is None and rules.config_from_dict(d).splits == 6
    assert "splits" in rules.config_problem(dict(d, splits=5))


def test_shape_rules_need_a_k_tile_per_split():
    cfg = GemmConfig(cluster_m=1, splits=8)
    assert rules.shape_reasons(cfg, None, 512, 512, 1, K=8 * 64) is None
    assert "k-tiles" in rules.shape_reasons(cfg, None, 512, 512, 1, K=7 * 64)
    assert rules.shape_reasons(cfg, None, 512, 512, 1) is None  # K unknown (the tuner's space)
    assert "int32" in rules.shape_reasons(GemmConfig(cluster_m=1, splits=16), None, 16384, 16384, 1, K=1 << 20)
    # the schedule's two tensors count against the kernel's tensor slots
    assert rules.config_reason(GemmConfig(cluster_m=1, splits=2)) is None


@pytest.mark.parametrize("splits", SPLITS)
def test_units_partition_every_k_range(splits):
    for k_tiles in range(splits, 3 * splits + 5):
        ranges = [split_k.k_range(s, splits, k_tiles) for s in range(splits)]
        assert ranges[0][0] == 0 and ranges[-1][1] == k_tiles
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(e > b for b, e in ranges), (splits, k_tiles, ranges)  # every split has a k-tile


@pytest.mark.parametrize("splits,size", [(2, 1), (4, 2), (16, 2), (3, 1)])
def test_workspace_slots_are_one_per_partial(splits, size):
    """Every (cluster tile, non-final split, CTA rank) has its own slot, and they fill the host's buffer exactly."""
    tiles = 7
    got = sorted(split_k.slot(t, s, r, splits, size) for t in range(tiles) for s in range(splits - 1)
                 for r in range(size))
    assert got == list(range(split_k.slots(tiles, splits, size)))


def _simulate(n_tiles: int, splits: int, clusters: int) -> int:
    """The persistent static schedule with the fixup's waits: cluster c runs units c, c + P, ... in order, one
    step each; a tile's final unit can only run once its other units ran. Returns the steps, or -1 on deadlock."""
    n_units = n_tiles * splits
    queues = [list(range(c, n_units, clusters)) for c in range(clusters)]
    done, steps = set(), 0
    while any(queues):
        progressed = []
        for q in queues:
            if q:
                u = q[0]
                t, s = divmod(u, splits)
                if s < splits - 1 or all(t * splits + j in done for j in range(splits - 1)):
                    progressed.append(u)
                    q.pop(0)
        if not progressed:
            return -1
        done.update(progressed)
        steps += 1
    return steps


@pytest.mark.parametrize("n_tiles,splits,clusters", itertools.product((1, 2, 5, 8, 33, 64), (2, 3, 8, 16),
                                                                       (1, 7, 66, 132)))
def test_the_schedule_cannot_deadlock(n_tiles, splits, clusters):
    clusters = min(clusters, n_tiles * splits)  # the grid: at most one cluster per unit
    steps = _simulate(n_tiles, splits, clusters)
    assert steps > 0
    if n_tiles * splits <= clusters:  # one wave: every unit at once, the final ones one step later
        assert steps == 2


def test_host_buffers_sized_per_cta_tile_and_reused():
    cfg = GemmConfig(tile_m=128, tile_n=256, cluster_m=2, splits=4)
    dev = torch.device("cpu")  # (the CPU tests build kernel arguments there)
    ws, flags = gemm_module._split_buffers(cfg, 1, 300, 600, dev)  # 3 x 3 CTA tiles -> 2 x 3 cluster tiles
    n = split_k.slots(2 * 3, 4, 2)
    assert n == 36 and flags.numel() == n and ws.numel() == n * 128 * 256
    assert flags.dtype == torch.int32 and not flags.any() and ws.dtype == torch.float32
    again = gemm_module._split_buffers(cfg, 1, 128, 256, dev)
    assert again[0].data_ptr() == ws.data_ptr() and again[1].data_ptr() == flags.data_ptr()
    args, _, _ = gemm_module.epilogue_tensors(coda.kernels.epilogue.IDENTITY, _prob(300, 600, 4096),
                                              {}, torch.empty(1, 300, 600), cfg)
    assert [t.data_ptr() for t, _ in args] == [ws.data_ptr(), flags.data_ptr()]


def _prob(M, N, K):
    from coda._validate import check_gemm_args
    return check_gemm_args(torch.empty(M, K, dtype=torch.bfloat16), torch.empty(N, K, dtype=torch.bfloat16))


def test_gemm_refuses_more_splits_than_k_tiles_before_anything_runs():
    a, b = torch.randn(256, 7 * 64, dtype=torch.bfloat16), torch.randn(256, 7 * 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="splits=8 needs at least 8 k-tiles"):
        coda.gemm(a, b, config=GemmConfig(cluster_m=1, splits=8))
    with pytest.raises(ValueError, match="splits must be one of"):
        coda.gemm(a, b, config=GemmConfig(cluster_m=1, splits=5))


@pytest.mark.parametrize("cfg", [GemmConfig(splits=4), GemmConfig(tile_n=128, cluster_m=1, splits=3)],
                         ids=lambda c: c.name)
def test_split_kernels_build_for_sm90a_without_spills(cfg, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    from coda.check import compile_variant
    from coda.epilogues.scale_bias import ScaleBiasSumsq
    for epi in (coda.kernels.epilogue.IDENTITY, ScaleBiasSumsq()):  # + staged VecM / VecN, a row reduction
        row = compile_variant(cfg, epi)
        assert row["ok"], (epi.name, row["error"])
        assert row["wgmma"] > 0 and row["spill_bytes"] == 0


def test_the_tuner_times_splits_only_for_few_tiles_and_a_long_k():
    from coda.autotune import space
    from coda.kernels.epilogue import IDENTITY

    def names(M, N, K, level="quick"):
        return [c.name for c in space.split_candidates(IDENTITY, "bfloat16", "bfloat16", M, N, K, level=level)]
    few = names(512, 512, 32768)
    assert "128x256_coop_c1x1_rm8_sk16" in few and "128x128_coop_c1x1_rm8_sk2" in few
    assert names(8192, 8192, 2048) == []  # 256 tiles of 128 x 256 and 512 of 128 x 128: two waves and more
    assert names(512, 512, 1024) == ["128x256_coop_c1x1_rm8_sk2", "128x128_coop_c1x1_rm8_sk2"]  # 16 k-tiles
    assert names(512, 512, 960) == []  # 15 k-tiles: no split keeps 8 a split
    assert names(1, 4096, 4096, "near") == ["128x256_coop_c1x1_rm8_sk2", "128x256_coop_c1x1_rm8_sk4",
                                            "128x256_coop_c1x1_rm8_sk8"]
    assert all(GemmConfig(**{k: v for k, v in rules.config_to_dict(c).items()}).problems() == []
               for c in space.split_candidates(IDENTITY, "bfloat16", "bfloat16", 6144, 768, 16384))


def test_a_remembered_split_config_wins_over_the_host_split(monkeypatch):
    """coda.gemm(config=None) of a plain few-tile long-K problem: the host's batched split unless the store or the
    shipped file has an in-kernel split-K config for it; with CODA_AUTOTUNE=0 always the host split."""
    from coda import _device
    from coda.runtime import select
    monkeypatch.delenv("CODA_AUTOTUNE", raising=False)  # (conftest sets 0) the library's default
    monkeypatch.setattr(_device, "require_hopper", lambda *a, **k: None)
    monkeypatch.setattr(_device, "sm_count", lambda *a: 132)
    monkeypatch.setattr(gemm_module, "split_k", lambda *a: 4)
    monkeypatch.setattr(gemm_module, "_split_k", lambda *a: "host split")

    class Chosen(Exception):
        pass

    def chosen(*a):
        raise Chosen
    monkeypatch.setattr(gemm_module, "select_config", chosen)
    a, b = torch.randn(512, 4096, dtype=torch.bfloat16), torch.randn(512, 4096, dtype=torch.bfloat16)
    monkeypatch.setattr(select, "key_for", lambda *a: "key")  # (a CPU device has no tuning key)
    chain = []  # what the store / shipped file would serve: (config, source), not memoised here
    monkeypatch.setattr(select, "_default_chain", lambda *a: chain[-1])
    chain.append((GemmConfig(), "heuristic"))
    assert coda.gemm(a, b) == "host split"
    chain.append((GemmConfig(cluster_m=1), "tuned"))  # measured unsplit: the host split
    assert coda.gemm(a, b) == "host split"
    chain.append((GemmConfig(cluster_m=1, splits=4), "shipped"))
    with pytest.raises(Chosen):
        coda.gemm(a, b)
    monkeypatch.setenv("CODA_AUTOTUNE", "0")
    assert coda.gemm(a, b) == "host split"
