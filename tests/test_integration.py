"""The patched model inside the rest of the ecosystem: sdpa, generate, torch.compile, accelerate, peft."""

from __future__ import annotations

import pytest
import torch
from conftest import ORIGINAL_CONTEXT, make_model, random_ids
from transformers import AutoModelForCausalLM

from hf_rope_ext import get_patch_info, patch_model, unpatch_model

L0 = ORIGINAL_CONTEXT


@pytest.mark.parametrize("method", ["yarn", "dynamic-yarn"])
def test_sdpa_matches_eager(family, method):
    eager = make_model(family, attn_implementation="eager")
    sdpa = make_model(family, attn_implementation="sdpa")
    for model in (eager, sdpa):
        patch_model(model, scale=4, method=method)
    ids = random_ids(3 * L0)
    with torch.no_grad():
        torch.testing.assert_close(sdpa(ids).logits, eager(ids).logits, rtol=0, atol=2e-5)
    kwargs = dict(max_new_tokens=2 * L0, do_sample=False, pad_token_id=0)
    assert torch.equal(sdpa.generate(ids[:, :20], **kwargs), eager.generate(ids[:, :20], **kwargs))


def test_generate_changes_with_patch_and_returns_after_unpatch():
    model = make_model("llama", attn_implementation="sdpa")
    prompt = random_ids(L0 - 4)
    kwargs = dict(max_new_tokens=3 * L0, do_sample=False, pad_token_id=0)
    plain = model.generate(prompt, **kwargs)
    patch_model(model, scale=4, method="yarn")
    scaled = model.generate(prompt, **kwargs)
    unpatch_model(model)
    assert not torch.equal(plain, scaled)
    assert torch.equal(model.generate(prompt, **kwargs), plain)


@pytest.mark.parametrize("method", ["linear", "ntk", "yarn", "llama3"])
def test_torch_compile_fullgraph_static_methods(method):
    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method=method)
    ids = random_ids(3 * L0)
    with torch.no_grad():
        expected = model(ids).logits
        # backend="eager": fullgraph=True catches graph breaks; inductor would only add compile time.
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(ids).logits, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("method", ["linear", "yarn", "llama3"])
def test_torch_compile_fullgraph_decode_loop_with_a_static_cache(method):
    """A compiled (fullgraph) prefill and decode steps over a StaticCache equal one eager forward,
    and an eager step may continue the cache the compiled ones filled (they skip the cache record)."""
    from transformers import StaticCache

    model = make_model("llama", attn_implementation="sdpa")
    patch_model(model, scale=4, method=method)
    ids = random_ids(3 * L0)
    prompt = 2 * L0
    with torch.no_grad():
        expected = model(ids).logits
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        cache = StaticCache(config=model.config, max_cache_len=3 * L0)
        steps = [compiled(ids[:, :prompt], past_key_values=cache).logits]
        for position in range(prompt, 3 * L0 - 1):
            steps.append(compiled(ids[:, position : position + 1], past_key_values=cache).logits)
        steps.append(model(ids[:, -1:], past_key_values=cache).logits)  # eager, after compiled steps
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, rtol=0, atol=5e-5)


def test_accelerate_device_map_with_disk_offload(tmp_path):
    reference = make_model("llama")
    reference.save_pretrained(tmp_path / "model")
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",  # weights stay on disk; accelerate hooks load them per forward
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    dispatched = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "offload", attn_implementation="eager"
    ).eval()
    assert hasattr(dispatched, "hf_device_map")
    for model in (reference, dispatched):
        patch_model(model, scale=4, method="dynamic-yarn")
    ids = random_ids(3 * L0)
    with torch.no_grad():
        torch.testing.assert_close(dispatched(ids).logits, reference(ids).logits, rtol=0, atol=2e-5)
    kwargs = dict(max_new_tokens=2 * L0, do_sample=False, pad_token_id=0)
    assert torch.equal(dispatched.generate(ids[:, :20], **kwargs), reference.generate(ids[:, :20], **kwargs))
    unpatch_model(dispatched)
    assert get_patch_info(dispatched) is None


def test_peft_wrapped_model():
    from peft import LoraConfig, get_peft_model

    model = make_model("qwen3")
    ids = random_ids(3 * L0)
    with torch.no_grad():
        plain = model(ids).logits
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    patch_model(peft_model, scale=4, method="yarn")
    assert get_patch_info(peft_model).module_name.endswith("model.rotary_emb")
    with torch.no_grad():
        scaled = peft_model(input_ids=ids).logits
        assert not torch.allclose(scaled, plain, atol=1e-3)
        unpatch_model(peft_model)
        assert torch.equal(peft_model(input_ids=ids).logits, plain)  # LoRA B starts at zero


def test_training_step_backpropagates_through_patched_model():
    model = make_model("mistral").train()
    patch_model(model, scale=4, method="dynamic-yarn")
    ids = random_ids(3 * L0, batch=2)
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    # The frequencies are buffers, not parameters: an optimizer step over every parameter leaves
    # them as they were (a frequency tensor registered as a parameter would move with lr=1).
    rotary = model.model.rotary_emb
    buffers = {name: buffer.clone() for name, buffer in rotary.named_buffers()}
    assert buffers
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    assert all(torch.equal(buffer, buffers[name]) for name, buffer in rotary.named_buffers())


# -- peft: modules_to_save, prefix tuning -------------------------------------------------------
# References: the same tiny model patched the same way without peft (LoRA B starts at zero and a
# modules_to_save copy starts equal to its module, so the logits must be the same), and a peft
# model that was never patched.


def _lora(**kwargs):
    from peft import LoraConfig

    return LoraConfig(r=4, target_modules=["q_proj"], **kwargs)


def _copied_layer(peft_model):
    return peft_model.base_model.model.model.layers[1].modules_to_save["default"]


def _check_patched_then_unpatched(peft_model, reference, never_patched, copied_config, ids):
    """The patched peft model gives the reference's logits; unpatched, its copied layer holds its
    own config object again, reading as the original, and it is the never-patched model bitwise."""
    torch.testing.assert_close(peft_model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
    unpatch_model(peft_model)
    assert _copied_layer(peft_model).self_attn.config is copied_config
    assert copied_config._attn_implementation == "eager"
    assert torch.equal(peft_model(ids).logits, never_patched(ids).logits)


@pytest.mark.parametrize("method", ["self-extend-yarn", "dual-chunk"])
@pytest.mark.parametrize("order", ["peft-then-patch", "patch-then-peft"])
def test_a_decoder_layer_in_modules_to_save_is_patched_unpatched_and_repatched(order, method):
    from peft import get_peft_model

    ids = random_ids(3 * L0)
    reference = patch_model(make_model(), scale=4, method=method)
    never_patched = get_peft_model(make_model(), _lora(modules_to_save=["layers.1"]))
    model = make_model()
    if order == "patch-then-peft":
        patch_model(model, scale=4, method=method)
    peft_model = get_peft_model(model, _lora(modules_to_save=["layers.1"]))
    copied_config = _copied_layer(peft_model).self_attn.config
    if order == "peft-then-patch":
        patch_model(peft_model, scale=4, method=method)
    with torch.no_grad():
        _check_patched_then_unpatched(peft_model, reference, never_patched, copied_config, ids)
        other = "dual-chunk" if method != "dual-chunk" else "self-extend-yarn"
        patch_model(peft_model, scale=4, method=other)
        patch_model(reference, scale=4, method=other)
        torch.testing.assert_close(peft_model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)


def test_a_merged_modules_to_save_layer_is_patched_with_the_rest():
    from peft import get_peft_model

    ids = random_ids(3 * L0)
    merged = get_peft_model(make_model(), _lora(modules_to_save=["layers.1"])).merge_and_unload()
    fresh = make_model(seed=1)
    fresh.load_state_dict(merged.state_dict())
    for model in (merged, fresh):
        patch_model(model, scale=4, method="self-extend-yarn")
    with torch.no_grad():
        assert torch.equal(merged(ids).logits, fresh(ids).logits)


@pytest.mark.parametrize("method", ["dynamic-yarn", "self-extend-yarn"])
def test_the_rotary_module_in_modules_to_save_is_refused_in_one_line(method):
    from peft import get_peft_model

    model = patch_model(make_model(), scale=4, method=method)
    peft_model = get_peft_model(model, _lora(modules_to_save=["rotary_emb"]))
    with torch.no_grad(), pytest.raises(ValueError, match=r"modules_to_save=\['rotary_emb'\]") as error:
        peft_model(random_ids(3 * L0))
    assert "\n" not in str(error.value)
    # the other order: refused at patch_model, naming modules_to_save
    wrapped = get_peft_model(make_model(), _lora(modules_to_save=["rotary_emb"]))
    with pytest.raises(ValueError, match="modules_to_save holds the rotary module"):
        patch_model(wrapped, scale=4, method=method)
    assert get_patch_info(wrapped) is None


def test_the_rotary_module_in_modules_to_save_of_a_static_patch_works_and_copies():
    import copy

    from peft import get_peft_model

    ids = random_ids(3 * L0)
    reference = patch_model(make_model(), scale=4, method="yarn")
    patched_model = patch_model(make_model(), scale=4, method="yarn")
    peft_model = get_peft_model(patched_model, _lora(modules_to_save=["rotary_emb"]))
    copied = copy.deepcopy(peft_model)
    with torch.no_grad():
        assert torch.equal(peft_model(ids).logits, reference(ids).logits)
        assert torch.equal(copied(ids).logits, reference(ids).logits)


def test_a_refused_repatch_keeps_the_static_patch_of_a_rotary_module_in_modules_to_save():
    # Patched before wrapping with the rotary module in modules_to_save: a re-patch or patched()
    # block is refused, and the model keeps its patch (reference: a never-wrapped patched model).
    from peft import get_peft_model

    from hf_rope_ext.patching import patched

    ids = random_ids(3 * L0)
    reference = patch_model(make_model(), scale=4, method="yarn")
    peft_model = get_peft_model(patch_model(make_model(), scale=4, method="yarn"), _lora(modules_to_save=["rotary_emb"]))
    with pytest.raises(ValueError, match="modules_to_save holds this model's patched rotary module") as error:
        patch_model(peft_model, scale=2, method="linear")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="modules_to_save"):
        with patched(peft_model, scale=2, method="yarn"):
            pass
    assert get_patch_info(peft_model).method == "yarn"
    with torch.no_grad():
        assert torch.equal(peft_model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("method", ["yarn", "dynamic-yarn", "self-extend", "dual-chunk"])
def test_a_copy_of_a_copy_of_a_patched_rotary_module(method):
    import copy

    model = patch_model(make_model(), scale=4, method=method)
    twice = copy.deepcopy(copy.deepcopy(model.model.rotary_emb))
    positions = torch.arange(L0)[None]
    x = torch.zeros(1)
    expected = model.model.rotary_emb(x, positions)
    if method in ("yarn",):  # a static rotary-only patch keeps no state in the model's hooks
        assert all(torch.equal(a, b) for a, b in zip(twice(x, positions), expected))
    else:
        with pytest.raises(ValueError, match="copy of a .* made apart from the model"):
            twice(x, positions)


@pytest.mark.parametrize("method", ["yarn", "self-extend"])
def test_peft_prefix_tuning_is_refused_naming_it(method):
    from peft import PrefixTuningConfig, get_peft_model

    prefix = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=10)
    ids = random_ids(2 * L0)
    peft_model = get_peft_model(patch_model(make_model(), scale=4, method=method), prefix)
    with torch.no_grad(), pytest.raises(ValueError, match="peft prefix tuning .* use LoRA or prompt tuning"):
        peft_model(input_ids=ids, attention_mask=torch.ones_like(ids))
    wrapped = get_peft_model(make_model(), prefix)
    with pytest.raises(ValueError, match="prefix tuning.*use LoRA or prompt tuning"):
        patch_model(wrapped, scale=4, method=method)
    assert get_patch_info(wrapped) is None


@pytest.mark.parametrize("edit", ["pad_token_id", "eos_token_id", "custom attribute", "resize_token_embeddings"])
def test_an_edit_of_the_model_config_after_wrapping_with_modules_to_save_keeps_the_default_patch(edit):
    # The modules_to_save copy of a layer keeps the config values of wrapping time; an ordinary
    # edit of the model's config afterwards must not make the (default, attention-level) patch refuse.
    from peft import get_peft_model

    def apply(model):
        if edit == "pad_token_id":
            model.config.pad_token_id = 2
        elif edit == "eos_token_id":
            model.config.eos_token_id = [2, 3]
        elif edit == "custom attribute":
            model.config.foo = 1
        else:
            torch.manual_seed(0)
            model.resize_token_embeddings(model.config.vocab_size + 2)

    ids = random_ids(3 * L0)
    reference = make_model()  # never wrapped, edited the same way
    apply(reference)
    patch_model(reference, scale=4, method="self-extend-yarn")
    never_patched = get_peft_model(make_model(), _lora(modules_to_save=["layers.1"]))
    apply(never_patched.base_model.model)
    peft_model = get_peft_model(make_model(), _lora(modules_to_save=["layers.1"]))
    apply(peft_model.base_model.model)
    copied_config = _copied_layer(peft_model).self_attn.config
    patch_model(peft_model, scale=4, method="self-extend-yarn")
    with torch.no_grad():
        _check_patched_then_unpatched(peft_model, reference, never_patched, copied_config, ids)


def test_two_models_of_one_config_class_are_patched_apart():
    # A config of the same class held by another model is not this model's: patching one leaves
    # the other (and its config) as it was.
    ids = random_ids(3 * L0)
    reference = patch_model(make_model(), scale=4, method="self-extend-yarn")
    first, second = make_model(), make_model()
    plain = second(ids).logits.detach()
    patch_model(first, scale=4, method="self-extend-yarn")
    with torch.no_grad():
        torch.testing.assert_close(first(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
        assert torch.equal(second(ids).logits, plain)
    assert second.config._attn_implementation == "eager"
