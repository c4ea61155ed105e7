"""The frequency functions: closed forms, golden values, properties, and transformers' own functions."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from conftest import make_model

from hf_rope_ext import get_method, list_methods, patch_model
from hf_rope_ext.methods import default_inv_freq, resolve_params

DIM, BASE, L0 = 64, 10000.0, 2048


def params_for(name: str, scale: float = 4.0, **given):
    method = get_method(name)
    params = resolve_params(method, DIM, given)
    params.update(factor=scale, original_max_position_embeddings=L0)
    return params


def compute(name: str, seq_len=None, scale: float = 4.0, dim: int = DIM, **given):
    method = get_method(name)
    params = resolve_params(method, dim, given)
    params.update(factor=scale, original_max_position_embeddings=L0)
    return method.compute(dim, BASE, params, seq_len)


LONG_FACTOR = [1.0 + 0.25 * i for i in range(DIM // 2)]
EXTRA = {"longrope": {"long_factor": LONG_FACTOR}}


def test_default_frequencies_golden():
    # theta_i = 10000 ** (-2i / 64), written out for i = 0, 1, 16, 31.
    inv = default_inv_freq(DIM, BASE)
    assert inv.dtype == torch.float64 and inv.shape == (32,)
    golden = {0: 1.0, 1: 0.7498942093324559, 16: 0.01, 31: 0.0001333521432163324}
    for index, value in golden.items():
        assert inv[index].item() == pytest.approx(value, rel=1e-14)


def test_linear_divides_frequencies_and_maps_positions():
    inv, attention = compute("linear", scale=4.0)
    assert attention == 1.0
    torch.testing.assert_close(inv, default_inv_freq(DIM, BASE) / 4, rtol=1e-15, atol=0)
    # Position x at scale s is rotated like original position x / s.
    positions = torch.tensor([0.0, 4.0, 400.0, 8188.0], dtype=torch.float64)
    scaled_angles = positions[:, None] * inv
    original_angles = (positions / 4)[:, None] * default_inv_freq(DIM, BASE)
    torch.testing.assert_close(scaled_angles, original_angles, rtol=1e-14, atol=0)


@pytest.mark.parametrize("scale", [2.0, 4.0, 8.0, 32.0])
def test_ntk_equals_transformers_dynamic_at_the_same_effective_scale(scale):
    inv, attention = compute("ntk", scale=scale)
    assert attention == 1.0
    # transformers' dynamic NTK with factor 2 at length L raises the base by (2 L / L0 - 1) ** (d / (d - 2)):
    # at L = L0 (s + 1) / 2 that is the static NTK base of scale s.
    config = _config({"rope_type": "dynamic", "factor": 2.0}, L0)
    reference, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=int(L0 * (scale + 1) / 2))
    torch.testing.assert_close(inv.float(), reference, rtol=2e-6, atol=0)
    # Closed form: the highest frequency is untouched, the lowest is interpolated by exactly s.
    theta = default_inv_freq(DIM, BASE)
    assert inv[0].item() == 1.0
    assert (theta[-1] / inv[-1]).item() == pytest.approx(scale, rel=1e-12)


def test_dynamic_unchanged_within_original_context_and_grows_beyond():
    theta = default_inv_freq(DIM, BASE)
    for seq_len in (None, 1, L0 // 2, L0):
        inv, attention = compute("dynamic", seq_len=seq_len)
        torch.testing.assert_close(inv, theta, rtol=0, atol=0)
        assert attention == 1.0
    previous = theta
    for seq_len in (L0 + 1, 2 * L0, 4 * L0, 16 * L0):
        inv, _ = compute("dynamic", seq_len=seq_len)
        assert torch.all(inv[1:] < previous[1:])  # more interpolation as the input grows
        previous = inv
    # At L = 2 * L0 the effective scale is s * 2 - (s - 1) = 5 for s = 4: the static NTK base of scale 5.
    torch.testing.assert_close(compute("dynamic", seq_len=2 * L0)[0], compute("ntk", scale=5.0)[0], rtol=1e-13, atol=0)


def test_yarn_between_interpolation_and_extrapolation():
    theta = default_inv_freq(DIM, BASE)
    inv, attention = compute("yarn", scale=8.0)
    assert torch.all(inv <= theta * (1 + 1e-15)) and torch.all(inv >= theta / 8 * (1 - 1e-15))
    # Dimensions turning more than beta_fast=32 times in L0 are kept, those below beta_slow=1 fully interpolated.
    turns = L0 * theta / (2 * math.pi)
    torch.testing.assert_close(inv[turns > 32 * 1.5], theta[turns > 32 * 1.5], rtol=0, atol=0)
    torch.testing.assert_close(inv[turns < 1 / 1.5], theta[turns < 1 / 1.5] / 8, rtol=1e-15, atol=0)
    assert attention == pytest.approx(0.1 * math.log(8.0) + 1.0, rel=1e-15)
    assert compute("yarn", scale=8.0, attention_factor=1.0)[1] == 1.0


def test_dynamic_yarn_follows_length():
    theta = default_inv_freq(DIM, BASE)
    for seq_len in (None, L0):
        inv, attention = compute("dynamic-yarn", seq_len=seq_len)
        torch.testing.assert_close(inv, theta, rtol=0, atol=0)
        assert attention == 1.0
    # At L = 3 * L0 it is YaRN with s = 3, whatever the configured scale.
    inv, attention = compute("dynamic-yarn", seq_len=3 * L0, scale=8.0)
    expected_inv, expected_attention = compute("yarn", scale=3.0)
    torch.testing.assert_close(inv, expected_inv, rtol=0, atol=0)
    assert attention == pytest.approx(expected_attention)


def test_dynamic_linear_follows_length():
    inv, _ = compute("dynamic-linear", seq_len=3 * L0, scale=8.0)
    torch.testing.assert_close(inv, default_inv_freq(DIM, BASE) / 3, rtol=1e-15, atol=0)
    torch.testing.assert_close(compute("dynamic-linear", seq_len=L0)[0], default_inv_freq(DIM, BASE), rtol=0, atol=0)


def test_llama3_bands():
    theta = default_inv_freq(DIM, BASE)
    inv, attention = compute("llama3", scale=8.0)
    wavelength = 2 * math.pi / theta
    high = wavelength < L0 / 4  # short wavelengths: kept
    low = wavelength > L0 / 1  # long wavelengths: divided by s
    torch.testing.assert_close(inv[high], theta[high], rtol=0, atol=0)
    torch.testing.assert_close(inv[low], theta[low] / 8, rtol=1e-15, atol=0)
    middle = ~(high | low)
    assert middle.any() and torch.all(inv[middle] < theta[middle]) and torch.all(inv[middle] > theta[middle] / 8)
    assert attention == 1.0


def test_longrope_uses_long_factors_beyond_original_context():
    theta = default_inv_freq(DIM, BASE)
    factors = torch.tensor(LONG_FACTOR, dtype=torch.float64)
    short, attention = compute("longrope", seq_len=L0, long_factor=LONG_FACTOR)
    long, _ = compute("longrope", seq_len=L0 + 1, long_factor=LONG_FACTOR)
    torch.testing.assert_close(short, theta, rtol=0, atol=0)
    torch.testing.assert_close(long, theta / factors, rtol=1e-15, atol=0)
    assert attention == pytest.approx(math.sqrt(1 + math.log(4.0) / math.log(L0)))


# -- equivalence with transformers' own functions ----------------------------------------------


def _config(rope_parameters: dict, max_position_embeddings: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=DIM * 4,
        num_attention_heads=4,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_theta": BASE, **rope_parameters},
    )


NATIVE_CASES = [
    ("linear", {}, {"rope_type": "linear", "factor": 4.0}, 4 * L0, None),
    ("dynamic", {}, {"rope_type": "dynamic", "factor": 4.0}, L0, 3 * L0 + 17),
    ("dynamic", {}, {"rope_type": "dynamic", "factor": 4.0}, L0, L0 // 2),
    ("yarn", {}, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L0}, 4 * L0, None),
    (
        "yarn",
        {"beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.3},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": L0,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "attention_factor": 1.3,
        },
        4 * L0,
        None,
    ),
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
        None,
    ),
    (
        "longrope",
        {"long_factor": LONG_FACTOR},
        {
            "rope_type": "longrope",
            "factor": 4.0,
            "original_max_position_embeddings": L0,
            "long_factor": LONG_FACTOR,
            "short_factor": [1.0] * (DIM // 2),
        },
        4 * L0,
        3 * L0,
    ),
]


@pytest.mark.parametrize("name, given, rope, max_positions, seq_len", NATIVE_CASES)
def test_matches_transformers_function(name, given, rope, max_positions, seq_len):
    config = _config(rope, max_positions)
    reference, reference_attention = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu", seq_len=seq_len)
    ours, attention = compute(name, seq_len=seq_len, **given)
    # transformers computes in float32; ours in float64 and then agrees to float32 rounding.
    torch.testing.assert_close(ours.float(), reference, rtol=2e-6, atol=0)
    assert attention == pytest.approx(reference_attention, rel=1e-7)


# -- the relative-position property -------------------------------------------------------------


@pytest.mark.parametrize("name", list(list_methods()))
def test_attention_score_depends_only_on_relative_position(name):
    """cos/sin of the patched model's own rotary module, applied as the model applies them."""
    model = make_model("llama", hidden_size=2 * DIM, num_attention_heads=2, num_key_value_heads=1, head_dim=DIM,
                       max_position_embeddings=L0, rope_parameters={"rope_type": "default", "rope_theta": BASE})
    patch_model(model, scale=4, method=name, **EXTRA.get(name, {}))
    rotary = model.model.rotary_emb
    rotary.frequency_length = 4 * L0  # one set of frequencies for every call (length-dependent methods)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 1, 1, DIM, generator=generator, dtype=torch.float64)
    key = torch.randn(1, 1, 1, DIM, generator=generator, dtype=torch.float64)

    def score(m: int, n: int) -> float:
        cos, sin = rotary(torch.zeros(1, dtype=torch.float64), torch.tensor([[m, n]]))
        q_rot, _ = apply_rotary_pos_emb(query, query, cos[:, :1], sin[:, :1])
        k_rot, _ = apply_rotary_pos_emb(key, key, cos[:, 1:], sin[:, 1:])
        return (q_rot * k_rot).sum().item()

    for distance in (0, 1, 37, 1500):
        reference = score(distance, 0)
        # cos/sin are float32; inside the original context the attention-level methods use the
        # original module, whose float32 angles are off by up to ~1e-4 rad at position 2048.
        for offset in (5, 999, 5000):
            assert score(distance + offset, offset) == pytest.approx(reference, rel=1e-4, abs=1e-4)
    assert score(1, 0) != pytest.approx(score(37, 0), rel=1e-3)  # the score does depend on the distance
    # ... and the module is the patch's: the same scores as plain RoPE would give differ at long distances
    if name not in ("self-extend", "dual-chunk"):  # these keep the trained frequencies and remap in attention
        inv = default_inv_freq(DIM, BASE)
        angles = torch.tensor([[5000.0], [0.0]], dtype=torch.float64) * inv
        emb = torch.cat((angles, angles), dim=-1)
        q_plain, _ = apply_rotary_pos_emb(query, query, emb.cos()[None, :1], emb.sin()[None, :1])
        k_plain, _ = apply_rotary_pos_emb(key, key, emb.cos()[None, 1:], emb.sin()[None, 1:])
        assert score(5000, 0) != pytest.approx((q_plain * k_plain).sum().item(), rel=1e-3)


# -- parameter checks ------------------------------------------------------------------------------


def test_unknown_parameter_suggests_the_right_name():
    with pytest.raises(ValueError, match=r"'beta_fats'.*did you mean 'beta_fast'"):
        resolve_params(get_method("yarn"), DIM, {"beta_fats": 16})


def test_bad_parameter_values():
    with pytest.raises(ValueError, match="beta_fast > beta_slow"):
        resolve_params(get_method("yarn"), DIM, {"beta_fast": 1.0, "beta_slow": 2.0})
    with pytest.raises(TypeError, match="finite number"):
        resolve_params(get_method("yarn"), DIM, {"beta_fast": "32"})
    with pytest.raises(ValueError, match="attention_factor"):
        resolve_params(get_method("yarn"), DIM, {"attention_factor": -1.0})
    with pytest.raises(ValueError, match="list of 32 numbers"):
        resolve_params(get_method("longrope"), DIM, {"long_factor": [1.0] * 3})
    with pytest.raises(ValueError, match="needs parameter"):
        resolve_params(get_method("longrope"), DIM, {})
    with pytest.raises(ValueError, match="high_freq_factor > low_freq_factor"):
        resolve_params(get_method("llama3"), DIM, {"low_freq_factor": 4.0, "high_freq_factor": 1.0})


def test_unknown_method_lists_valid_ones():
    with pytest.raises(ValueError, match=r"Unknown RoPE method 'yarm'.*Did you mean 'yarn'.*Valid methods: linear, ntk"):
        get_method("yarm")


# -- values a patch record (config.json) can hold -------------------------------------------------


def _own_frequencies(rotary_dim, base, params, seq_len=None):
    return default_inv_freq(rotary_dim, base) / params["factor"], 1.0


def test_parameter_values_and_defaults_that_are_not_json_are_refused():
    import json

    import hf_rope_ext

    for default in ({1, 2}, object(), b"x"):
        with pytest.raises(TypeError, match=r"defaults\['k'\] must be a JSON value"):
            hf_rope_ext.register_method("not-json", _own_frequencies, defaults={"k": default})
    assert "not-json" not in list_methods()
    hf_rope_ext.register_method("tagged", _own_frequencies, defaults={"tag": None, "weights": None})
    try:
        model = make_model("llama")
        with pytest.raises(TypeError, match=r"Parameter 'tag' of method 'tagged' must be a JSON value.*got set"):
            patch_model(model, 4, method="tagged", tag={"a"})
        assert not hasattr(model.config, "hf_rope_ext")
        # numpy and torch values become plain JSON, also inside lists and dicts
        import numpy as np

        patch_model(model, 4, method="tagged", tag={"n": np.int64(3)}, weights=(torch.tensor(0.5), np.float32(2)))
        record = json.loads(model.config.to_json_string())["hf_rope_ext"]
        assert record["params"] == {"tag": {"n": 3}, "weights": [0.5, 2.0]}
    finally:
        hf_rope_ext.unregister_method("tagged")


def test_an_attention_factor_that_float32_rounds_to_zero_or_subnormal_is_refused():
    import hf_rope_ext

    tiny = torch.finfo(torch.float32).tiny
    for value in (5e-324, 1e-40, tiny / 2):
        with pytest.raises(ValueError, match="attention_factor must be a finite number > 0 .*smallest normal"):
            patch_model(make_model("llama"), 4, method="yarn", attention_factor=value)
    model = patch_model(make_model("llama"), 4, method="yarn", attention_factor=tiny)  # the smallest normal
    cos, _ = model.model.rotary_emb(torch.zeros(1), torch.arange(4)[None])
    assert (cos[0, 0] > 0).all()  # position 0: cos = factor

    hf_rope_ext.register_method("vanishing", lambda d, b, p, s=None: (default_inv_freq(d, b) / p["factor"], 1e-45))
    try:
        with pytest.raises(ValueError, match=r"'vanishing' .*returned attention factor 1e-45.*smallest normal"):
            patch_model(make_model("llama"), 4, method="vanishing")
    finally:
        hf_rope_ext.unregister_method("vanishing")


def test_negative_zero_is_recorded_as_zero():
    import json

    model = patch_model(make_model("llama"), 4, method="dual-chunk", local_window=-0.0)
    saved = json.loads(model.config.to_json_string())["hf_rope_ext"]["params"]["local_window"]
    assert saved == 0 and math.copysign(1.0, saved) == 1.0


# -- PatchSpec: a value that cannot change the patch it describes ---------------------------------


def test_patch_info_is_a_plain_copy_independent_of_the_live_patch():
    import dataclasses
    import io

    import yaml

    from hf_rope_ext import get_patch_info, patched

    # longrope: a parameter that is a list, which a shallow copy would share
    long_factor = [1.0 + 0.5 * i for i in range(8)]  # the tiny llama rotates 16 dimensions
    model = patch_model(make_model("llama"), 4, method="longrope", long_factor=long_factor)
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    info = get_patch_info(model)
    # plain dicts: they serialize as they did before the spec was hashable
    assert type(info.params) is dict and type(info.kept) is dict
    assert yaml.safe_load(yaml.safe_dump(info.params)) == model.config.hf_rope_ext["params"]
    buffer = io.BytesIO()
    torch.save({"rope_params": info.params}, buffer)
    assert torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)["rope_params"]["long_factor"] == long_factor
    as_dict = dataclasses.asdict(info)
    as_dict["params"].update(long_factor=[2.0] * 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.scale = 8.0
    # editing the handed-out copy, top level and nested, changes only that copy
    info.params["long_factor"][0] = 99.0
    info.params["short_factor"] = [3.0] * 8
    info.kept["partial_rotary_factor"] = 0.5
    assert get_patch_info(model).params["long_factor"] == long_factor and get_patch_info(model).kept == {}
    with patched(model, 8, "linear"):  # exit puts the previous patch back
        pass
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert model.config.hf_rope_ext["params"]["long_factor"] == long_factor


def test_patch_specs_hash_by_their_contents():
    from hf_rope_ext import PatchSpec, get_patch_info

    model = patch_model(make_model("llama"), 4, method="longrope", long_factor=[1.0 + 0.5 * i for i in range(8)])
    spec = get_patch_info(model)  # a list among its parameters
    assert len({spec, get_patch_info(model)}) == 1 and hash(spec) == hash(get_patch_info(model))
    # equal specs (16 == 16.0) hash alike; a different one is another set member
    given_int = PatchSpec("dual-chunk", 4.0, 32, params={"chunk_size": 16})
    given_float = PatchSpec("dual-chunk", 4.0, 32, params={"chunk_size": 16.0})
    assert given_int == given_float and hash(given_int) == hash(given_float)
    assert len({given_int, PatchSpec("dual-chunk", 4.0, 32, params={"chunk_size": 8})}) == 2
    # the hash follows the contents: an edited copy hashes as a spec made with those contents
    edited = PatchSpec("yarn", 4.0, 32)
    edited.params["beta_fast"] = 16.0
    made = PatchSpec("yarn", 4.0, 32, params={"beta_fast": 16.0})
    assert edited == made and hash(edited) == hash(made)


def test_a_logn_suffix_in_the_constructor_turns_log_n_attention_on():
    import dataclasses

    from hf_rope_ext import PatchSpec, get_patch_info

    spec = PatchSpec("yarn+logn", 4.0, 32)
    assert (spec.method, spec.logn_attention, spec.label) == ("yarn", True, "yarn+logn")
    model = make_model("llama")
    spec.apply(model)
    assert get_patch_info(model).label == "yarn+logn" and model.config.hf_rope_ext["logn_attention"] is True
    plain = PatchSpec("yarn", 4.0, 32)
    assert plain.logn_attention is False
    with pytest.raises(ValueError, match="turns log-n attention on, but logn_attention=False") as error:
        dataclasses.replace(plain, method="self-extend+logn", params={})  # the flag it carries says off
    assert "\n" not in str(error.value)
    assert dataclasses.replace(plain, method="self-extend", params={}, logn_attention=True).label == "self-extend+logn"


def test_register_method_refuses_parameter_names_patch_model_takes_itself():
    import inspect

    import hf_rope_ext
    from hf_rope_ext.patching import patched
    from hf_rope_ext.runtimes import describe_patch, runtime_settings
    from hf_rope_ext.spec import PatchSpec

    keywords = {
        parameter.name
        for function in (patch_model, patched, PatchSpec.create, describe_patch, runtime_settings)
        for parameter in inspect.signature(function).parameters.values()
        if parameter.kind is not parameter.VAR_KEYWORD
    }
    # cls: PatchSpec.create's own, hidden by the classmethod's signature
    keywords |= {"cls"}
    assert {"scale", "method", "max_length", "model", "rope_theta", "partial_rotary_factor"} <= keywords
    for name in sorted(keywords):
        with pytest.raises(ValueError, match=rf"defaults must not contain \['{name}'\].*rename it") as error:
            hf_rope_ext.register_method("clashing", _own_frequencies, defaults={name: 2.0})
        assert "\n" not in str(error.value)
    for key in (1, None, "beta-fast", ""):
        with pytest.raises(TypeError, match="identifier strings"):
            hf_rope_ext.register_method("clashing", _own_frequencies, defaults={key: 2.0})
    assert "clashing" not in list_methods()


def _divided_frequencies(rotary_dim, base, params, seq_len=None):
    return default_inv_freq(rotary_dim, base) / params[params["name"]], 1.0


@pytest.mark.parametrize("name", ["cls", "partial_rotary_factor", "strength"])
def test_a_parameter_register_method_accepts_reaches_the_method_from_every_entry_point(name):
    import hf_rope_ext
    from hf_rope_ext.runtimes import describe_patch, runtime_settings
    from hf_rope_ext.spec import PatchSpec

    try:
        hf_rope_ext.register_method("divided", _divided_frequencies, defaults={"name": name, name: 1.0})
    except ValueError as error:
        assert name != "strength" and "defaults must not contain" in str(error)
        return
    try:
        expected = default_inv_freq(16, 10000.0) / 2.0  # the tiny llama: 16 rotated dimensions, theta 1e4
        model = patch_model(make_model("llama"), 4, "divided", **{name: 2.0})
        rotary = model.model.rotary_emb
        torch.testing.assert_close(rotary.inv_freq.double(), expected, rtol=1e-6, atol=0)
        assert PatchSpec.create("divided", 4, original_max_length=32, **{name: 2.0}).params[name] == 2.0
        described = describe_patch("divided", 4, original_max_length=32, rope_theta=1e4, rotary_dim=16, **{name: 2.0})
        assert described.params[name] == 2.0 and described.kept == {}
        runtime_settings(make_model("llama").config, "divided", 4, **{name: 2.0})
    finally:
        hf_rope_ext.unregister_method("divided")


def test_the_constructor_rounds_the_scale_to_whole_tokens_as_patch_model_does():
    from hf_rope_ext import PatchSpec, get_patch_info

    spec = PatchSpec("yarn", 3.3, 32)  # 105.6 tokens -> 106
    assert spec.scale == 106 / 32 and spec.extended_context == 106
    model = make_model("llama")
    spec.apply(model)
    assert model.config.max_position_embeddings == 106 and model.config.rope_parameters["factor"] * 32 == 106
    assert get_patch_info(model).scale == 106 / 32
    with pytest.raises(ValueError, match="less than half a token; the smallest extension is") as error:
        PatchSpec("yarn", 1.0000001, 32)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="less than half a token"):
        PatchSpec("yarn", 1 + 1e-12, 32)
    assert PatchSpec("linear", (2**31 - 1) / 13, 13).extended_context == 2**31 - 1  # whole already: kept
    # a record from before the rule keeps its scale (README): its context is rounded up
    record = PatchSpec.create("yarn", 4, original_max_length=32, rope_theta=10000.0).to_record()
    legacy = PatchSpec.from_record({**record, "scale": 3.3})
    assert legacy.scale == 3.3 and legacy.extended_context == 106
    assert legacy.bound_to(16, 10000.0, {}).scale == 3.3


def test_only_the_scale_as_recorded_is_kept_a_changed_copy_is_rounded():
    import dataclasses

    from hf_rope_ext import PatchSpec

    record = PatchSpec.create("yarn", 4, original_max_length=32, rope_theta=10000.0).to_record()
    legacy = PatchSpec.from_record({**record, "scale": 3.3})  # written before the whole-token rule
    assert dataclasses.replace(legacy, params={"beta_fast": 16.0}).scale == 3.3  # scale and context as read
    assert dataclasses.replace(legacy, scale=3.4).scale == round(3.4 * 32) / 32  # 108.8 -> 109 tokens
    on_33 = dataclasses.replace(legacy, original_max_position_embeddings=33)  # 3.3 * 33 = 108.9 -> 109 tokens
    assert on_33.scale == 109 / 33 and on_33.extended_context == 109
    # rounded once, the copy does not go back to the recorded scale
    assert dataclasses.replace(on_33, original_max_position_embeddings=32).scale == 106 / 32


@pytest.mark.parametrize(
    "scale, original",
    [(8 + 0.0004 / 131072, 131072), (4 + 0.3 / 2**20, 2**20), (2 + 1e-9, 2**27), (3.3, 32), (101 / 3, 3),
     ((2**31 - 1 + 0.3) / 64, 64)],  # just past the limit of positions, rounded back to it
)
def test_the_constructor_gives_the_whole_token_scale_for_long_contexts_too(scale, original):
    from hf_rope_ext import PatchSpec

    spec = PatchSpec("yarn", scale, original)
    tokens = math.floor(scale * original + 0.5)  # the nearest token, as README says
    assert spec.scale == tokens / original and spec.extended_context == tokens
    assert spec == PatchSpec.create("yarn", scale, original_max_length=original)


def test_changing_the_method_with_replace_says_to_pass_its_params():
    import dataclasses

    from hf_rope_ext import PatchSpec

    with pytest.raises(ValueError, match=r"parameters of method 'yarn', not of 'linear'.*params=\{\}") as error:
        dataclasses.replace(PatchSpec("yarn", 4.0, 32), method="linear")
    assert "\n" not in str(error.value)
    assert dataclasses.replace(PatchSpec("yarn", 4.0, 32), method="linear", params={}).params == {}
    with pytest.raises(ValueError, match="'beta_fats' \\(did you mean 'beta_fast'"):  # a misspelling: as before
        PatchSpec("yarn", 4.0, 32, params={"beta_fats": 16.0})


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"kept": None}, "kept must be a mapping"),
        ({"kept": 5}, "kept must be a mapping"),
        ({"kept": {1: 0.5}}, "kept must be a mapping"),
        ({"module_name": 5}, "module_name must be a string"),
        ({"logn_attention": 1}, "logn_attention must be True or False"),
    ],
)
def test_patch_spec_fields_of_the_wrong_type_are_refused_in_one_line(fields, message):
    from hf_rope_ext import PatchSpec

    with pytest.raises(TypeError, match=message) as error:
        PatchSpec("yarn", 4.0, 32, **fields)
    assert "\n" not in str(error.value)
