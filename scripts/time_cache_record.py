"""Time the KV-cache record of static patches (the hooks that refuse a cache another patch filled):
the microseconds both hooks add to one decode forward, 10,000 calls with a DynamicCache of 300
tokens passed as generate passes it, best of 5.

    python scripts/time_cache_record.py
"""

import argparse
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_rope_ext import patch_model
from hf_rope_ext.rotary import ExtendedRotaryEmbedding


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # takes no options
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval(); patch_model(model, 4, method="yarn")
    record = next(m for m in model.modules() if isinstance(m, ExtendedRotaryEmbedding)).cache_guard
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        out = model.model(torch.randint(0, 512, (1, 300)), past_key_values=cache)
    kwargs = {"input_ids": torch.zeros(1, 1, dtype=torch.long), "past_key_values": cache, "use_cache": True}
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(10000):
            record._before_forward(model.model, (), kwargs)
            record._after_forward(model.model, (), kwargs, out)
        best = min(best, (time.perf_counter() - start) / 10000 * 1e6)
    print(f"{best:.1f} us per decode forward")


if __name__ == "__main__":
    main()
