"""patch_model / unpatch_model on tiny random models of each family."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import threading

import pytest
import torch
from conftest import (
    ORIGINAL_CONTEXT,
    TINY_SHAPE,
    make_model,
    native_twin,
    on_a_thread,
    paused_on_a_thread,
    random_ids,
    strengthen_weights,
    thread_paused_at,
)
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LogitsProcessor, LogitsProcessorList

import hf_rope_ext
from hf_rope_ext import get_patch_info, patch_model, patched, unpatch_model
from hf_rope_ext.methods import default_inv_freq

L0 = ORIGINAL_CONTEXT
LONG_FACTOR = [1.0 + 0.5 * i for i in range(8)]  # head_dim 16 -> 8 frequencies

# (method, patch kwargs, transformers' own rope_parameters, max_position_embeddings of the twin)
NATIVE = [
    ("linear", {}, {"rope_type": "linear", "factor": 4.0}, 4 * L0),
    ("ntk", {}, {"rope_type": "default"}, 4 * L0),  # rope_theta filled in per model below
    ("dynamic", {"steps_per_doubling": None}, {"rope_type": "dynamic", "factor": 4.0}, L0),
    ("yarn", {}, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L0}, 4 * L0),
    (
        "llama3",
        {},
        {
            "rope_type": "llama3",
            "factor": 4.0,
            "original_max_position_embeddings": L0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        4 * L0,
    ),
    (
        "longrope",
        {"long_factor": LONG_FACTOR},
        {
            "rope_type": "longrope",
            "factor": 4.0,
            "original_max_position_embeddings": L0,
            "long_factor": LONG_FACTOR,
            "short_factor": [1.0] * 8,
        },
        4 * L0,
    ),
]


def _native_parameters(model, method, rope):
    rope = dict(rope)
    if method == "ntk":  # static NTK is plain RoPE with base * s^(d/(d-2))
        rope["rope_theta"] = model.config.rope_parameters["rope_theta"] * 4.0 ** (16 / 14)
    return rope


@pytest.mark.parametrize("method, kwargs, rope, max_positions", NATIVE, ids=[case[0] for case in NATIVE])
def test_matches_transformers_native_implementation(family, method, kwargs, rope, max_positions):
    model = make_model(family)
    twin = native_twin(model, _native_parameters(model, method, rope), max_positions)
    ids = random_ids(3 * L0 + 5)
    with torch.no_grad():
        unpatched = model(ids).logits
        expected = twin(ids).logits
        # The comparison can fail: the original model differs from the twin beyond L0.
        assert (unpatched - expected).abs().max() > 1e-2
        patch_model(model, scale=4, method=method, **kwargs)
        got = model(ids).logits
        positions = torch.arange(ids.shape[1])[None]
        hidden = torch.zeros(1, dtype=torch.float32)
        cos, sin = model.model.rotary_emb(hidden, positions)
        cos_ref, sin_ref = twin.model.rotary_emb(hidden, positions)
    torch.testing.assert_close(cos, cos_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(sin, sin_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("method", ["dynamic", "dynamic-yarn", "dynamic-linear"])
def test_length_dependent_methods_identical_inside_original_context(family, method):
    model = make_model(family)
    ids = random_ids(L0, batch=2)
    with torch.no_grad():
        before = model(ids).logits
        patch_model(model, scale=8, method=method)
        after = model(ids).logits
        longer = model(random_ids(L0 + 1, batch=2)).logits[:, :L0]
    assert torch.equal(before, after)
    assert not torch.allclose(before, longer, atol=1e-4)  # one token beyond L0 does change them


SHORT_FACTOR = [1.0 + 0.1 * i for i in range(8)]


def _transformers_reference(method, length):
    """transformers' own rope_parameters (and max_position_embeddings) giving the frequencies of
    ``method`` at scale 4 for an input of ``length`` tokens."""
    if method == "dynamic":
        return {"rope_type": "dynamic", "factor": 4.0}, L0
    if method == "longrope":
        rope = {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": L0,
                "long_factor": LONG_FACTOR, "short_factor": SHORT_FACTOR}  # fmt: skip
        return rope, 4 * L0
    if length <= L0:  # dynamic-yarn and dynamic-linear are the original RoPE inside L0
        return {"rope_type": "default"}, L0
    factor = length / L0  # ... and yarn / linear at scale L / L0 beyond it
    if method == "dynamic-yarn":
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": L0}, L0
    return {"rope_type": "linear", "factor": factor}, L0


@pytest.mark.parametrize("method", ["dynamic", "dynamic-yarn", "dynamic-linear", "longrope"])
def test_length_dependent_methods_below_at_and_above_original_context(method):
    """Each length-dependent method against transformers and against its own frequency function,
    at lengths below, at and above L0 (exact-length frequencies)."""
    from hf_rope_ext.methods import get_method

    model = make_model("llama")
    extra = {"long_factor": LONG_FACTOR, "short_factor": SHORT_FACTOR} if method == "longrope" else {}
    patch_model(model, scale=4, method=method, steps_per_doubling=None, **extra)
    rotary = model.model.rotary_emb
    params = dict(rotary.params)
    ids = random_ids(3 * L0)
    for length in (L0 - 5, L0, L0 + 1, 2 * L0 + 3):
        positions = torch.arange(length)[None]
        with torch.no_grad():
            cos, sin = rotary(torch.zeros(1), positions)
        inv_freq, attention = get_method(method).compute(rotary.rotary_dim, rotary.base, params, length)
        angles = positions[0, :, None].double() * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        torch.testing.assert_close(cos[0].double(), angles.cos() * attention, rtol=0, atol=2e-6)
        torch.testing.assert_close(sin[0].double(), angles.sin() * attention, rtol=0, atol=2e-6)
        rope, max_positions = _transformers_reference(method, length)
        twin = native_twin(model, rope, max_positions)
        with torch.no_grad():
            torch.testing.assert_close(model(ids[:, :length]).logits, twin(ids[:, :length]).logits, rtol=0, atol=2e-5)


def test_longrope_inside_original_context_uses_short_factor_and_attention_factor():
    model = make_model("llama")
    ids = random_ids(L0 - 8)
    with torch.no_grad():
        before = model(ids).logits
        patch_model(model, scale=4, method="longrope", long_factor=LONG_FACTOR)  # short_factor: all ones
        after = model(ids).logits
    # The attention factor sqrt(1 + ln 4 / ln L0) applies at every length, as in transformers.
    twin = native_twin(model, _transformers_reference("longrope", L0)[0] | {"short_factor": [1.0] * 8}, 4 * L0)
    with torch.no_grad():
        torch.testing.assert_close(after, twin(ids).logits, rtol=0, atol=2e-5)
    assert (after - before).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["yarn", "dynamic-yarn"])
def test_patching_after_a_cast_to_half_precision(dtype, method):
    """The usual preparation, model.half() or model.to(bfloat16), then patch_model."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cast_first = make_model("llama").to(dtype)
    patch_model(cast_first, scale=4, method=method)
    patched_first = make_model("llama")
    patch_model(patched_first, scale=4, method=method)
    patched_first.to(dtype)
    rotary = cast_first.model.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32
    # Frequencies rebuilt in full precision: those of transformers' own yarn at 4 * L0, not the cast ones.
    twin = native_twin(make_model("llama"), {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L0})
    expected, attention = ROPE_INIT_FUNCTIONS["yarn"](twin.config)
    got, got_attention = rotary.frequencies(4 * L0)
    torch.testing.assert_close(got.float(), expected, rtol=1e-6, atol=0)
    assert got_attention == pytest.approx(attention)
    ids = random_ids(3 * L0)
    with torch.no_grad():
        assert torch.equal(cast_first(ids).logits, patched_first(ids).logits)
        inside = ids[:, : L0 - 2]  # inside the original context too (no cast frequencies used)
        assert torch.equal(cast_first(inside).logits, patched_first(inside).logits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_patch_cast_unpatch_equals_a_plain_cast(dtype):
    plain = make_model("llama").to(dtype)
    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn")
    model.to(dtype)
    unpatch_model(model)
    buffers, expected = dict(model.named_buffers()), dict(plain.named_buffers())
    assert buffers.keys() == expected.keys()
    for name, buffer in expected.items():
        assert buffers[name].dtype == buffer.dtype and torch.equal(buffers[name], buffer), name
    ids = random_ids(L0 + 8)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)


def test_patching_after_a_cast_and_back():
    model = make_model("llama").to(torch.bfloat16).to(torch.float32)  # frequencies keep bf16 rounding
    patch_model(model, scale=4, method="yarn")
    reference = make_model("llama").to(torch.bfloat16).to(torch.float32)
    reference.model.rotary_emb = make_model("llama").model.rotary_emb  # the exact frequencies
    patch_model(reference, scale=4, method="yarn")
    ids = random_ids(3 * L0)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_frequencies_other_than_rope_are_refused_after_a_cast(dtype):
    model = make_model("llama").to(dtype)
    rotary = model.model.rotary_emb
    for name in ("inv_freq", "original_inv_freq"):
        getattr(rotary, name).mul_(1.05)  # 5%: far beyond any dtype's rounding
    with pytest.raises(ValueError, match="not plain RoPE"):
        patch_model(model, scale=4)
    assert get_patch_info(model) is None


def test_round_trip_is_bitwise(family):
    model = make_model(family)
    ids = random_ids(3 * L0)
    config_before = model.config.to_dict()
    modules_before = [(name, type(module)) for name, module in model.named_modules()]
    buffers_before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    parameters_before = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        logits_before = model(ids).logits
        for method in ("yarn", "dynamic-yarn"):
            patch_model(model, scale=4, method=method)
            assert model.config.to_dict() != config_before
            assert not torch.allclose(model(ids).logits, logits_before, atol=1e-4)
            assert sum(p.numel() for p in model.parameters()) == parameters_before
            unpatch_model(model)
            assert torch.equal(model(ids).logits, logits_before)
    assert model.config.to_dict() == config_before
    assert [(name, type(module)) for name, module in model.named_modules()] == modules_before
    buffers_after = dict(model.named_buffers())
    assert buffers_after.keys() == buffers_before.keys()
    assert all(torch.equal(buffers_after[name], buffer) for name, buffer in buffers_before.items())
    assert not model.model._forward_pre_hooks and not model.model._forward_hooks
    assert not hasattr(model.config, "hf_rope_ext")


def test_repatching_never_compounds():
    model = make_model("llama")
    fresh = make_model("llama")
    ids = random_ids(2 * L0)
    patch_model(model, scale=2, method="linear")
    patch_model(model, scale=4, method="linear")
    patch_model(fresh, scale=4, method="linear")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fresh(ids).logits)
    assert model.config.rope_parameters == fresh.config.rope_parameters
    assert model.config.max_position_embeddings == 4 * L0
    unpatch_model(model)
    assert model.config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert model.config.max_position_embeddings == L0


def test_context_manager_restores_previous_state():
    model = make_model("llama")
    ids = random_ids(2 * L0)
    with torch.no_grad():
        plain = model(ids).logits
        with patched(model, scale=4, method="yarn") as same:
            assert same is model
            assert get_patch_info(model).method == "yarn"
        assert get_patch_info(model) is None and torch.equal(model(ids).logits, plain)

        patch_model(model, scale=2, method="linear")
        linear = model(ids).logits
        with pytest.raises(RuntimeError, match="boom"):
            with patched(model, scale=8, method="ntk"):
                raise RuntimeError("boom")
        info = get_patch_info(model)
        assert (info.method, info.scale) == ("linear", 2.0)
        assert torch.equal(model(ids).logits, linear)


def test_config_describes_the_patch():
    model = make_model("llama")
    patch_model(model, max_length=4 * L0, method="yarn", beta_fast=16)
    assert model.config.max_position_embeddings == 4 * L0
    assert model.config.rope_parameters == {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": L0,
        "beta_fast": 16,
        "beta_slow": 1.0,
        "truncate": True,
    }
    record = model.config.hf_rope_ext
    assert record["method"] == "yarn" and record["scale"] == 4.0 and record["original_max_position_embeddings"] == L0
    info = get_patch_info(model)
    assert info.max_position_embeddings == 4 * L0 and info.params["beta_fast"] == 16

    patch_model(model, scale=4, method="dynamic")
    # transformers and vLLM read max_position_embeddings as where dynamic scaling starts
    assert model.config.max_position_embeddings == L0
    assert model.config.rope_parameters == {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}


@pytest.mark.parametrize("method", ["linear", "ntk", "yarn", "llama3", "dynamic", "dynamic-yarn", "longrope"])
def test_save_pretrained_reloads_to_same_logits(tmp_path, family, method):
    model = make_model(family)
    extra = {"long_factor": LONG_FACTOR} if method == "longrope" else {}
    patch_model(model, scale=4, method=method, steps_per_doubling=None, **extra) if method in (
        "dynamic",
        "dynamic-yarn",
        "longrope",
    ) else patch_model(model, scale=4, method=method, **extra)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = random_ids(3 * L0 + 3)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=2e-5)


def test_patched_frequencies_stay_float32_in_bf16():
    model = make_model("llama")
    patch_model(model, scale=4, method="yarn")
    model.to(torch.bfloat16)
    rotary = model.model.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32
    expected, _ = rotary.frequencies()
    assert torch.equal(rotary.inv_freq, expected.float())
    cos, _ = rotary(torch.zeros(1, dtype=torch.bfloat16), torch.arange(4)[None])
    assert cos.dtype == torch.bfloat16
    unpatch_model(model)
    assert model.model.rotary_emb.inv_freq.device.type == "cpu"


def test_user_registered_method(tmp_path):
    def half_frequencies(rotary_dim, base, params, seq_len=None):
        """Halve every frequency times a user parameter."""
        return default_inv_freq(rotary_dim, base) / (2 * params["strength"]), 1.0

    hf_rope_ext.register_method("halve", half_frequencies, defaults={"strength": 1.0})
    try:
        assert "halve" in hf_rope_ext.list_methods()
        with pytest.raises(ValueError, match="already registered"):
            hf_rope_ext.register_method("halve", half_frequencies)
        with pytest.raises(ValueError, match="built-in"):
            hf_rope_ext.register_method("yarn", half_frequencies)
        model = make_model("llama")
        twin = native_twin(model, {"rope_type": "linear", "factor": 2.0}, 2 * L0)
        patch_model(model, scale=2, method="halve")
        ids = random_ids(2 * L0)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, twin(ids).logits, rtol=0, atol=2e-5)
        assert model.config.rope_parameters["rope_type"] == "hf_rope_ext.halve"
        model.save_pretrained(tmp_path)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
        with torch.no_grad():
            torch.testing.assert_close(reloaded(ids).logits, twin(ids).logits, rtol=0, atol=2e-5)
    finally:
        hf_rope_ext.unregister_method("halve")
    assert "halve" not in hf_rope_ext.list_methods()


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"scale": 0}, ValueError, "must be > 1"),
        ({"scale": -2}, ValueError, "must be > 1"),
        ({"scale": float("nan")}, ValueError, "finite"),
        ({"scale": float("inf")}, ValueError, "finite"),
        ({"scale": "4"}, TypeError, "must be a number"),
        ({"scale": True}, TypeError, "must be a number"),
        ({"scale": 0.5}, ValueError, "below 1, which would shrink"),
        ({"scale": 1}, ValueError, "leaves the model unchanged"),
        ({}, ValueError, "needs scale="),
        ({"scale": 2, "max_length": 128}, ValueError, "either scale or max_length"),
        ({"max_length": 16}, ValueError, "not beyond the model's original context of 32"),
        ({"max_length": 100.5}, TypeError, "positive integer"),
        ({"scale": 4, "method": "yran"}, ValueError, r"Did you mean 'yarn'.*Valid methods:"),
        ({"scale": 4, "method": 3}, TypeError, "method must be a string"),
        ({"scale": 4, "method": "yarn", "beta_fats": 3}, ValueError, "did you mean 'beta_fast'"),
        ({"scale": 4, "method": "linear", "factor": 3}, ValueError, "Unknown parameter"),
        ({"scale": 4, "method": "linear", "steps_per_doubling": 2}, ValueError, "only applies to length-dependent"),
        ({"scale": 4, "method": "yarn", "beta_fast": 0.5}, ValueError, "beta_fast > beta_slow"),
        ({"scale": 4, "method": "yarn", "attention_factor": 1.0, "beta_fast": 1e9, "beta_slow": 1e8}, ValueError, "unchanged"),
        ({"scale": 4, "original_max_length": 0}, ValueError, "positive number of tokens"),
    ],
)
def test_bad_input_is_rejected_and_model_untouched(kwargs, error, message):
    model = make_model("llama")
    config_before = model.config.to_dict()
    with pytest.raises(error, match=message):
        patch_model(model, **kwargs)
    assert get_patch_info(model) is None
    assert model.config.to_dict() == config_before


def test_model_without_rope_names_its_type():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported: learned absolute position"):
        patch_model(model, scale=4)


def test_unknown_model_without_rotary_module():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="no rotary position embedding module"):
        patch_model(model, scale=4)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        patch_model("not a model", scale=4)


def test_already_scaled_model_is_refused():
    """A checkpoint trained with its scaling (Llama 3.1, Qwen2.5) needs it: the message says to use
    it as it is, not to load it without the scaling. runtime_settings says the same, with or
    without a method."""
    from hf_rope_ext.runtimes import runtime_settings

    model = make_model("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    advice = r"already uses RoPE scaling \(rope_type='linear', factor 2.0 in its config\).*use this model as it is"
    with pytest.raises(ValueError, match=advice):
        patch_model(model, scale=4)
    for arguments in ({}, {"method": "yarn", "scale": 4}):
        with pytest.raises(ValueError, match=advice):
            runtime_settings(model.config, **arguments)


def test_missing_original_context_length():
    model = make_model("llama")
    object.__setattr__(model.config, "max_position_embeddings", None)  # as in a config without the field
    with pytest.raises(ValueError, match="original_max_length="):
        patch_model(model, scale=4)
    patch_model(model, scale=4, original_max_length=L0, method="linear")
    assert get_patch_info(model).original_max_position_embeddings == L0
    unpatch_model(model)
    assert model.config.max_position_embeddings is None


def test_unpatching_an_unpatched_model_is_an_error():
    with pytest.raises(ValueError, match="not patched"):
        unpatch_model(make_model("llama"))


def test_patch_info_and_base_model():
    model = make_model("qwen3")
    patch_model(model.model, scale=3, method="ntk")  # the base model works too
    info = get_patch_info(model)
    assert info.method == "ntk" and info.scale == 3.0 and info.module_name == "model.rotary_emb"
    assert info.max_position_embeddings == math.ceil(3 * L0)


# -- other families: found by structure, no per-family code ---------------------------------------

OTHER_FAMILIES = {
    "gemma": {"head_dim": 16},
    "granite": {},
    "olmo2": {},
    "starcoder2": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "stablelm": {"partial_rotary_factor": 0.5},
    "gpt_neox": {"rotary_pct": 0.5},
}


@pytest.mark.parametrize("model_type", list(OTHER_FAMILIES))
def test_other_families_match_native_yarn(model_type):
    from hf_rope_ext.families import FAMILIES

    torch.manual_seed(0)
    model = strengthen_weights(_tiny(model_type, **OTHER_FAMILIES[model_type]))
    twin = native_twin(model, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L0}, 4 * L0)
    ids = random_ids(3 * L0)
    with torch.no_grad():
        assert (model(ids).logits - twin(ids).logits).abs().max() > 1e-3
        patch_model(model, scale=4, method="yarn")
        torch.testing.assert_close(model(ids).logits, twin(ids).logits, rtol=0, atol=2e-5)
    assert FAMILIES[model_type].tested


def _tiny(model_type, **extra):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **TINY_SHAPE, **extra)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def test_config_class_that_restricts_rope_types():
    model = _tiny("phi3", pad_token_id=0)
    before = model.config.to_dict()
    with pytest.raises(ValueError, match="model_type 'phi3': its config rejects rope_type 'yarn'"):
        patch_model(model, scale=4, method="yarn")
    assert model.config.to_dict() == before and get_patch_info(model) is None
    patch_model(model, scale=4, method="longrope", long_factor=LONG_FACTOR)  # the type Phi-3 accepts
    assert model.config.rope_parameters["rope_type"] == "longrope"


@pytest.mark.parametrize(
    "model_type, message",
    [
        ("cohere", "model_type 'cohere' is not supported: interleaved"),
        ("gemma3_text", "model_type 'gemma3_text' .*RoPE settings"),
    ],
)
def test_unsupported_layouts_name_the_model_type(model_type, message):
    with pytest.raises(ValueError, match=message):
        patch_model(_tiny(model_type), scale=4)


@pytest.mark.parametrize("method", ["yarn", "dynamic-yarn", "self-extend"])
def test_a_falcon_config_with_alibi_is_refused_and_one_with_rope_is_patched(method):
    """Falcon builds a rotary module whatever its config says; with alibi=True no layer calls it, so
    a frequency patch changed nothing (logits bitwise the unpatched model's) and an attention-level
    one rotated queries and keys of a model that has no RoPE. Both are refused before any change."""
    from hf_rope_ext.runtimes import runtime_settings

    torch.manual_seed(0)
    alibi = strengthen_weights(_tiny("falcon", alibi=True, pad_token_id=0))
    ids = random_ids(3 * L0)
    with torch.no_grad():
        plain = alibi(ids).logits
    before = alibi.config.to_dict()
    with pytest.raises(ValueError, match=r"model_type 'falcon' with alibi=True is not supported: .*ALiBi") as error:
        patch_model(alibi, scale=4, method=method)
    assert "\n" not in str(error.value)
    assert get_patch_info(alibi) is None and alibi.config.to_dict() == before
    with torch.no_grad():
        assert torch.equal(alibi(ids).logits, plain)
    with pytest.raises(ValueError, match="with alibi=True is not supported"):
        runtime_settings(alibi.config, "yarn", 4)
    rope = strengthen_weights(_tiny("falcon", alibi=False, pad_token_id=0))
    with torch.no_grad():
        unpatched = rope(ids).logits
        patch_model(rope, scale=4, method="yarn")
        assert (rope(ids).logits - unpatched).abs().max() > 1e-3  # RoPE is used: the patch changes the output


# -- PatchSpec: the one patch type -------------------------------------------------------------------


def test_patch_spec_record_round_trip_and_apply():
    from hf_rope_ext import PatchSpec

    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn+logn", steps_per_doubling=2, beta_fast=16)
    spec = get_patch_info(model)
    assert isinstance(spec, PatchSpec) and spec.label == "dynamic-yarn+logn"
    assert (spec.method, spec.scale, spec.steps_per_doubling, spec.logn_attention) == ("dynamic-yarn", 4.0, 2, True)
    record = spec.to_record()
    assert record == model.config.hf_rope_ext  # the config entry is the spec's record
    again = PatchSpec.from_record(record)
    assert again.to_record() == record and again.params == spec.params
    fresh = make_model("llama")
    again.apply(fresh)
    assert get_patch_info(fresh) == spec
    ids = random_ids(2 * L0 + 3)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.pop("scale"), r"lacks \['scale'\]"),
        (lambda r: r.update(scale="4"), r"scale='4'; it must be a number > 1"),
        (lambda r: r.update(original_max_position_embeddings=0), "original_max_position_embeddings=0"),
        (lambda r: r.update(steps_per_doubling=True), "steps_per_doubling=True"),
        (lambda r: r.update(logn_attention="yes"), "logn_attention='yes'"),
        (lambda r: r["params"].update(beta_fats=3), "did you mean 'beta_fast'"),
        (lambda r: r.update(method="yarnn"), "method 'yarnn', which is not registered"),
    ],
)
def test_patch_spec_from_record_names_the_problem_on_one_line(edit, message):
    from hf_rope_ext import PatchSpec

    model = make_model("llama")
    patch_model(model, scale=4, method="dynamic-yarn")
    record = json.loads(json.dumps(get_patch_info(model).to_record()))
    edit(record)
    with pytest.raises(ValueError, match=message) as error:
        PatchSpec.from_record(record, source="rope_patch.json")
    assert "\n" not in str(error.value) and "rope_patch.json" in str(error.value)


def test_patch_spec_checks_its_fields_and_its_model():
    from hf_rope_ext import PatchSpec

    with pytest.raises(ValueError, match="only applies to length-dependent"):
        PatchSpec("yarn", 4.0, L0, steps_per_doubling=2)
    with pytest.raises(ValueError, match="only applies to length-dependent"):
        PatchSpec.create("linear", 4, original_max_length=L0, steps_per_doubling=None)
    assert PatchSpec.create("dynamic", 4, original_max_length=L0).steps_per_doubling is None  # the default
    with pytest.raises(ValueError, match="below 1, which would shrink"):
        PatchSpec("yarn", 0.5, L0)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        PatchSpec("yarn", 4.0, L0, rotary_dim=15)
    spec = PatchSpec.create("yarn", max_length=4 * L0, original_max_length=L0, rotary_dim=32, rope_theta=10000.0)
    assert spec.scale == 4.0 and spec.extended_context == 4 * L0 and spec.params["beta_fast"] == 32.0
    with pytest.raises(ValueError, match=r"made for a model with rotary_dim=32, this one has 16"):
        spec.apply(make_model("llama"))  # head_dim 16


# -- copies and deleted models ---------------------------------------------------------------------


@pytest.mark.parametrize("method", ["self-extend-yarn", "dual-chunk", "yarn+logn", "dynamic-yarn"])
def test_a_deep_copy_of_a_patched_model_is_patched_on_its_own(method):
    """copy.deepcopy (as TRL makes reference models) gives a model with its own attention
    patch: it computes as a model patched afresh, and outlives unpatching the original."""
    import copy

    from test_attention import _generation_matches_full_forward

    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method=method)
    copied = copy.deepcopy(model)
    fresh = make_model("llama", attn_implementation="sdpa")  # same seed, same weights
    reference = make_model("llama", attn_implementation="sdpa")
    patch_model(fresh, scale=4, method=method)
    ids = random_ids(3 * ORIGINAL_CONTEXT + 5)
    assert copied.config._attn_implementation != model.config._attn_implementation or method == "dynamic-yarn"
    unpatch_model(model)
    with torch.no_grad():
        torch.testing.assert_close(copied(ids).logits, fresh(ids).logits, rtol=0, atol=0)
        short = ids[:, : ORIGINAL_CONTEXT - 4]  # and a shorter input after the long one (the copy's own state)
        torch.testing.assert_close(copied(short).logits, fresh(short).logits, rtol=0, atol=0)
    _generation_matches_full_forward(copied, short)  # generating across L0 on the copy's own cache hooks
    unpatch_model(copied)
    with torch.no_grad():
        assert torch.equal(copied(ids).logits, reference(ids).logits)


def test_a_deleted_patched_model_is_freed_with_its_registry_entries():
    import gc
    import weakref

    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    gc.collect()
    before = (set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping))
    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4)  # the default: attention-level, length-dependent
    with torch.no_grad():
        model(random_ids(3 * ORIGINAL_CONTEXT))
    name = model.config._attn_implementation
    assert name in AttentionInterface._global_mapping
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None
    assert (set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping)) == before


def test_patched_does_not_hide_the_blocks_own_error_when_the_block_unpatched():
    model = make_model("llama")
    patch_model(model, scale=2, method="ntk")
    info = get_patch_info(model)
    with pytest.raises(KeyError, match="the block's own"):
        with patched(model, 4, "yarn"):
            unpatch_model(model)
            raise KeyError("the block's own")
    assert get_patch_info(model) == info  # the patch from before the block is back


@pytest.mark.parametrize("method", ["yarn", "dynamic-yarn", "self-extend", "self-extend-yarn"])
@pytest.mark.parametrize("put_back", ["patched() block", "check_configurations"])
def test_a_cache_filled_before_a_patch_is_put_back_is_refused_after_it(method, put_back):
    """A patch put back starts with no record of the KV caches filled before: the patch used
    meanwhile may have reset and refilled one of them (generate does so with a reused static
    cache), which a record from before would read as cropped and continue with states written
    under another patch. Such a cache is refused in one line; a new one equals a full forward."""
    from transformers import StaticCache

    from hf_rope_ext.auto import check_configurations

    model = make_model("llama")
    patch_model(model, scale=4, method=method)
    ids = random_ids(60)
    cache = StaticCache(config=model.config, max_cache_len=100)
    with torch.no_grad():
        model(ids[:, :40], past_key_values=cache, use_cache=True)
    if put_back == "patched() block":
        with patched(model, 2, "ntk"), torch.no_grad():
            cache.reset()
            model(ids[:, :30], past_key_values=cache, use_cache=True)  # 30 tokens under ntk
    else:
        check_configurations(model, ["yarn"], 4)
    with torch.no_grad(), pytest.raises(ValueError, match="not written under this model's current.*before this patch "
                                                          "was put back by a patched\\(\\) block") as error:
        model(ids[:, 30:50], past_key_values=cache, use_cache=True)
    assert "\n" not in str(error.value)
    with torch.no_grad(), hf_rope_ext.planned_length(model, 60):
        fresh = model(ids[:, :40], use_cache=True).past_key_values
        continued = model(ids[:, 40:], past_key_values=fresh, use_cache=True).logits
        full = model(ids).logits[:, 40:]
    torch.testing.assert_close(continued, full, rtol=1e-5, atol=1e-5)


def test_a_user_method_registered_again_is_not_rebuilt_into_a_patched_model():
    """A model patched with a user method that was registered again since (other code) keeps the
    patch it runs: putting a patch back (patched(), a refused re-patch) is refused in one line."""
    def halved(dim, base, params, length):
        return default_inv_freq(dim, base) / params["factor"], 1.0

    def quartered(dim, base, params, length):
        return default_inv_freq(dim, base) / (2 * params["factor"]), 1.0

    hf_rope_ext.register_method("mine-again", halved)
    try:
        model = make_model("llama")
        patch_model(model, scale=4, method="mine-again")
        ids = random_ids(100)
        with torch.no_grad():
            before = model(ids).logits
        hf_rope_ext.unregister_method("mine-again")
        hf_rope_ext.register_method("mine-again", quartered)
        with pytest.raises(ValueError, match="registered again since, with other code; call unpatch_model"):
            with patched(model, 2, "ntk"):
                pass
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
    finally:
        hf_rope_ext.unregister_method("mine-again")


@pytest.mark.parametrize("put_back", ["after a patched() block", "after a refused re-patch"])
def test_a_patch_put_back_keeps_its_config_and_its_rotary_modules_mode(put_back):
    """The patch put back is the one the model had: the same config object, with the changes made
    to it since patching, and its rotary module in the mode model.train() gave it (a new rotary
    module would take the mode of the original one, kept outside the module tree)."""
    model = make_model("llama", attention_dropout=0.1)
    ids = random_ids(2 * L0)
    patch_model(model, 2, "self-extend")
    model.config.use_cache, model.config.pad_token_id = False, 0
    config, values = model.config, model.config.to_dict()
    before = _logits(model, ids)
    model.train()
    if put_back == "after a patched() block":
        with patched(model, 4, "ntk"):  # rotary-only: taken in training mode
            pass
    else:
        with pytest.raises(ValueError, match="beta_fast"):
            patch_model(model, 4, "yarn", beta_fast=-1)
    assert all(module.training for module in model.modules())  # the patched rotary module is one of them
    with pytest.raises(ValueError, match=r"\('self-extend'\) cannot train with attention dropout.*dropout=0.1"):
        model(ids)  # the patched rotary module's own refusal of a training forward
    assert model.config is config and config.to_dict() == values
    assert all(layer.self_attn.config is config for layer in model.model.layers)
    model.eval()
    assert torch.equal(_logits(model, ids), before)  # its attention patch runs under the config's registry name


# -- the model instance, and only it ----------------------------------------------------------------


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_the_rotary_module_itself_is_refused_and_the_model_left_as_it_was():
    ids = random_ids(80)
    model = make_model("llama")
    unpatched = _logits(model, ids)
    with pytest.raises(ValueError, match=r"not its rotary embedding module \(LlamaRotaryEmbedding\)"):
        patch_model(model.model.rotary_emb, 4, method="yarn")
    assert get_patch_info(model) is None and "hf_rope_ext" not in model.config.to_dict()
    assert "" not in model.model.rotary_emb._modules
    model.state_dict()  # no cycle in the module tree
    assert torch.equal(_logits(model, ids), unpatched)

    patch_model(model, 4)
    patched_logits = _logits(model, ids)
    rotary = model.model.rotary_emb
    with pytest.raises(ValueError, match="not its rotary embedding module"):
        unpatch_model(rotary)
    for method in ("yarn", "self-extend-yarn"):
        with pytest.raises(ValueError, match="not its rotary embedding module"):
            patch_model(rotary, 2, method=method)
    with pytest.raises(ValueError, match="not its rotary embedding module"):
        get_patch_info(rotary)
    assert get_patch_info(model).scale == 4.0 and model.config.hf_rope_ext["scale"] == 4.0
    assert torch.equal(_logits(model, ids), patched_logits)
    unpatch_model(model)
    assert torch.equal(_logits(model, ids), unpatched)


def _shared_config():
    from transformers import LlamaConfig

    return LlamaConfig(**TINY_SHAPE, rope_theta=10000.0)


@pytest.mark.parametrize("method", ["self-extend-yarn", "yarn"])
def test_models_sharing_one_config_object_are_patched_independently(method):
    from transformers import LlamaForCausalLM

    ids = random_ids(80)
    config = _shared_config()
    torch.manual_seed(0)
    a = LlamaForCausalLM(config).eval()
    torch.manual_seed(1)
    b = LlamaForCausalLM(config).eval()
    assert a.config is b.config  # transformers keeps the object it is given
    before = config.to_dict()
    b_unpatched = _logits(b, ids)
    # The reference: b's weights in a model with a config of its own, patched.
    twin = LlamaForCausalLM(_shared_config()).eval()
    twin.load_state_dict(b.state_dict())
    patch_model(twin, 4, method=method)
    twin_patched = _logits(twin, ids)

    patch_model(a, 4, method=method)
    assert config.to_dict() == before and b.config is config
    assert torch.equal(_logits(b, ids), b_unpatched)
    patch_model(b, 4, method=method)  # not mistaken for a model loaded from a patched checkpoint
    assert torch.equal(_logits(b, ids), twin_patched)
    unpatch_model(a)
    unpatch_model(b)
    assert a.config is config and b.config is config and config.to_dict() == before
    assert all(module.config is config for module in b.modules() if "config" in vars(module))
    assert torch.equal(_logits(b, ids), b_unpatched)


def test_set_attn_implementation_after_patching_is_refused_at_the_next_forward():
    ids = random_ids(80)
    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, 4)  # attention-level default
    patched_logits = _logits(model, ids)
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match=r"config._attn_implementation was changed to 'eager' after patching"):
        model(ids)
    model.set_attn_implementation(model.model.rotary_emb.attention_patch.name)  # the patch's own again
    assert torch.equal(_logits(model, ids), patched_logits)
    # The way the message gives: unpatch, change, patch again.
    reference = make_model("llama", attn_implementation="eager")
    patch_model(reference, 4)
    unpatch_model(model)
    model.set_attn_implementation("eager")
    patch_model(model, 4)
    assert torch.allclose(_logits(model, ids), _logits(reference, ids), atol=1e-5)


def test_a_method_unregistered_while_in_use_keeps_the_model_patched():
    def half_frequencies(rotary_dim, base, params, seq_len=None):
        return default_inv_freq(rotary_dim, base) / params["factor"], 1.0

    ids = random_ids(80)
    hf_rope_ext.register_method("in-use", half_frequencies)
    try:
        model = make_model("llama")
        patch_model(model, 4, method="in-use")
        patched_logits = _logits(model, ids)
    finally:
        hf_rope_ext.unregister_method("in-use")
    assert get_patch_info(model).method == "in-use"
    with pytest.raises(ValueError, match=r"patched with method 'in-use', which has been unregistered"):
        patch_model(model, 2, method="yarn")
    assert get_patch_info(model).method == "in-use" and torch.equal(_logits(model, ids), patched_logits)
    unpatch_model(model)
    assert torch.equal(_logits(model, ids), _logits(make_model("llama"), ids))


def test_an_attention_function_that_returns_no_position_remap_is_refused_at_patch_time():
    def frequencies(rotary_dim, base, params, seq_len=None):
        return default_inv_freq(rotary_dim, base), 1.0

    hf_rope_ext.register_method("no-remap", frequencies, attention=lambda params: 42)
    try:
        model = make_model("llama")
        with pytest.raises(ValueError, match=r"method 'no-remap': attention must return .*PositionRemap, got int"):
            patch_model(model, 4, method="no-remap")
    finally:
        hf_rope_ext.unregister_method("no-remap")
    assert get_patch_info(model) is None and model.config._attn_implementation == "eager"


@pytest.mark.parametrize("method", ["linear", "yarn", "llama3"])
def test_a_static_patch_pickles_and_unpatches_after_loading(method):
    import io

    ids = random_ids(80)
    model = make_model("llama")
    patch_model(model, 4, method=method)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert get_patch_info(loaded) == get_patch_info(model)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))
    unpatch_model(loaded)
    assert torch.equal(_logits(loaded, ids), _logits(make_model("llama"), ids))


@pytest.mark.parametrize("method", ["self-extend", "dual-chunk", "self-extend-yarn", "dynamic", "yarn+logn"])
def test_pickling_a_patch_with_hooks_is_refused_in_one_line(method):
    import copy
    import io
    import pickle

    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, 4, method=method)
    for save in (lambda: torch.save(model, io.BytesIO()), lambda: pickle.dumps(model)):
        refusal = rf"A model patched with '{re.escape(method)}' cannot be pickled.*save_patched"
        with pytest.raises(TypeError, match=refusal):
            save()
    ids = random_ids(80)
    assert torch.equal(_logits(copy.deepcopy(model), ids), _logits(model, ids))  # copies still work


def test_unpatch_is_complete_even_after_the_config_was_edited():
    ids = random_ids(80)
    reference = make_model("llama")
    model = make_model("llama")
    before = model.config.to_dict()
    patch_model(model, 4)
    model.config.rope_parameters = None  # a hostile edit of the patched config
    unpatch_model(model)
    assert type(model.model.rotary_emb).__name__ == "LlamaRotaryEmbedding"
    assert model.config.to_dict() == before and model.config._attn_implementation == "eager"
    assert not model.model._forward_hooks and not model.model._forward_pre_hooks
    assert torch.equal(_logits(model, ids), _logits(reference, ids))


def test_a_model_on_the_meta_device_is_refused_in_one_line():
    from conftest import make_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(make_config("llama"))
    with pytest.raises(ValueError, match="the model is on the meta device"):
        patch_model(model, 4, method="yarn")

    def meta_frequencies(rotary_dim, base, params, seq_len=None):
        return default_inv_freq(rotary_dim, base).to("meta") / params["factor"], 1.0

    hf_rope_ext.register_method("on-meta", meta_frequencies)
    try:
        model = make_model("llama")
        with pytest.raises(ValueError, match="'on-meta' returned frequencies on the meta device"):
            patch_model(model, 4, method="on-meta")
    finally:
        hf_rope_ext.unregister_method("on-meta")
    assert get_patch_info(model) is None


def test_attention_dropout_with_an_attention_level_method_is_refused_before_training():
    ids = random_ids(60)
    model = make_model("llama", attn_implementation="sdpa", attention_dropout=0.1)
    patch_model(model, 4)  # eval mode: inference is deterministic and works
    reference = make_model("llama", attn_implementation="sdpa")
    patch_model(reference, 4)
    assert torch.equal(_logits(model, ids), _logits(reference, ids))
    model.train()
    short = ids[:, :20]  # inside L0: before, only the first batch beyond it failed
    with pytest.raises(ValueError, match=r"cannot train with attention dropout.*config.attention_dropout=0.1"):
        model(short, labels=short)
    with pytest.raises(ValueError, match=r"'dual-chunk'.*config.attention_dropout=0.1"):
        patch_model(model, 4, method="dual-chunk")  # in training mode: refused at once
    assert get_patch_info(model).method == "self-extend-yarn"  # the previous patch is kept
    static = make_model("llama", attn_implementation="sdpa", attention_dropout=0.1).train()
    patch_model(static, 4, method="yarn")  # frequency methods apply dropout as transformers does
    static(ids, labels=ids).loss.backward()


# -- threads: calls that span forwards, and swapping a patch while a call runs ------------------------

ANOTHER_THREAD = "running a forward on another thread"


class _AtStep(LogitsProcessor):
    """Runs ``action()`` in generate's step ``step`` (between two forwards), on generate's thread."""

    def __init__(self, step: int, action):
        self.step, self.action, self.calls = step, action, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.step:
            self.action()
        return scores


def _patched_pair(method: str):
    """Two identically patched tiny models: the one under test and an untouched reference."""
    models = [make_model("llama", attn_implementation="sdpa") for _ in range(2)]
    return [patch_model(model, scale=4, method=method) for model in models]


def _greedy(model, prompt, new_tokens, processors=()):
    return model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                          logits_processor=LogitsProcessorList(list(processors)))  # fmt: skip


def _generating_on_a_thread(model, prompt, new_tokens):
    """Start a greedy ``generate`` on a thread of its own that waits between two of its forwards
    until the block ends; yields the dict its tokens go in (``"result"``, once the block ended)."""
    processors = []

    def install(pause):
        processors.append(_AtStep(3, pause))
        return processors.clear

    return thread_paused_at(lambda: _greedy(model, prompt, new_tokens, processors), install)


@pytest.mark.parametrize("method", ["self-extend-yarn", "dynamic"])
def test_another_thread_is_refused_while_generate_runs_between_its_forwards(method):
    """Between two forwards of a ``generate``, the patch holds that call's planned length (and a
    raised max_position_embeddings): another thread's forward there was accepted and computed with
    the other call's frequencies (0.3 off). The whole call now holds the model for its thread: a
    forward, a generate, a planned_length block or an unpatch from another thread is refused in one
    line, the running generate stays exact, and once it ended the other thread runs exactly."""
    model, reference = _patched_pair(method)
    prompt, short = random_ids(40), random_ids(20, seed=2)
    with torch.no_grad():
        expected_tokens = _greedy(reference, prompt, 30)
        expected_short = reference(short).logits
    with _generating_on_a_thread(model, prompt, 30) as first, torch.no_grad():
        with pytest.raises(RuntimeError, match=ANOTHER_THREAD):
            model(short)
        with pytest.raises(RuntimeError, match=ANOTHER_THREAD):
            _greedy(model, short, 8)
        with pytest.raises(RuntimeError, match=ANOTHER_THREAD), hf_rope_ext.planned_length(model, 64):
            pass
        with pytest.raises(RuntimeError, match="unpatch_model: a forward or generate call .* on another thread"):
            unpatch_model(model)
    assert torch.equal(first["result"], expected_tokens)
    assert model.config.max_position_embeddings == reference.config.max_position_embeddings
    with torch.no_grad():
        torch.testing.assert_close(model(short).logits, expected_short, atol=1e-5, rtol=1e-5)
        assert torch.equal(_greedy(model, short, 8), _greedy(reference, short, 8))


@pytest.mark.parametrize("method", ["self-extend-yarn", "dynamic"])
def test_a_forward_inside_generate_on_its_own_thread_is_still_allowed(method):
    """The hold is per thread: a logits processor may run the model inside generate (it gets the
    call's plan, as documented), and another thread's generate afterwards runs exactly."""
    model, reference = _patched_pair(method)
    prompt, short = random_ids(40), random_ids(20, seed=2)
    inner = {}
    with torch.no_grad():
        tokens = _greedy(model, prompt, 10, [_AtStep(4, lambda: inner.update(logits=model(short).logits))])
        assert torch.equal(tokens, _greedy(reference, prompt, 10))
        with hf_rope_ext.planned_length(reference, 40 + 10):  # the frequencies of the generate's plan
            torch.testing.assert_close(inner["logits"], reference(short).logits, atol=1e-6, rtol=1e-6)
    outcome = on_a_thread(lambda: _greedy(model, prompt, 10))
    assert torch.equal(outcome.get("result"), tokens), outcome.get("error")


@pytest.mark.parametrize("stop", [KeyboardInterrupt, ValueError])
def test_generate_stopped_by_an_exception_leaves_the_model_free_for_other_threads(stop):
    """An interrupt or error inside generate (here from a logits processor, between forwards)
    releases the call's hold: other threads run, unpatch works, and the plan is gone."""
    model, reference = _patched_pair("dynamic")
    prompt, short = random_ids(40), random_ids(20, seed=2)

    def raise_it():
        raise stop("stopped")

    with pytest.raises(stop), torch.no_grad():
        _greedy(model, prompt, 30, [_AtStep(3, raise_it)])
    with torch.no_grad():
        expected = reference(short).logits
    outcome = on_a_thread(lambda: model(short).logits)
    assert "error" not in outcome, outcome.get("error")
    torch.testing.assert_close(outcome["result"], expected, atol=1e-5, rtol=1e-5)
    assert model.config.max_position_embeddings == reference.config.max_position_embeddings
    unpatch_model(model)


@pytest.mark.parametrize("method", ["self-extend-yarn", "dynamic"])
def test_a_copy_made_while_another_thread_generates_has_no_plan(method):
    """The refusal advises a copy per thread; a copy made while the original is inside generate
    took that call's plan with it for good (every forward of the copy 0.3 off), and the call's
    raised max_position_embeddings (which a saved config would then carry)."""
    model, reference = _patched_pair(method)
    prompt, short = random_ids(40), random_ids(20, seed=2)
    with _generating_on_a_thread(model, prompt, 30):
        copied = copy.deepcopy(model)
    assert copied.config.max_position_embeddings == reference.config.max_position_embeddings == L0
    with torch.no_grad():
        torch.testing.assert_close(copied(short).logits, reference(short).logits, atol=1e-6, rtol=1e-6)
        assert torch.equal(_greedy(copied, prompt, 10), _greedy(reference, prompt, 10))


@pytest.mark.parametrize("method", ["self-extend-yarn", "dynamic", "dual-chunk"])
@pytest.mark.parametrize("swap", ["unpatch", "re-patch"])
def test_swapping_the_patch_while_another_thread_runs_a_forward_is_refused(method, swap):
    """unpatch_model or a re-patch during another thread's forward was accepted, and that forward
    ran its first layer patched and the next unpatched (0.26 off both). Now it is refused in one
    line, the model keeps its patch, the forward under way is exact, and the swap works after."""
    model, reference = _patched_pair(method)
    plain = make_model("llama", attn_implementation="sdpa")
    ids = random_ids(3 * L0)
    with torch.no_grad():
        expected, expected_plain = reference(ids).logits, plain(ids).logits
    function = "unpatch_model" if swap == "unpatch" else "patch_model"
    with paused_on_a_thread(model.model.layers[1], lambda: model(ids).logits) as first:
        with pytest.raises(RuntimeError, match=f"^{function}: a forward or generate call .* on another thread"):
            unpatch_model(model) if swap == "unpatch" else patch_model(model, scale=2, method="linear")
        assert get_patch_info(model).method == method
    torch.testing.assert_close(first["result"], expected, atol=1e-5, rtol=1e-5)
    unpatch_model(model)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected_plain, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("method", ["self-extend-yarn", "dynamic"])
def test_swapping_the_patch_inside_a_call_of_the_model_on_its_own_thread_is_refused(method):
    """From a hook in the middle of a forward, or a logits processor inside generate, an unpatch
    would leave the call under way half patched: refused in one line, and the call stays exact."""
    model, reference = _patched_pair(method)
    ids, prompt = random_ids(3 * L0), random_ids(40)
    refusals = []

    def try_unpatch(*_):
        with pytest.raises(RuntimeError, match="^unpatch_model was called inside a forward or generate call"):
            unpatch_model(model)
        with pytest.raises(RuntimeError, match="^patch_model was called inside a forward or generate call"):
            patch_model(model, scale=2, method="linear")
        refusals.append(True)

    handle = model.model.layers[0].register_forward_hook(try_unpatch)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-6, rtol=1e-6)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(_greedy(model, prompt, 10, [_AtStep(4, try_unpatch)]), _greedy(reference, prompt, 10))
    assert len(refusals) == 2 and get_patch_info(model).method == method


def test_save_patched_during_a_generate_on_another_thread_is_refused_and_writes_nothing(tmp_path):
    """A length-dependent patch's generate raises config.max_position_embeddings to its extended
    context while it runs: a save then wrote that value, and load_patched refused the checkpoint as
    edited. save_patched is refused in one line naming the cause, and saves the original context after."""
    from hf_rope_ext.hub import load_patched, save_patched

    model, reference = _patched_pair("dynamic-yarn")
    target = tmp_path / "ckpt"
    with _generating_on_a_thread(model, random_ids(40), 30):
        assert model.config.max_position_embeddings > reference.config.max_position_embeddings  # what a save kept
        with pytest.raises(RuntimeError, match="^save_patched: a forward or generate call .* config.max_position_embeddings"):
            save_patched(model, target)
    assert not target.exists()
    save_patched(model, target)
    assert json.loads((target / "config.json").read_text())["max_position_embeddings"] == L0
    loaded = load_patched(target)
    ids = random_ids(3 * L0)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_a_planned_length_block_closed_while_its_lock_is_taken_does_not_hang():
    """A generator paused inside planned_length runs the block's exit where it is collected, which
    may be inside the package's own locked section on that thread: the exit took the same lock
    again and the whole process hung. Closing it there now returns, and the hold is counted out."""
    from hf_rope_ext import forward_threads

    model, reference = _patched_pair("dynamic-yarn")

    def steps():
        with hf_rope_ext.planned_length(model, 3 * L0):
            yield

    paused = steps()
    next(paused)
    closed = threading.Event()

    def close_inside_the_lock():
        with forward_threads._LOCK:  # as a garbage collection inside a locked section would close it
            paused.close()
        closed.set()

    worker = threading.Thread(target=close_inside_the_lock, daemon=True)
    worker.start()
    worker.join(timeout=10)
    if not closed.is_set():  # the old code: free the worker (a Lock may be released by any thread)
        forward_threads._LOCK.release()
        worker.join(timeout=10)
    assert closed.is_set(), "closing a planned_length block inside the lock hung"
    ids = random_ids(2 * L0)
    with torch.no_grad():
        outcome = on_a_thread(lambda: model(ids).logits)  # another thread: refused if the hold were kept
        assert "error" not in outcome, outcome.get("error")
        torch.testing.assert_close(outcome["result"], reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_the_refusal_during_another_threads_generate_says_to_join_that_thread():
    """A TextIteratorStreamer ends inside generate, before it returns: a call right after the stream
    is refused, and the line says why and what to do."""
    model, _ = _patched_pair("self-extend-yarn")
    with _generating_on_a_thread(model, random_ids(40), 30), torch.no_grad():
        with pytest.raises(RuntimeError, match="a generate ends when it returns, not when its streamer does: join its thread"):
            model(random_ids(20, seed=2))


def test_a_config_with_a_null_head_dim_patches_as_one_that_gives_it():
    """Mixtral's default config has head_dim None, which transformers' longrope (and yarn) init
    multiplies: patch_model refused with "unsupported operand type(s)". It now patches as the same
    model whose config states the head size, and unpatch gives the null back."""
    from transformers import MixtralConfig

    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=L0, num_local_experts=2)  # fmt: skip
    factors = {"long_factor": [1.0 + 0.25 * i for i in range(8)], "short_factor": [1.0] * 8}
    models = []
    for head_dim in (None, 16):
        torch.manual_seed(0)
        models.append(AutoModelForCausalLM.from_config(MixtralConfig(**shape, head_dim=head_dim)).eval())
    null, stated = models
    assert null.config.head_dim is None
    ids = random_ids(3 * L0)
    for model in models:
        patch_model(model, scale=4, method="longrope", **factors)
    with torch.no_grad():
        assert torch.equal(null(ids).logits, stated(ids).logits)
    unpatch_model(null)
    assert null.config.head_dim is None


def test_patch_model_refuses_a_null_record_as_an_edited_config():
    """A config whose ``hf_rope_ext`` entry is present but null (config.json edited by hand) is an
    edited record, refused in one line; read as "no record", the patch would start from RoPE
    fields that may hold another patch's values."""
    model = make_model("llama")
    model.config.hf_rope_ext = None
    with pytest.raises(ValueError, match=r"hf_rope_ext.*must be a JSON object, got NoneType") as error:
        patch_model(model, scale=2.0, method="yarn")
    assert "\n" not in str(error.value)
    assert get_patch_info(model) is None
