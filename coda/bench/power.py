"""The GPU's power draw and SM clock while a benchmark runs, sampled by ``nvidia-smi`` in a background thread.

On the H100 the llama-1b training step's GEMM phases run at the board's 700 W cap (session 33: the SM clock falls
from 1980 to 1410-1680 MHz; session 38: the step's mean is 580-600 W), so a kernel made faster without doing less
work may not shorten the step (session 37). The step report (``coda.bench.step``) prints each mode's mean power, SM clock and
energy per step from these samples. Where ``nvidia-smi`` is missing or fails, no samples are taken (``window``
returns None)."""
from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from typing import Optional


class Sampler:
    """``nvidia-smi --query-gpu=power.draw,clocks.sm -lms ms`` for GPU ``gpu`` (its index or UUID as nvidia-smi
    takes it), read in a daemon thread into ``samples``: (time.time(), W, MHz) tuples. ``stop()`` ends it."""

    def __init__(self, gpu: str = "0", ms: int = 50):
        self.samples: list = []
        self._proc = None
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return
        try:
            self._proc = subprocess.Popen([exe, "-i", str(gpu), "--query-gpu=power.draw,clocks.sm",
                                           "--format=csv,noheader,nounits", "-lms", str(ms)],
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                w, mhz = (float(x) for x in line.strip().split(","))
            except ValueError:  # "[N/A]" or a header: skipped
                continue
            self.samples.append((time.time(), w, mhz))

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()


def smi_id(index: int) -> str:
    """nvidia-smi's id of CUDA device ``index``: its entry in CUDA_VISIBLE_DEVICES (an index or a UUID, both of
    which ``nvidia-smi -i`` takes) where that is set, else the index."""
    visible = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return visible[index] if index < len(visible) else str(index)


def window(samples: list, t0: float, t1: float) -> Optional[dict]:
    """Mean power (W) and SM clock (MHz) of the samples taken in [t0, t1], and their count; None without any."""
    win = [s for s in samples if t0 <= s[0] <= t1]
    if not win:
        return None
    return {"w": sum(s[1] for s in win) / len(win), "mhz": sum(s[2] for s in win) / len(win), "samples": len(win)}
