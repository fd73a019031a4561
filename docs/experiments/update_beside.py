"""The AdamW update of a layer's weights beside its dW GEMMs on a few SMs, instead of in their epilogues?

A llama-1b layer's four dW GEMMs (gate/up, down, qkv, o; K = 8192 tokens) with the update in their epilogues
(``coda.optim.update_config``: what the step runs) against: plain dW GEMMs (default configs) then torch's fused AdamW
over the layer's weights, serial; and plain dW GEMMs capped at S SMs (``GemmConfig.sms``) while torch's fused AdamW
updates the previous layer's weights on a second stream, whose CTAs can only run on the SMs the GEMMs leave free
(a GEMM CTA holds an SM's registers and shared memory). Medians (do_bench), ms a layer.
Usage on the GPU: python docs/experiments/update_beside.py"""
import torch
from triton.testing import do_bench

import coda
from coda.config import GemmConfig
from coda.epilogues.adamw import HYPER, adamw
from coda.optim import update_config

T, H, I, KV = 8192, 2048, 8192, 512
bf = dict(device="cuda", dtype=torch.bfloat16)
h = torch.tensor([0.9, 0.1, 0.95, 0.05, 1.2, 1e-8, 1e-4, 1.0], device="cuda").unsqueeze(1).repeat(1, 4)
hyper = {n: h[i, :1] for i, n in enumerate(HYPER)}
SMS = torch.cuda.get_device_properties(0).multi_processor_count
SHAPES = {"gate_up": (2 * I, H), "down": (H, I), "qkv": (H + 2 * KV, H), "o": (H, H)}


class Weight:
    def __init__(self, N, K):
        self.dy, self.x = torch.randn(T, N, **bf), torch.randn(T, K, **bf)
        self.p, self.g = torch.randn(N, K, **bf), torch.empty(N, K, **bf)
        self.m, self.v = torch.zeros(N, K, **bf), torch.zeros(N, K, **bf)
        self.step = torch.zeros((), device="cuda")
        self.cfg = update_config(False, (N, K))

    def fused(self):
        coda.gemm(self.dy.t(), self.x.t(), epilogue=adamw, out=self.p, p=self.p, m=self.m, v=self.v,
                  config=self.cfg, **hyper)

    def plain(self, cfg=None):
        coda.gemm(self.dy.t(), self.x.t(), out=self.g, config=cfg)


def torch_step(ws):
    torch._fused_adamw_([w.p for w in ws], [w.g for w in ws], [w.m for w in ws], [w.v for w in ws], [],
                        [w.step for w in ws], lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.0, eps=1e-8,
                        amsgrad=False, maximize=False)


layer = [Weight(*s) for s in SHAPES.values()]
prev = [Weight(*s) for s in SHAPES.values()]
side = torch.cuda.Stream()


def ms(fn):
    fn()
    return sorted(do_bench(fn, rep=200) for _ in range(3))[1]


t_fused = ms(lambda: [w.fused() for w in layer])
t_plain = ms(lambda: [w.plain() for w in layer])
t_upd = ms(lambda: torch_step(prev))
print(f"{torch.cuda.get_device_name()} ({SMS} SMs), ms a layer: dW + update in the epilogues {t_fused:.3f}; "
      f"plain dW {t_plain:.3f} + torch AdamW {t_upd:.3f} = {t_plain + t_upd:.3f}", flush=True)
for s in (SMS, 128, 124, 120, 116, 112):
    cfg = GemmConfig(sms=s)  # the heuristic's 128 x 256 cluster 2 x 1 tiles on s SMs

    def beside():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch_step(prev)
        for w in layer:
            w.plain(cfg)
        torch.cuda.current_stream().wait_stream(side)
    tc = ms(lambda: [w.plain(cfg) for w in layer])
    tb = ms(beside)
    print(f"plain dW on {s} SMs {tc:.3f}; with the previous layer's update beside it {tb:.3f} "
          f"({t_fused - tb:+.3f} vs in the epilogues)", flush=True)
