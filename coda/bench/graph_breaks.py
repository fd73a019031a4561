"""Dynamo graph breaks of the coda.fuse'd example model on this device (tiny config):
``python -m coda.bench.graph_breaks`` (add TORCH_LOGS=graph_breaks for the reasons). Found the 2 breaks per layer
that an import inside FusedAttention.forward caused under torch 2.11 (fixed: 0 breaks)."""
import os, sys
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from llama_model import LlamaConfig, LlamaForCausalLM
import coda
cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
m = coda.fuse(LlamaForCausalLM(cfg).to("cuda", torch.bfloat16))
ids = torch.randint(0, 256, (2, 64), device="cuda")
e = torch._dynamo.explain(m)(ids, labels=ids)
print("graphs", e.graph_count, "breaks", e.graph_break_count)
for b in e.break_reasons[:6]:
    print("BREAK", str(b.reason)[:600].replace("\n", " | "))
    for fr in (b.user_stack or [])[-3:]:
        print("   at", fr.filename, fr.lineno, fr.line)
