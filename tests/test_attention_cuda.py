"""Attention-level methods on a CUDA GPU: the fused kernels against a float64 softmax, and the
patched model against the papers' position maps (skipped without a GPU)."""

from __future__ import annotations

import math

import pytest
import torch

from hf_rope_ext import patch_model, unpatch_model
from hf_rope_ext import attention as attention_level

from conftest import make_model, random_ids
from test_attention import LENGTH, PAPER_CASES, _generation_matches_full_forward, reference_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def softmax_reference(query, key, value, allowed, scaling):
    """Output and log-sum-exp of masked softmax attention, in float64 on the host."""
    q, k, v = (x.double().cpu() for x in (query, key, value))
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = q @ k.transpose(-1, -2) * scaling
    if allowed is not None:
        scores = scores.masked_fill(~allowed.cpu(), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    return weights @ v, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile", ["all", "masked", "causal"])
def test_fused_cuda_kernels_match_a_float64_softmax(dtype, tile):
    # 9 query heads on 3 key heads (SmolLM2's grouping), rows and keys not multiples of 16 or 32
    generator = torch.Generator().manual_seed(0)
    keys = 70 if tile == "causal" else 100  # a causal tile is square
    query = torch.randn(1, 9, 70, 64, generator=generator)
    key, value = torch.randn(1, 3, keys, 64, generator=generator), torch.randn(1, 3, keys, 64, generator=generator)
    allowed = None
    if tile == "masked":
        allowed = torch.rand(1, 1, 70, keys, generator=generator) < 0.6
        allowed[:, :, 5] = False  # a row with no key at all
    triangle = torch.ones(70, 70, dtype=torch.bool).tril()[None, None]
    expected_output, expected_lse = softmax_reference(query, key, value, triangle if tile == "causal" else allowed, 0.125)
    cuda = [x.to("cuda", dtype) for x in (query, key, value)]
    with torch.no_grad():
        output, lse = attention_level._partial_attention(
            *cuda, None if allowed is None else allowed.cuda(), 0.125, causal=tile == "causal"
        )
    assert not attention_level._FUSED_CUDA_FAILED, "a fused CUDA kernel refused the call"
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(output.double().cpu(), expected_output, atol=tolerance, rtol=tolerance)
    finite = torch.isfinite(expected_lse)
    torch.testing.assert_close(lse.double().cpu()[finite], expected_lse[finite], atol=tolerance, rtol=tolerance)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)  # the empty row drops out of the merge


@pytest.mark.parametrize("case", list(PAPER_CASES))
def test_patched_model_on_cuda_matches_naive_reference(case):
    ids = random_ids(LENGTH)
    params, position_fn = PAPER_CASES[case]
    # the float64 reference runs on the host, on the same weights
    expected = reference_logits(make_model("llama", attn_implementation="sdpa"), ids, position_fn)
    model = make_model("llama", attn_implementation="sdpa").cuda()
    patch_model(model, scale=4, method=case.split()[0], **params)
    try:
        with torch.no_grad():
            actual = model(ids.cuda()).logits
    finally:
        unpatch_model(model)
    assert not attention_level._FUSED_CUDA_FAILED, "a fused CUDA kernel refused the call"
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["self-extend", "dual-chunk", "dynamic-yarn-dca", "self-extend-dca", "self-extend-yarn"])
def test_generation_with_cache_equals_full_forward_on_cuda(method):
    model = make_model("llama", attn_implementation="sdpa").cuda()
    params = {"self-extend": {"neighbor_window": 8}, "self-extend-yarn": {}}.get(method, {"chunk_size": 20, "local_window": 4})
    patch_model(model, scale=4, method=method, **params)
    _generation_matches_full_forward(model, random_ids(20).cuda())
    assert not attention_level._FUSED_CUDA_FAILED, "a fused CUDA kernel refused the call"


def test_left_padded_generation_on_cuda():
    """A padding mask makes every key block undecided by positions: the per-run masks on CUDA."""
    model = make_model("llama", attn_implementation="sdpa").cuda()
    patch_model(model, scale=4, method="self-extend", neighbor_window=8, far_positions="by-parts")
    ids = random_ids(20, batch=2).cuda()
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = 0, 0
    _generation_matches_full_forward(model, ids, attention_mask=mask)
    assert not attention_level._FUSED_CUDA_FAILED, "a fused CUDA kernel refused the call"


def test_self_extend_dca_below_its_settle_length_matches_reference_on_cuda():
    """Between L0 and 2 x L0 the default is Self-Extend by-parts (window L0 / 4) on the trained frequencies."""
    from test_attention import L0, self_extend_by_parts_positions

    ids = random_ids(2 * L0)
    host = make_model("llama", attn_implementation="sdpa")
    head_dim = host.model.layers[0].self_attn.head_dim
    theta = 1.0 / host.config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    expected = reference_logits(host, ids, lambda i, j: self_extend_by_parts_positions(i, j, None, L0 // 4, theta))
    model = make_model("llama", attn_implementation="sdpa").cuda()
    patch_model(model, scale=4, method="self-extend-dca")
    with torch.no_grad():
        actual = model(ids.cuda()).logits
    assert not attention_level._FUSED_CUDA_FAILED, "a fused CUDA kernel refused the call"
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["self-extend", "dual-chunk"])
def test_sliding_window_of_flash_attention_models_on_cuda_matches_reference(case):
    """The window as flash attention passes it (an argument, no mask) narrows every band: on CUDA
    the mask-free tiles, against the float64 reference with transformers' window on the host."""
    from test_attention import SLIDING_WINDOW, _as_flash_attention

    ids = random_ids(LENGTH)
    params, position_fn = PAPER_CASES[case]
    host = make_model("mistral", attn_implementation="sdpa", sliding_window=SLIDING_WINDOW)
    expected = reference_logits(host, ids, position_fn, window=True)
    model = _as_flash_attention(make_model("mistral", attn_implementation="sdpa", sliding_window=SLIDING_WINDOW).cuda())
    patch_model(model, scale=4, method=case, **params)
    with torch.no_grad():
        actual = model(ids.cuda()).logits  # every call beyond L0: the flash kernel itself is not needed
    assert not attention_level._FUSED_CUDA_FAILED, "a fused CUDA kernel refused the call"
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-4, rtol=1e-4)
