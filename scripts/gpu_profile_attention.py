"""Where one 64k attention call of the default's regime (Self-Extend by-parts, W=2048, bf16, SmolLM2's
layer shapes) spends its time on CUDA: wall time per call with the key tables kept (as across the
layers of a forward), then torch.profiler's tables by GPU and by host time (README "On a GPU, the
one-pass kernel").

    python scripts/gpu_profile_attention.py
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hf_rope_ext import attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args()
    if not torch.cuda.is_available():  # before any work, in one line
        parser.exit(2, "error: no CUDA GPU visible; this script profiles a CUDA attention call (README \"On a GPU\")\n")

    T = 65536
    params = {"original_max_position_embeddings": 8192, "factor": 8, "neighbor_window": 2048, "far_positions": "by-parts"}
    remap = attention.self_extend_remap(params)
    torch.manual_seed(0)
    q = torch.randn(1, 9, T, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 3, T, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    pos = torch.arange(T, device="cuda")[None]
    inv = 1.0 / 1e5 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    tables = attention.KeyRotationTables()
    def call():
        return attention.remapped_attention(q, k, v, query_positions=pos, key_positions=pos, allowed=lambda a, b: None,
                                            remap=remap, inv_freq=inv, scaling=0.125, key_rotations=tables)
    with torch.no_grad():
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        print(f"wall per call (tables cached): {(time.perf_counter() - t) / 5 * 1000:.2f} ms")
        # host time alone: how long the host takes to issue one call
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
