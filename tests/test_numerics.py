"""Precision of cos/sin at long positions, against a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_model

from hf_rope_ext import patch_model
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
