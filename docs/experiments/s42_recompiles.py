"""Session 42: does a compiled fused Llama recompile from step to step? (CPU reference path or GPU.)
Trains a fused Llama (coda.fuse) compiled with coda.optim.AdamW for --steps steps and prints each step's wall time and
dynamo's counters (frames compiled, recompiles, graph breaks); with --attention fused the attention block's fused GEMMs
stay under compile (FusedAttention.inductor_under_compile = False, i.e. CODA_INDUCTOR_UNDER_COMPILE=none)."""
import argparse
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--attention", choices=["inductor", "fused"], default="fused")
    ap.add_argument("--stock", action="store_true", help="the stock model and torch's AdamW (no coda.fuse)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--inter", type=int, default=0, help="intermediate size (default 2 x hidden)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cprofile", action="store_true", help="cProfile the first step: the top functions")
    ap.add_argument("--log-compiles", action="store_true", help="print every kernel load / compile with its time")
    ap.add_argument("--stacks-after", type=float, default=0, help="dump every thread's stack after this many s")
    ap.add_argument("--silent-side-effects", action="store_true",
                    help="torch._dynamo.config.side_effect_replay_policy = 'silent' (no user stack a mutation)")
    args = ap.parse_args()
    if args.silent_side_effects:
        torch._dynamo.config.side_effect_replay_policy = "silent"
    if args.stacks_after:
        import faulthandler
        faulthandler.dump_traceback_later(args.stacks_after, repeat=True)
    import coda
    import coda.nn_attention
    import coda.optim
    from transformers import LlamaConfig, LlamaForCausalLM
    if args.log_compiles:
        import coda.runtime.compile_cache as cc
        inner, t_run = cc.cached, time.perf_counter()

        def cached(key, build):
            t = time.perf_counter()
            fn, how = inner(key, build)
            print(f"  [{time.perf_counter() - t_run:7.1f} s] {how} {time.perf_counter() - t:6.2f} s "
                  f"{str(key)[-90:]}", flush=True)
            return fn, how
        cc.cached = cached
    coda.nn_attention.FusedAttention.inductor_under_compile = args.attention == "inductor"
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=args.inter or 2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads,
                      max_position_embeddings=4 * args.seq)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dev, getattr(torch, args.dtype))
    if args.stock:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        coda.fuse(model)
        opt = coda.optim.AdamW(model.parameters(), lr=1e-3)
    f = torch.compile(model)
    from torch._dynamo.utils import counters
    for s in range(args.steps):
        ids = torch.randint(0, 512, (2, args.seq), device=dev)
        t = time.perf_counter()
        prof = None
        if args.cprofile and s == 0:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        loss = f(ids, labels=ids).loss
        loss.backward()
        if prof is not None:
            prof.disable()
            import pstats
            st = pstats.Stats(prof)
            st.sort_stats("cumulative").print_stats(45)
            st.sort_stats("tottime").print_stats(25)
            st.print_callers("prefixed_lines|indent|_torchscript_schema_to_signature_impl")  # who formats text
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev == "cuda":
            torch.cuda.synchronize()
        st = counters["stats"]
        print(f"step {s}: {time.perf_counter() - t:7.2f} s loss {loss.item():.4f} frames {st['unique_graphs']} "
              f"calls {st['calls_captured']} recompiles {dict(counters['recompiles'])} "
              f"breaks {sum(counters['graph_break'].values())}", flush=True)


if __name__ == "__main__":
    main()
