"""tests/dist_harness.py itself (CPU, gloo): a rank that fails -- by an exception or by a signal before its checks
are done -- fails the caller; ranks that finish leave no error. The harness tolerates only a signal after every rank
wrote its done marker (see its docstring), so a real failure can never pass."""
import os
import sys

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import spawn  # noqa: E402


def _ok(rank, path):
    dist.all_reduce(__import__("torch").ones(1))
    with open(os.path.join(path, f"ran.{rank}"), "w"):
        pass


def _raises(rank):
    if rank == 1:
        raise RuntimeError("rank 1 fails its check")


def _aborts(rank):
    if rank == 1:
        os.abort()
    dist.barrier()


def test_finishing_ranks_pass(tmp_path):
    spawn(_ok, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["ran.0", "ran.1"]


def test_exception_on_one_rank_fails_the_caller():
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 fails its check"):  # the cause, not rank 0's barrier
        spawn(_raises)


def test_signal_before_the_checks_end_fails_the_caller():
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        spawn(_aborts)
