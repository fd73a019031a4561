"""``python -m coda.bench.attention [--model llama-1b] [--batch 2] [--seq 4096]``: the step's attention (causal SDPA,
forward + backward, bf16) on each SDPA backend, with grouped-query heads passed as ``enable_gqa`` or repeated
before the call, q / k / v as FusedAttention hands them (strided views of one packed projection) or contiguous.
Each: the median over ``--rounds`` interleaved rounds of a do_bench median, ms, on one GPU; a backend that refuses
the inputs prints its error. Also checks each backend's output and gradients against the math backend in float32."""
from __future__ import annotations

import statistics


def main(argv=None) -> int:
    from .step import shape_parser
    ap = shape_parser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .gemm import median_of_runs
    from . import step_report as SR
    from .step import PRESETS

    cfg = PRESETS[args.model]
    B, T, nh, nkv = args.batch, args.seq, cfg["heads"], cfg["kv_heads"]
    d = SR.head_dim(cfg)
    torch.manual_seed(0)
    packed = torch.randn(B, T, (nh + 2 * nkv) * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(B, nh, T, d, device="cuda", dtype=torch.bfloat16)

    def heads(t):  # q, k, v of a packed projection as FusedAttention hands them to SDPA: strided (B, H, T, d)
        q, k, v = torch.split(t, [nh * d, nkv * d, nkv * d], dim=-1)
        return tuple(x.reshape(B, T, -1, d).transpose(1, 2) for x in (q, k, v))

    def qkv(layout):
        q, k, v = heads(packed)
        return (q, k, v) if layout == "views" else tuple(t.contiguous() for t in (q, k, v))

    def run(backend, gqa, layout):
        q, k, v = qkv(layout)
        if gqa == "repeat":
            k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa == "enable_gqa")
        return o

    def fwd_bwd(backend, gqa, layout):
        def f():
            packed.grad = None
            run(backend, gqa, layout).backward(dy)
        return f

    # correctness against the math backend in float32
    ref_in = packed.detach().float().requires_grad_(True)

    def ref():
        q, k, v = heads(ref_in)
        k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))
        with sdpa_kernel([SDPBackend.MATH]):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(dy.float())
        return o.detach(), ref_in.grad.detach()

    o_ref, g_ref = ref()
    variants = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for gqa in ("enable_gqa", "repeat"):
            for layout in ("views", "contiguous"):
                name = f"{backend.name.lower()} {gqa} {layout}"
                try:
                    packed.grad = None
                    o = run(backend, gqa, layout)
                    o.backward(dy)
                    torch.cuda.synchronize()
                    eo = (o.float() - o_ref).abs().max().item()
                    eg = (packed.grad.float() - g_ref).abs().max().item()
                    print(f"{name}: max |err| vs fp32 math: out {eo:.3e}, grad {eg:.3e}", flush=True)
                    variants[name] = fwd_bwd(backend, gqa, layout)
                except Exception as e:  # a backend refusing these inputs is a result here
                    print(f"{name}: refused ({type(e).__name__}: {str(e).splitlines()[0][:160]})", flush=True)
    times = {n: [] for n in variants}
    for _ in range(args.rounds):
        for n, f in variants.items():
            times[n].append(median_of_runs(f))
    flops = 3.5 * 4 * B * nh * T * T * d / 2  # fwd 2 GEMMs (x2 FLOPs), bwd 2.5x fwd, causal half
    print(f"\nattention fwd+bwd, B={B} T={T} heads={nh}/{nkv} d={d} ({torch.cuda.get_device_name()}):")
    for n, t in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
        ms = statistics.median(t)
        print(f"  {n:42s} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  x {cfg['layers']} layers "
              f"= {ms * cfg['layers']:6.2f} ms a step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
