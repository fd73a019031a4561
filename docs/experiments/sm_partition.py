"""Two few-tile dW + AdamW GEMMs side by side, each on its share of the SMs (``GemmConfig.sms``).

The O-projection's dW (2048 x 2048, 128 tiles of 128 x 256: one wave, its update's traffic exposed at the end) and
the QKV dW (3072 x 2048, 192 tiles: 1.45 waves) of a llama-1b layer (K = 8192 tokens) each leave SMs idle. Launched
on two streams with persistent grids that split the 132 SMs, they run as one better-filled launch would. For each
config and split: the median (do_bench) of both serial under ``coda.optim.update_config`` (what the step runs) and
side by side. Usage on the GPU: python docs/experiments/sm_partition.py"""
import torch
from triton.testing import do_bench

import coda
from coda.config import GemmConfig
from coda.epilogues.adamw import HYPER, adamw
from coda.optim import update_config

T, H, KV = 8192, 2048, 512
bf = dict(device="cuda", dtype=torch.bfloat16)
h = torch.tensor([0.9, 0.1, 0.95, 0.05, 1.2, 1e-8, 1e-4, 1.0], device="cuda").unsqueeze(1).repeat(1, 4)
hyper = {n: h[i, :1] for i, n in enumerate(HYPER)}
SMS = torch.cuda.get_device_properties(0).multi_processor_count


def dw(N, K):
    dy, x = torch.randn(T, N, **bf), torch.randn(T, K, **bf)
    p, m, v = torch.randn(N, K, **bf), torch.zeros(N, K, **bf), torch.zeros(N, K, **bf)
    return lambda cfg: coda.gemm(dy.t(), x.t(), epilogue=adamw, out=p, p=p, m=m, v=v, config=cfg, **hyper)


o, qkv = dw(H, H), dw(H + 2 * KV, H)
side = torch.cuda.Stream()


def pair(co, cq):
    def run():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            o(co)
        qkv(cq)
        torch.cuda.current_stream().wait_stream(side)
    return run


def ms(fn):
    fn()
    return sorted(do_bench(fn, rep=200) for _ in range(3))[1]


base_o, base_q = update_config(False, (H, H)), update_config(False, (H + 2 * KV, H))
t_o, t_q = ms(lambda: o(base_o)), ms(lambda: qkv(base_q))
t_serial = ms(lambda: (o(base_o), qkv(base_q)))
print(f"{torch.cuda.get_device_name()} ({SMS} SMs), ms: o dW + update {t_o:.3f}, qkv {t_q:.3f}, serial {t_serial:.3f}"
      f" (update_config: {base_o.name} / {base_q.name})", flush=True)
KINDS = {"128x128 c2 dyn": dict(tile_m=128, tile_n=128, cluster_m=2, sched="dynamic", epi_n=32),
         "128x256 c2 ewg": dict(tile_m=128, tile_n=256, cluster_m=2, epi_wg=True),
         "128x128 c2 ewg": dict(tile_m=128, tile_n=128, cluster_m=2, epi_wg=True)}
for kind, kw in KINDS.items():
    for so in (44, 52, 56, 60, 64, 72):
        co, cq = GemmConfig(sms=so, **kw), GemmConfig(sms=SMS - so, **kw)
        a, b = ms(lambda: o(co)), ms(lambda: qkv(cq))
        t = ms(pair(co, cq))
        print(f"{kind} o on {so} SMs {a:.3f}, qkv on {SMS - so} {b:.3f}, side by side {t:.3f} "
              f"({t_serial - t:+.3f} vs serial)", flush=True)
