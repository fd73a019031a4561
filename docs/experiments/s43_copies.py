"""Session 43: which ops launch the copy kernels of a compiled fused step (the bf16 direct_copy and DtoD memcpy that
fused + compile runs and fused eager does not: ~1.4 ms a llama-1b step on the H200, call 1).
Builds coda.bench.step's model at llama-1b widths with --layers layers, coda.fuse, torch.compile, coda.optim.AdamW;
runs 3 steps, profiles one and prints, per copy-like kernel, its total time and the CPU op chain that launched it."""
import argparse
import collections

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args()
    import coda
    import coda.optim
    from coda.bench.step import PRESETS, build_model, make_batches
    cfg = dict(PRESETS[args.preset], layers=args.layers)
    torch.manual_seed(0)
    with torch.device(args.device):
        model, _ = build_model(cfg, args.seq)
    model = model.to(torch.bfloat16)
    coda.fuse(model)
    opt = coda.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=args.device == "cuda")
    f = model if args.eager else torch.compile(model)
    batches = [b.to(args.device) for b in make_batches(cfg["vocab"], 2, args.seq, 2, 1)]

    def step(i):
        loss = f(batches[i % 2], labels=batches[i % 2])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(3):
        step(i)
    if args.device == "cuda":
        torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step(3)
        if args.device == "cuda":
            torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        for k in ev.kernels:
            name = k.name
            if not any(s in name for s in ("copy", "Memcpy", "clone", "cat", "Cat")):
                continue
            chain, p = [], ev
            while p is not None and len(chain) < 8:
                shapes = getattr(p, "input_shapes", None)
                chain.append(f"{p.name}{shapes if p is ev and shapes else ''}")
                p = p.cpu_parent
            key = (name[:90], " <- ".join(chain))
            agg[key][0] += k.duration / 1000.0
            agg[key][1] += 1
    for (name, chain), (ms, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:8]:
        print(f"{ms:8.3f} ms x{n:3d}  {name}\n           {chain}")


if __name__ == "__main__":
    main()
