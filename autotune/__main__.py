"""``python -m coda.autotune --gemm M,N,K[,L] [--gemm ...] [--epilogue NAME] [--level quick|full] [--clear]``

``python -m coda.autotune --model llama-1b --batch 2 --seq 4096``: runs one fused training step of that model
(``coda.bench.step.PRESETS``) on the GPU, recording every GEMM problem and epilogue it uses, then tunes each (one
progress bar) and stores the winners: run it once per machine (and per batch shape) so that ``coda.gemm``'s
default path finds tuned configs; ``--prefill`` records the model's inference forward instead (no grad: other
epilogues than training's). ``--show``: a table of the tuning store's and the shipped entries for this GPU
(all GPUs without one, or ``--gpu NAME``). ``--ship-from FILE`` (repeat): convert tuning results (a tuning store
``autotune.json``, or ``docs/tune_h100/tuned_table.py`` rows with ``--gpu``, ``--sm-count``, ``--cutlass-dsl``)
into the shipped per-GPU files (``coda/autotune/shipped/``, or ``--ship-dir``).

--gemm Pre-tunes the given problems on this machine's Hopper GPU (random inputs; the epilogue's operands are random
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
    ap.add_argument("--level", choices=("quick", "full", "near"), default="quick",
                    help="quick: ~50 first-order configs a problem; full: then the best 3 refined; near: the "
                         "heuristic's config one knob away (~10 a problem)")
    ap.add_argument("--clear", action="store_true", help="empty the result and compiled-kernel caches first")
    ap.add_argument("--space", action="store_true", help="print the pruned config space (no GPU needed)")
    ap.add_argument("--model", default=None, metavar="PRESET",
                    help="tune every GEMM of one fused training step of this coda.bench.step preset")
    ap.add_argument("--batch", type=int, default=2, help="--model: sequences per step (default 2)")
    ap.add_argument("--seq", type=int, default=4096, help="--model: tokens per sequence (default 4096)")
    ap.add_argument("--only", default=None,
                    help="--model: tune only the problems whose label (MxNxK epilogue) contains one of these "
                         "comma-separated strings")
    ap.add_argument("--source", default=None, metavar="SRC[,SRC]",
                    help="--model: tune only the problems the step was served from these sources (tuned, shipped, "
                         "heuristic): 'heuristic' tunes what neither the store nor the shipped file covers")
    ap.add_argument("--optimizer", choices=("adamw", "coda-adamw"), default="coda-adamw",
                    help="--model: the step's optimizer (coda-adamw: coda.optim.AdamW, updates in the backward, "
                         "the step report's fused modes; adamw: torch's)")
    ap.add_argument("--compile", action="store_true",
                    help="--model: record the step of torch.compile(model) (the fused+compile mode's problems)")
    ap.add_argument("--prefill", action="store_true",
                    help="--model: record the inference forward of --batch prompts of --seq tokens (no grad, no "
                         "labels, no optimizer) instead of the training step")
    ap.add_argument("--retune", action="store_true", help="--model: also tune problems the store already has")
    ap.add_argument("--show", action="store_true", help="table of the store's and shipped entries (this GPU)")
    ap.add_argument("--ship-from", action="append", default=[], metavar="FILE",
                    help="convert tuning results into the shipped per-GPU files (repeat)")
    ap.add_argument("--ship-dir", default=None, help="--ship-from: where to write (default: the package's)")
    ap.add_argument("--gpu", default=None, help="--show / --ship-from: the GPU name (e.g. 'NVIDIA H100 80GB HBM3')")
    ap.add_argument("--sm-count", type=int, default=None, help="--ship-from tuner-table rows: the GPU's SMs")
    ap.add_argument("--cutlass-dsl", default=None, help="--ship-from tuner-table rows: the cutlass-dsl version")
    ap.add_argument("--note", default="", help="--ship-from: a provenance note")
    ap.add_argument("--drop", action="append", default=[], metavar="KEY=WHY",
                    help="--ship-from: an entry key not to ship, and why (repeat; kept in the provenance)")
    args = ap.parse_args(argv)
    if not (args.gemm or args.clear or args.space or args.model or args.show or args.ship_from):
        ap.error("nothing to do: give --model PRESET, --gemm M,N,K, --show, --ship-from, --clear or --space")
    if args.model is not None:
        from coda.bench.step import PRESETS
        if args.model not in PRESETS:
            ap.error(f"--model: unknown preset {args.model!r}; one of {', '.join(sorted(PRESETS))}")
        if args.batch <= 0 or args.seq <= 0:
            ap.error("--batch and --seq must be positive")
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
    if args.ship_from:
        rc = ship_files(args)
        if rc:
            return rc
    if not (shapes or args.model):
        if args.show:
            show(args.gpu)
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
    if args.model:
        tune_model(args)
    if args.show:
        show(args.gpu)
    if not shapes:
        return 0
    from .tuner import describe
    for M, N, K, L in shapes:
        print(f"\n== {M}x{N}x{K}{f' L={L}' if L else ''} {args.dtype}->{out_dtype} epilogue {epi.name!r} "
              f"({args.level})", flush=True)
        result = at.tune_shape(M, N, K, L, args.dtype, out_dtype, epi, level=args.level)
        print(result.table())
        print(describe(result))
    print(f"\nresults stored in {at.store.path}")
    return 0


def tune_model(args) -> None:
    import coda.autotune as at
    from . import model
    wanted = set(args.source.split(",")) if args.source else set()
    bad = wanted - {"tuned", "shipped", "heuristic"}
    if bad:  # (before the step is recorded: it runs on the GPU)
        raise SystemExit(f"coda.autotune: --source takes tuned, shipped, heuristic; got {sorted(bad)}")
    what = "prefill forward" if args.prefill else "training step"
    print(f"coda.autotune: recording one fused {what} of {args.model}{' (torch.compile)' * args.compile} "
          f"(batch {args.batch}, seq {args.seq})", file=sys.stderr, flush=True)
    problems = model.record_model_step(args.model, args.batch, args.seq, dtype_name(args.dtype),
                                       optimizer=args.optimizer, compile=args.compile, prefill=args.prefill)
    if args.only:  # problems whose label ("MxNxK epilogue") contains one of the comma-separated strings
        problems = [r for r in problems if any(o in r.label for o in args.only.split(","))]
    if wanted:  # what served each problem in the recorded step (model.Recorded.source)
        problems = [r for r in problems if r.source in wanted]
    src = collections.Counter(r.source for r in problems)
    print(f"coda.autotune: {len(problems)} GEMM problems ({', '.join(f'{n} {k}' for k, n in src.items())}); "
          f"tuning ({args.level} level)", file=sys.stderr, flush=True)
    rows = model.tune_recorded(problems, level=args.level, retune=args.retune, desc=f"coda.autotune {args.model}")
    print(f"{'problem':44s} {'calls':>5s}  result")
    for r, _, status in rows:
        print(f"{r.label:44s} {r.calls:5d}  {status}")
    print(f"\nresults stored in {at.store.path}")


def dtype_name(dt):
    from .keys import dtype_name as f
    return f(dt)


def ship_files(args) -> int:
    from . import ship
    gpu = None
    if args.gpu or args.sm_count or args.cutlass_dsl:
        if not (args.gpu and args.sm_count and args.cutlass_dsl):
            print("coda.autotune: --ship-from of tuner-table rows needs --gpu, --sm-count and --cutlass-dsl",
                  file=sys.stderr)
            return 2
        gpu = (args.gpu, args.sm_count, "sm_90a", args.cutlass_dsl)
    if any("=" not in d for d in args.drop):
        print("coda.autotune: --drop takes KEY=WHY", file=sys.stderr)
        return 2
    try:
        written = ship.ship_from(args.ship_from, gpu, args.ship_dir, dtype_name(args.dtype),
                                 dtype_name(args.out_dtype) if args.out_dtype else None, args.note,
                                 drop=dict(d.split("=", 1) for d in args.drop))
    except (OSError, ValueError) as e:
        print(f"coda.autotune: {e}", file=sys.stderr)
        return 2
    for p in written:
        import json
        doc = json.loads(p.read_text())
        print(f"wrote {p}: {len(doc['entries'])} entries for {doc['provenance']['gpu']}, cutlass-dsl "
              f"{doc['cutlass_dsl']}, {len(doc['provenance'].get('skipped', []))} rows skipped")
    return 0


def _this_gpu(name):
    """(DeviceInfo or None, label) of the GPU to show."""
    from .keys import DeviceInfo, device_info
    if name:
        return None, name
    try:
        import torch
        if torch.cuda.is_available():
            d = device_info()
            return d, d.tag
    except Exception:
        pass
    return None, "all GPUs (no CUDA device)"


def show(gpu_name=None) -> None:
    """Print the tuning store's and the shipped entries (this GPU's; all without a GPU)."""
    import coda.autotune as at
    from . import ship
    dev, label = _this_gpu(gpu_name)
    rows = []
    for key, e in sorted(at.store.load().items()):
        k = ship.parse_store_key(key)
        if k is None:
            continue
        if (dev is not None and (k["gpu"], int(k["sms"])) != (dev.name, dev.sm_count)) or \
                (dev is None and gpu_name and k["gpu"] != gpu_name):
            continue
        ep = e.get("epilogue") or {}
        rows.append(("store", k["gpu"], f"{k['din']}->{k['dout']}", f"{k['M']}x{k['N']}x{k['K']}"
                     + (f" L{k['L']}" if k["L"] != "1" else ""), ep.get("name", f"#{key.rsplit(' ', 1)[-1][:8]}"),
                     e.get("name", "?"), e.get("ms"), e.get("default")))
    for path, doc in ship.shipped_entries(dev):
        if dev is None and gpu_name and doc["gpu"]["name"] != gpu_name:
            continue
        for e in doc["entries"].values():
            p = e["problem"]
            rows.append((f"shipped:{path.name}", doc["gpu"]["name"], f"{p['in_dtype']}->{p['out_dtype']}",
                         f"{p['M']}x{p['N']}x{p['K']}" + (f" L{p['L']}" if p["L"] != 1 else "")
                         + ("" if (p["a_major"], p["b_major"]) == ("k", "k") else f" {p['a_major']},{p['b_major']}"),
                         e["epilogue"]["name"], e["name"], e.get("ms"), e.get("default")))
    print(f"coda.autotune entries for {label}: store {at.store.path}, shipped {ship.SHIPPED_DIR}")
    print(f"{'source':22s} {'gpu':24s} {'dtypes':20s} {'M x N x K':22s} {'epilogue':18s} {'config':30s} "
          f"{'ms':>9s}  default")
    for src, gpu, dt, shape, epi, cfg, ms, default in rows:
        ms_s = f"{ms:9.4f}" if isinstance(ms, (int, float)) else f"{'-':>9s}"
        print(f"{src:22s} {gpu[:24]:24s} {dt:20s} {shape:22s} {epi[:18]:18s} {cfg:30s} {ms_s}  {default or '-'}")
    if not rows:
        print("(no entries)")


if __name__ == "__main__":
    sys.exit(main())
