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
