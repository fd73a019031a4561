"""Run a test function on WORLD ranks (torch.multiprocessing + a file rendezvous): gloo on CPU, NCCL on GPUs."""
import os
import tempfile

import torch
import torch.distributed as dist

WORLD = 2


def _entry(rank, init, backend, fn, args):
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=WORLD,
                                device_id=torch.device("cuda", rank))
    else:
        torch.set_num_threads(1)  # two processes on a 2-core machine
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, *args, backend="gloo"):
    """Run fn(rank, *args) on WORLD ranks; an exception on any rank fails the caller with its traceback."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_entry, args=(f"file://{os.path.join(d, 'init')}", backend, fn, args), nprocs=WORLD, join=True)
