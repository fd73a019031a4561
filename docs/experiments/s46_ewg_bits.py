"""GPU: a hash of the epilogue warps' outputs for the VecN-reading entries (rms_radial_residual, fold_grads) at the
H100 shipped configs, fixed inputs -- run under `coda.bench.ab_files` to check a change is bit-exact (session 46)."""
import hashlib
import sys

import torch

import coda
from coda.autotune import space
from coda.runtime.shipped import SHIPPED_DIR

sys.path.insert(0, "tests")
from test_epi_wg_gpu import _shipped_case  # noqa: E402
import json  # noqa: E402

for e in json.loads((SHIPPED_DIR / "h100_sxm.json").read_text())["entries"].values():
    name, p = e["epilogue"]["name"], e["problem"]
    if not e["config"].get("epi_wg") or name not in ("rms_radial_residual", "fold_grads"):
        continue
    torch.manual_seed(1)
    M, N, K = min(p["M"], 4096), min(p["N"], 2048), min(p["K"], 4096)
    a, b, ops, epi = _shipped_case(name, M, N, K, p["a_major"], p["b_major"])
    got = coda.gemm(a, b, epilogue=epi, config=space.config_from_dict(e["config"]), **ops)
    got = got if isinstance(got, dict) else {"out": got}
    h = hashlib.sha256(b"".join(got[k].contiguous().view(torch.uint8).cpu().numpy().tobytes() for k in sorted(got)))
    print(f"BITS {name} {M}x{N}x{K} {e['name']}: {h.hexdigest()[:16]}")
