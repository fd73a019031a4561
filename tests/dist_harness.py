"""Run a test function on WORLD ranks (torch.multiprocessing + a file rendezvous): gloo on CPU, NCCL on GPUs.

Teardown: a rank whose function returned waits for the others (a barrier), destroys the process group, writes a
``done.<rank>`` marker and leaves with ``os._exit(0)``, skipping the interpreter's static destructors: CI saw a
rank abort there once (``terminate called without an active exception``, gloo, after every check had passed). If
a rank still dies of a signal after *every* rank wrote its marker, the checks are complete and the crash belongs
to the process's exit, not to the test: a warning says so. Any failure before that fails the caller.
"""
import os
import sys
import tempfile
import time
import warnings

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
    except BaseException:
        dist.destroy_process_group()
        raise
    try:
        dist.barrier()
    except Exception:  # another rank failed: let its own error reach the caller first (mp.spawn reports the first)
        time.sleep(5)
        raise
    dist.destroy_process_group()
    with open(os.path.join(os.path.dirname(init[len("file://"):]), f"done.{rank}"), "w"):
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, *args, backend="gloo"):
    """Run fn(rank, *args) on WORLD ranks; an exception on any rank fails the caller with its traceback."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.spawn(_entry, args=(f"file://{os.path.join(d, 'init')}", backend, fn, args), nprocs=WORLD, join=True)
        except mp.ProcessExitedException as e:
            if e.signal_name is None or not all(os.path.exists(os.path.join(d, f"done.{r}")) for r in range(WORLD)):
                raise
            warnings.warn(f"every rank finished its checks; then {e} (a crash in the process's exit)")
