"""examples/distributed_train.py on the CPU: 2 processes under torchrun (gloo, the reference path). Tensor parallel
(with and without sequence parallelism; and ``--stock``, torch's own plan over the unfused model) follows the single-process fused run of examples/llama_train.py (same
init, same batches, torch AdamW) step for step within bf16 noise; FSDP2 trains (its ranks see different batches:
the loss falls); outside torchrun the script says how to run it."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EX = os.path.join(ROOT, "examples")
COMMON = ["--device", "cpu", "--steps", "9", "--log-every", "4", "--warmup", "0"]


def _losses(text: str) -> list:
    return [float(x) for x in re.findall(r"step +\d+ +loss ([0-9.]+)", text)]


def _torchrun(*args) -> str:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           os.path.join(EX, "distributed_train.py"), *COMMON, *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def single():
    proc = subprocess.run([sys.executable, os.path.join(EX, "llama_train.py"), "--fused", *COMMON],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return _losses(proc.stdout)


@pytest.mark.parametrize("extra", [(), ("--sequence-parallel",), ("--stock",)], ids=["tp", "tp+sp", "stock-tp"])
def test_tensor_parallel_follows_the_single_process_run(single, extra):
    got = _losses(_torchrun("--parallel", "tp", *extra))
    assert len(got) == len(single) == 3 and got[-1] < got[0]
    for a, b in zip(got, single):
        assert abs(a - b) <= 2e-3 * abs(b), (got, single)


@pytest.mark.parametrize("extra", [(), ("--stock",)], ids=["fused", "stock"])
def test_fsdp_trains(extra):
    got = _losses(_torchrun("--parallel", "fsdp", *extra))
    assert len(got) == 3 and all(x == x for x in got) and got[-1] < got[0]


def test_outside_torchrun_says_how():
    proc = subprocess.run([sys.executable, os.path.join(EX, "distributed_train.py"), "--device", "cpu"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "torchrun" in proc.stderr


def test_stock_has_no_sequence_parallel():
    proc = subprocess.run([sys.executable, os.path.join(EX, "distributed_train.py"), "--parallel", "tp", "--stock",
                           "--sequence-parallel"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--stock" in proc.stderr
