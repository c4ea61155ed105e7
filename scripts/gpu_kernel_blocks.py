"""Block sizes of the two-regime kernel (hf_rope_ext.fused_attention), swept on CUDA (README "On a GPU,
the one-pass kernel"): the queries beyond 8k of a 16k and a 64k input in one launch, bf16, SmolLM2's
layer shapes, W=2048, each (BLOCK_M, BLOCK_N, num_warps, num_stages) timed with triton.testing.do_bench,
against one causal sdpa call over all rows (compared per query-key pair).

    python scripts/gpu_kernel_blocks.py
"""

import argparse

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args()
    if not torch.cuda.is_available():  # before any work, in one line
        parser.exit(2, "error: no CUDA GPU visible; this script times CUDA kernels (README \"On a GPU\")\n")
    import triton

    from hf_rope_ext.fused_attention import two_regime_attention

    torch.manual_seed(0)
    for T in (16384, 65536):
        F = 8192; rows = T - F
        qn, qf = (torch.randn(1, 9, rows, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        kn, kf, v = (torch.randn(1, 3, T, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qfull = torch.randn(1, 9, T, 64, device="cuda", dtype=torch.bfloat16)
        sdpa = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(qfull, kn, v, is_causal=True, enable_gqa=True))
        # the causal sdpa over all T rows does more work than the rows >= F: scale by the pairs
        pairs_all, pairs_rows = T * (T + 1) / 2, sum(range(F + 1, T + 1))
        ref = None
        for cfg in [None, (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 4), (128, 32, 4, 3),
                    (64, 64, 4, 3), (64, 128, 4, 3), (128, 128, 4, 3), (256, 64, 8, 3), (128, 64, 8, 4)]:
            try:
                f = lambda: two_regime_attention(qn, qf, kn, kf, v, first_distance=F, window=2048, scaling=0.125, block_sizes=cfg)
                out = f()
                if ref is None: ref = out
                ms = triton.testing.do_bench(f)
                print(f"T={T} cfg={cfg}: {ms:.2f} ms; sdpa (all rows) {sdpa:.2f} ms, per pair {ms / pairs_rows / (sdpa / pairs_all):.2f}x; diff {(out.float()-ref.float()).abs().max().item():.1e}", flush=True)
            except Exception as e:
                print(f"T={T} cfg={cfg}: failed {type(e).__name__}: {str(e)[:100]}", flush=True)


if __name__ == "__main__":
    main()
