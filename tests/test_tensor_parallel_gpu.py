"""coda.tensor_parallel on 2 Hopper GPUs (NCCL, bf16, CODA's kernels): the checks of tests/test_tensor_parallel.py.

Passed on 4 NVIDIA H200 (session 28, 2 ranks, NCCL). To run on a 2-GPU host (nvidia-h100-x2):

    python -m pytest -q tests/test_tensor_parallel_gpu.py -p no:cacheprovider

- the tiny coda.fuse'd Llama of tests/test_distributed.py in bf16 at tp = 2 (partial sums reduced in float32, the
  default, and in bf16), with and without sequence parallelism: loss and every gathered gradient (by stock name)
  vs the float64 fused model by the 2x rule (at most 2x the error of the single-GPU bf16 fused model, plus a 1e-3
  floor);
- the gathered stock state dict equals the bf16 stock model's (bitwise: no step was taken), loads into a stock
  model and reproduces the single-GPU bf16 loss (to 1e-6);
- a tp size that does not divide the kv heads raises ValueError naming tp on both ranks, and the group stays usable;
- sequence_parallel=True: the bf16 checks above (both reduce dtypes, all-gathers / reduce-scatters over NCCL), and
  a sequence length not divisible by tp raises ValueError on both ranks.
"""
import copy
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cross_entropy_ref import rel  # noqa: E402
from dist_harness import WORLD, spawn  # noqa: E402
from test_distributed import CFG, _batch, _stock_model  # noqa: E402
from test_tensor_parallel import _loss_and_grads, _tp_model  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs 2 CUDA devices")]


def _spawn(fn, *args):
    spawn(fn, *args, backend="nccl")


def _worker(rank, d):
    import coda.tensor_parallel as tp
    ref = torch.load(os.path.join(d, "ref.pt"), map_location="cuda")
    ids = _batch().cuda()
    stock = _stock_model().cuda()
    for reduce_dtype, sp in ((torch.float32, False), (None, False), (torch.float32, True), (None, True)):
        model = _tp_model(stock, torch.bfloat16, reduce_dtype=reduce_dtype, sequence_parallel=sp)
        loss, grads = _loss_and_grads(model, ids, tp.stock_grads)
        want, single = ref["loss64"], ref["loss_bf16"]
        assert abs(loss.double() - want) <= 2 * abs(single - want) + 1e-3, (loss, single, want, reduce_dtype, sp)
        assert grads.keys() == ref["grads64"].keys()
        for k, g in grads.items():
            e, e1 = rel(g, ref["grads64"][k]), rel(ref["grads_bf16"][k], ref["grads64"][k])
            assert e <= 2 * e1 + 1e-3, (k, e, e1, reduce_dtype, sp, rank)
    bad = ids[:, :31]  # sequence parallelism: T not divisible by tp raises on both ranks, before any collective
    with pytest.raises(ValueError, match=r"sequence length 31 .*divisible by the tp size 2"):
        model(bad, labels=bad)
    model = _tp_model(stock, torch.bfloat16)
    sd = tp.stock_state_dict(model)
    want = stock.to(torch.bfloat16).state_dict()
    assert list(sd) == list(want) and all(torch.equal(sd[k], want[k]) for k in want)
    if rank == 0:
        torch.save({k: v.cpu() for k, v in sd.items()}, os.path.join(d, "tp_full.pt"))


def _bad_size_worker(rank):
    import coda
    import coda.tensor_parallel as tp
    from llama_model import LlamaConfig, LlamaForCausalLM
    model = coda.fuse(LlamaForCausalLM(LlamaConfig(**{**CFG, "num_key_value_heads": 1})).cuda().to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"argument tp .*num_key_value_heads 1"):
        tp.parallelize(model)
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    assert t.item() == WORLD


def test_tensor_parallel_fused_llama_nccl():
    import coda
    stock = _stock_model().cuda()
    ids = _batch().cuda()
    loss64, grads64 = _loss_and_grads(coda.fuse(copy.deepcopy(stock).double()), ids, coda.stock_grads)
    half = coda.fuse(copy.deepcopy(stock).to(torch.bfloat16))
    loss_bf16, grads_bf16 = _loss_and_grads(half, ids, coda.stock_grads)
    with torch.no_grad():
        want = half(ids, labels=ids)
    with tempfile.TemporaryDirectory() as d:
        torch.save({"loss64": loss64, "grads64": grads64, "loss_bf16": loss_bf16.double(), "grads_bf16": grads_bf16},
                   os.path.join(d, "ref.pt"))
        _spawn(_worker, d)
        fresh = _stock_model().to(torch.bfloat16)
        fresh.load_state_dict(torch.load(os.path.join(d, "tp_full.pt")))
    fresh = coda.fuse(fresh.cuda())
    with torch.no_grad():
        got = fresh(ids, labels=ids)
    assert rel(got, want) <= 1e-6, (got, want)


def test_tensor_parallel_bad_size_nccl():
    _spawn(_bad_size_worker)
