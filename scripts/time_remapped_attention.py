"""Time one call of the attention-level kernel (`remapped_attention`) with one layer's shapes.

Random queries/keys/values shaped like a SmolLM2 layer (9 query heads on 3 key heads, head size
64, L0 8192), the method's default parameters for the given scale; prints the best of
`--repeats` calls, its ratio to one causal `scaled_dot_product_attention` call on the same
tensors (what yarn's layer runs), and a checksum of the output, so two versions of the code can be
compared on the same inputs (run it with PYTHONPATH pointing at each checkout, alternately):

    PYTHONPATH=/path/to/old/checkout python scripts/time_remapped_attention.py self-extend
    PYTHONPATH=. python scripts/time_remapped_attention.py self-extend --device cuda --dtype bf16

On CUDA the one-pass two-regime kernel (hf_rope_ext.fused_attention) runs the chunks it covers;
`--both-paths` also times the partial-softmax tiles (HF_ROPE_EXT_TWO_REGIME_KERNEL=0) on the same
inputs and prints the largest difference between the two outputs.

`--count-tiles` times nothing: it counts the fused-kernel calls one call makes with CUDA's query
chunks, and how many of them take a mask (runs anywhere, in seconds).
"""

from __future__ import annotations

import os
import time

import torch

from hf_rope_ext import attention
from hf_rope_ext.arguments import check_device

try:  # each option given once; gpu_attention_speed.sh OTHER runs this against a checkout that may predate it
    from hf_rope_ext.arguments import ArgumentParser
except ImportError:
    from argparse import ArgumentParser

METHODS = ("self-extend", "self-extend-by-parts", "dual-chunk")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def best_time(run, repeats: int, device: torch.device) -> tuple[float, torch.Tensor]:
    best, output = float("inf"), None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        output = run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best, output


def count_tiles(method: str, tokens: int, remap) -> None:
    """Print how many fused-kernel calls one attention call makes on CUDA, how many take a mask, and
    the share of score elements in masked calls (the memory-efficient kernel with a bias)."""
    calls = []
    partial = attention._partial_attention

    def counted(query, key, value, allowed, *args, **kwargs):
        calls.append((allowed is not None, query.shape[2] * key.shape[2]))
        return partial(query, key, value, allowed, *args, **kwargs)

    # this process only: the counting wrapper and CUDA's choices (query chunks, masks per run)
    attention._partial_attention = counted
    attention._refines_masks = lambda device: False
    tiny = torch.zeros(1, 1, tokens, 2)
    positions = torch.arange(tokens)[None]
    with torch.no_grad():
        attention.remapped_attention(
            tiny, tiny, tiny, query_positions=positions, key_positions=positions, allowed=lambda a, b: None,
            remap=remap, inv_freq=torch.ones(1, dtype=torch.float64), scaling=1.0, query_chunk=attention.QUERY_CHUNK_CUDA,
        )
    masked = sum(size for is_masked, size in calls if is_masked)
    total = sum(size for _, size in calls)
    print(f"{method} {tokens} tokens, CUDA query chunks: {len(calls)} kernel calls, "
          f"{sum(is_masked for is_masked, _ in calls)} with a mask, {masked / total:.1%} of the score elements masked")


def main() -> None:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("method", choices=METHODS)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument("--both-paths", action="store_true",
                        help="also time the partial-softmax tiles with the two-regime kernel switched off")
    parser.add_argument("--count-tiles", action="store_true",
                        help="time nothing: count the kernel calls one call makes with CUDA's query chunks (any device)")
    args = parser.parse_args()
    try:
        attention._two_regime_switched_on()  # a bad HF_ROPE_EXT_TWO_REGIME_KERNEL fails here, in one line
    except ValueError as error:
        parser.error(str(error))
    original = 8192
    if args.tokens <= original or args.repeats < 1:
        parser.error(f"--tokens must exceed the original context {original} and --repeats be >= 1")
    try:
        device = torch.device(check_device(args.device) or "cpu")  # cpu, cuda(:N) or mps that this machine has
    except ValueError as error:
        parser.error(str(error))
    params = {"original_max_position_embeddings": original, "factor": args.tokens / original}
    if args.method == "self-extend-by-parts":
        params.update(neighbor_window=original // 4, far_positions="by-parts")
    make = attention.dual_chunk_remap if args.method == "dual-chunk" else attention.self_extend_remap
    remap = make(params)
    if args.count_tiles:
        count_tiles(args.method, args.tokens, remap)
        return
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    query = torch.randn(1, 9, args.tokens, 64).to(device, dtype)
    key, value = (torch.randn(1, 3, args.tokens, 64).to(device, dtype) for _ in range(2))
    positions = torch.arange(args.tokens, device=device)[None]
    inv_freq = 1.0 / 1e5 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    def run():
        return attention.remapped_attention(
            query, key, value, query_positions=positions, key_positions=positions, allowed=lambda a, b: None,
            remap=remap, inv_freq=inv_freq, scaling=0.125,
        )

    with torch.no_grad():
        remapped, output = best_time(run, args.repeats, device)
        plain, _ = best_time(lambda: torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=0.125, enable_gqa=True,
        ), args.repeats, device)
        tiles = tiles_output = None
        if args.both_paths:
            previous = os.environ.get(attention.TWO_REGIME_SWITCH)
            os.environ[attention.TWO_REGIME_SWITCH] = "0"
            try:
                tiles, tiles_output = best_time(run, args.repeats, device)
            finally:
                if previous is None:
                    del os.environ[attention.TWO_REGIME_SWITCH]
                else:
                    os.environ[attention.TWO_REGIME_SWITCH] = previous
    print(f"{args.method} {args.tokens} tokens {args.dtype} on {args.device}: best of {args.repeats} {remapped:.4f} s, "
          f"causal sdpa {plain:.4f} s ({remapped / plain:.2f}x), checksum {float(output.double().abs().sum()):.6f}")
    if tiles is not None:
        difference = float((output.float() - tiles_output.float()).abs().max())
        print(f"  partial-softmax tiles (kernel off): {tiles:.4f} s ({tiles / plain:.2f}x sdpa; default path "
              f"{tiles / remapped:.2f}x faster), checksum {float(tiles_output.double().abs().sum()):.6f}, "
              f"largest difference {difference:.2e}")


if __name__ == "__main__":
    main()
