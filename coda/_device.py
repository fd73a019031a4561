"""Where CODA's GEMM can run: a Hopper (sm_90) GPU, checked before anything is compiled or launched."""
from __future__ import annotations

from typing import Optional, Union

import torch

HOPPER_CAPABILITY = (9, 0)


def hopper_available() -> bool:
    """True when torch sees a CUDA device of compute capability 9.0 (sm_90)."""
    try:
        if not torch.cuda.is_available():
            return False
        return any(
            torch.cuda.get_device_capability(i) == HOPPER_CAPABILITY for i in range(torch.cuda.device_count())
        )
    except Exception:  # a broken driver / runtime counts as "no Hopper"
        return False


_sm_counts: dict = {}


def sm_count(device=None) -> int:
    """The number of SMs of a CUDA ``device`` (cached per index); an H100's 132 where there is none (the config
    heuristic's wave size for CPU-side planning)."""
    from .config import H100_SMS
    dev = torch.device(device) if device is not None else None
    if (dev is not None and dev.type != "cuda") or not torch.cuda.is_available():
        return H100_SMS
    index = dev.index if dev is not None and dev.index is not None else torch.cuda.current_device()
    n = _sm_counts.get(index)
    if n is None:
        n = _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


def is_hopper(device: Optional[Union[torch.device, str, int]]) -> bool:
    """Whether ``device`` is a Hopper (sm_90) CUDA device (what :func:`require_hopper` demands)."""
    try:
        require_hopper(device)
    except RuntimeError:
        return False
    return True


def require_hopper(device: Optional[Union[torch.device, str, int]], entry: str = "coda.gemm") -> None:
    """Raise ``RuntimeError`` unless ``device`` is a Hopper (sm_90) CUDA device.

    ``device`` is the device of the operands (``None``: the current CUDA device); ``entry`` names the public
    function in the message (e.g. ``"coda.gemm"``).
    """
    found = None
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cuda":
        found = "CPU tensors" if dev.type == "cpu" else f"{dev.type} tensors"
    elif not torch.cuda.is_available():
        found = "no CUDA device"
    else:
        index = dev.index if dev is not None and dev.index is not None else torch.cuda.current_device()
        capability = torch.cuda.get_device_capability(index)
        if capability != HOPPER_CAPABILITY:
            name = torch.cuda.get_device_name(index)
            found = f"{name} (sm_{capability[0]}{capability[1]}) on cuda:{index}"
    if found is not None:
        raise RuntimeError(
            f"{entry} needs a Hopper (sm_90) GPU; found {found}; "
            "use coda.reference.gemm (same arguments, any device) for a torch reference"
        )
