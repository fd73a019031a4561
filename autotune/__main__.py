"""``python -m coda.autotune --gemm M,N,K[,L] [--gemm ...] [--epilogue NAME] [--level quick|full] [--clear]``

Pre-tunes the given problems on this machine's Hopper GPU (random inputs; the epilogue's operands are random
tensors of their declared kinds), stores the winners in the result cache (``$CODA_CACHE_DIR``, default
``~/.cache/coda``) and prints a table per problem. ``--clear`` empties the result and compiled-kernel caches first
(alone, it needs no GPU). ``--space`` prints how the config space is pruned for the epilogue and dtypes (no GPU).
Without a Hopper GPU, ``--gemm`` prints why and exits with status 2.

``--epilogue``: ``identity`` (default), ``module:attribute`` (an Epilogue instance or class), or the attribute
name / ``.name`` of an epilogue defined in ``coda.epilogues``.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import sys


def resolve_epilogue(name: str):
    from coda.kernels.epilogue import IDENTITY, Epilogue
    if name in ("", "identity", "none"):
        return IDENTITY
    if ":" in name:
        mod, attr = name.split(":", 1)
        obj = getattr(importlib.import_module(mod), attr)
    else:
        lib = importlib.import_module("coda.epilogues")
        obj = getattr(lib, name, None)
        if obj is None:
            found = [v for v in vars(lib).values()
                     if (isinstance(v, Epilogue) or (isinstance(v, type) and issubclass(v, Epilogue)))
                     and getattr(v, "name", None) == name]
            if not found:
                raise ValueError(f"no epilogue named {name!r} in coda.epilogues (use module:attribute)")
            obj = found[0]
    if isinstance(obj, type) and issubclass(obj, Epilogue):
        obj = obj()
    if not isinstance(obj, Epilogue):
        raise ValueError(f"{name!r} is not a coda Epilogue (got {type(obj).__name__})")
    return obj


def parse_shape(text: str) -> tuple:
    parts = [int(x) for x in text.replace("x", ",").split(",") if x.strip()]
    if len(parts) not in (3, 4) or any(p <= 0 for p in parts):
        raise ValueError(f"expected M,N,K or M,N,K,L with positive integers, got {text!r}")
    return tuple(parts) if len(parts) == 4 else (*parts, None)


def print_space(epi, dtype: str, out_dtype: str) -> None:
    from . import space
    kept, pruned = space.prune(epi, dtype, out_dtype)
    quick = [c for c in kept if all(getattr(c, k) == v for k, v in space.QUICK_DEFAULTS.items())]
    print(f"config space for epilogue {epi.name!r}, {dtype} -> {out_dtype}: {len(kept) + len(pruned)} configs, "
          f"{len(kept)} kept ({len(quick)} at the quick level), {len(pruned)} pruned")
    reasons = collections.Counter(r.split(":")[0] if r.startswith(("invalid", "shared memory", "duplicate"))
                                  else r for _, r in pruned)
    for r, n in reasons.most_common():
        print(f"  {n:6d}  {r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m coda.autotune", description=__doc__.splitlines()[0])
    ap.add_argument("--gemm", action="append", default=[], metavar="M,N,K[,L]", help="a problem to tune (repeat)")
    ap.add_argument("--epilogue", default="identity", metavar="NAME")
    ap.add_argument("--dtype", default="bfloat16", help="input dtype: bfloat16 or float16")
    ap.add_argument("--out-dtype", default=None, help="output dtype (default: the input dtype)")
    ap.add_argument("--level", choices=("quick", "full"), default="quick")
    ap.add_argument("--clear", action="store_true", help="empty the result and compiled-kernel caches first")
    ap.add_argument("--space", action="store_true", help="print the pruned config space (no GPU needed)")
    args = ap.parse_args(argv)
    if not (args.gemm or args.clear or args.space):
        ap.error("nothing to do: give --gemm M,N,K, --clear or --space")
    try:
        shapes = [parse_shape(s) for s in args.gemm]
        epi = resolve_epilogue(args.epilogue)
    except (ValueError, ImportError, AttributeError) as e:
        print(f"coda.autotune: {e}", file=sys.stderr)
        return 2
    import coda.autotune as at
    from .keys import dtype_name
    out_dtype = dtype_name(args.out_dtype or args.dtype)
    if args.clear:
        removed = at.clear()
        print(f"cleared {at.cache_dir()}: results file {'removed' if removed['results'] else 'absent'}, "
              f"{removed['kernels']} compiled kernels removed")
    if args.space:
        print_space(epi, dtype_name(args.dtype), out_dtype)
    if not shapes:
        return 0
    from coda._device import hopper_available
    if not hopper_available():
        import torch
        found = "no CUDA device" if not torch.cuda.is_available() else \
            ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        print(f"coda.autotune: tuning needs a Hopper (sm_90) GPU; found {found}. Nothing was tuned. "
              "(Without a GPU, coda.reference.gemm is the torch reference; CODA_AUTOTUNE=0 makes coda.gemm use "
              "the heuristic default config.)", file=sys.stderr)
        return 2
    from .tuner import describe
    for M, N, K, L in shapes:
        print(f"\n== {M}x{N}x{K}{f' L={L}' if L else ''} {args.dtype}->{out_dtype} epilogue {epi.name!r} "
              f"({args.level})", flush=True)
        result = at.tune_shape(M, N, K, L, args.dtype, out_dtype, epi, level=args.level)
        print(result.table())
        print(describe(result))
    print(f"\nresults stored in {at.store.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
