"""Precision of cos/sin at long positions, against a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ORIGINAL_CONTEXT, make_model, random_ids
from transformers import DynamicCache

from hf_rope_ext import DEFAULT_METHOD, patch_model
from hf_rope_ext.rotary import ANGLE_BLOCK, rope_angles, rope_angles_float32

HEAD_DIM, BASE, SCALE = 64, 10000.0, 4.0
POSITIONS = torch.arange(0, 131072)[None]
BF16_ROUNDING = 2.0**-9  # largest rounding error of bfloat16 for values in [-1, 1] (half of 2^-8)
ANGLE_BUDGET = 2e-4  # allowed angle error of the float32-only path, radians


def reference_inv_freq(method: str) -> torch.Tensor:
    exponents = torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM
    if method == "linear":
        return BASE ** (-exponents) / SCALE
    if method == "ntk":
        return (BASE * SCALE ** (HEAD_DIM / (HEAD_DIM - 2))) ** (-exponents)
    raise ValueError(method)


def reference_cos_sin(method: str) -> tuple[torch.Tensor, torch.Tensor]:
    angles = POSITIONS[..., None].double() * reference_inv_freq(method)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


@pytest.fixture(scope="module")
def model():
    return make_model("llama", hidden_size=2 * HEAD_DIM, num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM)


@pytest.mark.parametrize("method", ["linear", "ntk"])
def test_bf16_model_cos_sin_within_rounding_up_to_131072(model, method):
    patch_model(model, scale=SCALE, method=method)
    model.to(torch.bfloat16)
    try:
        rotary = model.model.rotary_emb
        assert rotary.inv_freq.dtype == torch.float32  # the cast did not reach the frequencies
        cos, sin = rotary(torch.zeros(1, dtype=torch.bfloat16), POSITIONS)
    finally:
        model.to(torch.float32)
    assert cos.dtype == torch.bfloat16
    cos_ref, sin_ref = reference_cos_sin(method)
    bound = BF16_ROUNDING + 1e-6  # bfloat16 rounding of an angle exact to float32
    assert (cos.double() - cos_ref).abs().max().item() <= bound
    assert (sin.double() - sin_ref).abs().max().item() <= bound

    # The bound is tight enough to catch plain float32 angles (transformers' m.float() * inv_freq).
    naive = POSITIONS[..., None].float() * reference_inv_freq(method).float()
    naive_cos = torch.cat((naive, naive), dim=-1).cos().to(torch.bfloat16)
    assert (naive_cos.double() - cos_ref).abs().max().item() > bound


@pytest.mark.parametrize("float64_device", [True, False], ids=["float64", "float32-only device"])
def test_angles_match_float64_for_any_frequencies(float64_device):
    generator = torch.Generator().manual_seed(0)
    inv_freq = torch.rand(48, generator=generator, dtype=torch.float64) * 1.5  # up to 1.5 rad per token
    positions = torch.cat([torch.arange(0, 3000), torch.randint(0, 131072, (3000,), generator=generator)])[None]
    if float64_device:
        angles = rope_angles(positions, inv_freq)
        budget = 1e-6  # one float32 rounding of a value below 2 pi
    else:  # the path for devices without float64 (Apple MPS)
        phase = torch.remainder(inv_freq * ANGLE_BLOCK, 2 * math.pi).float()
        angles = rope_angles_float32(positions, inv_freq.float(), phase)
        budget = ANGLE_BUDGET
    assert angles.dtype == torch.float32
    exact = positions[..., None].double() * inv_freq
    # Compare on the circle: the angles may differ by whole turns.
    error = torch.remainder(angles.double() - exact + math.pi, 2 * math.pi) - math.pi
    assert error.abs().max().item() < budget
    naive = positions[..., None].float() * inv_freq.float()  # transformers' float32 product
    naive_error = torch.remainder(naive.double() - exact + math.pi, 2 * math.pi) - math.pi
    assert naive_error.abs().max().item() > budget


def test_fp16_model_keeps_float32_frequencies(model):
    patch_model(model, scale=SCALE, method="yarn")
    model.to(torch.float16)
    try:
        rotary = model.model.rotary_emb
        assert rotary.inv_freq.dtype == torch.float32
        assert rotary.inv_freq_exact.dtype == torch.float64
        cos, _ = rotary(torch.zeros(1, dtype=torch.float16), torch.tensor([[0, 100_000]]))
        assert cos.dtype == torch.float16
    finally:
        model.to(torch.float32)


@pytest.mark.parametrize("method", ["linear", "ntk"])
def test_static_angles_survive_fsdp_buffer_mixed_precision(method):
    """FSDP1's MixedPrecision(buffer_dtype=bf16) casts every buffer in place, without the module's
    `_apply` (torch.distributed.fsdp._runtime_utils._cast_buffers_to_dtype_and_device): the
    rotations must still be those of the float64 frequencies, past ANGLE_BLOCK too."""
    model = make_model("llama", hidden_size=2 * HEAD_DIM, num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM)
    patch_model(model, scale=SCALE, method=method)
    for buffer in model.buffers():
        buffer.data = buffer.to(dtype=torch.bfloat16)
    positions = torch.arange(0, 3 * ANGLE_BLOCK)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1), positions)
    angles = positions[..., None].double() * reference_inv_freq(method)
    emb = torch.cat((angles, angles), dim=-1)
    bound = 1e-6  # float32 rounding of the reduced angle and of cos/sin
    assert (cos.double() - emb.cos()).abs().max().item() <= bound
    assert (sin.double() - emb.sin()).abs().max().item() <= bound


def _cached_decode_and_full_forward(model, ids: torch.Tensor, prefill: int) -> tuple[torch.Tensor, torch.Tensor]:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        steps = [model(ids[:, :prefill], past_key_values=cache).logits]
        for position in range(prefill, ids.shape[1]):
            steps.append(model(ids[:, position : position + 1], past_key_values=cache).logits)
        full = model(ids).logits
    return torch.cat(steps, dim=1), full


@pytest.mark.parametrize("method", [DEFAULT_METHOD, "self-extend", "dual-chunk"])
@pytest.mark.parametrize("cast_first", [True, False], ids=["half-patch-float", "patch-bfloat16-float"])
def test_cached_decoding_equals_full_forward_after_a_half_precision_round_trip(method, cast_first):
    """A round trip through fp16/bf16 leaves the original module float32 but rounded: it must not
    rotate the keys cached inside the native context while the patch rotates beyond it."""
    model = make_model("llama")
    if cast_first:
        model.half()
    patch_model(model, scale=4, method=method)
    if cast_first:
        model.float()
    else:
        model.bfloat16().float()
    ids = random_ids(2 * ORIGINAL_CONTEXT - 4)
    decoded, full = _cached_decode_and_full_forward(model, ids, prefill=ORIGINAL_CONTEXT - 12)
    torch.testing.assert_close(decoded, full, rtol=0, atol=1e-5)  # float32 noise; 7e-4 with rounded keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("method", [DEFAULT_METHOD, "dynamic-yarn", "dual-chunk"])
@pytest.mark.parametrize("cast_first", [True, False], ids=["cast-patch", "patch-cast"])
def test_inside_native_context_is_the_unpatched_model_bitwise_after_a_cast(dtype, method, cast_first):
    plain = make_model("llama").to(dtype)
    patched = make_model("llama")
    if cast_first:
        patched.to(dtype)
    patch_model(patched, scale=4, method=method)
    patched.to(dtype)
    ids = random_ids(ORIGINAL_CONTEXT - 2)
    with torch.no_grad():
        assert torch.equal(patched(ids).logits, plain(ids).logits)
