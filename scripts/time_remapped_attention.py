"""Time one call of the attention-level kernel (`remapped_attention`) with one layer's shapes.

Random queries/keys/values shaped like a SmolLM2 layer (9 query heads on 3 key heads, head size
64, L0 8192), the method's default parameters for the given scale; prints the best of
`--repeats` calls and a checksum of the output, so two versions of the code can be compared on
the same inputs (run it with PYTHONPATH pointing at each checkout, alternately):

    PYTHONPATH=/path/to/old/checkout python scripts/time_remapped_attention.py self-extend
    PYTHONPATH=. python scripts/time_remapped_attention.py self-extend
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_rope_ext import attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("method", choices=("self-extend", "dual-chunk"))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    original = 8192
    if args.tokens <= original or args.repeats < 1:
        parser.error(f"--tokens must exceed the original context {original} and --repeats be >= 1")
    params = {"original_max_position_embeddings": original, "factor": args.tokens / original}
    remap = (attention.self_extend_remap if args.method == "self-extend" else attention.dual_chunk_remap)(params)
    torch.manual_seed(0)
    query = torch.randn(1, 9, args.tokens, 64)
    key, value = torch.randn(1, 3, args.tokens, 64), torch.randn(1, 3, args.tokens, 64)
    positions = torch.arange(args.tokens)[None]
    inv_freq = 1.0 / 1e5 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    best = float("inf")
    with torch.no_grad():
        for _ in range(args.repeats):
            start = time.perf_counter()
            output = attention.remapped_attention(
                query, key, value, query_positions=positions, key_positions=positions, allowed=lambda a, b: None,
                remap=remap, inv_freq=inv_freq, scaling=0.125,
            )
            best = min(best, time.perf_counter() - start)
    print(f"{args.method} {args.tokens} tokens: best of {args.repeats} {best:.2f} s, "
          f"checksum {float(output.double().abs().sum()):.6f}")


if __name__ == "__main__":
    main()
